"""The coordinator: the kinds, the actor runtime, the commit pipeline and time.

Everything that changes state goes through :meth:`Coordinator.commit`:

1. a kind's decide (an ``op_*`` handler running on its actor's task, or an activity
   firing) validates and builds journal records;
2. ``commit`` applies them, synchronously and with no ``await``, to every entity they
   touch (a record may span actors: a group finalizing cancels its gate run and its
   members in one apply), lets *reactions* add follow-up records to the same commit (a
   member finishing can finalize its group), then appends the whole list to the journal
   as ONE entry with one LSN;
3. the actor replies; the transport sends the reply -- success or error -- only once the
   journal is durable past ``journal.last_lsn`` as it was when the reply was made (so
   nothing a client is told can be taken back by a crash).

**Fail-stop.** If an apply raises, or the records cannot be encoded, the state in memory
may be ahead of the journal: the coordinator marks itself failed (every later batch,
reply and snapshot is refused) and raises :class:`FatalError`, which ends the actor tree
and the node; a restart replays the journal, which never held the failed commit.

**Time.** Before every command batch of every actor, :meth:`before_batch` (1) notices an
event-loop stall -- a gap of more than :data:`STALL_S` between two looks at the clock,
which a 0.5 s tick guarantees otherwise -- and extends every outstanding lease by the gap
(one ``LeasesExtended`` record), then (2) fires every activity due by the clock, earliest
first, runs' deadlines first at equal times. So every time-based state is judged against
the clock at request time, and what fell due while the loop was busy fires in due order.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

import msgspec
import trio

from .._version import __version__
from ..clock import Clock
from ..errors import InternalError, RallypointError, UnavailableError
from ..ids import IdGenerator, slot_of
from ..protocol import encoder
from ..events import DEFAULT_RETAIN_EVENTS, Entry, EventLog
from ..records import ALL_RECORD_TYPES, LeasesExtended, decode_commit, encode_commit
from .admission import Admission
from .barrier import Barriers
from .budget import Budgets
from .claim import Claims
from .common import MemoryJournal
from .group import Groups
from .diagnostics import Diagnostics
from .idempotency import DEFAULT_TTL_MS, Idempotency
from .inbox import Inboxes
from .joinset import JoinSets
from .keys import Keys, grant_of
from ..limits import Limits
from .once import Onces
from .opmark import BoundOp, OpTable, build_table
from .pool import Pools
from .queue import WorkQueues
from .quota import Quotas
from .retention import Retention
from .epochs import Epochs
from .outbox import Outbox
from .sharding import Sharding
from .run import Runs
from .runtime import PRIO_DEFAULT, AtOnce, Park, ReplySink, Runtime, Subscribe, _FatalMarker, fatal_unwrapped, shutdown_error
from .watch import Watchers
from .space import Spaces
from .timer import Timers
from .schedule import Schedules
from .operator_log import OperatorLog

log = logging.getLogger("rallypoint.coordinator")

__all__ = ["Coordinator", "FatalError", "STALL_S", "TICK_S", "KIND_CLASSES"]

#: Every kind class, in the order :class:`Coordinator` makes them. The operation table
#: that needs no coordinator (the client's re-send rules, the HTTP layer's reply types:
#: :data:`rallypoint.actors.api.TABLE`) is built from these classes' ``@op`` marks;
#: ``tests/test_op_table.py`` checks a coordinator holds exactly these.
KIND_CLASSES = (Runs, WorkQueues, Groups, Barriers, Timers, JoinSets, Keys, Spaces, Quotas, Budgets, Inboxes, Claims,
                Pools, Admission, Onces, Idempotency, Diagnostics, Retention, Epochs, Outbox, Schedules, OperatorLog)

#: A gap longer than this (seconds) between two looks at the clock is an event-loop
#: stall: outstanding leases are extended by it.
STALL_S = 2.0
#: the dirty ids (changed since the last snapshot) are kept in dicts of at most this
#: many: a dict's table is freed in one step on the loop, in time proportional to its
#: size (2.4 ms for 1M ids; 0.2 ms for this many)
DIRTY_CHUNK = 1 << 16
#: The coordinator looks at the clock (and writes its heartbeat) at least this often.
TICK_S = 0.5


class FatalError(RuntimeError):
    """An apply failed: the node must stop (fail-stop) and recover from its journal."""


_FatalMarker.fatal_type = FatalError


class ClusterNode(Protocol):
    """What a coordinator asks of the cluster node it runs in
    (:class:`rallypoint.cluster.member.ShardMember`)."""

    def status(self) -> Any:
        """This node as a ``protocol.ClusterView`` (the server status carries it)."""
        ...

    def cluster_map_view(self) -> Any:
        """The slot map and every shard's leader, a ``protocol.ClusterMapView``."""
        ...


class ConnectionSource(Protocol):
    """What counts a node's live client connections (:class:`rallypoint.transport.server.Server`)."""

    def connection_count(self) -> int:
        """The client connections open now."""
        ...


