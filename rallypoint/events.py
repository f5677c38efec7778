"""Events: every state change, derived from the journaled records, as one ordered stream
per space.

**Where events come from (one place per kind).** A kind marks one method per record
type it describes with :func:`emits`; the coordinator calls it right after the record
is applied -- live and in replay alike, through the same code -- and the method returns
the record's events (or nothing). A record whose apply also changes *other* entities
(a run's end cancels its subtree, a group finalizing cancels its members) describes
each of those changes as an *implied fact*: the transition function that makes the
change calls ``coord.implied(fact)``, where ``fact`` is the record that would have said
so (``TaskCancelled``, ``ScopeEnded``, ``GroupFinalized``, ``TimerCancelled``) or one of
the never-journaled facts of :mod:`rallypoint.records` (``BarrierCancelled``,
``JoinSetChildDone``, ``JoinSetDone``), and the same ``@emits`` table turns it into
events. So the events of a commit are a pure function of its records and of the state
they were applied to: replay after a restart derives the same events with the same
sequence numbers, and nothing is stored that the journal does not already say (events
kept in a snapshot are a cache of derived data, never read back into state).

Order within a commit: each record's own events, then the events of what its step did
to other entities, in the order it did them; records in commit order.

**The stream.** Each space has one sequence, ``seq`` = 1, 2, 3... strictly increasing and
gap-free in what was ever emitted; ``retain_count`` / ``retain_ms`` bound what is kept
(the oldest are dropped). A *cursor* is the ``seq`` of the last event a client has
processed: reading from cursor ``c`` returns the events with ``seq > c``; a cursor
older than what is kept (``c < oldest - 1``) is CURSOR_EXPIRED.

**Durability.** An event leaves the server (a push to a watcher, a page of
``events.list``) only once the journal is durable past the commit that made it, so a
watcher is never told of a change a crash could take back; after a restart the same
change has the same ``seq``.

The catalogue of event types (:data:`CATALOGUE`) is what ``docs/events.md`` lists;
``tests/test_events.py`` checks that every type a kind emits is in it.
"""

from __future__ import annotations

from typing import Callable, Iterable

import msgspec

__all__ = [
    "Entry", "ev", "emits", "EventLog", "Stream", "EventFilter", "CATALOGUE", "SILENT_RECORDS",
    "parse_retain_events", "DEFAULT_RETAIN_EVENTS",
]

#: Events kept per space when ``--retain-events`` is not given.
DEFAULT_RETAIN_EVENTS = 100_000


class Entry(msgspec.Struct, gc=False, array_like=True, omit_defaults=True):
    """One event in memory. ``data`` is a dict, or a msgspec Struct (``gc=False``) that
    encodes as the same map (the hot task events: no GC allocation per event); ``at_ms``
    is the wall instant (ms) of the change it describes;
    ``seq`` is given when its commit is journaled; ``lsn`` is that journal entry (0:
    known durable: loaded or replayed); ``raw`` its wire encoding, made once when first
    needed. (A Struct without GC tracking: the log holds 100,000s of them.)"""

    space: str
    type: str
    kind: str
    id: str
    run: str | None
    at_ms: int
    data: dict | None = None
    seq: int = 0
    lsn: int = 0
    raw: bytes | None = None

    def __repr__(self) -> str:
        return f"<Event {self.seq} {self.type} {self.kind}:{self.id} run={self.run}>"


ev = Entry  # the constructor emitters use: ev(space, type, kind, id, run, at_ms, data)


def emits(*rec_types: type, pure: bool = False) -> Callable:
    """Mark a kind's method as the event source of these record (or implied fact) types:
    ``fn(record) -> Entry | list[Entry] | None`` (one event, several, or none), called
    after the record was applied. At most one per type per kind; the coordinator builds
    its table from the marks.

    ``pure=True`` promises that ``fn`` reads nothing but the record (no state, no
    ``instant``) and returns exactly ONE event, in the record's own ``space``: recovery's
    replay may then derive it later, only if retention keeps it
    (:meth:`EventLog.publish_replayed`, :meth:`EventLog.recovered`)."""

    def deco(fn):
        fn._emits = rec_types
        fn._emits_pure = pure
        return fn

    return deco


