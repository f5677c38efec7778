"""A blocking client for plain scripts and threads: ``rallypoint.sync.connect(url)``.

The same methods as the async client, without ``await``::

    with rallypoint.sync.connect("tcp://127.0.0.1:7411") as rs:
        run = rs.scopes.create(name="batch")
        rs.mailboxes.ensure("jobs").submit({"n": 1}, scope=run)

One background thread runs a Trio loop holding the connection; calls from any thread
are forwarded to it (``trio.from_thread``) and block until the reply. Handles returned
by methods (runs, mailboxes, tickets, deliveries, groups, messages, quotas and their
waiters, budgets and their reservations, claim leases, pools, grants) are wrapped the
same way.

:func:`consume` is the worker loop for plain scripts: ``rallypoint.consume``'s semantics
(lease renewal every third of the lease, completes, retries, Ctrl-C), with a plain
handler called in a worker thread with a blocking delivery.

The SDK's async context managers become blocking ``with`` blocks: ``run.claims.hold(key)``,
``lease.keep_alive()``, ``pool.hold(units, scope=run)``. The lease is renewed by a task on
the client's loop while the body runs in the caller's thread; a thread cannot be
cancelled, so a lost lease (``lease.lost`` turns True at once) is raised as
LeaseLostError when the ``with`` block ends.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import trio

from .client.api import Client, Delivery, Group, Groups, Mailbox, Mailboxes, NextDeliveries, Run, Scopes, Ticket

__all__ = ["connect", "consume", "SyncClient"]

from .client.api import Barrier, Barriers, Events, EventStream, JoinSet, JoinSets, Timer, Timers
from .client.api import Budget, Budgets, Message, Quota, Quotas, QuotaWaiter, Reservation
from .client.api import ClaimLease, Claims, Grant, Pool, Pools, RunPools, SpaceClaims, WorkLimits
from .client.api import Schedule, Schedules

_HANDLES = (Client, Run, Mailbox, Ticket, Delivery, Group, Groups, Scopes, Mailboxes, JoinSet, JoinSets, Barrier, Barriers,
            Timer, Timers, Events, Message, Quotas, Quota, QuotaWaiter, Budgets, Budget, Reservation, Claims, SpaceClaims,
            ClaimLease, Pools, Pool, RunPools, Grant, WorkLimits, Schedules, Schedule)


class SyncEventStream:
    """The blocking form of :class:`rallypoint.client.api.EventStream`:
    ``with rs.events.watch(...) as stream: for ev in stream: ...``; ``stream.next(timeout)``
    raises WaitTimeout after ``timeout`` seconds; ``stream.cursor`` as the async one.

    As with the async form, entering the ``with`` block makes the subscription (so with
    ``start="now"`` an event caused inside the block is seen); a stream iterated
    without ``with`` subscribes at its first ``next``."""

    def __init__(self, stream: EventStream, portal: "SyncClient") -> None:
        self._stream = stream
        self._portal = portal

    @property
    def cursor(self):
        return self._stream.cursor

    def __iter__(self) -> "SyncEventStream":
        return self

    def __next__(self):
        try:
            return self._portal._run(self._stream.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None

    def next(self, timeout: float | None = None):
        return self._portal._run(self._stream.next, timeout)

    def close(self) -> None:
        self._portal._run(self._stream.aclose)

    def __enter__(self) -> "SyncEventStream":
        self._portal._run(self._stream.__aenter__)  # subscribe now, as ``async with`` does
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Proxy:
    """Blocking view of an async handle."""

    __slots__ = ("_obj", "_portal")

    def __init__(self, obj: Any, portal: "SyncClient") -> None:
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_portal", portal)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._obj, name)
        if inspect.iscoroutinefunction(value):
            portal = self._portal

            @functools.wraps(value)
            def blocking(*args, **kwargs):
                args = tuple(a._obj if isinstance(a, _Proxy) else a for a in args)
                kwargs = {k: (v._obj if isinstance(v, _Proxy) else v) for k, v in kwargs.items()}
                return portal._wrap(portal._run(value, *args, **kwargs))

            return blocking
        if inspect.ismethod(value):  # plain methods that make handles (rs.scope(id), rs.mailbox(name), run.task(id))
            portal = self._portal

            @functools.wraps(value)
            def plain(*args, **kwargs):
                args = tuple(a._obj if isinstance(a, _Proxy) else a for a in args)
                kwargs = {k: (v._obj if isinstance(v, _Proxy) else v) for k, v in kwargs.items()}
                return portal._wrap(value(*args, **kwargs))

            return plain
        return self._portal._wrap(value)

    def __repr__(self) -> str:
        return f"sync.{self._obj!r}"

    @property
    def id(self):  # common attribute, kept fast
        return self._obj.id


class _SyncContext:
    """A blocking ``with`` around one of the SDK's async context managers: a task on the
    client's loop enters it, waits for the body (run in the caller's thread) to end, and
    exits it; an error it raises on exit (LeaseLostError) is raised from ``__exit__``."""

    def __init__(self, acm: Any, portal: "SyncClient") -> None:
        self._acm = acm
        self._portal = portal
        self._box: dict[str, Any] = {}
        self._entered = threading.Event()
        self._done = threading.Event()
        self._exit_event: trio.Event | None = None

    async def _host(self) -> None:
        box = self._box
        try:
            async with self._acm as value:
                box["value"] = value
                self._entered.set()
                await self._exit_event.wait()
        except Exception as e:
            box["error"] = e
        finally:
            self._entered.set()
            self._done.set()

    def __enter__(self) -> Any:
        portal = self._portal

        def start() -> None:
            self._exit_event = trio.Event()
            portal._nursery.start_soon(self._host)

        trio.from_thread.run_sync(start, trio_token=portal._token)
        self._entered.wait()
        if "value" not in self._box:
            raise self._box["error"]
        return portal._wrap(self._box["value"])

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            trio.from_thread.run_sync(self._exit_event.set, trio_token=self._portal._token)
        except trio.RunFinishedError:
            pass
        self._done.wait()
        if exc_type is None and "error" in self._box:
            raise self._box["error"]
        return False


class SyncClient(_Proxy):
    """The blocking ``rs``. Close it (or use ``with``) to stop its thread."""

    __slots__ = ("_thread", "_token", "_stop", "_error", "_nursery")

    def __init__(self, url: str | None = None, api_key: str | None = None, connect_timeout: float = 10.0,
                 *, client_name: str = "", tls_ca: str | None = None, ssl_context: Any = None,
                 reconnect: Any = True) -> None:
        ready = threading.Event()
        box: dict[str, Any] = {}

        async def main() -> None:
            from . import connect as aconnect

            try:
                async with aconnect(url, api_key=api_key, client_name=client_name, connect_timeout=connect_timeout,
                                    tls_ca=tls_ca, ssl_context=ssl_context, reconnect=reconnect) as rs:
                    async with trio.open_nursery() as nursery:  # hosts blocking `with` blocks
                        box["rs"] = rs
                        box["token"] = trio.lowlevel.current_trio_token()
                        box["stop"] = trio.Event()
                        box["nursery"] = nursery
                        ready.set()
                        await box["stop"].wait()
                        nursery.cancel_scope.cancel()
            except BaseException as e:  # surfaced to the constructor
                box["error"] = e
                ready.set()

        thread = threading.Thread(target=trio.run, args=(main,), name="rallypoint-sync", daemon=True)
        thread.start()
        ready.wait()
        if "error" in box and "rs" not in box:
            thread.join()
            raise box["error"]
        object.__setattr__(self, "_obj", box["rs"])
        object.__setattr__(self, "_portal", self)
        object.__setattr__(self, "_thread", thread)
        object.__setattr__(self, "_token", box["token"])
        object.__setattr__(self, "_stop", box["stop"])
        object.__setattr__(self, "_nursery", box["nursery"])

    def _run(self, fn, *args, **kwargs):
        return trio.from_thread.run(functools.partial(fn, *args, **kwargs), trio_token=self._token)

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, EventStream):
            return SyncEventStream(value, self)
        if isinstance(value, _HANDLES):
            return _Proxy(value, self)
        if hasattr(value, "__aenter__") and hasattr(value, "__aexit__"):
            return _SyncContext(value, self)
        if isinstance(value, NextDeliveries):  # (complete_and_next: the list keeps its task and stopped)
            return NextDeliveries([_Proxy(v, self) for v in value], value.task, value.stopped)
        if isinstance(value, list) and value and isinstance(value[0], _HANDLES):
            return [_Proxy(v, self) for v in value]
        return value

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
            self._thread.join()

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(
    url: str | None = None,
    *,
    api_key: str | None = None,
    client_name: str = "",
    connect_timeout: float = 10.0,
    tls_ca: str | None = None,
    ssl_context: Any = None,
    reconnect: Any = True,
) -> SyncClient:
    """Connect and return a blocking client (see the module docstring).

    The arguments are those of :func:`rallypoint.connect`: ``url`` defaults to
    ``$RALLYPOINT_URL`` (else ``tcp://127.0.0.1:7411``), ``api_key`` to
    ``$RALLYPOINT_API_KEY``; ``tls_ca`` is a PEM CA file for ``tls://`` URLs;
    ``reconnect`` is True (default), False or a :class:`rallypoint.Reconnect`.

    Raises UnavailableError (UNAVAILABLE) if the server cannot be reached,
    UnauthenticatedError (UNAUTHENTICATED) for a bad key, ValidationError
    (VALIDATION_FAILED) for a bad URL. Close the client with ``close()`` or ``with``.
    """
    return SyncClient(url, api_key=api_key, connect_timeout=connect_timeout, client_name=client_name,
                      tls_ca=tls_ca, ssl_context=ssl_context, reconnect=reconnect)


def consume(
    rs: SyncClient,
    mailbox: Any,
    scope: Any,
    handler: Any,
    *,
    concurrency: int = 1,
    lease_seconds: float = 30,
    wait: float = 20,
    drain_timeout: float = 30,
    handle_signals: bool = True,
    holder: str | None = None,
    complete_and_next: bool = True,
):
    """Serve ``mailbox`` for ``scope`` (a run, or its id) until the run becomes inactive,
    blocking: :func:`rallypoint.consume` for plain scripts, with the same semantics
    (``holder``: the worker's name recorded with each delivery; ``complete_and_next``:
    a handler's complete and the next receive in one request, the default).

    ``handler(delivery) -> outcome`` is a plain function, called in a worker thread of
    the client (``concurrency`` at once), with a blocking delivery: ``delivery.input``,
    ``delivery.attempt``, ``delivery.run()``... without ``await``. Its return value is
    the outcome (any msgpack-able value up to 64 KiB encoded); an exception is a retry
    (``"Type: message"``; FAILED after ``max_attempts``), logged as one WARNING on
    ``rallypoint.consume``. Meanwhile the client's loop renews each lease every
    ``lease_seconds / 3`` (5-600 s) -- the script does nothing for it -- and a lease that
    is lost (the run stopped, the task was cancelled) marks ``delivery.lost`` (the
    thread cannot be cancelled: its result is then not recorded).

    Called from the main thread it owns SIGINT/SIGTERM as :func:`rallypoint.consume`
    does: the first Ctrl-C stops taking work, lets running handlers finish for up to
    ``drain_timeout`` seconds and gives back (uncounted, ``delivery.release``) what is
    still running, then returns; a second one raises KeyboardInterrupt at once.

    Returns :class:`rallypoint.ConsumeStats`. Raises what ``rallypoint.consume`` raises
    (NotFoundError, ValidationError -- also for an ``async def`` handler: use
    ``rallypoint.consume`` for those -- UnavailableError, AuthError).
    """
    from .client.consume import _INTERRUPTS, _Stopper
    from .client.consume import consume as aconsume
    from .errors import ValidationError

    if not isinstance(rs, SyncClient):
        raise ValidationError("rallypoint.sync.consume takes a client of rallypoint.sync.connect()",
                              details={"field": "rs"})
    if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None)):
        raise ValidationError("handler is an async function: rallypoint.sync.consume calls plain functions "
                              "(use rallypoint.consume in async code)", details={"field": "handler"})
    if not callable(handler):
        raise ValidationError(f"handler must be callable (got {handler!r})", details={"field": "handler"})

    def plain(delivery):  # in a worker thread of the client's loop
        return handler(_Proxy(delivery, rs))

    stop = _Stopper()
    token = _INTERRUPTS.register(stop.request) if handle_signals else None
    try:
        return rs._run(
            aconsume, rs._obj, mailbox._obj if isinstance(mailbox, _Proxy) else mailbox,
            scope._obj if isinstance(scope, _Proxy) else scope, plain, concurrency=concurrency,
            lease_seconds=lease_seconds, wait=wait, drain_timeout=drain_timeout, handle_signals=False, holder=holder,
            complete_and_next=complete_and_next, _stop=stop,
        )
    finally:
        _INTERRUPTS.unregister(token)
