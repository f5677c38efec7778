"""``consume()``: the SDK worker loop (SPEC §3).

Receives deliveries from a mailbox for a run (and its descendants), runs the handler on
each inside its own cancel scope, renews the lease every ``lease_seconds / 3``,
completes with the handler's return value, retries on an exception (its type and
message as the error), and cancels the handler as soon as a renewal is refused (the
lease was lost or the run stopped). Returns when the run becomes inactive. Works under
Trio and asyncio (over TCP; the embedded mode needs Trio).

Every delivery it receives ends exactly one way, and :class:`ConsumeStats` counts it
there: ``completed`` (the outcome was recorded), ``retried`` (the server took the task
back for another attempt, or failed it for good after its last attempt: ``failed``),
``released`` (given back unfinished, the attempt not counted: a stop on SIGINT/SIGTERM)
or ``lost`` (the outcome could not be recorded: the lease ran out, the task was
cancelled, or the run stopped while the handler ran; the delivery's ``lost`` is then
True).

**Ctrl-C (SIGINT) and SIGTERM.** While ``consume()`` runs in the main thread it owns
these two signals (:class:`_Interrupts`, one handler per process for every loop): the
first stops taking work (the pending receive is cancelled), lets running handlers
finish and records their outcomes, gives back uncounted (``delivery.release``) what is
still running after ``drain_timeout`` seconds, logs one WARNING line, and returns. A
second one is handed to whoever had the signal before (Trio's or Python's Ctrl-C:
KeyboardInterrupt, raised out of ``consume`` bare, never in an ExceptionGroup; SIGTERM's
default: the process ends). The previous handlers are back once the last loop returns.
A signal that is ignored (SIG_IGN) when the first loop starts is left ignored: a worker
a shell started in the background (``worker.py &`` in a script) inherits SIGINT
ignored, so the terminal's Ctrl-C is not for it (it neither drains nor exits on it; it
used to drain on the first and then ignore the second); stop it with SIGTERM.
The runstate SDK's ``serve()`` behaves the same way.
"""

from __future__ import annotations

import heapq
import inspect
import logging
import os
import signal
import threading
from typing import Any, Awaitable, Callable

import anyio

from ..errors import LeaseLostError, RallypointError, ScopeInactiveError, ValidationError, is_transient_refusal
from ..logutil import RateLimitedLogger
from .. import protocol as p
from .api import Client, Delivery, Mailbox, _id_of, _mailbox_name, _ms, complete_many, encode_payload
from .types import TaskInfo


def _decoded(raw: Any) -> Any:
    """An encoded payload (msgspec.Raw) as the value the SDK's views decode it to."""
    import msgspec

    return msgspec.msgpack.decode(bytes(raw))

log = logging.getLogger("rallypoint.consume")

__all__ = ["consume", "ConsumeStats"]

#: Longest wait between two tries of a refused call (seconds): a refusal's
#: ``retry_after`` is waited, doubling from there up to this.
RIDE_OUT_MAX_S = 10.0
_ride_log = RateLimitedLogger(log, window_s=30.0, burst=1)


async def _ridden(call: Callable[[], Awaitable[Any]], what: str, kind: str, stats: "ConsumeStats") -> Any:
    """``await call()``; a refusal that applied nothing and passes by itself (a full
    disk, no in-sync standby under ``--min-insync 2``, a failover, a limit: see
    :func:`rallypoint.errors.is_transient_refusal`) is waited out -- its ``retry_after``
    seconds, then twice that, up to :data:`RIDE_OUT_MAX_S` -- and ``call`` made again,
    for as long as it takes (the caller's cancel scope ends it); ``stats.refused``
    counts the refusals. Anything else is raised. ``kind`` groups the WARNING lines
    (``receive``, ``renew``, ``complete``, ``retry``, ``release``: one per kind and code
    every 30 s)."""
    delay: float | None = None
    while True:
        try:
            return await call()
        except RallypointError as e:
            if not is_transient_refusal(e):
                raise
            ra = max(0.05, float(e.retry_after or 0))
            delay = ra if delay is None else min(RIDE_OUT_MAX_S, max(ra, delay * 2))
            stats.refused += 1
            _ride_log.log(logging.WARNING, f"ride-out-{kind}-{e.code}",
                          "%s refused (%s: %s); trying again in %.2g s, for as long as it is refused",
                          what, e.code, e.message, delay,
                          extra={"event": "consume_refused", "code": e.code, "kind": kind})
            await anyio.sleep(delay)