# ---------------------------------------------------------------------------- catalogue
#: type -> (aggregate kind, what it means, payload fields). docs/events.md is this table.
CATALOGUE: dict[str, tuple[str, str, str]] = {
    # runs
    "scope.created": ("scope", "a run was created (also a group's gate run and a task's own run)",
                      "parent, name, deadline, group, task"),
    "scope.cancelled": ("scope", "the run was cancelled (its subtree stops at once)", "reason (when the cancel gave one)"),
    "scope.completed": ("scope", "the run completed", "reason"),
    "scope.deadline": ("scope", "the run passed its deadline (its subtree stops)", "deadline"),
    # work queues and tasks
    "mailbox.created": ("mailbox", "a work queue was created", "name, max_attempts, backlog_limit, requirements, aging_ms, "
                        "weights, rate_limits"),
    "mailbox.scheduling_set": ("mailbox", "an ensure changed the queue's aging, fair-share weights or "
                               "rate limits per fairness key", "name, aging_ms, weights, rate_limits"),
    "mailbox.requirements_set": ("mailbox", "an ensure replaced the queue's default requirements", "name, requirements"),
    "task.submitted": ("task", "a task was queued", "mailbox, key, group, joinset, deadline, priority, fair_key"),
    "task.priority_set": ("task", "a queued task's priority changed (task.set_priority)", "priority, fair_key"),
    "task.delivered": ("task", "a worker leased the task (never its token: the lease's secret); holder: who "
                       "received it (the worker name the receive gave, else its connection's client@peer)",
                       "attempt, holder, priority, fair_key"),
    "task.completing": ("task", "its worker completed a task that owns a run; the run's join sets are closing",
                        "attempt, run"),
    "task.completed": ("task", "the task SUCCEEDED", "attempt"),
    "task.retried": ("task", "its worker asked for a retry: back in the queue", "attempt"),
    "task.lease_expired": ("task", "the lease ran out: back in the queue for takeover", "attempt"),
    "task.released": ("task", "its worker gave it back unfinished: back in the queue, the attempt not counted",
                      "attempt"),
    "task.failed": ("task", "the task FAILED", "reason (rejected, max_attempts, lease_expired), attempt"),
    "task.cancelled": ("task", "the task was CANCELLED", "reason"),
    "task.expired": ("task", "the task passed its own deadline (EXPIRED)", ""),
    "leases.extended": ("space", "outstanding leases were extended by time the server could not hear",
                        "by_ms, reason (restart, stall), leases"),
    # groups
    "group.created": ("group", "a task group was created (with its gate run)",
                      "condition, threshold, expected_members, mailbox, gate"),
    "group.member_joined": ("group", "a task became a member", "task"),
    "group.sealed": ("group", "the group takes no new members", ""),
    "group.verdict": ("group", "a member was ACCEPTED or REJECTED", "task, verdict, late"),
    "group.finalized": ("group", "the group decided (its gate run is cancelled with it)", "outcome, reason"),
    # barriers
    "barrier.created": ("barrier", "a barrier was created", "target"),
    "barrier.arrived": ("barrier", "a distinct key arrived (`early`: for the next epoch, held until it begins)",
                        "key, epoch, arrived, target, early"),
    "barrier.released": ("barrier", "the target-th key arrived: waiters released", "epoch"),
    "barrier.next_epoch": ("barrier", "the barrier was reset for reuse, with its early arrivals", "epoch, arrived"),
    "barrier.cancelled": ("barrier", "the barrier's run ended before it released", "reason"),
    # timers
    "timer.created": ("timer", "a durable timer was armed", "fire_at"),
    "timer.fired": ("timer", "the timer fired", ""),
    "timer.acked": ("timer", "a waiter acknowledged the fire", ""),
    "timer.cancelled": ("timer", "the timer was disarmed (timer.cancel() or its run ended)", "reason"),
    # schedules
    "schedule.created": ("schedule", "a schedule was made", "name"),
    "schedule.updated": ("schedule", "its settings changed", "name"),
    "schedule.deleted": ("schedule", "the schedule was deleted (its runs stay)", "name"),
    "schedule.paused": ("schedule", "paused (by hand, or by pause on failure)", "name, note"),
    "schedule.unpaused": ("schedule", "unpaused: the times due meanwhile are skipped", "name, note"),
    "schedule.fired": ("schedule", "an action for one scheduled time, its run (and task) in the same commit",
                       "name, scheduled_at, origin (scheduled, catchup, buffered, trigger, backfill), action, task"),
    "schedule.skipped": ("schedule", "scheduled times not fired (a range of count)",
                         "name, scheduled_at, last, count, reason (overlap, buffer_full, catchup_window, paused, "
                         "already_fired, or a refusal's code)"),
    "schedule.buffered": ("schedule", "a time waits for the running action (buffer_one, buffer_all)",
                          "name, scheduled_at"),
    "schedule.action_ended": ("schedule", "an action's run or task ended",
                              "action, scheduled_at, outcome (succeeded, failed, cancelled, timed_out), paused"),
    # join sets
    "joinset.created": ("joinset", "a join set was created", "name"),
    "joinset.delay_submitted": ("joinset", "a durable delay child was added", "child, fire_at"),
    "joinset.child_done": ("joinset", "a child finished: its completion record (in completion order)",
                           "child, child_kind, ok, failure_kind"),
    "joinset.consumed": ("joinset", "join_next took a completion record (a step of the set's log)",
                         "index, step"),
    "joinset.closing": ("joinset", "the set was closed (by close(), its run's complete() or end)", ""),
    "joinset.closed": ("joinset", "every child of a closing set finished", ""),
    # claims (named, space-wide; never purged)
    "claim.acquired": ("claim", "a lease on the claim's key was taken (by an acquire, or handed to the next waiter)",
                       "key, generation, holder, request_id"),
    "claim.waiting": ("claim", "an acquire joined the claim's FIFO queue (a durable waiter)", "key, request_id, holder"),
    "claim.wait_ended": ("claim", "a waiter left the queue unserved", "key, request_id, reason (expired, withdrawn, "
                         "cancelled: its run ended)"),
    "claim.released": ("claim", "the holder released its lease", "key, generation, reason (released, withdrawn)"),
    "claim.expired": ("claim", "the lease ran out", "key, generation"),
    "claim.completed": ("claim", "the holder recorded the result: COMPLETED for good", "key, generation"),
    # pools (runstate's permits) and their grants
    "pool.created": ("pool", "a pool of units was created", "name, units_total"),
    "pool.waiting": ("pool", "an acquire joined the pool's FIFO queue", "name, request_id, units, holder"),
    "pool.wait_ended": ("pool", "a waiter left the queue unserved",
                        "name, request_id, reason (expired, withdrawn, cancelled: its run ended)"),
    "grant.acquired": ("grant", "units of a pool were granted (an acquire, a waiter served, or a task's admission)",
                       "pool, units, task, holder, request_id"),
    "grant.released": ("grant", "the units went back to the pool",
                       "pool, units, reason (released, withdrawn, delivery_ended)"),
    "grant.expired": ("grant", "the grant's lease ran out: the units went back", "pool, units"),
    # quotas (runstate's allowances)
    "quota.created": ("quota", "a quota (units per fixed window) was created", "name, units_limit, window_ms"),
    "quota.consumed": ("quota", "units were taken at once", "name, units, consumption_id, waiter, holder"),
    "quota.waiting": ("quota", "a take joined the quota's FIFO queue (a durable waiter)", "name, units, waiter, holder"),
    "quota.granted": ("quota", "a waiter was served (one event per waiter)", "name, units, consumption_id, waiter"),
    "quota.wait_ended": ("quota", "a waiter left unserved", "name, waiter, state (EXPIRED, CANCELLED), units"),
    "quota.cooldown": ("quota", "nothing is granted until the instant given", "name, until, reason"),
    # budgets
    "budget.created": ("budget", "a budget was created", "name, currency, scale, limit_minor"),
    "budget.reserved": ("budget", "an amount was reserved (by a worker, or for a task's admission)",
                        "reservation, amount_minor, task, holder"),
    "budget.settled": ("budget", "a reservation was charged (by a settle, or in full when its task succeeded)",
                       "reservation, usage_key, requested_minor, charged_minor, closes"),
    "budget.voided": ("budget", "a reservation was released unspent (a void, or its task's delivery did not succeed)",
                      "reservation, released_minor"),
    "budget.reservation_stale": ("budget", "a reservation passed its settle-by instant (still held)",
                                 "reservation, remaining_minor"),
    # admission
    "work_limit.created": ("work_limit", "a cap on unfinished tasks of a run was created", "name, max_outstanding"),
    # once
    "once.acquired": ("once", "a holder took the once (run, key)", "key, holder, attempts"),
    "once.completed": ("once", "the once is DONE (its result recorded)", "key"),
    "once.failed": ("once", "an attempt failed (final: FAILED for good, else OPEN again)", "key, final, attempts, error"),
    "once.lease_expired": ("once", "the holder's lease ran out: OPEN again", "key"),
    # task subscriptions
    "task.subscribed": ("task", "a subscriber joined the task (interest only)", "subscriber"),
    "task.detached": ("task", "a subscriber detached from the task", "subscriber"),
    # access
    "key.created": ("key", "an API key was created", "name, permissions"),
    "key.revoked": ("key", "an API key was revoked", ""),
    # cluster
    "cluster.leader_changed": ("space", "a node became the shard's leader (a failover or the first start of a "
                               "replicated shard); in `default` and every space with events", "epoch, node, lsn"),
    # retention
    "retention.purged": ("space", "finished runs and tasks were deleted (--retain-finished)",
                         "runs, tasks, entities"),
    # operators
    "console.action": ("console", "an operator acted from the web console (its own operation's events tell the "
                       "effect); key: the key id that did it (none: open mode)", "action, key, note"),
}

