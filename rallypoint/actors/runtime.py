"""The actor runtime: activations with a private inbox, one task and a nursery each, on
a nursery tree that mirrors the run tree; passivation; parked waiters; one activity heap.

Vocabulary (kept apart on purpose):

- an **inbox** is an actor's private queue of commands (the design card's "private
  mailbox"); a **work queue** is runstate's durable "mailbox" of tasks (``queue.py``);
- an **actor** is the *activation* of one entity (a run, a group, a barrier...): its
  inbox, its task, its nursery and its parked waiters. The entity's *state* (a msgspec
  Struct) and the logic that decides and applies changes to it belong to its *kind*
  (``run.py``, ``group.py``...); the state outlives every activation.

Life of an actor::

    PASSIVE --send()--> STARTING --task runs--> ACTIVE --idle for IDLE_S--> PASSIVE
                                                  |--its nursery cancelled--> PASSIVE

- ``send(command)`` appends to the inbox (a ``collections.deque``) and wakes the actor's
  task (one ``reschedule``); a passive actor is activated first: its task is started in
  its *parent's* nursery (a run's parent run, the run of a group/barrier/timer/join set;
  root runs and space-level actors in the runtime's root nursery), activating passive
  ancestors on the way. So the tasks form a nursery tree that mirrors the run tree.
- The task drains the inbox in batches: every command of a batch is handled to the end
  (decide, commit, apply, reply) before the next starts: an actor handles one command
  at a time. Before each batch the coordinator fires every activity due by the clock
  (:meth:`Runtime.before_batch`), so time-based state is judged at request time.
- A handler may *park* a waiter (:class:`Park`): a server-side wait (task result,
  receive, group/barrier/timer wait, join_next, run completion) is a parked entry of the
  actor it waits on, not a task. Apply functions ``notify(actor_id, key)``; the actor
  re-checks the waiters on that key after its batch. Timeouts are activity-heap entries.
- Cancelling an actor's nursery (a run cancelled, completed or past its deadline) ends
  its task and every actor task below it through Trio cancellation; on the way out each
  actor answers the commands still in its inbox and every parked waiter by ONE rule,
  the system's ``cancelled_answer(actor, park)`` (the coordinator's: UNAVAILABLE when
  the tree is being stopped; the outcome the run's end decided, read by the waiter's
  ``check``; else the run's code; a waiter with no answer at all is a loud INTERNAL,
  never its time-out answer), then passivates.
- An actor with an empty inbox, no waiters and no child tasks passivates after
  ``idle_s`` (default 2 s) without a command: its task exits, its state stays. So idle
  runs cost bytes (their state Struct), not tasks.

Activities (deadlines, leases, retry delays, timers, join-set delays, wait timeouts,
passivation) are entries of ONE :class:`ActivityHeap` per runtime with one sleeping task:
never a task per timer, lease or waiter.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, Callable

import trio

from ..errors import RallypointError, UnavailableError, shutting_down_error

log = logging.getLogger("rallypoint.runtime")

__all__ = ["Actor", "Runtime", "Park", "Subscribe", "Waiter", "ActivityHeap", "ReplySink", "PASSIVE", "STARTING",
           "ACTIVE", "PRIO_RUN_DEADLINE", "PRIO_DEFAULT", "PRIO_WAIT_END"]

PASSIVE, STARTING, ACTIVE = 0, 1, 2
_wait_rescheduled = trio.lowlevel.wait_task_rescheduled
_ABORT_SUCCEEDED = trio.lowlevel.Abort.SUCCEEDED
_STATUS_NAMES = {PASSIVE: "passive", STARTING: "starting", ACTIVE: "active"}

#: Priority of a heap entry at equal due time: runs' deadlines first (an enclosing
#: run's end decides before what it encloses), then everything else, and the ends of
#: waits last: a wait's deadline sees what fell due at or before it (a window that rolls,
#: a lease that runs out at that same instant).
PRIO_RUN_DEADLINE = 0
PRIO_DEFAULT = 1
PRIO_WAIT_END = 2


def _deadline_after(ms: int) -> float:
    return trio.current_time() + ms / 1000


# ---------------------------------------------------------------------------- replies
class ReplySink:
    """Where an actor sends the answer to a command: a connection, or an embedded call.

    ``deliver(rid, reply, lsn)``: ``reply`` is the encoded reply body (bytes) or a
    RallypointError; it must not reach the client before the journal is durable past
    ``lsn`` (0: depends on no state). ``track(rid, waiter)`` / ``untrack(rid)`` let the
    sink cancel a parked waiter (a Cancel frame, a closed connection)."""

    closed: bool = False

    def deliver(self, rid: int, reply: "bytes | RallypointError", lsn: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def track(self, rid: int, waiter: "Waiter") -> None:
        return None

    def note_op(self, rid: int, tag: str, request: Any = None) -> None:
        """Request ``rid`` decoded as operation ``tag`` (its op Struct: ``request``), for
        a connection's metrics."""
        return None

    def untrack(self, rid: int) -> None:
        return None

    def gone(self) -> bool:
        """Whether the peer behind this sink is taken as gone (a connection that brought
        nothing for a while though its client pings): its waiters are dropped before
        they are re-checked -- a parked receive is never handed a delivery for a dead
        peer to hold for a whole lease."""
        return False

    def drop_gone(self) -> None:
        """:meth:`gone` said so: close what is behind the sink."""
        return None

    def flush(self) -> None:
        """The dispatcher delivered a batch: send what is queued (a connection writes
        its replies together here). Optional; a sink that sends in ``deliver`` needs
        nothing."""
        return None

    # -- subscriptions (events.watch): a sink that can carry a stream implements these
    def add_stream(self, rid: int, watcher) -> bool:
        """Request ``rid`` became a subscription (``watcher.cancel()`` ends it). False:
        this sink cannot carry one."""
        return False

    def push_room(self, rid: int) -> int:
        """Bytes of pushes this sink can take now (<= 0: none)."""
        return 0

    def push(self, rid: int, events: list, cursor: int) -> None:
        """Send encoded events (a list of bytes, possibly empty) for subscription
        ``rid``, and ``cursor``: the seq the watch has scanned up to (``wire.Push``)."""

    def push_encoded(self, rid: int, n: int, array: bytes, cursor: int) -> None:
        """Send ``n`` events for subscription ``rid``, encoded together as one msgpack
        array (the same bytes as :meth:`push` would send)."""
        import msgspec

        self.push(rid, [bytes(r) for r in msgspec.msgpack.decode(array, type=list[msgspec.Raw])], cursor)

    def end_stream(self, rid: int, error) -> None:
        """The server ends subscription ``rid`` with ``error`` (a RallypointError)."""


