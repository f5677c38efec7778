"""Schedules: recurring actions the server takes itself, exactly once per scheduled time.

A schedule is a *spec* (when), an *action* (what) and *policies* (how):

- **spec**: the union of ``cron`` expressions (5 fields, or 6 with seconds first; parsed
  by ``cronsim``) read in the schedule's ``timezone`` (IANA, ``zoneinfo`` + ``tzdata``),
  and an ``interval_ms`` grid shifted by ``offset_ms`` from the epoch (UTC, no time zone
  involved); only times in [``start_ms``, ``end_ms``] count. Each scheduled time ``t``
  fires at ``t + jitter(t)``, the jitter in [0, ``jitter_ms``) a hash of (schedule id,
  ``t``): a replay, a restart and a standby agree on it. Jitter delays, never reorders:
  the times are taken in scheduled order.
- **action**: a root run named by the ``run_name`` template (``{schedule}``, ``{time}``:
  the scheduled time ISO UTC, ``{local}``: the same in the time zone), with a deadline
  ``run_deadline_ms`` after the fire and the schedule's ``metadata`` kept on the action;
  with ``mailbox``, a task of ``input`` submitted to that work queue in the run.
- **policies**: ``overlap`` when the previous action (the one the last fire started) is
  still running: ``skip`` (record the time skipped), ``buffer_one`` (keep one time in a
  buffer, skip more), ``buffer_all`` (keep up to 1,000), ``cancel_other`` (cancel the
  running run(s), then fire), ``allow_all`` (fire anyway); ``catchup_window_ms``; a
  ``pause_on_failure``; ``remaining_actions``.

**Exactly once per scheduled time.** Every action is keyed by (schedule, scheduled
time) and its ``ScheduleFired`` record is journaled in ONE commit with its effect: the
``ScopeCreated`` of its run and the ``TaskSubmitted`` of its task (and, for
``cancel_other``, the ``ScopeEnded`` of the run it cancels). The schedule keeps a
*cursor*: the last scheduled time its spec has dealt with; every fire, skip or buffer of
a spec time moves it in the same record. So after kill -9, a restart or a failover
(the standby replays the same journal), a time is either in the journal -- with its run
-- or not yet dealt with; it is never fired twice and never has a run without its
record. A time that fell due while the server was down is fired at start-up (origin
``catchup``) when it is at most ``catchup_window_ms`` late, else recorded skipped
(reason ``catchup_window``); runs of consecutive skipped times are one record (``count``).

**Clock and DST.** Scheduled times are UTC instants (ms). Waiting for them is on the
wall clock (a step of the wall clock, NTP or an operator, moves the fire with it: a
step forward makes the times it jumps over due at once -- fired if within the catch-up
window, else skipped --, a step back delays the next fire; nothing fires twice, since
the cursor only moves forward). Cron expressions follow ``cronsim``'s rules for the
time zone's transitions, as Debian's cron does:

- *spring forward* (a local hour that does not exist, e.g. 02:00-03:00 in Europe/Berlin
  on the last Sunday of March): a job whose hour and minute fields name that hour
  (``30 2 * * *``) fires ONCE, at the first instant after the gap (03:00 local); a job
  with a wildcard hour (``*/30 * * * *``) simply has no times in the missing hour;
- *fall back* (a local hour that happens twice, 02:00-03:00 on the last Sunday of
  October): a job with a fixed hour (``30 2 * * *``) fires ONCE, in the first
  occurrence (summer time); a job with a wildcard hour fires in both occurrences (they
  are different instants).

Interval specs are on UTC and ignore DST.

**Outcomes.** An action is RUNNING until its run ends or (with a task) its task
finishes: the task's end ends the run (COMPLETED when the task succeeded, else
CANCELLED) in the same commit, and the outcome is the task's (succeeded, failed,
cancelled, timed_out for an expired task); without a task, the run's end decides
(COMPLETED: succeeded, CANCELLED: cancelled, its deadline: timed_out). The
``ScheduleActionEnded`` record is a reaction in the commit that ended it; it fires the
next buffered time, and pauses the schedule (pause on failure) on failed or timed_out.

**Where things live.** The schedule is a space-level entity (its home shard); each
action is an entity of its run (the run's nursery, retention purges it with the run).
Every schedule sits in the *bucket* of its next fire instant (wall ms), and each bucket
is one entry of the coordinator's activity heap (no task per schedule, one heap entry
for all the schedules due at the same instant). A bucket fires its schedules in group
commits of :data:`STEP_FIRES` (one journal entry each, every fire with its effect in
it); the fire lag (``rallypoint_schedule_fire_lag_seconds``) is the instant a fire's
group is journaled minus its fire instant.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import logging
from datetime import datetime, timezone
from typing import Iterator

import msgspec
import trio

from ..clock import to_iso
from ..errors import ConflictError, NotFoundError, RallypointError, UnavailableError, ValidationError
from ..events import emits, ev
from ..ids import is_id
from ..protocol import (
    NIL, ScheduleActionView, ScheduleBackfill, ScheduleCreate, ScheduleDelete, ScheduleGet, ScheduleList,
    ScheduleListView, SchedulePause, ScheduleTrigger, ScheduleUpdate, ScheduleView,
)
from ..records import (
    ScheduleActionEnded, ScheduleBuffered, ScheduleConfig, ScheduleCreated, ScheduleDeleted, ScheduleFired,
    SchedulePaused, ScheduleSkipped, ScheduleUpdated, ScopeCreated, ScopeEnded,
)
from .common import applies, check_label, check_name, check_payload, check_range, data, did_you_mean, parse_instant, short
from .kind import Kind
from .opmark import ALWAYS, NEVER, SPACE, C, R, W, by, op

log = logging.getLogger("rallypoint.schedules")

__all__ = ["ScheduleState", "ScheduleActionState", "Schedules", "spec_times", "jitter_ms_of", "OVERLAP_POLICIES"]

OVERLAP_POLICIES = ("skip", "buffer_one", "buffer_all", "cancel_other", "allow_all")
MIN_INTERVAL_MS = 1_000
MAX_INTERVAL_MS = 366 * 24 * 3600 * 1000
MAX_JITTER_MS = 24 * 3600 * 1000
MIN_CATCHUP_MS = 1_000
MAX_CATCHUP_MS = 366 * 24 * 3600 * 1000
MAX_RUN_DEADLINE_MS = 366 * 24 * 3600 * 1000
MAX_CRON = 20
MAX_METADATA = 64
MAX_BUFFER = 1_000
MAX_RECENT = 100  # action ids a schedule keeps for describe (newest last)
MAX_BACKFILL = 10_000
#: a backfill's end may be this far past now (ms): a client's clock a little ahead of the
#: server's; the range is cut at now
BACKFILL_FUTURE_MS = 300_000
MAX_NOTE = 1_024
#: scheduled times one activity step deals with (the rest in the next step, at once)
STEP_TIMES = 10_000
STEP_FIRES = 1_000
#: one group commit of a bucket (:meth:`Schedules._on_bucket`, ONE journal entry) holds at
#: most :data:`STEP_FIRES` commits (fires, skips, buffers) and about this many bytes
#: (estimated: 512 a fire plus its task's input): far below a journal entry's and a
#: replication message's bound (256 / 64 MiB) even when every fire carries a 64 KiB input
#: or one schedule catches up a thousand times
GROUP_BYTES = 4 << 20
#: the fire-lag histogram's bucket bounds, seconds (rallypoint_schedule_fire_lag_seconds)
LAG_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)

_TASK_OUTCOME = {"SUCCEEDED": "succeeded", "ACKED": "succeeded", "FAILED": "failed", "CANCELLED": "cancelled",
                 "EXPIRED": "timed_out"}
_FAILURES = ("failed", "timed_out")


class ScheduleState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a schedule. Instants are wall ms. ``cursor_ms``: the last
    scheduled time the spec has dealt with (fired, skipped or buffered) or the instant of
    its creation/last update; ``resume_ms``: the unpause instant (unhandled times up to it
    are skipped, reason ``paused``); ``buffer``: the scheduled times (ms) waiting for the
    running action; ``running``: the RUNNING action ids; ``recent``: the last action ids."""

    id: str
    space: str
    name: str
    config: ScheduleConfig
    created_at_ms: int
    cursor_ms: int
    paused: bool = False
    note: str | None = None
    resume_ms: int | None = None
    remaining: int | None = None
    actions: int = 0
    skipped: int = 0
    running: list[str] = []
    buffer: list[int] = []
    recent: list[str] = []