#: Record types that change state but make no event, and why (a test checks that every
#: record type either has an emitter or is listed here).
SILENT_RECORDS: dict[str, str] = {
    "SlotsReleased": "a change of the cluster's layout, not of any space's entities (rallypoint cluster status shows it)",
    "RunLinked": "bookkeeping between shards (the run's end will be told to a home shard); the run's own events tell its story",
    "RemoteRunAdopted": "bookkeeping between shards: the home shard's note of a run that lives on another shard (the run's events are that shard's)",
    "RemoteRunEnded": "the end of a run of another shard, whose scope.cancelled / scope.completed / scope.deadline its own shard emitted; what it ends here has its own events (claim, pool and quota waiters)",
    "OutboxAcked": "bookkeeping between shards (outbox entries another shard holds)",
    "AdmissionHeld": "the home shard's hold for another shard's delivery: its grants and budget reservations are the records' own (grant.acquired, budget.reserved events)",
    "AdmissionEnded": "a reservation for another shard's delivery ended unused; its grants and budget reservations end with their own events",
    "RemoteDeliveryNoted": "another shard's delivery started or ended (that shard emits task.delivered, task.completed...); what it releases here has its own events",
    "TaskReservationHeld": "bookkeeping between shards: the home shard's reservation, kept for the next delivery (task.delivered tells it)",
    "ReservationUsed": "part of the delivery's commit (task.delivered tells it)",
    "LeaseRenewed": "a renewal only moves the lease's expiry; frequent, and no one waits on it",
    "ClaimRenewed": "a renewal only moves the lease's expiry (as LeaseRenewed)",
    "GrantRenewed": "a renewal only moves the lease's expiry (as LeaseRenewed)",
    "OnceRenewed": "a renewal only moves the lease's expiry (as LeaseRenewed)",
    "IdempotencyRecorded": "the HTTP layer's stored answer to a request (its own bookkeeping; the request's "
                           "effect has its own events)",
    "IdempotencyExpired": "stored HTTP answers past their TTL forgotten (bookkeeping)",
    "JoinSetAnswered": "a step of the set's replay log that took no record: a probe's 'pending' or "
                       "'exhausted' answer, or a record a closing consume had already taken, handed to the "
                       "await that waited for it (that close shows as joinset.closing)",
}