class AtOnce:
    """What a handler returns for an answer that may leave before the journal is durable
    past what it saw: an operator's view of the server (``server.status``), which must
    answer while a shard refuses writes and its last records wait for a standby (its
    ``durable_lsn < last_lsn`` tells the reader). Never for state a client acts on."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


# ---------------------------------------------------------------------------- waiters
class Park:
    """What a handler returns to wait on the server instead of answering now.

    Args:
        key: what the waiter waits on in its actor (``notify(actor_id, key)`` re-checks
            the waiters on that key, in the order they parked).
        check: ``() -> reply | None``: the answer once the wait is over, else None. It may
            commit (a receive leases, a join_next consumes) and may raise a
            RallypointError (the error is the answer: e.g. BARRIER_CANCELLED).
        wait_ms: the longest wait, milliseconds (the caller clamped it to 60 s).
        expire: ``() -> reply``: the answer when ``wait_ms`` passed first.
    """

    __slots__ = ("key", "check", "wait_ms", "expire")

    def __init__(self, key: Any, check: Callable[[], Any], wait_ms: int, expire: Callable[[], Any]) -> None:
        self.key = key
        self.check = check
        self.wait_ms = wait_ms
        self.expire = expire


class Subscribe:
    """What a handler returns to open a subscription (``events.watch``) on its sink:
    ``space``, ``filter`` (an EventFilter), ``cursor`` (events after it follow)."""

    __slots__ = ("space", "filter", "cursor")

    def __init__(self, space: str, flt, cursor: int) -> None:
        self.space = space
        self.filter = flt
        self.cursor = cursor


class Waiter:
    """A parked server-side wait: its actor, its key, its sink and request id; ``who``:
    the grant of the session that parked it (its API key's id, ``keys.OPEN_MODE``, or
    None for a trusted session), which :meth:`Runtime.end_waiters` ends it by."""

    __slots__ = ("actor", "park", "sink", "rid", "done", "who")

    def __init__(self, actor: "Actor", park: Park, sink: ReplySink, rid: int, who: str | None = None) -> None:
        self.actor = actor
        self.park = park
        self.sink = sink
        self.rid = rid
        self.done = False
        self.who = who

    def cancel(self) -> None:
        """The client abandoned the wait (Cancel frame, connection closed): no answer."""
        if not self.done:
            self.done = True
            self.actor._unlist(self)
            self.actor._waiter_gone()


# ---------------------------------------------------------------------------- activities
def _waiter_done(w: "Waiter") -> bool:
    return w.done


class ActivityHeap:
    """One heap of due activities: ``(due, prio, seq, fn, arg)``, ``due`` in Trio time.

    ``fn(arg)`` is called once the entry is due, in (due, prio, arm order) order. Entries
    are not removed when they become irrelevant (a lease renewed, a task finished): the
    callback re-checks and ignores a stale entry, so arming is O(log n) and cancelling
    is free. One task sleeps until the earliest entry (:meth:`run`); the coordinator
    also calls :meth:`fire_due` before every command batch.

    Two things keep the stale entries cheap (a lease armed per delivery stays in the heap
    for the lease's length after its task completed: 30 s x 20k deliveries/s = 600k
    entries). A bound method ``fn`` is stored as a small integer code, so an entry whose
    ``arg`` holds only strings and numbers has nothing the cyclic GC tracks (CPython
    untracks such tuples): a full collection does not walk them. And a kind may say how
    to tell a stale entry (:meth:`stale_when`); when the heap has doubled since it was
    last compacted, entries known stale are dropped and the heap rebuilt (amortised
    O(1) per arm; the order of the others is unchanged: it is total on (due, prio, seq)).
    """

    __slots__ = ("_heap", "_seq", "_task", "fired", "_firing", "_codes", "_fns", "_stale", "_compact_at",
                 "compacted", "_held", "_held_seq")

    #: Never compact below this many entries.
    COMPACT_MIN = 4096

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self._task = None  # the sleeping task while it sleeps
        self.fired = 0
        self._firing = False
        self._codes: dict[Any, int] = {}  # bound method -> code
        self._fns: list[Callable[[Any], None]] = []  # code -> bound method
        self._stale: dict[int, Callable[[Any], bool]] = {}  # code -> "this arg is stale"
        self._compact_at = self.COMPACT_MIN
        self.compacted = 0  # stale entries dropped so far
        #: activities refused with UNAVAILABLE (disk full, no in-sync standby): token ->
        #: (fn, arg, prio), tried again at the refusal's ``retry_after`` or as soon as
        #: :meth:`release_held` says writes are accepted again, whichever comes first
        self._held: dict[int, tuple[Callable[[Any], None], Any, int]] = {}
        self._held_seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def _code(self, fn: Callable[[Any], None]) -> Any:
        """The integer code of a bound method (registered on first use); any other
        callable is stored as itself (a lambda made per call must not grow the table)."""
        code = self._codes.get(fn)
        if code is None:
            if getattr(fn, "__self__", None) is None or not hasattr(fn, "__func__"):
                return fn
            code = self._codes[fn] = len(self._fns)
            self._fns.append(fn)
        return code

    def stale_when(self, fn: Callable[[Any], None], is_stale: Callable[[Any], bool]) -> None:
        """Entries of ``fn`` (a bound method) whose ``arg`` makes ``is_stale(arg)`` true may
        be dropped without being called: ``is_stale`` must be true only when ``fn(arg)``
        would do nothing, now and at any later time."""
        code = self._code(fn)
        if isinstance(code, int):
            self._stale[code] = is_stale

    def arm(self, due: float, fn: Callable[[Any], None], arg: Any = None, prio: int = PRIO_DEFAULT) -> None:
        """Call ``fn(arg)`` at Trio time ``due`` (seconds)."""
        heap = self._heap
        if len(heap) >= self._compact_at:
            self._compact()
        code = self._codes.get(fn)
        if code is None:
            code = self._code(fn)
        self._seq += 1
        entry = (due, prio, self._seq, code, arg)
        heapq.heappush(heap, entry)
        if heap[0] is entry and self._task is not None:
            task, self._task = self._task, None
            trio.lowlevel.reschedule(task)

    def _compact(self) -> None:
        heap = self._heap
        stale = self._stale
        if stale:
            before = len(heap)
            # in place: fire_due holds the list while an activity it fires arms another
            heap[:] = [e for e in heap if (p := stale.get(e[3])) is None or not p(e[4])]
            heapq.heapify(heap)
            self.compacted += before - len(heap)
        self._compact_at = max(self.COMPACT_MIN, 2 * len(heap))

    def entries(self) -> list[tuple[float, int, int, Callable[[Any], None], Any]]:
        """The entries, unordered, as ``(due, prio, seq, fn, arg)`` (for tests and views)."""
        fns = self._fns
        return [(d, p, s, fns[c] if c.__class__ is int else c, a) for d, p, s, c, a in self._heap]

    def clear(self) -> None:
        self._heap.clear()
        self._held.clear()

    def next_due(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def due_now(self) -> bool:
        heap = self._heap
        return bool(heap) and heap[0][0] <= trio.current_time()

    def fire_due(self, now: float | None = None) -> int:
        """Fire every entry due at ``now`` (Trio seconds; default: the current time),
        earliest first; returns how many fired. Re-entrant calls (an activity whose
        commit reaches another batch start) do nothing. The coordinator passes its
        step's pinned instant, so an entry fires only when the time its activity reads
        has reached it."""
        if self._firing:
            return 0
        heap = self._heap
        fns = self._fns
        if now is None:
            now = trio.current_time()
        n = 0
        self._firing = True
        retry = []
        try:
            while heap and heap[0][0] <= now:
                entry = heapq.heappop(heap)
                fn = entry[3]
                if fn.__class__ is int:
                    fn = fns[fn]
                try:
                    fn(entry[4])
                except UnavailableError as exc:  # disk full: refused before applying; later
                    retry.append((now + (exc.retry_after or 1.0), fn, entry))
                n += 1
        finally:
            self._firing = False
            held = self._held
            for due, fn, (_, prio, _, _, arg) in retry:
                if fn != self._retry_held:  # (a held one refused again keeps its token)
                    self._held_seq += 1
                    held[self._held_seq] = (fn, arg, prio)
                    arg = self._held_seq
                self.arm(due, self._retry_held, arg, prio)
        self.fired += n
        return n

    def _retry_held(self, token: int) -> None:
        """Try a refused activity again (its timed retry, or :meth:`release_held`'s:
        the first of the two runs it, the other finds the token gone)."""
        item = self._held.pop(token, None)
        if item is None:
            return
        try:
            item[0](item[1])
        except UnavailableError:
            self._held[token] = item  # refused again: fire_due re-arms the token
            raise

    def release_held(self) -> int:
        """Writes are accepted again (the journal's disk has space, an in-sync standby is
        back): every activity refused meanwhile is due now instead of at its refusal's
        ``retry_after`` (a deadline that fell in a full-disk window fires as the window
        ends, not up to a poll interval later). Returns how many."""
        now = trio.current_time()
        for token, (_fn, _arg, prio) in list(self._held.items()):
            self.arm(now, self._retry_held, token, prio)
        return len(self._held)

    async def run(self, before: Callable[[], None], after: Callable[[], None], *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The one sleeping task: wakes at the earliest due time (or when an earlier entry
        is armed), calls ``before()`` (the coordinator's catch-up, which fires what is due)
        and ``after()`` (sends the answers that produced), sleeps again."""
        task_status.started()
        while True:
            before()
            after()
            deadline = self.next_due()
            with trio.move_on_at(deadline):
                self._task = trio.lowlevel.current_task()

                def abort(_raise_cancel):
                    self._task = None
                    return trio.lowlevel.Abort.SUCCEEDED

                await trio.lowlevel.wait_task_rescheduled(abort)
            self._task = None