#: Longest error text sent with a retry (characters; at most 4 bytes each in UTF-8,
#: so the payload stays under the 64 KiB limit).
MAX_ERROR_CHARS = 16_000


class ConsumeStats:
    """What a ``consume`` call did. Once it returns, ``received == completed + retried +
    released + lost``.

    Attributes:
        received: deliveries leased.
        completed: outcomes recorded (the task is SUCCEEDED).
        retried: deliveries handed back with an error (the handler raised, or its result
            could not be encoded) and taken back by the server: the task is QUEUED for
            another attempt, or FAILED after its last one.
        failed: of ``retried``, those that were the task's last attempt (FAILED).
        released: deliveries given back unfinished without counting an attempt
            (``delivery.release``): still running ``drain_timeout`` seconds after a
            SIGINT/SIGTERM, or received just as it arrived.
        lost: deliveries whose outcome could not be recorded: the lease was lost or the
            task cancelled (a renewal, complete or retry was refused or changed
            nothing), or the handler was cancelled because the run stopped.
        stop_reason: SCOPE_CANCELLED or DEADLINE_EXCEEDED once the run stopped;
            ``SIGINT`` or ``SIGTERM`` when a signal stopped it.
        refused: calls refused for a passing reason (a full disk, no in-sync
            standby, a failover, a limit) and made again after waiting.
    """

    def __init__(self) -> None:
        self.received = 0
        self.completed = 0
        self.retried = 0
        self.failed = 0
        self.released = 0
        self.lost = 0
        self.refused = 0
        self.stop_reason: str | None = None

    def __repr__(self) -> str:
        return (
            f"ConsumeStats(received={self.received}, completed={self.completed}, retried={self.retried}, "
            f"failed={self.failed}, released={self.released}, lost={self.lost}, refused={self.refused}, "
            f"stop_reason={self.stop_reason!r})"
        )


# ------------------------------------------------------------------ SIGINT / SIGTERM


class _Interrupts:
    """SIGINT and SIGTERM for every ``consume()`` loop of the process (one handler
    however many loops run, installed by the first, the previous handlers restored when
    the last returns). Signal handlers can only be set from the main thread: a loop
    registered from another thread gets no signal (``register`` returns None).

    The first signal calls every registered ``notify(signame)`` (each schedules its
    loop's drain, thread-safely); the second restores the previous handlers and hands
    the signal to the one that was there (Trio's or Python's KeyboardInterrupt; for
    SIG_DFL the process is signalled again and ends; SIG_IGN: nothing)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._loops: dict[int, Callable[[str], None]] = {}
        self._previous: dict[int, Any] = {}
        self._next = 0
        self.signalled: str | None = None  # the first signal's name, while installed

    def register(self, notify: Callable[[str], None]) -> int | None:
        """Add a loop; its token, or None when this is not the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if not self._loops:
            self.signalled = None
            self._previous = {}
            for sig in self.SIGNALS:
                try:
                    if signal.getsignal(sig) == signal.SIG_IGN:
                        # ignored on purpose (a job a shell started in the background with
                        # `cmd &` inherits SIGINT ignored, so the terminal's Ctrl-C is not
                        # for it): it stays ignored; SIGTERM stops such a worker
                        continue
                    self._previous[sig] = signal.signal(sig, self._on_signal)
                except (ValueError, OSError):  # (not settable here)
                    pass
        self._next += 1
        self._loops[self._next] = notify
        return self._next

    def unregister(self, token: int | None) -> None:
        if token is None or self._loops.pop(token, None) is None or self._loops:
            return
        self._restore()

    def _restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signalled is None:
            self.signalled = name
            for notify in list(self._loops.values()):
                notify(name)
            return
        # the second: exit now, as if consume() were not there
        prev = self._previous.get(signum)
        self._restore()
        if callable(prev):
            prev(signum, frame)
        elif prev in (signal.SIG_DFL, None):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)


_INTERRUPTS = _Interrupts()
_INTERRUPTS_REASONS = tuple(s.name for s in _Interrupts.SIGNALS)