def parse_retain_events(text: str) -> tuple[int | None, int | None]:
    """``--retain-events``: a count (``100000``) or an age (``30s``, ``15m``, ``24h``,
    ``7d``). Returns ``(count, age_ms)`` (one of them None). ``0``: keep every event.
    Raises ValueError on anything else."""
    text = text.strip().lower()
    if text.isdigit():
        return int(text), None
    return None, parse_duration_ms(text)


_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(text: str) -> int:
    """``30s``, ``15m``, ``24h``, ``7d``, ``250ms``, or plain seconds (``90``) -> ms.
    Raises ValueError."""
    text = text.strip().lower()
    for unit in ("ms", "s", "m", "h", "d"):
        if text.endswith(unit):
            num = text[: -len(unit)]
            break
    else:
        unit, num = "s", text
    value = float(num)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"not a duration: {text!r}")
    return int(value * _UNITS[unit])


# ---------------------------------------------------------------------------- filters
def unknown_types(types: Iterable[str]) -> list[str]:
    """The names of ``types`` (as :class:`EventFilter` reads them: exact names, or
    ``prefix.*``) that no event of :data:`CATALOGUE` can match. The server accepts them
    (a runstate program may watch for a type this server never emits); the CLI refuses
    them, since such a watch would wait forever."""
    out = []
    for t in types:
        if t.endswith(".*") or t.endswith("."):
            prefix = t.rstrip("*")
            if not any(name.startswith(prefix) for name in CATALOGUE):
                out.append(t)
        elif t not in CATALOGUE:
            out.append(t)
    return out