# ---------------------------------------------------------------------------- actors
class Actor:
    """One activation: an inbox, a task (while active), a nursery, parked waiters.

    Not made directly: :meth:`Runtime.actor` returns the activation for an id (a passive
    one if none is running). ``kind`` is the kind object whose handlers run here;
    ``parent_id`` the actor whose nursery this one's task runs in (None: the root)."""

    __slots__ = (
        "id", "kind", "parent_id", "runtime", "inbox", "status", "nursery", "_parked", "waiters",
        "n_waiters", "_dirty", "_pending_children", "_idle_since", "_passivate_armed", "_passivate",
        "commands", "depth", "_handling", "scope", "__weakref__",
    )

    def __init__(self, runtime: "Runtime", actor_id: str, kind: Any, parent_id: str | None) -> None:
        self.id = actor_id
        self.kind = kind
        self.parent_id = parent_id
        self.runtime = runtime
        self.inbox: deque = deque()
        self.status = PASSIVE
        self.nursery: trio.Nursery | None = None
        #: the cancel scope of this activation's nursery, kept until it passivates (its
        #: ``nursery`` is cleared earlier, when it stops taking new children)
        self.scope: trio.CancelScope | None = None
        self._parked = None
        self.waiters: dict[Any, list[Waiter]] = {}
        self.n_waiters = 0
        # keys notified since the last re-check, in notify order (a dict: re-checks run
        # in the same order in every process, whatever the string hash seed)
        self._dirty: dict | None = None
        self._pending_children: list[Actor] = []
        self._idle_since = 0.0
        self._passivate_armed = False
        self._passivate = False
        self.commands = 0
        self.depth = 0
        self._handling = False

    def __repr__(self) -> str:
        return f"<Actor {self.id} {_STATUS_NAMES[self.status]} inbox={len(self.inbox)} waiters={self.n_waiters}>"

    # -------------------------------------------------------------- inbox
    def send(self, item: tuple) -> None:
        """Append a command ``(handler, session, op, sink, rid)`` and wake the task
        (activating the actor, and passive ancestors, if needed)."""
        self.inbox.append(item)
        if self.status == ACTIVE:
            task = self._parked
            if task is not None:
                self._parked = None
                trio.lowlevel.reschedule(task)
        elif self.status == PASSIVE:
            self.runtime._activate(self)

    def notify(self, key: Any) -> None:
        """State that waiters on ``key`` may be waiting for changed: re-check them."""
        if self.n_waiters and key in self.waiters:
            if self._dirty is None:
                self._dirty = {key: None}
            else:
                self._dirty[key] = None
            task = self._parked
            if task is not None:
                self._parked = None
                trio.lowlevel.reschedule(task)

    def _wake(self) -> None:
        task = self._parked
        if task is not None:
            self._parked = None
            trio.lowlevel.reschedule(task)

    # -------------------------------------------------------------- the task
    async def _main(self) -> None:
        rt = self.runtime
        self.status = ACTIVE
        self._idle_since = trio.current_time()
        rt.n_active += 1
        rt.activations += 1
        try:
            async with fatal_unwrapped(), trio.open_nursery() as nursery:
                self.nursery = nursery
                self.scope = nursery.cancel_scope
                pending, self._pending_children = self._pending_children, []
                for child in pending:
                    nursery.start_soon(child._main)
                try:
                    await self._loop()
                except trio.Cancelled:
                    self._answer_all()
                    raise
                finally:
                    # From here the nursery only waits for its children: no new
                    # arrivals (a child activated now waits in _pending_children and is
                    # started by this actor's next activation).
                    self.nursery = None
        finally:
            self.nursery = None
            self.scope = None
            self._parked = None
            self.status = PASSIVE
            rt.n_active -= 1
            rt._deactivated(self)

    async def _loop(self) -> None:
        rt = self.runtime
        inbox = self.inbox
        handle = rt.handle
        while True:
            if inbox or self._dirty:
                rt.before_batch()
                self._handling = True
                try:
                    while inbox:
                        item = inbox.popleft()
                        self.commands += 1
                        handle(self, item)
                    if self._dirty:
                        self._recheck()
                finally:
                    self._handling = False
                    rt.after_batch()
                self._idle_since = rt.system.last_seen  # the batch's start: idle from about now
                continue
            if self._passivate:
                self._passivate = False
                if self._can_passivate():
                    return
            if not self._passivate_armed and self._can_passivate():
                self._passivate_armed = True
                rt.heap.arm(self._idle_since + rt.idle_s, rt._passivate_check, self)
            await self._park()

    async def _park(self) -> None:
        self._parked = trio.lowlevel.current_task()
        await _wait_rescheduled(self._abort_park)

    def _abort_park(self, _raise_cancel) -> Any:
        self._parked = None
        return _ABORT_SUCCEEDED

    def _can_passivate(self) -> bool:
        return (
            not self.inbox
            and not self.n_waiters
            and not self._pending_children
            and (self.nursery is None or not self.nursery.child_tasks)
        )

    # -------------------------------------------------------------- waiters
    def park(self, park: Park, sink: ReplySink, rid: int, who: str | None = None) -> None:
        """Register a waiter (called by the runtime for a handler's :class:`Park`);
        ``who``: the grant of the session that parked it (:attr:`Waiter.who`)."""
        w = Waiter(self, park, sink, rid, who)
        lst = self.waiters.get(park.key)
        if lst is None:
            self.waiters[park.key] = [w]
        else:
            lst.append(w)
        self.n_waiters += 1
        self.runtime.n_waiters += 1
        sink.track(rid, w)
        rt = self.runtime
        rt.heap.arm(rt.deadline_after(park.wait_ms), rt._wait_timeout, w, PRIO_WAIT_END)

    def _unlist(self, w: Waiter) -> None:
        lst = self.waiters.get(w.park.key)
        if lst is not None:
            try:
                lst.remove(w)
            except ValueError:
                pass
            if not lst:
                del self.waiters[w.park.key]

    def _waiter_gone(self) -> None:
        self.n_waiters -= 1
        self.runtime.n_waiters -= 1
        if not self.n_waiters:
            self._wake()  # may passivate

    def _finish_waiter(self, w: Waiter, reply) -> None:
        w.done = True
        self.n_waiters -= 1
        self.runtime.n_waiters -= 1
        w.sink.untrack(w.rid)
        self.runtime.reply(w.sink, w.rid, reply)

    def _recheck(self) -> None:
        dirty, self._dirty = self._dirty, None
        rt = self.runtime
        for key in dirty:
            lst = self.waiters.get(key)
            if not lst:
                continue
            keep = []
            for w in lst:
                if w.done:
                    continue
                if w.sink.gone():  # a dead peer: it takes nothing (a receive would lease)
                    w.done = True
                    self.n_waiters -= 1
                    rt.n_waiters -= 1
                    w.sink.untrack(w.rid)
                    w.sink.drop_gone()
                    continue
                try:
                    reply = w.park.check()
                except RallypointError as exc:
                    reply = exc
                except Exception as exc:  # a bug: answer INTERNAL, keep serving
                    if isinstance(exc, _FatalMarker.fatal_type):
                        # a check that commits can fail-stop: the node must stop, not answer
                        # INTERNAL and go on (found by the simulator, seed 3974)
                        raise
                    rt.internal_error(exc)
                    reply = exc
                if reply is None:
                    keep.append(w)
                else:
                    self._finish_waiter(w, reply)
            if keep:
                self.waiters[key] = keep
            else:
                del self.waiters[key]

    def _answer_all(self) -> None:
        """Cancelled (the nursery of this actor or an ancestor): answer every command
        still in the inbox and every parked waiter from the state as it is now."""
        rt = self.runtime
        rt.before_batch()
        try:
            inbox = self.inbox
            while inbox:
                item = inbox.popleft()
                self.commands += 1
                rt.handle(self, item, cancelled=True)
            for key, lst in list(self.waiters.items()):
                for w in lst:
                    if not w.done:
                        self._finish_waiter(w, rt.cancelled_answer(self, w.park))
            self.waiters.clear()
        finally:
            rt.after_batch()

    # -------------------------------------------------------------- introspection
    def statistics(self) -> dict:
        """Trio-style introspection: status, inbox depth, parked waiters, commands handled."""
        return {
            "id": self.id,
            "status": _STATUS_NAMES[self.status],
            "inbox": len(self.inbox),
            "waiters": self.n_waiters,
            "child_tasks": len(self.nursery.child_tasks) if self.nursery is not None else 0,
            "commands": self.commands,
        }


