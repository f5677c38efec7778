"""Spaces: the actor of each space, for what has no run or entity to run on.

A space (a tenant, SPEC §1) has one actor, ``spc:<space>``, in the root nursery. It
runs the commands that create or list space-level things: root runs, work queues (names
are per space), API keys, and the server status. It owns no state of its own: what it
creates belongs to the runs, work-queue and keys kinds.
"""

from __future__ import annotations

import heapq
import time

import msgspec

from .._version import __version__
from ..clock import to_iso
from ..errors import ValidationError
from ..events import EventFilter
from ..ids import is_id
from ..protocol import (
    EventPageView,
    EventsList,
    EventsWatch,
    OpsOverview,
    OverviewGroup,
    OverviewQueue,
    OVERVIEW_TOP_KEYS,
    OverviewRun,
    OverviewView,
    ServerStatus,
    ServerStatusView,
    WatchView,
)
from ..wire import PROTOCOL_VERSION
from .common import check_range
from .kind import Kind
from .runtime import AtOnce
from .opmark import ALL, ALWAYS, R, SPACE, in_slot, op
from .runtime import Subscribe
from .watch import durable_upto, encode_event, shard_of

__all__ = ["Spaces", "space_actor_id"]


def space_actor_id(space: str) -> str:
    """The actor id of a space."""
    return "spc:" + space