def closest_type(t: str) -> str | None:
    """The catalogue's name (or ``kind.*`` prefix, for a ``prefix.*`` given) closest to
    an unknown type ``t`` (difflib, similarity >= 0.6), or None: a "did you mean"."""
    import difflib

    if t.endswith(".*") or t.endswith("."):
        prefixes = sorted({name.split(".", 1)[0] + ".*" for name in CATALOGUE})
        close = difflib.get_close_matches(t.rstrip("*").rstrip(".") + ".*", prefixes, n=1, cutoff=0.6)
    else:
        close = difflib.get_close_matches(t, list(CATALOGUE), n=1, cutoff=0.6)
    return close[0] if close else None


class EventFilter:
    """What a watch or a list asks for: ``types`` (exact names, or ``prefix.*``),
    ``scope`` (a run: events of it and of every run below it), ``aggregate`` (one
    entity: ``kind:id`` or just the id)."""

    __slots__ = ("types", "prefixes", "scope", "aggregate", "_runs", "_cache")

    def __init__(self, types: Iterable[str] | None = None, scope: str | None = None,
                 aggregate: str | None = None, runs=None) -> None:
        exact, prefixes = set(), []
        for t in types or ():
            if t.endswith(".*") or t.endswith("."):
                prefixes.append(t.rstrip("*"))
            else:
                exact.add(t)
        self.types = frozenset(exact) if (exact or prefixes) else None
        self.prefixes = tuple(prefixes)
        self.scope = scope
        if aggregate is not None and ":" in aggregate:
            aggregate = aggregate.split(":", 1)[1]
        self.aggregate = aggregate
        self._runs = runs  # the runs kind: for ``scope`` (ancestry)
        self._cache: dict[str, bool] = {}

    @property
    def everything(self) -> bool:
        return self.types is None and self.scope is None and self.aggregate is None

    def match(self, e: Entry) -> bool:
        if self.types is not None and e.type not in self.types:
            if not self.prefixes or not e.type.startswith(self.prefixes):
                return False
        if self.aggregate is not None and e.id != self.aggregate:
            return False
        scope = self.scope
        if scope is not None:
            run = e.run
            if run is None:
                return False
            if run != scope:
                hit = self._cache.get(run)
                if hit is None:
                    hit = self._runs is not None and self._runs.is_descendant_or_self(run, scope)
                    if len(self._cache) > 10_000:
                        self._cache.clear()
                    self._cache[run] = hit
                if not hit:
                    return False
        return True