class Runtime:
    """The activations of one coordinator, its root nursery and its activity heap.

    Args:
        system: the coordinator: ``handle_command(actor, item, cancelled)``,
            ``before_batch()``, ``parent_of(actor_id) -> (kind, parent_id)``, ``reply``.
        idle_s: seconds an idle actor stays active before it passivates.
    """

    def __init__(self, system, *, idle_s: float = 2.0) -> None:
        self.system = system
        self.idle_s = idle_s
        self.actors: dict[str, Actor] = {}
        self.heap = ActivityHeap()
        self.heap.stale_when(self._wait_timeout, _waiter_done)
        self.root_nursery: trio.Nursery | None = None
        self._root_pending: list[Actor] = []
        self.n_active = 0
        self.n_waiters = 0
        self.activations = 0
        self.passivations = 0
        self.stopping = False
        self.handle = system.handle_command
        self.before_batch = system.before_batch
        self.after_batch = system.after_batch
        self.reply = system.reply
        self.internal_error = system.internal_error
        self.cancelled_answer = system.cancelled_answer
        #: ``(ms) -> Trio time`` of a wait's end, on the same grid as the system's other
        #: activities (so equal instants compare equal); default: now + ms
        self.deadline_after = getattr(system, "deadline_after", None) or _deadline_after

    # -------------------------------------------------------------- activations
    def actor(self, actor_id: str) -> Actor:
        """The activation of ``actor_id`` (a passive one when none runs)."""
        a = self.actors.get(actor_id)
        if a is None:
            kind, parent_id = self.system.parent_of(actor_id)
            a = self.actors[actor_id] = Actor(self, actor_id, kind, parent_id)
        return a

    def get(self, actor_id: str) -> Actor | None:
        """The activation of ``actor_id`` if it has one, else None (no activation made)."""
        return self.actors.get(actor_id)

    def _activate(self, a: Actor) -> None:
        if self.stopping:  # the runtime stopped (or a fail-stop): nothing starts any more
            self._refuse(a)
            return
        a.status = STARTING
        pid = a.parent_id
        if pid is None:
            if self.root_nursery is None:
                self._root_pending.append(a)
            else:
                try:
                    self.root_nursery.start_soon(a._main)
                except RuntimeError:
                    # the root nursery closed (its last task ended; the node is stopping)
                    # but run() has not returned yet: a command arriving now is answered
                    # UNAVAILABLE, not with Trio's RuntimeError (found by the simulator,
                    # seed 122: "Nursery is closed to new arrivals" reached a client)
                    self._refuse(a)
                    return
            a.depth = 0
            return
        parent = self.actor(pid)
        a.depth = parent.depth + 1
        if parent.status == ACTIVE and parent.nursery is not None:
            parent.nursery.start_soon(a._main)
            return
        parent._pending_children.append(a)
        if parent.status == PASSIVE:
            self._activate(parent)

    def _refuse(self, a: Actor) -> None:
        """The node is stopping: ``a`` (and the children waiting for it to start) will
        not run; their commands are answered UNAVAILABLE."""
        a.status = PASSIVE
        pending, a._pending_children = a._pending_children, []
        while a.inbox:
            _handler, _session, _op, sink, rid = a.inbox.popleft()
            self.reply(sink, rid, shutdown_error())
        for child in pending:
            self._refuse(child)

    def _deactivated(self, a: Actor) -> None:
        self.passivations += 1
        if a.inbox or a._pending_children:
            # commands arrived after the last batch of a cancelled task: a new activation
            # -- unless the runtime is stopping (a fail-stop: a new activation would die
            # at once on the failed coordinator and be re-activated, forever; found by the
            # simulator, seed 1261: the node never stopped and its memory grew without
            # bound), then they are answered UNAVAILABLE
            self._activate(a)
            if a.status != PASSIVE:
                return
        if self.actors.get(a.id) is a and not a.n_waiters:
            del self.actors[a.id]
        a._passivate_armed = False
        parent = self.actors.get(a.parent_id) if a.parent_id is not None else None
        if parent is not None and parent.status == ACTIVE:
            parent._wake()  # it may be able to passivate now

    def _passivate_check(self, a: Actor) -> None:
        a._passivate_armed = False
        if a.status != ACTIVE or a._handling:
            return
        idle_until = a._idle_since + self.idle_s
        if not a._can_passivate():
            return
        if trio.current_time() < idle_until:
            a._passivate_armed = True
            self.heap.arm(idle_until, self._passivate_check, a)
            return
        a._passivate = True
        a._wake()

    def cancelled_by(self, a: Actor) -> str | None:
        """The actor whose nursery cancellation reaches ``a`` (``a`` itself or an
        ancestor: the run whose end cancelled it, :meth:`cancel`), or None when none
        was cancelled (``a`` runs on, or the whole tree is being stopped from outside)."""
        actors = self.actors
        while a is not None:
            scope = a.scope
            if scope is not None and scope.cancel_called:
                return a.id
            a = actors.get(a.parent_id) if a.parent_id is not None else None
        return None

    def _wait_timeout(self, w: Waiter) -> None:
        if w.done:
            return
        a = w.actor
        try:
            # what became true by the deadline answers first: an activity due at or before
            # it (a lease running out re-queues a task) fired earlier in this same round,
            # and its wake-up re-check has not run yet (found by the simulator, seed 3609:
            # a receive timed out empty while the task it waited for was ready); the heap
            # fires wait ends after everything else due at the same instant (PRIO_WAIT_END)
            reply = w.park.check()
            if reply is None:
                if self.cancelled_by(a) is not None:
                    # its run ended in this same round and its actor's cancellation is on
                    # its way: the run's end answers, not the time limit
                    reply = self.cancelled_answer(a, w.park)
                else:
                    reply = w.park.expire()
        except RallypointError as exc:
            reply = exc
        except Exception as exc:  # a bug: answer INTERNAL, keep serving (as _recheck does)
            if isinstance(exc, _FatalMarker.fatal_type):
                raise  # fail-stop (a check that commits failed): the node stops
            self.internal_error(exc)
            reply = exc
        a._unlist(w)
        a._finish_waiter(w, reply)
        if not a.n_waiters:
            a._wake()  # may passivate

    def end_waiters(self, who: str) -> list[Waiter]:
        """Every parked waiter of grant ``who`` (:attr:`Waiter.who`) leaves its line now,
        unanswered: no check of theirs runs again, so none is handed anything that
        happens from here on (a receive never leases). Returns them (the caller answers
        each: ``waiter.sink``, ``waiter.rid``). Cost: one pass over the actors that have
        an activation."""
        out: list[Waiter] = []
        for a in list(self.actors.values()):
            if not a.n_waiters:
                continue
            for lst in list(a.waiters.values()):
                for w in [w for w in lst if w.who == who and not w.done]:
                    a._unlist(w)
                    w.done = True
                    a.n_waiters -= 1
                    self.n_waiters -= 1
                    w.sink.untrack(w.rid)
                    out.append(w)
            if not a.n_waiters:
                a._wake()  # may passivate
        return out

    def cancel(self, actor_id: str) -> bool:
        """Cancel the nursery of ``actor_id`` (its task and every actor task below it).
        Returns True when it was active."""
        a = self.actors.get(actor_id)
        if a is None:
            return False
        if a.nursery is not None:
            a.nursery.cancel_scope.cancel()
            return True
        if a.status == STARTING:
            # not started yet: its task will see the cancelled state in its first batch
            return False
        return False

    # -------------------------------------------------------------- lifecycle
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Open the root nursery and run the activity heap until cancelled."""
        try:
            async with fatal_unwrapped(), trio.open_nursery() as nursery:
                self.root_nursery = nursery
                pending, self._root_pending = self._root_pending, []
                for a in pending:
                    nursery.start_soon(a._main)
                await nursery.start(self.heap.run, self.before_batch, self.after_batch)
                task_status.started()
        finally:
            self.root_nursery = None

    # -------------------------------------------------------------- introspection
    def tasks_below(self, actor_id: str) -> int:
        """How many Trio tasks run in ``actor_id``'s nursery and every nursery below it
        (0 when it is passive)."""
        a = self.actors.get(actor_id)
        if a is None or a.nursery is None:
            return 0
        n = 0
        stack = [a.nursery]
        while stack:
            nursery = stack.pop()
            for t in nursery.child_tasks:
                n += 1
                stack.extend(t.child_nurseries)
        return n

    def statistics(self) -> dict:
        """Actors active (with a task) and their inbox depth, parked waiters, the depth
        of the nursery tree, activations and passivations since start."""
        depth = 0
        inbox = 0
        for a in self.actors.values():
            if a.status != PASSIVE:
                if a.depth + 1 > depth:
                    depth = a.depth + 1
                inbox += len(a.inbox)
        return {
            "active": self.n_active,
            "waiters": self.n_waiters,
            "inbox": inbox,
            "tree_depth": depth,
            "activations": self.activations,
            "passivations": self.passivations,
            "heap": len(self.heap),
        }


class _FatalMarker:
    """Set by the coordinator: the exception type that must travel up the actor tree
    as itself (not wrapped in one ExceptionGroup per nursery level)."""

    fatal_type: type[BaseException] = RuntimeError


@asynccontextmanager
async def fatal_unwrapped():
    """Let the coordinator's fail-stop error leave a nursery as itself: a nursery wraps
    a child's exception in an ExceptionGroup, and the actor tree nests nurseries."""
    try:
        yield
    except BaseExceptionGroup as eg:
        fatal, _rest = eg.split(_FatalMarker.fatal_type)
        if fatal is None:
            raise
        while isinstance(fatal, BaseExceptionGroup):
            fatal = fatal.exceptions[0]
        raise fatal from None


def shutdown_error() -> UnavailableError:
    return shutting_down_error()