class Coordinator:
    """The whole coordinator: one object per kind, the runtime, commit and time.

    Args:
        journal: ``append(bytes) -> lsn``, ``wait_durable(lsn)``, ``last_lsn``,
            ``durable_lsn``, ``write_now()``, ``add_durable_listener(fn)``, ``run()``
            (default: :class:`MemoryJournal`).
        clock: a :class:`~rallypoint.clock.Clock` (default: one made now).
        durability: ``memory``, ``interval`` or ``fsync`` (reported; ``memory`` also
            turns off snapshot bookkeeping).
        idle_s: seconds an idle actor stays active before it passivates.
        retain_events: events kept per space (count; None or 0: no count limit).
        retain_events_ms: events kept this long, ms (None: no age limit).
        retain_finished_ms: finished runs and tasks are deleted this long after they
            ended, ms (None or 0: kept forever). See :mod:`rallypoint.actors.retention`.
        limits: the limits per space to change from their defaults (name -> value,
            None: no limit); :mod:`rallypoint.actors.limits`. VALIDATION_FAILED for an
            unknown name or a bad value.
    """

    def __init__(
        self,
        *,
        journal=None,
        clock: Clock | None = None,
        durability: str = "memory",
        idle_s: float = 2.0,
        retain_events: int | None = DEFAULT_RETAIN_EVENTS,
        retain_events_ms: int | None = None,
        retain_finished_ms: int | None = None,
        idempotency_ttl_ms: int = DEFAULT_TTL_MS,
        limits: dict | None = None,
    ) -> None:
        self.clock = clock or Clock()
        #: the limits per space and every space's use (counted by the kinds' apply
        #: functions, checked by their decide handlers): rallypoint.actors.limits
        self.limits = Limits(limits)
        self.ids = IdGenerator(self.clock.mono_ms)
        #: a sharded cluster's slot map as this shard sees it (None: ids name no slot)
        self.sharding: Sharding | None = None
        self.journal = journal if journal is not None else MemoryJournal()
        self.durability = durability
        self.started_at = time.monotonic()
        #: what counts the live client connections (the server's status): the TCP
        #: server, set by :func:`rallypoint.nodeconfig.start_serving`; None: none
        self.connections: ConnectionSource | None = None
        self.heartbeat: Callable[[int, int], None] | None = None
        self.background: list[Callable] = []
        #: ids of entities changed since the last snapshot, as the keys of dicts of
        #: None: a dict of str -> None is never tracked by the garbage collector (a set
        #: always is, and a young set of 1M ids made a GC pass walk it: 60 ms). The
        #: current dict; filled ones (:data:`DIRTY_CHUNK` ids) move to ``_dirty_full``:
        #: freeing one dict's table is a single step on the loop, 2.4 ms at 1M ids
        self.dirty: dict[str, None] = {}
        self._dirty_full: list[dict[str, None]] = []
        self.track_dirty = durability != "memory"
        #: ``fn(lsn)`` for each grant that ended (a key revoked, open mode over) in the
        #: commit that will have LSN ``lsn``: the TCP server re-derives its connections'
        #: rights once that is durable (:meth:`end_grant`)
        self.grant_listeners: list[Callable[[int], None]] = []
        #: answers to the waits a grant's end took out of their lines, sent by
        #: :meth:`after_batch` once the commit is journaled: ``(sink, rid, error)``
        self._grant_ended: list = []
        self.replaying = False
        self.failed: BaseException | None = None
        self.commits = 0
        #: the records of a keyed HTTP request's step while its handler runs: its commits
        #: are journaled as ONE entry with the step's stored answer (:meth:`_handle_keyed`)
        self._deferred: list | None = None
        self.stalls = 0
        #: a stall's lease extension the journal refused (a full disk), ms: owed, and
        #: journaled first thing once writes are accepted again (:meth:`_writable_again`)
        self._stall_owed_ms = 0
        self._to_flush: set = set()
        self.last_seen = 0.0
        #: every space's event stream (derived from the records: see rallypoint.events)
        self.events = EventLog(retain_events, retain_events_ms)
        self.watchers = Watchers(self)
        self.runtime = Runtime(self, idle_s=idle_s)
        self.heap = self.runtime.heap
        # the kinds (one class each)
        self.runs = Runs(self)
        self.queues = WorkQueues(self)
        self.groups = Groups(self)
        self.barriers = Barriers(self)
        self.timers = Timers(self)
        self.joinsets = JoinSets(self)
        self.keys = Keys(self)
        self.spaces = Spaces(self)
        self.quotas = Quotas(self)
        self.budgets = Budgets(self)
        self.inboxes = Inboxes(self)
        self.claims = Claims(self)
        self.pools = Pools(self)
        self.admission = Admission(self)  # after the requirement kinds (its rebuild uses them)
        self.onces = Onces(self)
        self.idempotency = Idempotency(self, idempotency_ttl_ms)
        self.diagnostics = Diagnostics(self)
        self.retention = Retention(self, retain_finished_ms)
        self.epochs = Epochs(self)  # a replicated shard's leader terms (rallypoint.cluster)
        self.outbox = Outbox(self)  # a sharded cluster's remote runs, links and outbox
        self.schedules = Schedules(self)  # recurring actions (rallypoint.actors.schedule)
        self.operator_log = OperatorLog(self)  # the console's actions, audited (rallypoint.actors.operator_log)
        #: on a replicated shard's leader: the node (``rallypoint.cluster.member.
        #: ShardMember``): its status in the server status, its slot map in
        #: ``cluster.map`` (a sharded cluster's, once ``sharding`` is set); None: a
        #: single node
        self.cluster: ClusterNode | None = None
        self.kinds = (self.runs, self.queues, self.groups, self.barriers, self.timers, self.joinsets, self.keys,
                      self.spaces, self.quotas, self.budgets, self.inboxes, self.claims, self.pools, self.admission,
                      self.onces, self.idempotency, self.diagnostics, self.retention, self.epochs,
                      self.outbox, self.schedules, self.operator_log)
        self.task_linked_kinds = (self.pools, self.budgets)  # Kind.purge_task_links
        self._tables: dict[str, tuple[dict, type]] = {}
        self._kind_by_prefix: dict[str, Any] = {}
        self._apply: dict[type, Callable[[Any], None]] = {}
        self._emit: dict[type, Callable[[Any], Any]] = {}
        #: record types whose event is a function of the record alone (``@emits(...,
        #: pure=True)``): recovery derives it only if retention keeps it
        self._emit_pure: frozenset[type] = frozenset().union(*(k.pure_emitters() for k in self.kinds))
        for k in self.kinds:
            for rec_type, fn in k.emitters().items():
                if rec_type in self._emit:
                    raise RuntimeError(f"two event sources for {rec_type.__name__}")
                self._emit[rec_type] = fn
            for prefix, entry in k.entity_tables().items():
                self._tables[prefix] = entry
                self._kind_by_prefix[prefix] = k
            for rec_type, fn in k.appliers().items():
                if rec_type in self._apply:
                    raise RuntimeError(f"two apply functions for {rec_type.__name__}")
                self._apply[rec_type] = fn
        self._kind_by_prefix["spc"] = self.spaces
        missing = [t.__name__ for t in ALL_RECORD_TYPES if t not in self._apply]
        if missing:
            raise RuntimeError(f"record types without an apply function: {', '.join(missing)}")
        #: every operation's declaration, from the kinds' ``@op`` marks (RuntimeError here
        #: for an op with no handler or two, or a mark without a route, permission or
        #: re-send rule: :func:`~rallypoint.actors.opmark.build_table`)
        self.op_table: OpTable = build_table(tuple(type(k) for k in self.kinds))
        #: request Struct -> its handler and route bound to this coordinator's kinds
        self.ops: dict[type, BoundOp] = self.op_table.bind(self.kinds)

    # ------------------------------------------------------------------ ids
    def new_id(self, prefix: str, *, under: str | None = None, space: str | None = None,
               named: tuple[str, str] | None = None) -> str:
        """A new id: in a sharded cluster it names the slot of the run (or any id of
        its tree) ``under``, else the home slot of ``space``, else the slot of the named
        root run ``named`` (``(space, name)``), else this shard's open slot (a new root
        run); on a single node, as ``ids.new`` (:mod:`rallypoint.actors.sharding`)."""
        sh = self.sharding
        if sh is None:
            return self.ids.new(prefix)
        if named is not None:
            return self.ids.new(prefix, sh.named_slot(*named))
        if under is not None:
            return self.ids.new(prefix, slot_of(under))
        if space is not None:
            return self.ids.new(prefix, sh.home_slot(space))
        return self.ids.new(prefix, sh.root_slot())

    # ------------------------------------------------------------------ entities
    def entity_tables(self) -> dict[str, tuple[dict, type]]:
        """id prefix -> (table, state Struct type): what snapshots store."""
        return self._tables

    def entity(self, entity_id: str):
        t = self._tables.get(entity_id[:3])
        return None if t is None else t[0].get(entity_id)

    def entity_count(self) -> int:
        # a table may be listed under two prefixes (tasks and messages): count it once
        return sum(len(t) for t in {id(t): t for t, _ in self._tables.values()}.values())

    def touch(self, entity_id: str) -> None:
        """Mark an entity changed since the last snapshot (only when snapshots are
        taken: ``track_dirty`` is off in memory mode)."""
        if self.track_dirty:
            d = self.dirty
            d[entity_id] = None
            if len(d) >= DIRTY_CHUNK:
                self._dirty_full.append(d)
                self.dirty = {}

    def dirty_count(self) -> int:
        """How many entities are marked changed since the last snapshot (an id marked
        again after its dict filled up counts twice: an upper bound)."""
        return len(self.dirty) + sum(map(len, self._dirty_full))

    def dirty_ids(self):
        """Iterate the ids marked changed since the last snapshot (possibly repeated)."""
        for d in self._dirty_full:
            yield from d
        yield from self.dirty

    def take_dirty(self) -> list[dict[str, None]]:
        """Detach every marked id for a snapshot: the dicts of ids (each at most
        :data:`DIRTY_CHUNK`; an id may be in more than one), newest last; marking starts
        afresh. Hand back what was not written with :meth:`give_back_dirty`."""
        out = self._dirty_full
        out.append(self.dirty)
        self._dirty_full, self.dirty = [], {}
        return out

    def give_back_dirty(self, chunks: list[dict[str, None]]) -> None:
        """Mark again the ids of ``chunks`` (dicts from :meth:`take_dirty` a snapshot
        did not write: it failed or was cancelled part-way)."""
        self._dirty_full[:0] = [d for d in chunks if d]

    def rebuild_indexes(self) -> None:
        """After loading a snapshot: every kind recomputes its derived indexes (and the
        limits per space their uses)."""
        for k in self.kinds:
            k.rebuild_indexes()
        self.limits.rebuild(self)

    # ------------------------------------------------------------------ commit
    def commit(self, records: list) -> int:
        """Apply ``records`` (and the follow-ups reactions add) and journal them as one
        entry; returns its LSN. Synchronous: the caller validated everything, so an
        apply that raises is a bug and stops the node (:class:`FatalError`).

        While the handler of a keyed HTTP request's step runs (:meth:`_handle_keyed`),
        the records are applied here but journaled when the handler returns, with every
        other commit it made and the step's stored answer, as ONE entry (the LSN
        returned is the one that entry will have)."""
        if self.failed is not None:
            raise FatalError("the coordinator stopped after a failed apply") from self.failed
        # Disk full: refused (UNAVAILABLE, retry_after) BEFORE anything is applied -- an
        # answer, not a failed apply.
        self.journal.check_writable()
        events = self.events
        pending = events.pending  # (implied facts append here too; publish replaces it after the journal)
        try:
            apply = self._apply
            emit = self._emit
            i = 0
            while True:
                while i < len(records):
                    rec = records[i]
                    t = type(rec)
                    fn = emit.get(t)
                    if fn is None:
                        apply[t](rec)
                    else:
                        mark = len(pending)
                        apply[t](rec)
                        out = fn(rec)
                        if out is not None:
                            if type(out) is Entry:
                                if len(pending) == mark:
                                    pending.append(out)
                                else:  # the record's own events before what its step implied
                                    pending.insert(mark, out)
                            elif len(pending) == mark:
                                pending += out
                            else:
                                pending[mark:mark] = out
                    i += 1
                more = self.groups.react()
                more += self.queues.react()
                more += self.schedules.react()
                if not more:
                    break
                records.extend(more)
            deferred = self._deferred
            if deferred is not None:  # journaled with the step's answer when the handler returns
                deferred.extend(records)
                self.commits += 1
                return self.journal.last_lsn + 1
            payload = encode_commit(records)
        except BaseException as exc:
            events.discard()
            self._fail(exc, records)
            raise FatalError(f"apply of {type(records[min(i, len(records) - 1)]).__name__} failed: {exc!r}") from exc
        try:
            lsn = self.journal.append(payload)
        except BaseException:
            events.discard()
            raise
        self.commits += 1
        events.publish(lsn)
        return lsn

    def implied(self, fact) -> None:
        """A step of the record being applied changed another entity (a run's end
        cancelled a task, a group finalizing ended its gate run): describe it to the
        event table as ``fact`` (the record that would have said so, or an implied fact
        of :mod:`rallypoint.records`). Called by apply code, live and in replay; changes
        nothing itself."""
        fn = self._emit.get(type(fact))
        if fn is not None:
            out = fn(fact)
            if out is not None:
                if type(out) is Entry:
                    self.events.pending.append(out)
                else:
                    self.events.pending.extend(out)

    def _fail(self, exc: BaseException, records: list) -> None:
        self.failed = exc
        log.critical(
            "FATAL: applying a commit of %d record(s) failed; the state in memory is ahead of "
            "the journal, so the node stops now (restart it: recovery replays the journal). "
            "Records: %s", len(records), ", ".join(type(r).__name__ for r in records[:10]),
            exc_info=exc,
        )
        self.runtime.stopping = True

    def apply(self, rec) -> None:
        """Apply one record and derive its events (replay; tests). The events stay
        pending until :meth:`EventLog.publish`."""
        t = type(rec)
        events = self.events
        mark = len(events.pending)
        self._apply[t](rec)
        fn = self._emit.get(t)
        if fn is not None:
            out = fn(rec)
            if out is not None:
                events.pending[mark:mark] = [out] if type(out) is Entry else out

    def replay(self, payload: bytes) -> None:
        """Apply one journal entry during recovery (no reactions, no activities, no
        actors: the follow-ups are already in the journal). Its events are derived as
        they were live, with the same sequence numbers."""
        self.replaying = True
        try:
            for rec in decode_commit(payload):
                self.apply(rec)
            self.events.publish(0)
        except BaseException:
            self.events.discard()
            raise
        finally:
            self.replaying = False
            self.groups.touched.clear()
            self.queues.to_check.clear()
            self.schedules.to_check.clear()

    def replay_many(self, payloads, batch: int = 256, *, defer_events: bool = False) -> int:
        """Apply journal entries (``payloads``: an iterable of bytes, in LSN order) during
        recovery; returns how many. The same as :meth:`replay` on each, with less per
        record: one loop with the dispatch tables at hand, no per-entry bookkeeping of the
        live path (the reaction sets stay empty in replay), and the events of ``batch``
        entries numbered and appended to their streams at once (the same numbers and
        order as one entry at a time; :meth:`EventLog.instant` still sees only the
        entry's own events).

        ``defer_events``: a record whose event source is ``pure`` (and whose apply
        implied nothing) takes its event's place in the stream as itself; the event is
        derived only if retention keeps it, by :meth:`EventLog.recovered` with
        :meth:`derive_deferred` -- which the caller MUST call after the replay (the
        streams hold records until then). Replaying 1M runs derived 1M events to keep
        the last 100,000.

        Raises what an apply raises (msgspec.DecodeError for bytes that do not decode);
        the events of the batch in progress are discarded then."""
        from ..records import _dec

        decode = _dec.decode
        apply = self._apply
        emit_get = self._emit.get
        pure = self._emit_pure if defer_events else frozenset()
        # record type -> (apply, event source or None, deferrable): one lookup a record
        plan: dict[type, tuple] = {}
        plan_get = plan.get
        events = self.events
        publish = events.publish_replayed if defer_events else events.publish
        n = 0
        left = batch
        self.replaying = True
        try:
            pending = events.pending
            for payload in payloads:
                events.mark = len(pending)
                for rec in decode(payload):
                    t = type(rec)
                    step = plan_get(t)
                    if step is None:
                        step = plan[t] = (apply[t], emit_get(t), t in pure)
                    fn = step[1]
                    if fn is None:
                        step[0](rec)
                        continue
                    mark = len(pending)
                    step[0](rec)
                    if step[2] and len(pending) == mark:
                        pending.append(rec)  # its event, derived if retention keeps it
                        continue
                    out = fn(rec)
                    if out is not None:
                        if len(pending) == mark:
                            if type(out) is Entry:
                                pending.append(out)
                            else:
                                pending += out
                        else:  # the record's own events before what its step implied
                            pending[mark:mark] = [out] if type(out) is Entry else out
                n += 1
                left -= 1
                if not left:
                    events.mark = 0
                    publish(0)
                    pending = events.pending
                    left = batch
            events.mark = 0
            publish(0)
        except BaseException:
            events.mark = 0
            events.discard()
            raise
        finally:
            self.replaying = False
            self.groups.touched.clear()
            self.queues.to_check.clear()
            self.schedules.to_check.clear()
        return n

    def derive_deferred(self, rec) -> Entry:
        """The event of a record :meth:`replay_many` deferred (its ``pure`` source)."""
        return self._emit[type(rec)](rec)

    # ------------------------------------------------------------------ actors
    def parent_of(self, actor_id: str) -> tuple[Any, str | None]:
        """(kind, parent actor id) of an actor id: runs under their parent run, groups,
        barriers, timers and join sets under their run, the rest under the root."""
        kind = self._kind_by_prefix[actor_id[:3]]
        return kind, kind.parent_actor_id(actor_id)

    def notify(self, actor_id: str, key: Any) -> None:
        """Re-check the waiters on ``key`` of ``actor_id`` (if it has an activation)."""
        a = self.runtime.actors.get(actor_id)
        if a is not None and a.n_waiters:
            a.notify(key)

    def cancel_actor(self, actor_id: str) -> None:
        """Cancel the nursery of ``actor_id``: its task and every actor task below it end
        through Trio cancellation and answer what they hold. Not in replay."""
        if not self.replaying:
            self.runtime.cancel(actor_id)

    def handle_command(self, actor, item: tuple, cancelled: bool = False) -> None:
        """Run one command on ``actor``'s task: decide, reply or park."""
        handler, session, op, sink, rid = item
        grant = grant_of(session)
        try:
            if grant is not None:
                # rights are judged now, from the key table as it is (a request queued
                # before its key's revocation is refused after it)
                refused = self.keys.grant_refusal(grant)
                if refused is not None:
                    raise refused
            if getattr(session, "idempotency", None) is None:
                result = handler(actor, session, op)
            else:
                result = self._handle_keyed(handler, actor, session, op)
        except RallypointError as exc:
            self.reply(sink, rid, exc)
            return
        except FatalError:
            raise
        except Exception as exc:
            self.internal_error(exc)
            self.reply(sink, rid, exc)
            return
        t = type(result)
        if t is Park:
            if sink.closed:
                return
            if cancelled:
                self.reply(sink, rid, self.cancelled_answer(actor, result))
            else:
                actor.park(result, sink, rid, grant)
        elif t is Subscribe:
            self.subscribe(result, sink, rid, grant)
        else:
            self.reply(sink, rid, result)

    def _handle_keyed(self, handler, actor, session, op):
        """One step of an HTTP request with an Idempotency-Key (``session.idempotency``):
        a step whose answer is stored is answered from it (the encoded reply, bytes)
        without running again; otherwise the handler runs as :meth:`_keyed_step` (its
        commits and its answer journaled as ONE entry), and so does the check of the
        wait it parks (a receive that leases once a task comes). So after a crash the
        effect and its answer are both on disk or neither is: a retry never applies it
        twice (docs/architecture.md, "The HTTP layer")."""
        stored = self.idempotency.step_answer(session, op)
        if stored is not None:
            return stored
        result = self._keyed_step(lambda: handler(actor, session, op), session, op)
        if type(result) is Park:
            park = result
            check = park.check
            result = Park(park.key, lambda: self._keyed_step(check, session, op), park.wait_ms, park.expire)
        return result

    def _keyed_step(self, decide: Callable[[], Any], session, op):
        """Run ``decide`` (a handler, or a parked wait's check) with its commits deferred
        (:meth:`commit`) and journal what they applied as ONE entry, together with the
        step's answer (``IdempotencyRecorded`` with ``step``: the encoded reply, which is
        returned) when it answered and committed something. An answer-less outcome -- a
        park, a wait still waiting, a subscription, an error -- stores nothing; its
        commits are journaled all the same."""
        if self._deferred is not None:  # (never nested: a handler does not run another)
            return decide()
        result, deferred = self._deferring(decide)
        answer = None
        if deferred and isinstance(result, msgspec.Struct) and type(result) not in (Park, Subscribe):
            result = encoder.encode(result)
            answer = self.idempotency.step_record(session, op, result, self.now_ms())
        self._journal_deferred(deferred, answer)
        return result

    def _deferring(self, decide: Callable[[], Any]) -> tuple[Any, list]:
        """Run ``decide`` with its commits deferred; returns ``(its result, the deferred
        records)`` for the caller to journal. If it raises, what it applied is journaled
        (no answer) and the exception goes on; a :class:`FatalError` journals nothing."""
        deferred = self._deferred = []
        try:
            result = decide()
        except FatalError:
            self._deferred = None
            raise
        except BaseException:
            self._deferred = None
            self._journal_deferred(deferred, None)
            raise
        self._deferred = None
        return result, deferred

    def grouped(self, decide: Callable[[], Any]) -> Any:
        """Run ``decide`` with its commits applied at once (each :meth:`commit` applies
        its records and reactions, so what ``decide`` reads next sees them) but journaled
        together as ONE entry when it returns or raises (what it applied is journaled all
        the same; a :class:`FatalError` journals nothing). Returns what ``decide``
        returns. The entry is atomic on recovery and on a standby: all its commits or
        none. Inside a keyed step (or another group) it joins that entry. Used by the
        schedules to fire every schedule due at one instant in a few group commits."""
        if self._deferred is not None:
            return decide()
        result, deferred = self._deferring(decide)
        self._journal_deferred(deferred, None)
        return result

    def _journal_deferred(self, records: list, answer) -> None:
        """Journal a keyed step's applied ``records`` (and its stored ``answer``, a
        record applied here) as one entry."""
        if not records:
            return
        if answer is not None:
            try:
                self.apply(answer)
            except BaseException as exc:
                self.events.discard()
                self._fail(exc, records + [answer])
                raise FatalError(f"apply of {type(answer).__name__} failed: {exc!r}") from exc
            records.append(answer)
        payload = encode_commit(records)
        try:
            lsn = self.journal.append(payload)
        except BaseException:
            self.events.discard()
            raise
        self.events.publish(lsn)

    def subscribe(self, sub: Subscribe, sink: ReplySink, rid: int, who: str | None = None) -> None:
        """Open a subscription on ``sink``: its Ok (a WatchView, sent at once: it reveals
        only durable positions) and then pushes from :class:`Watchers`. ``who``: the
        grant of the session that opened it (:meth:`end_grant` ends it by that)."""
        from ..protocol import WatchView
        from .watch import Watcher, durable_upto

        if sink.closed:
            return
        w = Watcher(sub.space, sub.filter, sub.cursor, sink, rid, who)
        if not sink.add_stream(rid, w):
            from ..errors import ValidationError

            self.reply(sink, rid, ValidationError("events.watch needs a streaming transport (a TCP connection, "
                                                  "or the embedded client's events.watch())"))
            return
        s = self.events.stream(sub.space)
        newest = durable_upto(s, self.journal.durable_lsn)
        self._to_flush.add(sink)
        sink.deliver(rid, encoder.encode(WatchView(cursor=sub.cursor, oldest=s.first_seq, newest=newest)), 0)
        self.watchers.add(w)

    def decide(self, session, op):
        """Decide ``op`` synchronously on the calling task, outside the actors' inboxes:
        the op table's handler, with no actor. For model tests, benchmarks and the
        simulator that drive the decide/apply core step by step. Returns the reply
        Struct, or a :class:`Park` for a wait; raises the RallypointError it answers.
        (Routing checks -- NOT_FOUND across spaces -- are the handler's own too.)"""
        return self.ops[type(op)].handler(None, session, op)

    def end_grant(self, who: str, error: RallypointError) -> None:
        """A grant ended (``who``: a key id whose ``KeyRevoked`` is being applied, or
        ``keys.OPEN_MODE`` as the first key is created): called by that apply, so in the
        same step, wherever the record came from (``key.revoke``, the offline CLI, a
        cluster's ``key.adopt``). Every parked wait of the grant leaves its line now
        (:meth:`Runtime.end_waiters`: no later commit hands it anything, a receive never
        leases) and is answered ``error`` at the end of the batch, after this commit was
        journaled (so the answer is held until it is durable); every subscription of it
        ends with ``error`` once this commit is durable, nothing pushed after it
        (:meth:`Watchers.end_grant`); each of :attr:`grant_listeners` is told this
        commit's LSN. Nothing in replay (no waits or subscriptions exist then)."""
        if self.replaying:
            return
        lsn = self.journal.last_lsn + 1  # the commit being applied (journaled right after its applies)
        for w in self.runtime.end_waiters(who):
            self._grant_ended.append((w.sink, w.rid, error))
        self.watchers.end_grant(who, error, lsn)
        for fn in list(self.grant_listeners):
            fn(lsn)

    def reply(self, sink: ReplySink, rid: int, reply: Any) -> None:
        """Hand ``reply`` (a Struct, bytes or an exception) to ``sink`` with the LSN it
        depends on (the journal's last, as of now)."""
        if sink.closed:
            return
        self._to_flush.add(sink)
        lsn = self.journal.last_lsn
        if isinstance(reply, AtOnce):  # (server.status: no wait for durability)
            reply, lsn = reply.value, 0
        if self.failed is not None:
            reply = UnavailableError("the server stopped after an internal failure; retry once it restarted",
                                     retry_after=1.0)
        elif isinstance(reply, msgspec.Struct):
            try:
                reply = encoder.encode(reply)
            except Exception as exc:
                self.internal_error(exc)
                reply = exc
        elif isinstance(reply, Exception) and not isinstance(reply, RallypointError):
            reply = InternalError(f"internal error ({type(reply).__name__}); the server log has details")
        elif isinstance(reply, UnavailableError):
            # "could not do it now" (disk full, shutting down) reveals no state: at once
            sink.deliver(rid, reply, 0)
            return
        sink.deliver(rid, reply, lsn)

    def after_batch(self) -> None:
        """After an actor's batch (or the heap's): the batch's commits go to the journal
        file and the sync helper (:meth:`Journal.write_now`), and every sink that got
        answers sends them (a connection, in one write). The clock reads live again."""
        self.clock.unpin()
        if self._grant_ended:  # (end_grant's: their commit is journaled now)
            ended, self._grant_ended = self._grant_ended, []
            for sink, rid, error in ended:
                self.reply(sink, rid, error)
        self.journal.write_now()
        to_flush = self._to_flush
        if to_flush:
            for sink in to_flush:
                sink.flush()
            to_flush.clear()

    def cancelled_answer(self, actor, park: Park):
        """What a waiter parked on ``actor`` is told when its actor's nursery is
        cancelled -- the ONE rule for every kind (docs/architecture.md, "What a cancelled
        run's waiters are told"):

        1. the server is stopping (the tree is cancelled from outside, not by a run's
           end): UNAVAILABLE (``details.reason`` shutting_down), whatever it waited for;
        2. a wait for an *outcome* gets the outcome the run's end decided: its ``check``
           answers it (a task CANCELLED, a group FINALIZED, a join set's closing record,
           the run as it ended); a check may also raise its kind's own code
           (BARRIER_CANCELLED, TIMER_CANCELLED);
        3. a wait for an *event* that can no longer happen (its check has no answer)
           raises its run's code: SCOPE_CANCELLED or DEADLINE_EXCEEDED, with
           ``details.reason`` and the run that ended;
        4. no run ended above it (a cancellation that is not a run's end): a bug, logged
           at ERROR and answered INTERNAL -- never a silent timeout answer."""
        rt = self.runtime
        if rt.stopping or rt.cancelled_by(actor) is None:
            return shutdown_error()
        try:
            reply = park.check()
        except RallypointError as exc:
            return exc
        if reply is not None:
            return reply
        run_id = self.run_of_actor(actor)
        err = self.runs.inactive_error(run_id) if run_id is not None else None
        if err is not None:
            return err
        exc = InternalError("internal error: a wait was cancelled with no run ended above it; the server log "
                            "has details")
        log.error("waiter %r of actor %s was cancelled but no run above it ended (run %s): answered INTERNAL",
                  park.key, actor.id, run_id)
        return exc

    def run_of_actor(self, actor) -> str | None:
        """The run an actor belongs to: itself for a run's actor, else the nearest run
        its actor sits under (None: a space-level actor under the root)."""
        aid = actor.id
        while aid is not None:
            if aid.startswith("scp"):
                return aid
            a = self.runtime.actors.get(aid)
            aid = a.parent_id if a is not None else self.parent_of(aid)[1]
        return None

    def deadline_after(self, ms: int) -> float:
        """The Trio time ``ms`` of server time after this step's instant: a parked wait's
        end, on the same grid as every other activity armed on server time
        (:meth:`arm_mono`), so equal instants compare equal in the heap."""
        clock = self.clock
        return clock.trio_time_at_mono(clock.mono_ms() + ms)

    def internal_error(self, exc: BaseException) -> None:
        log.error("internal error while handling a command", exc_info=exc)

    # ------------------------------------------------------------------ time
    def now_ms(self) -> int:
        """Wall clock, ms since the epoch."""
        return self.clock.now_ms()

    def mono_ms(self) -> int:
        """Server time, ms (durations are measured on it)."""
        return self.clock.mono_ms()

    def arm_wall(self, at_ms: int, fn: Callable[[Any], None], arg: Any, prio: int = PRIO_DEFAULT) -> None:
        """Call ``fn(arg)`` at wall instant ``at_ms`` (not in replay)."""
        if not self.replaying:
            self.heap.arm(self.clock.trio_time_at(at_ms), fn, arg, prio)

    def arm_mono(self, mono_ms: int, fn: Callable[[Any], None], arg: Any, prio: int = PRIO_DEFAULT) -> None:
        """Call ``fn(arg)`` at server time ``mono_ms`` (not in replay)."""
        if not self.replaying:
            self.heap.arm(self.clock.trio_time_at_mono(mono_ms), fn, arg, prio)

    def before_batch(self) -> None:
        """Before any command is decided: pin the step's instant (every clock read of
        the batch, its records and ids, gets this one: :meth:`Clock.pin`), notice a
        stall, fire what is due at that instant. :meth:`after_batch` unpins."""
        if self.failed is not None:
            raise FatalError("the coordinator stopped after a failed apply") from self.failed
        now = trio.current_time()
        self.clock.pin(now)
        try:
            gap = now - self.last_seen
            self.last_seen = now
            if gap > STALL_S and self.last_seen_valid:
                self._on_stall(gap)
            heap = self.heap._heap
            if heap and heap[0][0] <= now:
                self.heap.fire_due(now)
        except BaseException:
            self.clock.unpin()  # the batch does not run: no after_batch
            raise

    last_seen_valid = False

    def leases_outstanding(self) -> int:
        """Leases (deliveries, claims, pool grants) and durable waiters with a time
        limit outstanding now, over every kind."""
        return sum(k.leases_outstanding() for k in self.kinds)

    def _on_stall(self, gap_s: float) -> None:
        self.stalls += 1
        if self.leases_outstanding():
            log.warning("event loop stalled for %.1f s: outstanding leases extended by that", gap_s)
            # Owed until journaled: a full disk refuses the record (nothing applied), and
            # the expiries it is owed to are refused too, and held; it is then journaled
            # before them as soon as writes are accepted again. (Raising here lost it,
            # and out of a batch's start it ended the activity heap's task: the
            # simulator's seed 12915.)
            self._stall_owed_ms += int(gap_s * 1000)
            self._journal_owed_extension()

    def _journal_owed_extension(self) -> bool:
        """Journal the stall extension owed (one ``LeasesExtended``), if any; False when
        the journal refuses it (it stays owed)."""
        owed = self._stall_owed_ms
        if owed:
            try:
                self.commit([LeasesExtended(by_ms=owed, at_ms=self.now_ms(), reason="stall")])
            except UnavailableError:
                return False
            self._stall_owed_ms = 0
        return True

    def _writable_again(self) -> None:
        """The journal accepts writes again: first a stall's lease extension that was
        refused, then every activity the heap held (:meth:`ActivityHeap.release_held`);
        if the extension is refused again (another cause still holds), at the next lift."""
        if self._journal_owed_extension():
            self.heap.release_held()

    def extend_leases_after_restart(self, gap_ms: int) -> int:
        """Recovery: the server could not hear renewals for ``gap_ms`` (it was down):
        outstanding leases are extended by it (one record). Returns the extension, ms
        (0 when there was no gap or no lease)."""
        if gap_ms > 0 and self.leases_outstanding():
            log.info("extending %d outstanding lease(s) by the %.3f s the server was down",
                     self.leases_outstanding(), gap_ms / 1000)
            self.commit([LeasesExtended(by_ms=gap_ms, at_ms=self.now_ms(), reason="restart")])
            return gap_ms
        return 0

    def _tick(self, _arg=None) -> None:
        hb = self.heartbeat
        if hb is not None:
            hb(self.clock.mono_ms(), self.clock.now_ms())
        self.heap.arm(trio.current_time() + TICK_S, self._tick, None)

    def rearm_all(self) -> None:
        """After recovery: every kind re-arms its activities at their original due times
        (what is already due fires at once, in due order, runs' deadlines first)."""
        for k in self.kinds:
            k.rearm()

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the journal, the actor runtime (root nursery, activity heap), the event
        watchers and the background tasks (snapshots) until cancelled.

        Stopping order: the runtime and the background tasks stop first, the journal
        last. Cancelled actors still answer what they hold, and an answer may commit (a
        command left in an inbox, an activity that fell due meanwhile); the journal,
        shielded until then, flushes what they appended and closes. (Cancelled together,
        an actor could commit after the journal closed: memory ahead of the journal and
        ``JournalClosedError`` out of a clean shutdown -- found by the simulator, seed
        2294.)"""
        self.last_seen = trio.current_time()
        self.last_seen_valid = True
        self._tick()
        self.retention.rearm()
        # shielded once started (below), not while it starts: a task cancelled before it
        # calls started() stays in nursery.start's own nursery, which waits for it --
        # shielded, for ever (a standby promoted and killed while its journal started)
        journal_scope = trio.CancelScope()

        async def journal_task(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with journal_scope:
                await self.journal.run(task_status=task_status)

        listen = getattr(self.journal, "add_writable_listener", None)
        if listen is not None:  # what was refused for a full disk is retried as space is back
            listen(self._writable_again)
        try:
            async with fatal_unwrapped(), trio.open_nursery() as nursery:
                await nursery.start(journal_task)
                journal_scope.shield = True
                try:
                    async with trio.open_nursery() as actors:
                        await actors.start(self.runtime.run)
                        await actors.start(self.watchers.run)
                        for fn in self.background:
                            await actors.start(fn)
                        task_status.started()
                finally:
                    self.runtime.stopping = True
                    journal_scope.shield = False
                    journal_scope.cancel()
        finally:
            self.runtime.stopping = True

    # ------------------------------------------------------------------ status
    def server_status(self) -> dict:
        rt = self.runtime.statistics()
        fs = getattr(self.journal, "fsync_seconds", None)  # None: no fsync (memory mode)
        return {
            "version": __version__,
            "uptime_s": time.monotonic() - self.started_at,
            "connections": self.connection_count(),
            "durability": self.durability,
            "entities": self.entity_count(),
            "last_lsn": self.journal.last_lsn,
            "durable_lsn": self.journal.durable_lsn,
            "sync_helper": getattr(self.journal, "sync_helper", ""),
            "fsyncs": fs.n if fs is not None else 0,
            "fsync_seconds": fs.sum if fs is not None else 0.0,
            "actors": self.actor_statistics(),
            "tree_depth": rt["tree_depth"],
        }

    def actor_statistics(self) -> dict[str, dict[str, int]]:
        """Per kind: entities, actors active (a task) and passive, inbox depth, parked
        waiters."""
        out: dict[str, dict[str, int]] = {}
        for k in self.kinds:
            if k.prefix:
                out[k.name] = {"active": 0, "passive": 0, "inbox": 0, "waiters": 0}
        for a in self.runtime.actors.values():
            s = out.get(a.kind.name)
            if s is None:
                s = out[a.kind.name] = {"active": 0, "passive": 0, "inbox": 0, "waiters": 0}
            if a.status:
                s["active"] += 1
            s["inbox"] += len(a.inbox)
            s["waiters"] += a.n_waiters
        for k in self.kinds:
            if k.prefix and k.name in out:
                table = self._tables[k.prefix][0]
                out[k.name]["passive"] = max(0, len(table) - out[k.name]["active"])
        return out

    def connection_count(self) -> int:
        """The live client connections of the server that serves this coordinator (0:
        none, an embedded or simulated one)."""
        return 0 if self.connections is None else self.connections.connection_count()

    def statistics(self) -> dict:
        return {
            "commits": self.commits,
            "stalls": self.stalls,
            "heap": len(self.heap),
            "heap_fired": self.heap.fired,
            "dirty": self.dirty_count(),
            "runtime": self.runtime.statistics(),
            **self.server_status(),
        }