# ---------------------------------------------------------------------------- the log
class Stream:
    """One space's events: ``entries[start:]`` hold ``first_seq .. next_seq - 1``."""

    __slots__ = ("space", "entries", "start", "first_seq", "next_seq", "durable_seq",
                 "persisted_first", "persisted_last")

    def __init__(self, space: str, next_seq: int = 1) -> None:
        self.space = space
        self.entries: list[Entry] = []
        self.start = 0
        self.first_seq = next_seq  # seq of entries[start] (== next_seq when empty)
        self.next_seq = next_seq
        self.durable_seq = next_seq - 1  # the last seq whose commit is durable
        # what the last snapshot holds (seq range), for incremental writes
        self.persisted_first = next_seq
        self.persisted_last = next_seq - 1

    def __len__(self) -> int:
        return len(self.entries) - self.start

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def get(self, seq: int) -> Entry | None:
        i = seq - self.first_seq
        if i < 0 or seq >= self.next_seq:
            return None
        return self.entries[self.start + i]

    def index_after(self, cursor: int) -> int:
        """The list index of the first entry with ``seq > cursor`` (clamped)."""
        i = cursor + 1 - self.first_seq
        if i < 0:
            i = 0
        return self.start + i

    def drop_before(self, seq: int) -> int:
        """Drop every entry with ``seq < seq``; returns how many."""
        n = min(seq, self.next_seq) - self.first_seq
        if n <= 0:
            return 0
        self.start += n
        self.first_seq += n
        if self.start > 4096 and self.start * 2 > len(self.entries):
            del self.entries[: self.start]
            self.start = 0
        return n