class ScheduleActionState(msgspec.Struct, gc=False, omit_defaults=True):
    """One action of a schedule (owned by its run): keyed by (``schedule_id``,
    ``scheduled_ms``)."""

    id: str
    space: str
    schedule_id: str
    scheduled_ms: int
    fired_at_ms: int
    origin: str
    run_id: str
    task_id: str | None = None
    state: str = "RUNNING"  # RUNNING | ENDED
    outcome: str | None = None
    ended_at_ms: int | None = None


# ---------------------------------------------------------------------------- the spec

@functools.lru_cache(maxsize=1024)
def _zone(name: str):
    """The ZoneInfo of an IANA name; VALIDATION_FAILED (field ``timezone``) for an unknown one."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise ValidationError(f"timezone {short(name)} is not a known IANA time zone (such as Europe/Berlin, "
                              "America/New_York or UTC)", details={"field": "timezone"}) from None


#: (cron expression, time zone, after ms) -> the next time (ms): schedules sharing an
#: expression and a cursor (every "* * * * *" at the top of the minute) compute it once;
#: cleared when it holds :data:`_NEXT_CACHE_MAX` entries (it is only a cache)
_NEXT_CACHE: dict[tuple[str, str, int], int] = {}
_NEXT_CACHE_MAX = 100_000


def _cron_iter(expr: str, tz, after_ms: int) -> Iterator[int]:
    from cronsim import CronSim

    start = datetime.fromtimestamp(after_ms // 1000, tz)
    for dt in CronSim(expr, start):
        ms = int(dt.timestamp()) * 1000
        if ms > after_ms:
            yield ms


def _cron_times(expr: str, tz_name: str, after_ms: int) -> Iterator[int]:
    """The times of one cron expression in ``tz_name`` strictly after ``after_ms``,
    through :data:`_NEXT_CACHE` until the first miss, then one cronsim iterator."""
    cache = _NEXT_CACHE
    t = after_ms
    while True:
        nxt = cache.get((expr, tz_name, t))
        if nxt is None:
            break
        yield nxt
        t = nxt
    it = _cron_iter(expr, _zone(tz_name), t)
    for nxt in it:
        if len(cache) >= _NEXT_CACHE_MAX:
            cache.clear()
        cache[(expr, tz_name, t)] = nxt
        yield nxt
        t = nxt


def _interval_times(interval_ms: int, offset_ms: int, after_ms: int) -> Iterator[int]:
    k = (after_ms - offset_ms) // interval_ms + 1
    t = offset_ms + k * interval_ms
    while True:
        yield t
        t += interval_ms


def spec_times(cfg: ScheduleConfig, after_ms: int) -> Iterator[int]:
    """The scheduled times (wall ms, ascending, no repeats) of ``cfg``'s spec strictly
    after ``after_ms`` and within its start/end; an empty iterator once past ``end_ms``."""
    if cfg.start_ms is not None and after_ms < cfg.start_ms - 1:
        after_ms = cfg.start_ms - 1
    gens = []
    if cfg.cron:
        _zone(cfg.timezone)
        gens += [_cron_times(e, cfg.timezone, after_ms) for e in cfg.cron]
    if cfg.interval_ms:
        gens.append(_interval_times(cfg.interval_ms, cfg.offset_ms, after_ms))
    it = gens[0] if len(gens) == 1 else heapq.merge(*gens)
    last = None
    end = cfg.end_ms
    for t in it:
        if end is not None and t > end:
            return
        if t != last:
            last = t
            yield t


def jitter_ms_of(schedule_id: str, scheduled_ms: int, jitter_ms: int) -> int:
    """The jitter (ms, in [0, ``jitter_ms``)) of one scheduled time: a hash of the
    schedule and the time, so every replica and replay computes the same."""
    if jitter_ms <= 0:
        return 0
    h = hashlib.blake2b(f"{schedule_id}:{scheduled_ms}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % jitter_ms


@functools.lru_cache(maxsize=4096)
def _time_strings(scheduled_ms: int, tz_name: str) -> tuple[str, str]:
    """(ISO UTC, ISO in ``tz_name``) of one scheduled time: computed once for every
    schedule of that zone due at that time (100,000 at the top of a minute)."""
    return to_iso(scheduled_ms), datetime.fromtimestamp(scheduled_ms / 1000, _zone(tz_name)).isoformat()


def render_run_name(template: str, schedule: str, scheduled_ms: int, tz_name: str) -> str:
    """The run name of one action: ``template`` with ``{schedule}``, ``{time}`` (ISO UTC)
    and ``{local}`` (ISO in ``tz_name``); cut to 256 characters."""
    utc, local = _time_strings(scheduled_ms, tz_name)
    out = template.format_map({"schedule": schedule, "time": utc, "local": local})
    return out[:256] or schedule


# ---------------------------------------------------------------------------- the kind

class Schedules(Kind):
    """Schedules and their actions: create, update, pause/unpause, trigger, backfill,
    delete, list, describe; the fire activity (one heap entry per schedule)."""

    prefix = "sch"
    name = "schedules"
    noun = "schedule"
    id_field = "schedule"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, ScheduleState] = {}
        self.actions: dict[str, ScheduleActionState] = {}
        self._init_indexes()
        #: action ids whose run or task may have ended in the current commit (reaction)
        self.to_check: set[str] = set()
        #: schedule id -> (scheduled ms, fire ms) of the heap entry that is current
        self.next_due: dict[str, tuple[int, int]] = {}
        #: fire instant (wall ms) -> the schedules armed at it (in arm order): ONE heap
        #: entry per instant, so 100,000 schedules due at the top of a minute are one
        #: entry, dealt with in group commits of :data:`STEP_FIRES` (:meth:`_on_bucket`);
        #: a schedule whose ``next_due`` moved elsewhere is stale in its old bucket
        self.buckets: dict[int, dict[str, None]] = {}
        #: fire instants (wall ms) of the fires applied but not yet journaled: their lag
        #: is taken once their group commit is journaled (:meth:`_note_lags`)
        self._lag_due: list[int] = []
        #: commits and estimated bytes in the current group commit (:meth:`_group_full`)
        self._group_n = 0
        self._group_bytes = 0
        #: the instant (wall ms) this process recovered: a fire of a time due before it is
        #: a catch-up
        self.started_ms = 0
        #: fire lag (seconds: the real instant the fire's group commit was journaled minus
        #: its fire time),
        #: the most recent samples (metrics: ``rallypoint_schedule_fire_lag_seconds``)
        self.lag_samples: list[float] = []
        self.lag_counts = [0] * (len(LAG_BOUNDS_S) + 1)  # histogram over LAG_BOUNDS_S (+Inf last)
        self.lag_sum_s = 0.0
        self.fires = 0
        self.skips = 0
        self._gone: dict[str, tuple[str, str]] = {}
        self._due_now: str | None = None  # the schedule _on_due is dealing with  # deleted in this apply: (space, name), for its event

    def _init_indexes(self) -> None:
        self.by_name: dict[tuple[str, str], str] = {}
        self.by_key: dict[tuple[str, int], str] = {}  # (schedule, scheduled ms) -> action id
        self.by_run: dict[str, str] = {}  # run id -> action id

    def entity_tables(self):
        return {"sch": (self.table, ScheduleState), "sca": (self.actions, ScheduleActionState)}

    def parent_actor_id(self, entity_id: str) -> str | None:
        a = self.actions.get(entity_id)
        return a.run_id if a is not None else None

    def statistics(self) -> dict:
        return {"schedules": len(self.table), "actions": len(self.actions),
                "running": sum(len(s.running) for s in self.table.values()), "fires": self.fires,
                "skips": self.skips}

    # ================================================================ lookups
    def get(self, space: str, name_or_id) -> ScheduleState:
        """A schedule by name or id; NOT_FOUND (with a did-you-mean) otherwise."""
        if not isinstance(name_or_id, str):
            raise ValidationError("schedule must be a name or an id", details={"field": "schedule"})
        sid = name_or_id if is_id(name_or_id, "sch") else self.by_name.get((space, name_or_id))
        s = self.table.get(sid) if sid else None
        if s is None or s.space != space:
            hint = did_you_mean(name_or_id, (n for (sp, n) in self.by_name if sp == space))
            raise NotFoundError(f"no schedule {short(name_or_id)}{hint}; create it with schedules.create()",
                                details={"schedule": name_or_id})
        return s

    def route(self, session, name_or_id) -> str:
        return self.get(session.space, name_or_id).id

    # ================================================================ validation
    def _config(self, space: str, op, base: ScheduleConfig | None = None) -> ScheduleConfig:
        """The configuration ``op`` (a ScheduleCreate, or a ScheduleUpdate over ``base``)
        asks for, validated. VALIDATION_FAILED naming the field; NOT_FOUND for a mailbox
        that does not exist."""
        cfg = ScheduleConfig() if base is None else msgspec.structs.replace(base)
        upd = base is not None

        def given(name):
            v = getattr(op, name)
            if name == "input":
                return bytes(v) != bytes(NIL)
            return v is not None

        if not upd or given("cron"):
            cron = op.cron
            if not isinstance(cron, list) or len(cron) > MAX_CRON:
                raise ValidationError(f"cron must be a list of at most {MAX_CRON} expressions",
                                      details={"field": "cron"})
            cfg.cron = [self._check_cron(i, e) for i, e in enumerate(cron)]
        if not upd or given("interval_ms"):
            iv = op.interval_ms
            if iv is not None and iv != 0:
                check_range("interval_ms", iv, MIN_INTERVAL_MS, MAX_INTERVAL_MS, " ms")
            cfg.interval_ms = iv or None
        if not upd or given("offset_ms"):
            cfg.offset_ms = op.offset_ms
        if not upd or given("timezone"):
            _zone(op.timezone)
            cfg.timezone = op.timezone
        if not upd or given("start"):
            cfg.start_ms = parse_instant("start", op.start) if op.start else None
        if not upd or given("end"):
            cfg.end_ms = parse_instant("end", op.end) if op.end else None
        if not upd or given("jitter_ms"):
            check_range("jitter_ms", op.jitter_ms, 0, MAX_JITTER_MS, " ms")
            cfg.jitter_ms = op.jitter_ms
        if not upd or given("run_name"):
            cfg.run_name = op.run_name
        if not upd or given("run_deadline_ms"):
            if op.run_deadline_ms is not None and op.run_deadline_ms != 0:
                check_range("run_deadline_ms", op.run_deadline_ms, 1, MAX_RUN_DEADLINE_MS, " ms")
            cfg.run_deadline_ms = op.run_deadline_ms or None
        if not upd or given("metadata"):
            md = op.metadata
            if len(md) > MAX_METADATA or any(len(k) > 128 or len(v) > 1024 for k, v in md.items()):
                raise ValidationError(f"metadata holds at most {MAX_METADATA} entries, keys of at most 128 and "
                                      "values of at most 1024 characters", details={"field": "metadata"})
            cfg.metadata = dict(md)
        if not upd or given("mailbox"):
            if op.mailbox:
                self.coord.queues.get_queue(space, op.mailbox)  # NOT_FOUND: ensure the work queue first
                cfg.mailbox = op.mailbox
            else:
                cfg.mailbox = None
        if not upd or given("input"):
            b = check_payload("input", op.input)
            cfg.input = None if b == bytes(NIL) else b
        if not upd or given("overlap"):
            cfg.overlap = self._check_overlap(op.overlap)
        if not upd or given("catchup_window_ms"):
            check_range("catchup_window_ms", op.catchup_window_ms, MIN_CATCHUP_MS, MAX_CATCHUP_MS, " ms")
            cfg.catchup_window_ms = op.catchup_window_ms
        if not upd or given("pause_on_failure"):
            cfg.pause_on_failure = bool(op.pause_on_failure)
        if not upd or given("remaining_actions"):
            if op.remaining_actions is not None:
                check_range("remaining_actions", op.remaining_actions, 0, 1 << 40)
            cfg.remaining_actions = op.remaining_actions
        # the spec as a whole
        if not cfg.cron and not cfg.interval_ms:
            raise ValidationError("give the schedule a spec: cron expressions and/or interval_ms",
                                  details={"field": "cron"})
        if cfg.interval_ms:
            check_range("offset_ms", cfg.offset_ms, 0, cfg.interval_ms - 1, " ms (below interval_ms)")
        elif cfg.offset_ms:
            raise ValidationError("offset_ms needs interval_ms", details={"field": "offset_ms"})
        if cfg.start_ms is not None and cfg.end_ms is not None and cfg.end_ms < cfg.start_ms:
            raise ValidationError(f"end {to_iso(cfg.end_ms)} is before start {to_iso(cfg.start_ms)}",
                                  details={"field": "end"})
        try:
            name = render_run_name(cfg.run_name, "x" * 128, 0, cfg.timezone)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ValidationError(f"run_name {short(cfg.run_name)} is not a valid template ({e!r}); it may use "
                                  "{schedule}, {time} and {local}", details={"field": "run_name"}) from None
        check_label("run_name", name, 10_000)
        return cfg

    @staticmethod
    def _check_cron(i: int, expr) -> str:
        from cronsim import CronSim, CronSimError

        if not isinstance(expr, str) or not expr.strip():
            raise ValidationError(f"cron[{i}] must be a cron expression such as '*/5 * * * *'",
                                  details={"field": f"cron[{i}]"})
        try:
            it = CronSim(expr, datetime(2026, 1, 1, tzinfo=timezone.utc))
            next(it)
        except (CronSimError, StopIteration, ValueError) as e:
            raise ValidationError(f"cron[{i}] {expr!r} is not a valid cron expression ({e}); 5 fields "
                                  "(minute hour day month weekday) or 6 with seconds first",
                                  details={"field": f"cron[{i}]"}) from None
        return expr

    @staticmethod
    def _check_overlap(v) -> str:
        if v not in OVERLAP_POLICIES:
            raise ValidationError(f"overlap must be one of {', '.join(OVERLAP_POLICIES)} (got {short(v)})",
                                  details={"field": "overlap"})
        return v

    # ================================================================ views
    def fire_ms(self, s: ScheduleState, t: int) -> int:
        return t + jitter_ms_of(s.id, t, s.config.jitter_ms)

    def next_times(self, s: ScheduleState, n: int) -> list[int]:
        """The next ``n`` fire instants (wall ms, jitter added) the spec will fire."""
        if s.paused or n <= 0 or s.remaining == 0:
            return []
        out = []
        for t in spec_times(s.config, s.cursor_ms):
            if s.resume_ms is not None and t <= s.resume_ms:
                continue
            out.append(self.fire_ms(s, t))
            if len(out) >= n:
                break
        return out

    def action_view(self, a: ScheduleActionState) -> ScheduleActionView:
        return ScheduleActionView(id=a.id, scheduled_at=to_iso(a.scheduled_ms), fired_at=to_iso(a.fired_at_ms),
                                  origin=a.origin, run_id=a.run_id, task_id=a.task_id, state=a.state,
                                  outcome=a.outcome, ended_at=to_iso(a.ended_at_ms))

    def view(self, s: ScheduleState, next_n: int = 5, recent: int = 10) -> ScheduleView:
        c = s.config
        acts = [self.actions[i] for i in reversed(s.recent) if i in self.actions][:recent]
        return ScheduleView(
            id=s.id, name=s.name, paused=s.paused, note=s.note, cron=list(c.cron), interval_ms=c.interval_ms,
            offset_ms=c.offset_ms, timezone=c.timezone, start=to_iso(c.start_ms), end=to_iso(c.end_ms),
            jitter_ms=c.jitter_ms, run_name=c.run_name, run_deadline_ms=c.run_deadline_ms, metadata=dict(c.metadata),
            mailbox=c.mailbox, overlap=c.overlap, catchup_window_ms=c.catchup_window_ms,
            pause_on_failure=c.pause_on_failure, remaining_actions=s.remaining, created_at=to_iso(s.created_at_ms),
            actions=s.actions, skipped=s.skipped, running=list(s.running),
            buffered=[to_iso(t) for t in s.buffer], next_fires=[to_iso(t) for t in self.next_times(s, next_n)],
            recent=[self.action_view(a) for a in acts],
        )

    # ================================================================ ops
    @op(ScheduleCreate, route=SPACE, permission=C, resend=ALWAYS)
    def op_schedule_create(self, actor, session, op: ScheduleCreate) -> ScheduleView:
        """Create the schedule, or return it when one of that name exists with the same
        settings (CONFLICT otherwise). VALIDATION_FAILED (bad cron, unknown time zone, end
        before start, a bad template, out-of-range durations), NOT_FOUND (``mailbox``),
        LIMIT_EXCEEDED (the space's ``schedules`` limit)."""
        space = session.space
        check_name("name", op.name)
        cfg = self._config(space, op)
        if op.note is not None and len(op.note) > MAX_NOTE:
            raise ValidationError(f"note is longer than {MAX_NOTE} characters", details={"field": "note"})
        sid = self.by_name.get((space, op.name))
        if sid is not None:
            s = self.table[sid]
            if s.config != cfg:
                diff = next((f for f in ScheduleConfig.__struct_fields__ if getattr(s.config, f) != getattr(cfg, f)),
                            "config")
                raise ConflictError(f"schedule {short(op.name)} exists with other settings ({diff} differs); "
                                    "change it with schedules.update()", details={"field": diff})
            return self.view(s)
        self.coord.limits.check_schedules(space)
        now = self.coord.now_ms()
        rec = ScheduleCreated(id=self.coord.new_id("sch", space=space), space=space, name=op.name, config=cfg,
                              at_ms=now, cursor_ms=now, paused=op.paused, note=op.note)
        self.coord.commit([rec])
        return self.view(self.table[rec.id])

    @op(ScheduleUpdate, route=by("schedule"), permission=C, resend=ALWAYS)
    def op_schedule_update(self, actor, session, op: ScheduleUpdate) -> ScheduleView:
        """Change the given settings; the spec's times are counted from now (the times
        already past are not fired by the new spec: backfill them). ``remaining_actions``
        given resets the count. VALIDATION_FAILED / NOT_FOUND as create."""
        s = self.get(session.space, op.schedule)
        cfg = self._config(session.space, op, s.config)
        reset = op.remaining_actions is not None
        if cfg == s.config and not (reset and s.remaining != cfg.remaining_actions):
            return self.view(s)
        now = self.coord.now_ms()
        self.coord.commit([ScheduleUpdated(id=s.id, config=cfg, at_ms=now, cursor_ms=max(now, s.cursor_ms),
                                           reset_remaining=reset)])
        return self.view(s)

    @op(ScheduleGet, route=by("schedule"), permission=R, resend=ALWAYS)
    def op_schedule_get(self, actor, session, op: ScheduleGet) -> ScheduleView:
        check_range("next_n", op.next_n, 0, 100)
        check_range("recent", op.recent, 0, MAX_RECENT)
        return self.view(self.get(session.space, op.schedule), op.next_n, op.recent)

    @op(ScheduleList, route=SPACE, permission=R, resend=ALWAYS)
    def op_schedule_list(self, actor, session, op: ScheduleList) -> ScheduleListView:
        """The space's schedules, by name (each with its next fire and last action; at
        most 1,000)."""
        mine = sorted((s for s in self.table.values() if s.space == session.space), key=lambda s: s.name)
        return ScheduleListView(schedules=[self.view(s, 1, 1) for s in mine[:1000]])

    @op(SchedulePause, route=by("schedule"), permission=W, resend=ALWAYS)
    def op_schedule_pause(self, actor, session, op: SchedulePause) -> ScheduleView:
        """Pause or unpause (idempotent). While paused nothing fires; at unpause the times
        that fell due meanwhile are recorded skipped (reason ``paused``)."""
        s = self.get(session.space, op.schedule)
        if op.note is not None and len(op.note) > MAX_NOTE:
            raise ValidationError(f"note is longer than {MAX_NOTE} characters", details={"field": "note"})
        if s.paused == op.paused and (op.note is None or op.note == s.note):
            return self.view(s)
        now = self.coord.now_ms()
        self.coord.commit([SchedulePaused(id=s.id, paused=op.paused, at_ms=now, note=op.note,
                                          cursor_ms=None if op.paused else now)])
        return self.view(s)

    @op(ScheduleTrigger, route=by("schedule"), permission=W, resend=NEVER)
    def op_schedule_trigger(self, actor, session, op: ScheduleTrigger) -> ScheduleView:
        """Take the action now (scheduled time: now) under ``overlap`` (default: the
        schedule's); a paused schedule fires too. CONFLICT when no actions remain;
        LIMIT_EXCEEDED and the task's refusals (NOT_FOUND mailbox, backlog) as raised."""
        s = self.get(session.space, op.schedule)
        overlap = self._check_overlap(op.overlap) if op.overlap is not None else s.config.overlap
        self._require_remaining(s)
        now = self.coord.now_ms()
        t = now
        while (s.id, t) in self.by_key or t in s.buffer:
            t += 1
        self.coord.commit(self._policy_records(s, t, "trigger", False, overlap, now))
        return self.view(s)

    @op(ScheduleBackfill, route=by("schedule"), permission=W, resend=ALWAYS)
    def op_schedule_backfill(self, actor, session, op: ScheduleBackfill) -> ScheduleView:
        """Take the action for every spec time in [start, end] that has none yet, in
        order, under ``overlap`` (default: the schedule's). The range is cut at now; an end
        more than 5 minutes in the future, an end before start or more than 10,000 times
        are VALIDATION_FAILED; CONFLICT when no actions remain."""
        s = self.get(session.space, op.schedule)
        overlap = self._check_overlap(op.overlap) if op.overlap is not None else s.config.overlap
        start = parse_instant("start", op.start)
        end = parse_instant("end", op.end)
        now = self.coord.now_ms()
        if end < start:
            raise ValidationError(f"end {op.end} is before start {op.start}", details={"field": "end"})
        if end > now + BACKFILL_FUTURE_MS:
            raise ValidationError(f"end {op.end} is in the future (now {to_iso(now)}); a backfill takes past times",
                                  details={"field": "end"})
        end = min(end, now)  # (a client clock a little ahead: the times after now are the spec's to fire)
        times = []
        for t in spec_times(s.config, start - 1):
            if t > end:
                break
            times.append(t)
            if len(times) > MAX_BACKFILL:
                raise ValidationError(f"the range holds more than {MAX_BACKFILL} scheduled times; backfill a "
                                      "shorter range", details={"field": "end"})
        buffered = set(s.buffer)
        todo = [t for t in times if (s.id, t) not in self.by_key and t not in buffered]
        if todo:
            self._require_remaining(s)
        for t in todo:
            if s.remaining == 0 or (s.id not in self.table):
                break
            self.coord.commit(self._policy_records(s, t, "backfill", False, overlap, now))
        return self.view(s)

    @op(ScheduleDelete, route=by("schedule"), permission=C, resend=NEVER)
    def op_schedule_delete(self, actor, session, op: ScheduleDelete) -> ScheduleView:
        """Delete the schedule; its runs are left as they are (end them yourself). The
        reply is its last view."""
        s = self.get(session.space, op.schedule)
        view = self.view(s)
        self.coord.commit([ScheduleDeleted(id=s.id, at_ms=self.coord.now_ms())])
        return view

    def _require_remaining(self, s: ScheduleState) -> None:
        if s.remaining == 0:
            raise ConflictError(f"schedule {s.name!r} has no remaining actions; raise remaining_actions with "
                                "schedules.update()", details={"schedule": s.id, "remaining_actions": 0})

    # ================================================================ deciding one time
    def _policy_records(self, s: ScheduleState, t: int, origin: str, advance: bool, overlap: str, now: int) -> list:
        """The records for scheduled time ``t`` under ``overlap``: fire, skip (overlap,
        buffer_full) or buffer. Raises what firing raises (for ops)."""
        if s.running and overlap != "allow_all":
            if overlap == "skip":
                return [ScheduleSkipped(schedule_id=s.id, scheduled_ms=t, last_ms=t, count=1, reason="overlap",
                                        at_ms=now, advance=advance)]
            if overlap in ("buffer_one", "buffer_all"):
                cap = 1 if overlap == "buffer_one" else MAX_BUFFER
                if len(s.buffer) >= cap:
                    return [ScheduleSkipped(schedule_id=s.id, scheduled_ms=t, last_ms=t, count=1,
                                            reason="buffer_full", at_ms=now, advance=advance)]
                return [ScheduleBuffered(schedule_id=s.id, scheduled_ms=t, at_ms=now, origin=origin, advance=advance)]
            if overlap == "cancel_other":
                ends = []
                for aid in s.running:
                    run = self.coord.runs.table.get(self.actions[aid].run_id)
                    if run is not None and run.state == "ACTIVE":
                        ends.append(ScopeEnded(id=run.id, state="CANCELLED", at_ms=now,
                                               reason=f"schedule {s.name}: overlap cancel_other"))
                return ends + self._fire_records(s, t, origin, advance, now)
        return self._fire_records(s, t, origin, advance, now)

    def _fire_records(self, s: ScheduleState, t: int, origin: str, advance: bool, now: int,
                      buffered: bool = False) -> list:
        """The action for ``t``: its run (and task) and the ``ScheduleFired`` that keys
        them, for one commit. Raises LIMIT_EXCEEDED (runs, tasks), NOT_FOUND (mailbox), the
        task's refusals."""
        coord = self.coord
        c = s.config
        space = s.space
        coord.limits.check_runs(space)
        run_id = coord.new_id("scp")
        deadline = now + c.run_deadline_ms if c.run_deadline_ms else None
        name = render_run_name(c.run_name, s.name, t, c.timezone)
        recs: list = [ScopeCreated(id=run_id, space=space, parent_id=None, name=name, deadline_ms=deadline,
                                   child_limit=1000, at_ms=now)]
        task_id = None
        if c.mailbox is not None:
            queues = coord.queues
            q = queues.get_queue(space, c.mailbox)
            sub = queues.prepare_submit(space, q, run_id, c.input if c.input is not None else bytes(NIL), None, None,
                                        now=now)
            recs.append(sub)
            task_id = sub.id
        recs.append(ScheduleFired(id=coord.new_id("sca", under=run_id), schedule_id=s.id, scheduled_ms=t, at_ms=now,
                                  run_id=run_id, origin=origin, advance=advance, task_id=task_id, buffered=buffered))
        return recs

    # ================================================================ the activity
    def _arm(self, s: ScheduleState) -> None:
        """Compute the next fire of ``s`` (derived state) and put it on the heap. Not in
        replay (``rearm`` arms every schedule after it), nor for the schedule whose due
        times :meth:`_on_due` is dealing with (it arms it once, at its end)."""
        if self.coord.replaying or s.id == self._due_now:
            return
        nxt = None
        if not s.paused and s.remaining != 0:
            for t in spec_times(s.config, s.cursor_ms):
                nxt = (t, self.fire_ms(s, t))
                break
        if nxt is None:
            self.next_due.pop(s.id, None)
            return
        if self.next_due.get(s.id) == nxt:
            return
        self.next_due[s.id] = nxt
        self._put(s.id, nxt[1])

    def _put(self, sid: str, fire_ms: int) -> None:
        """Put schedule ``sid`` in the bucket of ``fire_ms`` (its ``next_due`` says so
        already); the first of a bucket arms its one heap entry."""
        b = self.buckets.get(fire_ms)
        if b is None:
            self.buckets[fire_ms] = {sid: None}
            self.coord.arm_wall(fire_ms, self._on_bucket, fire_ms)
        else:
            b[sid] = None

    def _on_bucket(self, fire_ms: int) -> None:
        """The heap entry of the instant ``fire_ms`` came due: deal with every schedule
        still armed at it (:meth:`_on_due`, in arm order), :data:`STEP_FIRES` schedules
        per group commit (:meth:`Coordinator.grouped`: each fire applied with its effect
        at once, the group journaled as one entry, so a fire is in the journal with its
        run or not at all). The fire lag is taken when a group is journaled. A group
        refused (UNAVAILABLE: disk full, no in-sync standby) puts the schedules not yet
        dealt with back in the bucket; the heap tries the entry again."""
        bucket = self.buckets.pop(fire_ms, None)
        if not bucket:
            return
        nd = self.next_due
        due = [(sid, d) for sid in bucket if (d := nd.get(sid)) is not None and d[1] == fire_ms]
        on_due = self._on_due
        grouped = self.coord.grouped
        i = 0  # the schedule being dealt with (those before it are done)

        def decide():
            nonlocal i
            self._group_n = self._group_bytes = 0
            while i < len(due) and not self._group_full():
                on_due(due[i])
                i += 1

        try:
            while i < len(due):
                try:
                    grouped(decide)
                finally:
                    self._note_lags()
        except UnavailableError:
            left = self.buckets.setdefault(fire_ms, {})
            for sid, _d in due[i:]:
                left[sid] = None
            raise

    def _group_full(self) -> bool:
        """The current group commit holds :data:`STEP_FIRES` commits or
        :data:`GROUP_BYTES` (estimated): the next goes in another group (another
        schedule: the bucket's next group; more times of the same schedule: its next step,
        at once)."""
        return self._group_n >= STEP_FIRES or self._group_bytes >= GROUP_BYTES

    def _note_lags(self) -> None:
        """The fires applied since the last call are journaled now: their lag (this
        instant minus each fire instant) into the histogram and the samples."""
        fs = self._lag_due
        if not fs:
            return
        self._lag_due = []
        now = trio.current_time()
        base = self.coord.clock.trio_time_at(fs[0]) - fs[0] / 1000  # (wall ms -> trio s is linear)
        note = self._note_lag
        for f in fs:
            note(now - (base + f / 1000))

    def _on_due(self, arg) -> None:
        """A schedule's bucket came due (:meth:`_on_bucket`): deal with every spec time whose fire
        instant has come (at most :data:`STEP_TIMES` / :data:`STEP_FIRES` per step; the
        rest at once in the next), each in its own commit: fired (or buffered / skipped
        by the overlap policy), skipped as ``paused`` (up to the unpause) or
        ``catchup_window`` (too late), consecutive skips as one record."""
        sid, due = arg
        s = self.table.get(sid)
        if s is None or self.next_due.get(sid) != due:
            return
        self._due_now = sid
        try:
            self._deal_with_due(s, self.coord.now_ms(), s.config)
        finally:
            self._due_now = None

    def _deal_with_due(self, s: ScheduleState, now: int, c: ScheduleConfig) -> None:
        sid = s.id
        coord = self.coord
        pend: list | None = None  # [first, last, count, reason] of skips not yet committed
        seen = fires = 0
        more = False
        upcoming = None  # the first time not due yet: the next heap entry

        def flush():
            nonlocal pend
            if pend is not None:
                coord.commit([ScheduleSkipped(schedule_id=sid, scheduled_ms=pend[0], last_ms=pend[1], count=pend[2],
                                              reason=pend[3], at_ms=now)])
                self._group_n += 1
                self._group_bytes += 128
                pend = None

        for t in spec_times(c, s.cursor_ms):
            f = self.fire_ms(s, t)
            if f > now:
                upcoming = (t, f)
                break
            if seen >= STEP_TIMES or fires >= STEP_FIRES or self._group_full():
                more = True
                break
            seen += 1
            if s.resume_ms is not None and t <= s.resume_ms:
                reason = "paused"
            elif (sid, t) in self.by_key or t in s.buffer:
                reason = "already_fired"  # a backfill took it first (within its jitter)
            elif now - f > c.catchup_window_ms:
                reason = "catchup_window"
            else:
                reason = None
            if reason is not None:
                if pend is not None and pend[3] == reason:
                    pend[1] = t
                    pend[2] += 1
                else:
                    flush()
                    pend = [t, t, 1, reason]
                continue
            flush()
            if s.paused or s.remaining == 0 or sid not in self.table:
                break
            origin = "catchup" if f < self.started_ms else "scheduled"
            try:
                recs = self._policy_records(s, t, origin, True, c.overlap, now)
            except RallypointError as e:  # the action cannot be taken (a limit, a missing queue): recorded
                log.warning("schedule %s: the action for %s was refused: %s", s.name, to_iso(t), e)
                recs = [ScheduleSkipped(schedule_id=sid, scheduled_ms=t, last_ms=t, count=1,
                                        reason=e.code.lower(), at_ms=now)]
            coord.commit(recs)
            fires += 1
            self._group_n += 1
            self._group_bytes += 512 + (len(c.input) if c.mailbox is not None and c.input is not None else 0)
            if type(recs[-1]) is ScheduleFired:
                self._lag_due.append(f)  # (its lag once journaled: _note_lags)
        flush()
        self._due_now = None
        if sid not in self.table:
            return
        if more:  # the rest in the next step, at once
            self.next_due[sid] = (s.cursor_ms, now)
            self._put(sid, now)
        elif upcoming is not None and not s.paused and s.remaining != 0:
            # every time before ``upcoming`` was dealt with (each moved the cursor): it is next
            if self.next_due.get(sid) != upcoming:
                self.next_due[sid] = upcoming
                self._put(sid, upcoming[1])
        else:
            self._arm(s)

    def _note_lag(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self.fires += 1
        self.lag_sum_s += lag_s
        self.lag_counts[bisect.bisect_left(LAG_BOUNDS_S, lag_s)] += 1
        samples = self.lag_samples
        samples.append(lag_s)
        if len(samples) > 200_000:
            del samples[:100_000]

    # ================================================================ outcomes (a reaction)
    def note_task_end(self, task) -> None:
        """A task went terminal (called by the work queues' apply): if it is an action's
        task, check that action in this commit's reactions. Not in replay."""
        aid = self.by_run.get(task.scope_id)
        if aid is not None and not self.coord.replaying and self.actions[aid].task_id == task.id:
            self.to_check.add(aid)

    def on_run_inactive(self, action_id: str, at_ms: int, reason: str) -> None:
        """The action's run ended (in its apply): check the action in the reactions."""
        if not self.coord.replaying and action_id in self.actions:
            self.to_check.add(action_id)

    def react(self) -> list:
        """Follow-up records for the current commit: for each action whose run or task
        ended, the end of its run (when its task ended first) and ``ScheduleActionEnded``;
        then the next buffered time of its schedule fires (in the same commit)."""
        if not self.to_check:
            return []
        todo, self.to_check = self.to_check, set()
        coord = self.coord
        runs, tasks = coord.runs, coord.queues.tasks
        now = coord.now_ms()
        more: list = []
        for aid in sorted(todo):
            a = self.actions.get(aid)
            if a is None or a.state != "RUNNING":
                continue
            run = runs.table.get(a.run_id)
            live = run is not None and runs.live(a.run_id)
            t = tasks.get(a.task_id) if a.task_id is not None else None
            outcome = None
            if t is not None and t.state in _TASK_OUTCOME and (live or t.state != "CANCELLED"):
                outcome = _TASK_OUTCOME[t.state]
                if live:
                    more.append(ScopeEnded(id=run.id, state="COMPLETED" if outcome == "succeeded" else "CANCELLED",
                                           at_ms=now, reason=f"its scheduled task {t.id} {t.state}"))
            elif not live:
                if run is None:
                    outcome = "cancelled"
                elif run.deadline_fired or (run.state == "ACTIVE" and runs.deadline_passed(run.id)):
                    outcome = "timed_out"
                elif run.state == "COMPLETED":
                    outcome = "succeeded"
                else:
                    outcome = "cancelled"
            if outcome is None:
                continue
            s = self.table.get(a.schedule_id)
            pause = (s is not None and s.config.pause_on_failure and outcome in _FAILURES and not s.paused)
            more.append(ScheduleActionEnded(id=aid, outcome=outcome, at_ms=now, pause=pause))
            if s is not None and s.buffer and not pause and not s.paused and [r for r in s.running if r != aid] == []:
                bt = s.buffer[0]
                try:
                    more += self._fire_records(s, bt, "buffered", False, now, buffered=True)
                except RallypointError as e:
                    log.warning("schedule %s: the buffered action for %s was refused: %s", s.name, to_iso(bt), e)
        return more

    # ================================================================ apply
    @applies(ScheduleCreated)
    def _apply_created(self, r: ScheduleCreated) -> None:
        s = ScheduleState(id=r.id, space=r.space, name=r.name, config=r.config, created_at_ms=r.at_ms,
                          cursor_ms=r.cursor_ms, paused=r.paused, note=r.note,
                          remaining=r.config.remaining_actions)
        self.table[s.id] = s
        self.by_name[(s.space, s.name)] = s.id
        self.coord.limits.schedule_added(s.space)
        self.coord.touch(s.id)
        self._arm(s)

    @applies(ScheduleUpdated)
    def _apply_updated(self, r: ScheduleUpdated) -> None:
        s = self.table[r.id]
        s.config = r.config
        s.cursor_ms = r.cursor_ms
        s.resume_ms = None
        if r.reset_remaining or r.config.remaining_actions is None:
            s.remaining = r.config.remaining_actions
        self.coord.touch(s.id)
        self._arm(s)

    @applies(SchedulePaused)
    def _apply_paused(self, r: SchedulePaused) -> None:
        s = self.table[r.id]
        s.paused = r.paused
        if r.note is not None or not r.paused:
            s.note = r.note
        if r.cursor_ms is not None:
            s.resume_ms = r.cursor_ms
        self.coord.touch(s.id)
        self._arm(s)

    @applies(ScheduleDeleted)
    def _apply_deleted(self, r: ScheduleDeleted) -> None:
        s = self.table.pop(r.id)
        self._gone[s.id] = (s.space, s.name)
        if self.by_name.get((s.space, s.name)) == s.id:
            del self.by_name[(s.space, s.name)]
        self.next_due.pop(s.id, None)
        self.coord.limits.schedule_removed(s.space)
        self.coord.touch(s.id)

    def _advance(self, s: ScheduleState, t: int) -> None:
        if t > s.cursor_ms:
            s.cursor_ms = t
        if s.resume_ms is not None and s.cursor_ms >= s.resume_ms:
            s.resume_ms = None

    @applies(ScheduleFired)
    def _apply_fired(self, r: ScheduleFired) -> None:
        s = self.table[r.schedule_id]
        a = ScheduleActionState(id=r.id, space=s.space, schedule_id=s.id, scheduled_ms=r.scheduled_ms,
                                fired_at_ms=r.at_ms, origin=r.origin, run_id=r.run_id, task_id=r.task_id)
        self.actions[a.id] = a
        self.by_key[(s.id, a.scheduled_ms)] = a.id
        self.by_run[a.run_id] = a.id
        self.coord.runs.own(a.run_id, a.id)
        if r.buffered and s.buffer and s.buffer[0] == r.scheduled_ms:
            s.buffer = s.buffer[1:]
        s.running = s.running + [a.id]
        s.recent = (s.recent + [a.id])[-MAX_RECENT:]
        s.actions += 1
        if s.remaining is not None:
            s.remaining -= 1
        if r.advance:
            self._advance(s, r.scheduled_ms)
        self.coord.touch(s.id)
        self.coord.touch(a.id)
        self._arm(s)

    @applies(ScheduleSkipped)
    def _apply_skipped(self, r: ScheduleSkipped) -> None:
        s = self.table[r.schedule_id]
        s.skipped += r.count
        self.skips += r.count
        if r.advance:
            self._advance(s, r.last_ms)
        self.coord.touch(s.id)
        self._arm(s)

    @applies(ScheduleBuffered)
    def _apply_buffered(self, r: ScheduleBuffered) -> None:
        s = self.table[r.schedule_id]
        s.buffer = s.buffer + [r.scheduled_ms]
        if r.advance:
            self._advance(s, r.scheduled_ms)
        self.coord.touch(s.id)
        self._arm(s)

    @applies(ScheduleActionEnded)
    def _apply_action_ended(self, r: ScheduleActionEnded) -> None:
        a = self.actions[r.id]
        a.state = "ENDED"
        a.outcome = r.outcome
        a.ended_at_ms = r.at_ms
        self.coord.touch(a.id)
        s = self.table.get(a.schedule_id)
        if s is None:
            return
        if a.id in s.running:
            s.running = [x for x in s.running if x != a.id]
        if r.pause:
            s.paused = True
            s.note = f"paused on failure: the action for {to_iso(a.scheduled_ms)} {r.outcome} (run {a.run_id})"
        self.coord.touch(s.id)
        self._arm(s)

    # ================================================================ recovery
    def rebuild_indexes(self) -> None:
        self._init_indexes()
        runs = self.coord.runs
        for s in self.table.values():
            self.by_name[(s.space, s.name)] = s.id
        for a in self.actions.values():
            self.by_key[(a.schedule_id, a.scheduled_ms)] = a.id
            self.by_run[a.run_id] = a.id
            if a.run_id in runs.table:
                runs.own(a.run_id, a.id)

    def rearm(self) -> None:
        """After recovery: arm every schedule at its next fire (one already due fires at
        once: catch-up). Also checks the RUNNING actions whose run or task ended while
        their reaction could not run (never, with one commit per step: a safety net)."""
        self.started_ms = self.coord.now_ms()
        self.next_due = {}
        self.buckets = {}
        for s in self.table.values():
            self._arm(s)

    # ================================================================ retention
    def purge_run(self, run_id: str) -> int:
        """An action belongs to its run: purged with it (its key goes too)."""
        n = 0
        for eid in self.coord.runs.owned.get(run_id, ()):
            if eid.startswith("sca"):
                a = self.actions.pop(eid, None)
                if a is not None:
                    if self.by_key.get((a.schedule_id, a.scheduled_ms)) == eid:
                        del self.by_key[(a.schedule_id, a.scheduled_ms)]
                    self.by_run.pop(a.run_id, None)
                    self.coord.touch(eid)
                    n += 1
        return n

    # ================================================================ events
    @emits(ScheduleCreated)
    def _ev_created(self, r: ScheduleCreated):
        return ev(r.space, "schedule.created", "schedule", r.id, None, r.at_ms, {"name": r.name})

    @emits(ScheduleUpdated)
    def _ev_updated(self, r: ScheduleUpdated):
        s = self.table[r.id]
        return ev(s.space, "schedule.updated", "schedule", s.id, None, r.at_ms, {"name": s.name})

    @emits(SchedulePaused)
    def _ev_paused(self, r: SchedulePaused):
        s = self.table[r.id]
        return ev(s.space, "schedule.paused" if r.paused else "schedule.unpaused", "schedule", s.id, None, r.at_ms,
                  data(name=s.name, note=r.note))

    @emits(ScheduleDeleted)
    def _ev_deleted(self, r: ScheduleDeleted):
        space, name = self._gone.pop(r.id)
        return ev(space, "schedule.deleted", "schedule", r.id, None, r.at_ms, {"name": name})

    @emits(ScheduleFired)
    def _ev_fired(self, r: ScheduleFired):
        s = self.table[r.schedule_id]
        return ev(s.space, "schedule.fired", "schedule", s.id, r.run_id, r.at_ms,
                  data(name=s.name, scheduled_at=to_iso(r.scheduled_ms), origin=r.origin, action=r.id,
                       task=r.task_id))

    @emits(ScheduleSkipped)
    def _ev_skipped(self, r: ScheduleSkipped):
        s = self.table[r.schedule_id]
        return ev(s.space, "schedule.skipped", "schedule", s.id, None, r.at_ms,
                  {"name": s.name, "scheduled_at": to_iso(r.scheduled_ms), "last": to_iso(r.last_ms),
                   "count": r.count, "reason": r.reason})

    @emits(ScheduleBuffered)
    def _ev_buffered(self, r: ScheduleBuffered):
        s = self.table[r.schedule_id]
        return ev(s.space, "schedule.buffered", "schedule", s.id, None, r.at_ms,
                  {"name": s.name, "scheduled_at": to_iso(r.scheduled_ms)})

    @emits(ScheduleActionEnded)
    def _ev_action_ended(self, r: ScheduleActionEnded):
        a = self.actions[r.id]
        return ev(a.space, "schedule.action_ended", "schedule", a.schedule_id, a.run_id, r.at_ms,
                  data(action=a.id, scheduled_at=to_iso(a.scheduled_ms), outcome=r.outcome,
                       paused=True if r.pause else None))