class _Stopper:
    """A stop request that may come before the ``consume()`` loop it is for is running
    (``rallypoint.sync.consume`` registers for the signals in the caller's thread and
    runs the loop in the client's): ``request`` from any thread or a signal handler,
    ``attach`` from the loop. No lock (a signal handler must not wait for one): plain
    assignments, and the loop's drain is idempotent, so a request seen twice is fine."""

    def __init__(self) -> None:
        self._pending: str | None = None
        self._deliver: Callable[[str], None] | None = None

    def request(self, signame: str) -> None:
        self._pending = signame
        deliver = self._deliver
        if deliver is not None:
            deliver(signame)

    def attach(self, deliver: Callable[[str], None]) -> None:
        self._deliver = deliver
        if self._pending is not None:
            deliver(self._pending)


def _threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """A function scheduling a callback on the running event loop, from any thread or
    a signal handler (Trio: the run's token; asyncio: ``call_soon_threadsafe``)."""
    import sniffio

    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe


def _bare_interrupt(eg: BaseExceptionGroup) -> BaseException | None:
    """The KeyboardInterrupt inside ``eg`` when that is all it holds (anything else: None)."""
    _, rest = eg.split(KeyboardInterrupt)
    if rest is not None:
        return None
    leaf: BaseException = eg
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def _describe(exc: BaseException) -> str:
    """``"Type: message"`` of an exception, even one whose ``__str__`` fails."""
    try:
        text = str(exc)
    except Exception:
        text = "<unprintable>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _clip(text: str) -> str:
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return text[: MAX_ERROR_CHARS - 20] + " …[truncated]"