class EventLog:
    """Every space's event stream, the events of the commit being made, retention, and
    the watchers (:class:`rallypoint.actors.events_hub.Hub` pushes to them).

    Args:
        retain_count: events kept per space (None or 0: no count limit).
        retain_ms: events kept this long after their instant, ms (None: no age limit).
    """

    def __init__(self, retain_count: int | None = DEFAULT_RETAIN_EVENTS, retain_ms: int | None = None) -> None:
        self.streams: dict[str, Stream] = {}
        self.pending: list[Entry] = []
        #: where the commit being applied starts in ``pending`` (above 0 only while
        #: :meth:`Coordinator.replay_many` holds several entries' events there)
        self.mark = 0
        self.retain_count = retain_count or None
        self.retain_ms = retain_ms or None
        self.emitted = 0
        self.dropped = 0
        self.on_publish: Callable[[], None] | None = None  # the hub's wake-up, while it has watchers

    def stream(self, space: str) -> Stream:
        s = self.streams.get(space)
        if s is None:
            s = self.streams[space] = Stream(space)
        return s

    def publish(self, lsn: int) -> None:
        """The commit whose events are pending was journaled as ``lsn`` (0 in replay):
        number them and append them to their spaces' streams."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        streams = self.streams
        limit = self.retain_count
        if len(pending) == 1:  # the common case: one event
            e = pending[0]
            s = streams.get(e.space)
            if s is None:
                s = streams[e.space] = Stream(e.space)
            e.seq = s.next_seq
            s.next_seq += 1
            e.lsn = lsn
            s.entries.append(e)
            self.emitted += 1
            if limit is not None and len(s.entries) - s.start > limit + (limit >> 4):
                self.dropped += s.drop_before(s.next_seq - limit)
            if self.on_publish is not None:
                self.on_publish()
            return
        last = None
        s = None
        for e in pending:
            if e.space != last:
                if s is not None and limit is not None and len(s.entries) - s.start > limit + (limit >> 4):
                    self.dropped += s.drop_before(s.next_seq - limit)  # (trimmed in steps: amortized)
                last = e.space
                s = streams.get(last)
                if s is None:
                    s = streams[last] = Stream(last)
                seq = s.next_seq
                append = s.entries.append
            e.seq = seq
            seq += 1
            s.next_seq = seq
            e.lsn = lsn
            append(e)
        if limit is not None and len(s.entries) - s.start > limit + (limit >> 4):
            self.dropped += s.drop_before(s.next_seq - limit)
        self.emitted += len(pending)
        if self.on_publish is not None:
            self.on_publish()

    def trim_age(self, now_ms: int) -> int:
        """Drop events older than ``retain_ms`` (the retention tick calls it)."""
        if self.retain_ms is None:
            return 0
        horizon = now_ms - self.retain_ms
        n = 0
        for s in self.streams.values():
            entries, i, end = s.entries, s.start, len(s.entries)
            while i < end and entries[i].at_ms < horizon:
                i += 1
            if i > s.start:
                n += s.drop_before(s.first_seq + (i - s.start))
        self.dropped += n
        return n

    def trim_count(self) -> int:
        """Drop the oldest events beyond ``retain_count`` in every space."""
        n = 0
        if self.retain_count is not None:
            for s in self.streams.values():
                if len(s) > self.retain_count:
                    n += s.drop_before(s.next_seq - self.retain_count)
        self.dropped += n
        return n

    def publish_replayed(self, lsn: int = 0) -> None:
        """Recovery's replay with deferred events (:meth:`Coordinator.replay_many`):
        append what is pending to the streams as :meth:`publish` does with ``lsn`` 0
        (replayed: durable; the argument is there for the same call shape),
        where an item may be an event or a *record* whose one event (a ``pure``
        emitter's, in the record's ``space``) is derived only if retention keeps it
        (:meth:`recovered`). Its place in the stream is its sequence number; the count
        limit trims as in :meth:`publish`."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        streams = self.streams
        limit = self.retain_count
        cap = None if limit is None else limit + (limit >> 4)
        last = None
        s = None
        seq = 0
        for e in pending:
            if e.space != last:
                if s is not None:
                    s.next_seq = seq
                    if cap is not None and len(s.entries) - s.start > cap:
                        self.dropped += s.drop_before(seq - limit)
                last = e.space
                s = streams.get(last)
                if s is None:
                    s = streams[last] = Stream(last)
                seq = s.next_seq
                append = s.entries.append
            if type(e) is Entry:
                e.seq = seq
                e.lsn = 0
            seq += 1
            append(e)
        s.next_seq = seq
        if cap is not None and len(s.entries) - s.start > cap:
            self.dropped += s.drop_before(seq - limit)
        self.emitted += len(pending)

    def recovered(self, derive: Callable[[object], Entry] | None = None) -> None:
        """After recovery (snapshot events loaded, journal tail replayed): every event is
        durable; apply the count limit. ``derive(record) -> Entry``: the event of a
        record :meth:`publish_replayed` kept in its place -- called only for those
        retention keeps, each given the sequence number of its place.

        Raises RuntimeError when a deferred record is left and ``derive`` is None, or
        when ``derive`` does not return one event in the record's space (an emitter
        wrongly marked ``pure``)."""
        self.trim_count()
        for s in self.streams.values():
            entries = s.entries
            seq = s.first_seq
            for i in range(s.start, len(entries)):
                x = entries[i]
                if type(x) is not Entry:
                    if derive is None:
                        raise RuntimeError("a replayed record's event was deferred and nothing derives it")
                    e = derive(x)
                    if type(e) is not Entry or e.space != s.space:
                        raise RuntimeError(f"the pure event source of {type(x).__name__} did not return "
                                           f"one event in space {s.space!r}: {e!r}")
                    e.seq = seq
                    e.lsn = 0
                    entries[i] = e
                seq += 1
            s.durable_seq = s.last_seq

    def discard(self) -> None:
        """A commit failed (fail-stop): its events never happened."""
        self.pending = []

    def instant(self, now_ms: int) -> int:
        """The instant for an event of a record that carries none (a waiter leaving a
        queue): that of the event before it in the same commit, else ``now_ms`` (so in
        replay it is the replay's time: such events' ``at`` is approximate)."""
        return self.pending[-1].at_ms if len(self.pending) > self.mark else now_ms

    # ------------------------------------------------------------ reading
    def check_cursor(self, space: str, cursor: int | None) -> tuple[Stream, int]:
        """The stream and the effective cursor (None: before the oldest kept event).
        Raises CURSOR_EXPIRED for a cursor older than what is kept, VALIDATION_FAILED
        for a negative one or one past the newest event."""
        from .errors import CursorExpiredError, ValidationError

        s = self.stream(space)
        if cursor is None:
            return s, s.first_seq - 1
        if cursor < 0:
            raise ValidationError(f"cursor must be >= 0 (got {cursor})", details={"field": "cursor"})
        if cursor < s.first_seq - 1:
            raise CursorExpiredError(
                f"cursor {cursor} has expired: the oldest event kept is {s.first_seq} (how many are kept: "
                f"`rallypoint serve --retain-events`, open_embedded's retain_events); start again with "
                f"cursor=None (the oldest kept) or from now",
                details={"cursor": cursor, "oldest": s.first_seq, "newest": s.last_seq},
            )
        if cursor > s.last_seq:
            raise ValidationError(
                f"cursor {cursor} is past the newest event ({s.last_seq}); a cursor is the seq of an event "
                "this server sent", details={"field": "cursor", "newest": s.last_seq},
            )
        return s, cursor

    def page(self, s: Stream, cursor: int, limit: int, flt: EventFilter | None, upto: int,
             scan_limit: int = 100_000) -> tuple[list[Entry], int]:
        """Up to ``limit`` events with ``cursor < seq <= upto`` that match ``flt``, and
        the cursor to continue from (the last seq examined: past events that did not
        match, at most ``scan_limit`` of them)."""
        out: list[Entry] = []
        entries = s.entries
        i = s.index_after(cursor)
        end = s.start + (min(upto, s.last_seq) - s.first_seq + 1)
        scanned = 0
        last = cursor
        match = None if flt is None or flt.everything else flt.match
        while i < end and len(out) < limit and scanned < scan_limit:
            e = entries[i]
            i += 1
            scanned += 1
            last = e.seq
            if match is None or match(e):
                out.append(e)
        return out, last

    def statistics(self) -> dict:
        return {
            "spaces": len(self.streams),
            "events": sum(len(s) for s in self.streams.values()),
            "emitted": self.emitted,
            "dropped": self.dropped,
        }