class Spaces(Kind):
    """The per-space actors (no entities; ``prefix`` is empty so they are not counted
    as an entity kind)."""

    prefix = ""
    name = "spaces"

    def route(self, session, _op=None) -> str:
        return "spc:" + session.space

    @op(ServerStatus, route=SPACE, permission=R, resend=ALWAYS, shard=ALL, merge="server.status")
    def op_server_status(self, actor, session, op: ServerStatus) -> ServerStatusView:
        """The server's version, uptime, durability, the session's space's runs and tasks
        and its use of every limit. The whole server's figures -- connections, entities,
        journal LSNs, fsyncs, the actor runtime (actors by kind, tree depth), the
        cluster, every space's use -- only to a session that sees every space (open
        mode, an ``operator`` key: ``view`` server); a key of one space gets its
        space's connections and entities and nothing of the others (``view`` space).
        Answered at once (:class:`~rallypoint.actors.runtime.AtOnce`), also while writes
        wait for a standby: its counts may then include changes not yet acknowledged
        (``durable_lsn < last_lsn`` says so)."""
        coord = self.coord
        space = session.space
        runs = {"ACTIVE": 0, "CANCELLED": 0, "COMPLETED": 0}
        runs.update(coord.runs.counts.get(space, {}))
        tasks = {k: v for k, v in coord.queues.space_counts.get(space, {}).items() if v}
        limits = coord.limits
        perms = session.permissions
        if perms is not None and "operator" not in perms:
            use = limits.report([space])
            return AtOnce(ServerStatusView(
                version=__version__, protocol_version=PROTOCOL_VERSION, uptime_s=time.monotonic() - coord.started_at,
                connections=use[space]["connections"], durability=coord.durability, runs=runs, tasks=tasks,
                entities=use[space]["stored"], last_lsn=0, durable_lsn=0,
                sync_helper=getattr(coord.journal, "sync_helper", ""),
                view="space", limits=limits.wire_values(), space_use=use,
            ))
        st = coord.server_status()
        return AtOnce(ServerStatusView(
            version=st["version"],
            protocol_version=PROTOCOL_VERSION,
            uptime_s=st["uptime_s"],
            connections=st["connections"],
            durability=st["durability"],
            runs=runs,
            tasks=tasks,
            entities=st["entities"],
            last_lsn=st["last_lsn"],
            durable_lsn=st["durable_lsn"],
            sync_helper=st["sync_helper"],
            fsyncs=st["fsyncs"],
            fsync_seconds=st["fsync_seconds"],
            actors=st["actors"],
            tree_depth=st["tree_depth"],
            cluster=coord.cluster.status() if coord.cluster is not None else None,
            view="server",
            limits=limits.wire_values(),
            space_use=limits.report(),
        ))

    # ================================================================ events
    def _filter(self, op) -> EventFilter:
        if op.types is not None:
            if len(op.types) > 64 or not all(isinstance(t, str) and 1 <= len(t) <= 64 for t in op.types):
                raise ValidationError("types must be at most 64 event type names (1-64 characters each), "
                                      "e.g. ['task.completed', 'scope.*']", details={"field": "types"})
        if op.scope_id is not None and not is_id(op.scope_id, "scp"):
            raise ValidationError(f"scope_id must be a run id (scp_...), got {op.scope_id!r}",
                                  details={"field": "scope_id"})
        if op.aggregate is not None and (not isinstance(op.aggregate, str) or not 1 <= len(op.aggregate) <= 200):
            raise ValidationError("aggregate must be 'kind:id' or an id", details={"field": "aggregate"})
        return EventFilter(op.types, op.scope_id, op.aggregate, self.coord.runs)

    @op(EventsList, route=SPACE, permission=R, resend=ALWAYS, shard=in_slot("scope_id", "all"),
        merge="events")
    def op_events_list(self, actor, session, op: EventsList) -> EventPageView:
        """A page of the space's events after ``cursor`` (oldest first). CURSOR_EXPIRED
        for a cursor older than what is kept; VALIDATION_FAILED for a bad limit
        (1-10000), filter or a cursor past the newest event. The reply leaves once the
        journal is durable past every event in it."""
        check_range("limit", op.limit, 1, 10_000)
        flt = self._filter(op)
        log = self.coord.events
        s, cursor = log.check_cursor(session.space, op.cursor)
        evs, nxt = log.page(s, cursor, op.limit, flt, s.last_seq)
        shard = shard_of(self.coord)
        return EventPageView(events=[msgspec.Raw(encode_event(e, shard)) for e in evs], next_cursor=nxt,
                             oldest=s.first_seq, newest=s.last_seq)

    @op(EventsWatch, route=SPACE, permission=R, resend=ALWAYS, reply=WatchView,
        shard=in_slot("scope_id", "all"), merge="events")
    def op_events_watch(self, actor, session, op: EventsWatch) -> Subscribe:
        """Subscribe to the space's events after ``cursor`` (None: from the oldest kept,
        or from now with ``start="now"``). CURSOR_EXPIRED / VALIDATION_FAILED as
        :meth:`op_events_list`; LIMIT_EXCEEDED when the space has its ``watchers`` limit
        of subscriptions open (``rallypoint/limits.py``)."""
        if op.start not in ("oldest", "now"):
            raise ValidationError("start must be 'oldest' or 'now'", details={"field": "start"})
        flt = self._filter(op)
        self.coord.limits.check_watchers(session.space)
        log = self.coord.events
        if op.cursor is None and op.start == "now":
            s = log.stream(session.space)
            cursor = s.last_seq
        else:
            s, cursor = log.check_cursor(session.space, op.cursor)
        return Subscribe(session.space, flt, cursor)

    # ================================================================ operator view
    @op(OpsOverview, route=SPACE, permission=R, resend=ALWAYS, shard=ALL, merge="ops.overview")
    def op_ops_overview(self, actor, session, op: OpsOverview) -> OverviewView:
        """The newest ``limit`` active runs, every work queue, the newest ``limit`` open
        groups, parked waits and inbox depth per kind, the event positions and counts.
        A read-only view for humans (``rallypoint top``); it scans at most 200,000 runs
        and groups per call."""
        check_range("limit", op.limit, 1, 1000)
        coord = self.coord
        space = session.space
        runs_kind, queues = coord.runs, coord.queues
        runs: list[OverviewRun] = []
        scanned = 0
        for s in reversed(runs_kind.table.values()):
            scanned += 1
            if scanned > 200_000 or len(runs) >= op.limit:
                break
            if s.space != space or s.state != "ACTIVE" or s.group_id is not None or s.task_id is not None:
                continue
            if runs_kind.inactive_error(s.id) is not None:
                continue
            runs.append(OverviewRun(id=s.id, name=s.name, parent_id=s.parent_id, created_at=to_iso(s.created_at_ms),
                                    tasks=queues.run_task_counts(s.id), children=s.children))
        qs = []
        for q in queues.table.values():
            if q.space != space:
                continue
            queued, running = queues.queue_counts.get(q.id, (0, 0))
            by_prio, by_key = queues.ready_index.backlog(q.id)
            top = heapq.nsmallest(OVERVIEW_TOP_KEYS, by_key.items(), key=lambda kc: (-kc[1], kc[0] or ""))
            qs.append(OverviewQueue(name=q.name, queued=queued, running=running, done=queues.queue_done.get(q.id, 0),
                                    ready_by_priority={str(p): n for p, n in sorted(by_prio.items())},
                                    ready_keys=sum(1 for k in by_key if k is not None),
                                    ready_top_keys={(k or ""): n for k, n in top}))
        groups: list[OverviewGroup] = []
        open_groups = 0
        scanned = 0
        for g in reversed(coord.groups.table.values()):
            scanned += 1
            if scanned > 200_000:
                break
            if g.space != space or g.state == "FINALIZED":
                continue
            open_groups += 1
            if len(groups) < op.limit:
                groups.append(OverviewGroup(
                    id=g.id, condition=g.condition, state=g.state, members=len(g.members),
                    accepted=sum(1 for m in g.members if m.verdict == "ACCEPTED"), created_at=to_iso(g.created_at_ms)))
        s = coord.events.stream(space)
        return OverviewView(
            runs=runs,
            runs_active=coord.runs.counts.get(space, {}).get("ACTIVE", 0),
            queues=qs,
            groups=groups,
            groups_open=open_groups,
            waits=coord.actor_statistics(),
            events={"oldest": s.first_seq, "newest": durable_upto(s, coord.journal.durable_lsn),
                    "watchers": sum(1 for w in coord.watchers.watchers if w.space == space),
                    "cut_off": coord.watchers.cut_off},
            entities=coord.entity_count(),
            tasks={k: v for k, v in queues.space_counts.get(space, {}).items() if v},
            retention=coord.retention.statistics(),
        )