async def consume(
    rs: Client,
    mailbox: Mailbox | str,
    scope: Any,
    handler: Callable[[Delivery], Awaitable[Any] | Any],
    *,
    concurrency: int = 1,
    lease_seconds: float = 30,
    wait: float = 20,
    drain_timeout: float = 30,
    handle_signals: bool = True,
    holder: str | None = None,
    complete_and_next: bool = True,
    _stop: _Stopper | None = None,
) -> ConsumeStats:
    """Serve ``mailbox`` for ``scope`` (a run or its id) until the run becomes inactive.

    Args:
        handler: ``async def handler(delivery) -> outcome`` or a plain function (run in
            a worker thread). ``delivery.input`` is the task input; the return value is
            the outcome (any msgpack-able value up to 64 KiB encoded).
        concurrency: deliveries handled at once, >= 1. One receive is outstanding at a
            time, for as many deliveries as there are free handler slots (up to 100);
            handlers that finish together are completed in one ``complete_many``; one
            task renews every running handler's lease.
        lease_seconds: lease per delivery, seconds (5-600); renewed every third of it.
        wait: long-poll per receive request, seconds.
        drain_timeout: after a SIGINT/SIGTERM, how long running handlers may go on
            (seconds, >= 0) before they are cancelled and their deliveries given back.
        handle_signals: own SIGINT/SIGTERM while serving (only in the main thread;
            see the module docstring). False leaves the signals alone.
        holder: this worker's name (1-128 characters), recorded with each delivery
            (the task's ``holder``, the ``task.delivered`` event, the console); None:
            the server records the connection's ``client_name@host:port``.
        complete_and_next: a handler that returns while no other one is completing
            that way records its outcome and takes the next deliveries (for its own
            slot and the free ones) in ONE request (``delivery.complete_next``,
            waiting up to ``wait`` seconds for work), instead of a complete and a
            receive (issue 47); the handlers that finish meanwhile are completed
            together (``complete_many``). False: every complete is a
            ``complete_many`` and only the receiver receives.

    What happens to each delivery:

    - the handler returns: the outcome is completed (for a task whose handler made it a
      run of its own with ``delivery.run()``, the task is SUCCEEDED once that run's join
      sets closed; ``complete`` returns before, and this counts it ``completed``). A result that cannot be encoded
      (not msgpack-able, or over the payload/frame limit) is handled like an
      exception: a retry whose error says why.
    - the handler raises an ``Exception``: a retry with ``"Type: message"`` as the error
      (the task is FAILED once ``max_attempts`` is reached).
    - a renewal is refused (STALE_CLAIM, SCOPE_CANCELLED, DEADLINE_EXCEEDED): the
      handler is cancelled and the delivery counted lost.
    - the run stops (a receive is refused, e.g. the task group finalized and cancelled
      its gate run): running handlers are cancelled and counted lost, and consume
      returns.
    - SIGINT (Ctrl-C) or SIGTERM: no new work; running handlers finish and are
      completed (or retried) as usual; those still running after ``drain_timeout``
      seconds are cancelled and released (``delivery.release``: QUEUED again, the
      attempt not counted); consume returns with ``stop_reason`` ``SIGINT`` /
      ``SIGTERM``. One WARNING line says so. A second signal exits at once
      (KeyboardInterrupt for Ctrl-C; leases then run out on the server).

    Logging (logger ``rallypoint.consume``): one WARNING per delivery handed back with
    an error -- ``task ID attempt N: Type: message; retrying (attempt N+1 next)``, or
    that it was the last attempt, or that the lease was lost first -- and the handler's
    traceback at DEBUG.

    Over a reconnecting client (``rallypoint.connect``, the default) a daemon restart
    is invisible here: receives are re-issued, renewals and settles wait for the new
    connection and go on (see :func:`rallypoint.connect`).

    Returns:
        :class:`ConsumeStats`, once a receive is refused with SCOPE_CANCELLED or
        DEADLINE_EXCEEDED, or once a SIGINT/SIGTERM drain is done.

    A refusal that applied nothing and passes by itself -- a full disk, no in-sync
    standby under ``--min-insync 2``, a failover under way, a limit with
    ``retry_after`` (:func:`rallypoint.errors.is_transient_refusal`) -- is waited out:
    the receive, renewal, complete, retry or release is made again after its
    ``retry_after`` (doubling, at most 10 s between tries), handlers keep running and
    their leases are kept (the server holds lease expiries while it refuses writes).
    One WARNING per kind of refusal every 30 s says so.

    Raises (the error itself, never wrapped in an ExceptionGroup): NotFoundError
    (NOT_FOUND: no such mailbox or run), ValidationError (VALIDATION_FAILED: bad
    ``concurrency``, ``lease_seconds``, ``wait`` or ``holder``), UnavailableError (UNAVAILABLE: the
    server could not be reached again within the client's reconnect timeout), AuthError
    (UNAUTHENTICATED / FORBIDDEN). Running handlers are cancelled first.
    """
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValidationError(f"concurrency must be an integer >= 1 (got {concurrency!r})",
                              details={"field": "concurrency"})
    _ms(lease_seconds, "lease_seconds")
    _ms(wait, "wait")
    _ms(drain_timeout, "drain_timeout")
    if holder is not None and (not isinstance(holder, str) or not 1 <= len(holder) <= 128):
        raise ValidationError("holder must be 1 to 128 characters", details={"field": "holder"})
    mbx = rs.mailbox(_mailbox_name(mailbox))
    scope_id = _id_of(scope)
    is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)
    )
    stats = ConsumeStats()
    # Cancel scopes of running handlers and pending receives: cancelled when the run stops.
    active: set[anyio.CancelScope] = set()
    # Cancel scopes of the receiver's waits (a receive, a wait for a free slot): a drain
    # (SIGINT/SIGTERM) cancels only these.
    receiving: set[anyio.CancelScope] = set()
    running: dict[int, tuple[anyio.CancelScope, dict]] = {}  # handlers now: id(box) -> (scope, box)
    stopping = False
    drain_asked = anyio.Event()
    next_busy = False  # a complete_next (a settle and a receive) is on its way

    def stop_serving(reason: str) -> None:
        nonlocal stopping
        if stats.stop_reason is None:
            stats.stop_reason = reason
        stopping = True
        for s in list(active):
            s.cancel()

    def request_drain(signame: str) -> None:
        """On the loop: a SIGINT/SIGTERM asked this loop to stop (idempotent)."""
        nonlocal stopping
        if stopping:
            return
        stats.stop_reason = signame
        stopping = True
        for s in list(receiving):
            s.cancel()
        drain_asked.set()

    def lost(d: Delivery) -> None:
        d.lost = True
        stats.lost += 1

    async def release(d: Delivery) -> None:
        """Give ``d`` back unfinished, the attempt not counted."""
        try:
            info = await _ridden(d.release, f"releasing task {d.task_id}", "release", stats)
        except (LeaseLostError, ScopeInactiveError):
            lost(d)
            return
        if info.state == "QUEUED":
            stats.released += 1
        else:  # already finished or cancelled meanwhile: nothing changed
            lost(d)

    async def give_back(d: Delivery, error: str, exc: BaseException | None = None) -> None:
        try:
            info = await _ridden(lambda: d.retry(error=_clip(error)), f"retrying task {d.task_id}", "retry",
                                 stats)
        except (LeaseLostError, ScopeInactiveError) as e:
            lost(d)
            log.warning("task %s attempt %d: %s; not recorded: %s", d.task_id, d.attempt, _clip(error), e.code,
                        extra={"event": "consume_retry", "task_id": d.task_id, "attempt": d.attempt, "lost": True})
            return
        if info.state == "QUEUED":
            stats.retried += 1
            then = f"retrying (attempt {info.attempt} next)"
        elif info.state == "FAILED" and info.outcome_reason == "max_attempts" and info.attempt == d.attempt:
            stats.retried += 1
            stats.failed += 1
            then = f"the task is FAILED: that was its last attempt ({d.attempt})"
        else:  # the task was already finished or cancelled: the server changed nothing
            lost(d)
            return
        # one line per handed-back delivery; the traceback only at DEBUG
        log.warning("task %s attempt %d: %s; %s", d.task_id, d.attempt, _clip(error), then,
                    extra={"event": "consume_retry", "task_id": d.task_id, "attempt": d.attempt,
                           "final": info.state == "FAILED"})
        if exc is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("task %s attempt %d: the handler's traceback", d.task_id, d.attempt,
                      exc_info=(type(exc), exc, exc.__traceback__))

    # Completes are coalesced: handlers that finish while a complete_many is on its way
    # go together in the next round (one request and one commit per 100, not one each).
    # A round's handlers share one wake-up; each reads its own item's answer.
    completes: list[tuple[Delivery, Any, list]] = []  # this round's (delivery, outcome, answer box)
    round_done = anyio.Event()  # set when this round's answers are in
    complete_wake = anyio.Event()

    async def complete(d: Delivery, outcome: Any) -> Any:
        """Record ``d``'s outcome: the item's error (a RallypointError) if refused,
        else not an exception (None, or the task after a re-sent batch)."""
        box: list = [None]
        completes.append((d, outcome, box))
        done = round_done
        complete_wake.set()
        await done.wait()
        return box[0]

    async def completer() -> None:
        nonlocal completes, round_done, complete_wake
        while True:
            if not completes:
                complete_wake = anyio.Event()
                await complete_wake.wait()
                continue
            items, done = completes, round_done
            completes, round_done = [], anyio.Event()
            k = 0
            while k < len(items):
                # at most 100 items and ~768 KiB of outcomes per request (a frame holds 1 MiB)
                n, size = 0, 0
                for _, o, _ in items[k:k + 100]:
                    size += len(o)
                    if n and size > 768 * 1024:
                        break
                    n += 1
                batch = items[k:k + n]
                k += n
                try:
                    out = await _ridden(lambda: complete_many(rs, [(d, o) for d, o, _ in batch], details=False),
                                        "a complete", "complete", stats)
                except ValidationError:  # over the frame limit after all: each alone
                    out = []
                    for d, o, _ in batch:
                        try:
                            out += await _ridden(lambda: complete_many(rs, [(d, o)], details=False), "a complete", "complete",
                                                 stats)
                        except ValidationError as e:
                            out.append(e)
                for (_, _, box), r in zip(batch, out):
                    box[0] = r
            done.set()

    # Renewals: one task for every running handler (not one each): a heap of
    # [due, seq, delivery, handler scope, box, renewal scope | None, alive]. A due entry
    # is renewed in a task of its own (only handlers running longer than lease/3 get
    # one), then re-armed a third of the lease later. Every push is due at least as late
    # as what the heap holds (now + lease/3), so the renewer only needs waking when the
    # heap was empty.
    period = lease_seconds / 3
    due: list[list] = []
    seq = 0
    due_added = anyio.Event()

    def arm(entry: list, at: float) -> None:
        nonlocal seq
        seq += 1
        entry[0], entry[1] = at, seq
        heapq.heappush(due, entry)
        due_added.set()

    async def renew_one(entry: list) -> None:
        if not entry[6]:  # its handler ended before this task started
            return
        _, _, d, handler_scope, box, _, _ = entry
        with anyio.CancelScope() as scope:
            entry[5] = scope
            try:
                # (a refused renewal is tried again: the server holds lease expiries while
                # it refuses writes, so the lease is kept; a lost one answers STALE_CLAIM)
                await _ridden(d.renew, f"renewing task {d.task_id}'s lease", "renew", stats)
            except (LeaseLostError, ScopeInactiveError):
                handler_scope.cancel()
                return
            except Exception as e:  # e.g. UNAVAILABLE: the client gave up reconnecting
                box["fatal"] = e
                handler_scope.cancel()
                return
            finally:
                entry[5] = None
        if entry[6]:
            arm(entry, anyio.current_time() + period)

    async def renewer(tg: anyio.abc.TaskGroup) -> None:
        nonlocal due_added
        while True:
            if not due:
                due_added = anyio.Event()
                await due_added.wait()
                continue
            wait_s = due[0][0] - anyio.current_time()
            if wait_s > 0:
                await anyio.sleep(wait_s)
                continue
            entry = heapq.heappop(due)
            if entry[6]:
                tg.start_soon(renew_one, entry)

    async def settle_next(d: Delivery, outcome: Any, tg: anyio.abc.TaskGroup) -> Any:
        """Complete ``d`` and receive, in one request, the next deliveries for its slot
        and the free ones (reserved meanwhile: the receiver never leases past
        ``concurrency``); the new deliveries start here. Answers as :func:`complete`.
        A drain (SIGINT/SIGTERM) cancels the wait of its receive half: the task's
        status then tells whether the complete was applied, else it is made alone."""
        nonlocal free, next_busy
        next_busy = True
        want = min(free, 99) + 1
        free -= want - 1
        scope = anyio.CancelScope()
        receiving.add(scope)
        got = None
        err = None
        try:
            with scope:
                try:
                    got = await _ridden(lambda: d.complete_and_next(outcome, scope=scope_id, max_messages=want,
                                                                    lease_seconds=lease_seconds, wait=wait,
                                                                    holder=holder, details=False),
                                        "a complete", "complete", stats)
                except (LeaseLostError, ScopeInactiveError, ValidationError) as e:
                    err = e
        finally:
            receiving.discard(scope)
            free += want - 1
            next_busy = False
        if got is None and err is None:  # cancelled by a drain: was the complete applied?
            with anyio.CancelScope(shield=True):
                try:
                    st = await rs._call(p.TaskStatus(task_id=d.task_id), TaskInfo)
                except RallypointError as e:
                    st, err = None, e
                if st is not None and not (st.state in ("SUCCEEDED", "ACKED") and st.outcome == _decoded(outcome)):
                    err = await complete(d, outcome)
            if free > 0:
                slot_freed.set()
            return err
        if got is not None:
            for nd in got:
                stats.received += 1
                free -= 1
                tg.start_soon(handle, nd, tg)  # (a drain asked meanwhile: run_one releases it at once)
            if got.stopped is not None:
                stop_serving(got.stopped)
        if free > 0:
            slot_freed.set()
        return err

    async def run_one(d: Delivery, tg: anyio.abc.TaskGroup) -> None:
        box: dict[str, Any] = {}
        handler_scope = anyio.CancelScope()
        if stopping:  # (the run stopped, or a signal came, while this delivery was on its way)
            handler_scope.cancel()
            if stats.stop_reason in _INTERRUPTS_REASONS:
                box["release"] = True
        active.add(handler_scope)
        running[id(box)] = (handler_scope, box)
        entry = [0.0, 0, d, handler_scope, box, None, True]
        arm(entry, anyio.current_time() + period)
        try:
            with handler_scope:
                try:
                    if is_async:
                        box["value"] = await handler(d)
                    else:
                        box["value"] = await anyio.to_thread.run_sync(handler, d, abandon_on_cancel=True)
                except Exception as e:  # the handler failed: retry
                    box["error"] = e
        finally:
            entry[6] = False  # its heap entry is dropped when it falls due ...
            if entry[5] is not None:  # (a renewal on its way: no longer wanted)
                entry[5].cancel()
            entry[2] = entry[3] = entry[4] = None  # ... and holds no delivery meanwhile
            active.discard(handler_scope)
            running.pop(id(box), None)
        if "fatal" in box:
            raise box["fatal"]
        if "value" in box:
            try:
                outcome = encode_payload(box["value"], "outcome")
            except ValidationError as e:
                await give_back(d, f"the handler's result could not be encoded: {e}")
                return
            if complete_and_next and not next_busy and not stopping:
                err = await settle_next(d, outcome, tg)
            else:
                err = await complete(d, outcome)
            if isinstance(err, (LeaseLostError, ScopeInactiveError)):
                lost(d)
                return
            if isinstance(err, ValidationError):  # over the payload limit (server) or frame limit
                await give_back(d, f"the handler's result could not be encoded: {err}")
                return
            if isinstance(err, Exception):
                raise err
            stats.completed += 1
        elif "error" in box:
            await give_back(d, _describe(box["error"]), box["error"])
        elif box.get("release"):  # cancelled by a drain that ran out of time: give it back
            await release(d)
        else:  # cancelled: a renewal was refused, or the run stopped
            lost(d)

    fatal: list[Exception] = []
    free = concurrency  # handler slots not in use
    slot_freed = anyio.Event()

    async def guarded(tg: anyio.abc.TaskGroup, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """``fn(*args)``; its exception is consume's: kept (the first), everything else
        cancelled, raised once the task group has ended."""
        try:
            await fn(*args)
        except Exception as e:
            if not fatal:
                fatal.append(e)
            tg.cancel_scope.cancel()

    async def handle(d: Delivery, tg: anyio.abc.TaskGroup) -> None:
        nonlocal free
        try:
            await guarded(tg, run_one, d, tg)
        finally:
            free += 1
            slot_freed.set()

    async def receiver(tg: anyio.abc.TaskGroup) -> None:
        """ONE receive at a time, for as many deliveries as there are free handler
        slots (up to 100, a receive's limit): a batch of work costs one request, not
        one per handler."""
        nonlocal free, slot_freed
        while not stopping:
            if free == 0:
                slot_freed = anyio.Event()
                if free == 0:
                    with anyio.CancelScope() as slot_scope:
                        receiving.add(slot_scope)
                        try:
                            await slot_freed.wait()
                        finally:
                            receiving.discard(slot_scope)
                continue
            recv_scope = anyio.CancelScope()
            active.add(recv_scope)
            receiving.add(recv_scope)
            ds: list[Delivery] = []
            try:
                with recv_scope:
                    n = min(free, 100)
                    free -= n  # reserved: a complete_next meanwhile receives only for the other slots
                    try:
                        got = await _ridden(lambda: mbx.receive(scope_id, lease_seconds=lease_seconds, wait=wait,
                                                                max_messages=n, holder=holder), "a receive", "receive", stats)
                        ds = got if isinstance(got, list) else ([got] if got is not None else [])
                    except ScopeInactiveError as e:
                        stop_serving(e.code)
                        return
                    finally:
                        free += n
            finally:
                active.discard(recv_scope)
                receiving.discard(recv_scope)
            for d in ds:
                stats.received += 1
                free -= 1
                tg.start_soon(handle, d, tg)  # (a drain asked meanwhile: run_one releases it at once)

    async def drainer() -> None:
        """After a SIGINT/SIGTERM: wait ``drain_timeout`` s for running handlers, then
        cancel those left, marked to be released."""
        await drain_asked.wait()
        log.warning("%s: stopping: no new work from %r; finishing %d running handler(s), giving back what is "
                    "still running after %g s; %s again to exit now", stats.stop_reason, mbx.name, len(running),
                    drain_timeout, "Ctrl-C" if stats.stop_reason == "SIGINT" else stats.stop_reason,
                    extra={"event": "consume_interrupted", "signal": stats.stop_reason, "running": len(running)})
        await anyio.sleep(drain_timeout)
        for scope, box in list(running.values()):
            box["release"] = True
            scope.cancel()

    token = None
    if _stop is not None or handle_signals:
        call_soon = _threadsafe_caller()

        def notify(signame: str) -> None:  # from the signal handler (any thread)
            call_soon(lambda: request_drain(signame))

        if _stop is not None:
            _stop.attach(notify)
        else:
            token = _INTERRUPTS.register(notify)
    try:
        async with anyio.create_task_group() as outer:
            outer.start_soon(completer)
            outer.start_soon(renewer, outer)
            outer.start_soon(drainer)
            async with anyio.create_task_group() as tg:
                tg.start_soon(guarded, tg, receiver, tg)
            outer.cancel_scope.cancel()  # every handler is done: nothing is left to complete
    except BaseExceptionGroup as eg:
        ki = _bare_interrupt(eg)  # a second Ctrl-C: KeyboardInterrupt itself, not a group
        if ki is None:
            raise
        raise ki from None
    finally:
        _INTERRUPTS.unregister(token)
    if fatal:
        raise fatal[0]
    if stats.stop_reason in _INTERRUPTS_REASONS:
        log.info("%s: stopped serving %r: %d completed, %d retried, %d given back, %d lost", stats.stop_reason,
                 mbx.name, stats.completed, stats.retried, stats.released, stats.lost)
    return stats