# ---------------------------------------------------------------------------- encodings
#: Events are kept in a snapshot in chunks of this many consecutive seqs (one LMDB value
#: each, keyed by the chunk's first seq: one encode and one put per chunk).
CHUNK = 256

_chunk_enc = msgspec.msgpack.Encoder()
_chunk_dec = msgspec.msgpack.Decoder(list[Entry])


def chunk_start(seq: int) -> int:
    """The first seq of the chunk holding ``seq``."""
    return ((seq - 1) // CHUNK) * CHUNK + 1


def encode_chunk(entries) -> bytes:
    """A chunk's LMDB value: the events as one msgpack array (Entry is array-like)."""
    return _chunk_enc.encode(entries)


def decode_chunk(raw: bytes) -> list[Entry]:
    out = _chunk_dec.decode(raw)
    for e in out:
        e.lsn = 0  # loaded: durable
    return out


def event_key(space: str, seq: int) -> bytes:
    """LMDB key of the chunk starting at ``seq``: space, NUL, 8-byte big-endian seq
    (keys sort by space, then seq)."""
    return space.encode() + b"\x00" + seq.to_bytes(8, "big")


def split_event_key(key: bytes) -> tuple[str, int]:
    key = bytes(key)
    return key[:-9].decode(), int.from_bytes(key[-8:], "big")
