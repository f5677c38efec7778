"""rallypoint: a coordination server for swarms of agents and workers.

Two ways in, one API::

    async with rallypoint.connect("tcp://127.0.0.1:7411") as rs:     # a daemon
        ...
    async with rallypoint.open_embedded() as rs:                      # in-process (Trio)
        run = await rs.scopes.create(name="nightly")
        mbx = await rs.mailboxes.ensure("jobs")
        ticket = await mbx.submit({"n": 1}, scope=run)

See README.md and docs/ for the model (runs, mailboxes, tasks, groups).
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator

from ._version import __version__
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .errors import ValidationError

# The client API is imported on first use (PEP 562 ``__getattr__`` below), not with the
# package: ``python -m rallypoint serve`` binds its ports before the heavy imports (a
# client connecting during a restart waits in the backlog instead of being refused),
# and every CLI command starts faster. ``rallypoint.X`` and ``from rallypoint import X``
# work as before.
_LAZY: dict[str, str] = {
    **{name: ".client.api" for name in (
        "Budget", "ClaimLease", "Client", "Delivery", "Grant", "Group", "Mailbox", "Message", "Pool", "Quota",
        "QuotaWaiter", "Reservation", "Run", "Schedule", "Ticket")},
    "ConsumeStats": ".client.consume", "consume": ".client.consume",
    "Reconnect": ".client.reconnect",
    **{name: ".client.types" for name in (
        "BudgetInfo", "ClaimInfo", "GrantInfo", "GroupDecision", "GroupStatus", "MailboxInfo", "MessageInfo",
        "PoolInfo", "QuotaInfo", "QuotaTakeInfo", "ReservationInfo", "RunStatus", "ServerInfo", "SettleResult",
        "TaskInfo", "TaskOutcome", "VerdictResult", "WorkLimitInfo", "ScheduleInfo", "ScheduleActionInfo")},
    "format_minor": ".money", "minor_units": ".money",
    "sync": ".sync",  # rallypoint.sync.connect(url): the blocking client (a module)
}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from . import sync  # noqa: F401
    from .client.api import (  # noqa: F401
        Budget, ClaimLease, Client, Delivery, Grant, Group, Mailbox, Message, Pool, Quota, QuotaWaiter, Reservation,
        Run, Schedule, Ticket,
    )
    from .client.consume import ConsumeStats, consume  # noqa: F401
    from .client.reconnect import Reconnect  # noqa: F401
    from .client.types import (  # noqa: F401
        BudgetInfo, ClaimInfo, GrantInfo, GroupDecision, GroupStatus, MailboxInfo, MessageInfo, PoolInfo, QuotaInfo,
        QuotaTakeInfo, ReservationInfo, RunStatus, ServerInfo, SettleResult, TaskInfo, TaskOutcome, VerdictResult,
        WorkLimitInfo, ScheduleInfo, ScheduleActionInfo,
    )
    from .money import format_minor, minor_units  # noqa: F401


def __getattr__(name: str):
    """The client API's names, imported on first use (see ``_LAZY``)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rallypoint' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(module, __name__)
    value = mod if name == "sync" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "connect",
    "open_embedded",
    "consume",
    "ConsumeStats",
    "Reconnect",
    "sync",
    "Client",
    "Run",
    "Mailbox",
    "Ticket",
    "Delivery",
    "Group",
    "ClaimLease",
    "Pool",
    "Grant",
    "ClaimInfo",
    "PoolInfo",
    "GrantInfo",
    "WorkLimitInfo",
    "RunStatus",
    "TaskInfo",
    "TaskOutcome",
    "MailboxInfo",
    "GroupStatus",
    "GroupDecision",
    "VerdictResult",
    "ServerInfo",
    "Message",
    "MessageInfo",
    "Quota",
    "QuotaWaiter",
    "QuotaInfo",
    "QuotaTakeInfo",
    "Budget",
    "Reservation",
    "BudgetInfo",
    "ReservationInfo",
    "SettleResult",
    "Schedule",
    "ScheduleInfo",
    "ScheduleActionInfo",
    "minor_units",
    "format_minor",
    *_errors_all,
]

DEFAULT_URL = "tcp://127.0.0.1:7411"


def _resolve(url: str | None, api_key: str | None) -> tuple[str, str | None]:
    """``url`` or ``$RALLYPOINT_URL`` or the default; ``api_key`` or ``$RALLYPOINT_API_KEY``."""
    if url is None:
        url = os.environ.get("RALLYPOINT_URL") or DEFAULT_URL
    if api_key is None:
        api_key = os.environ.get("RALLYPOINT_API_KEY") or None
    return url, api_key


#: With several server addresses (a cluster): close a connection whose server sends
#: nothing for this long while calls wait (it is pinged at half of it), seconds. Well
#: inside the shortest lease (5 s) plus the failover's credit: a frozen leader (SIGSTOP,
#: a VM pause) is left, and its lease holders renew on the new one, in time.
CLUSTER_LIVENESS_S = 2.5
#: With one server address: the same check, longer (a restart is what usually ends a
#: link; a proxy or NAT that drops it silently is found within this), seconds.
LIVENESS_S = 6.0
#: With several server addresses: the longest one connection attempt may take, seconds
#: (a stopped node must not hold the whole connect timeout while others answer).
CLUSTER_ATTEMPT_S = 2.0


def _policy(reconnect: "Reconnect | bool | None") -> "Reconnect | None":
    from .client.reconnect import Reconnect

    if reconnect is True:
        return Reconnect()
    if reconnect is None or reconnect is False:
        return None
    if isinstance(reconnect, Reconnect):
        return reconnect
    raise ValidationError(f"reconnect must be True, False or a rallypoint.Reconnect (got {reconnect!r})",
                          details={"field": "reconnect"})


@asynccontextmanager
async def connect(
    url: str | None = None,
    *,
    api_key: str | None = None,
    client_name: str = "",
    connect_timeout: float = 10.0,
    tls_ca: str | None = None,
    ssl_context=None,
    reconnect: "Reconnect | bool" = True,
    route: bool = True,
) -> AsyncIterator[Client]:
    """Connect to a rallypoint daemon; yields the ``rs`` client.

    Args:
        url: ``tcp://host:port`` or ``tls://host:port``; for a replicated shard
            (``serve --cluster``) several nodes, ``tcp://a:7411,b:7411``: the client
            connects to whichever leads and follows it through a failover
            (:mod:`rallypoint.client.follow`). Default: ``$RALLYPOINT_URL``, else
            ``tcp://127.0.0.1:7411``.
        api_key: the key's secret. Default: ``$RALLYPOINT_API_KEY`` (none in open mode).
        client_name: shown in the server's logs.
        connect_timeout: seconds for one connection attempt (TCP, TLS and handshake).
        tls_ca: a PEM CA file to verify a ``tls://`` server (default: the system CAs);
            ``ssl_context`` overrides it.
        reconnect: ``True`` (default: :class:`Reconnect` defaults, giving up after
            60 s), a :class:`Reconnect` (timeout, backoff), or ``False`` (a dropped
            connection fails pending and later calls with UnavailableError).
        route: on a sharded cluster, send each request to the shard that owns it
            (default; with or without reconnection). False: everything goes to the node
            connected to, which answers WRONG_SHARD for what another shard owns.

    With reconnection, a dropped connection (e.g. a daemon restart) is re-opened with
    exponential backoff (logged on the ``rallypoint.client`` logger); calls made
    meanwhile wait for it; calls in flight are sent again when that cannot apply them
    twice (reads, waits, receive, a delivery's renew/complete/retry/reject, idempotent
    writes, submissions with a ``key``) and otherwise raise UnavailableError with
    ``details["maybe_applied"] = True`` (e.g. a submit without a key, creating a run).
    Deliveries keep their leases: renewals resume on the new connection. The full
    list is in :mod:`rallypoint.client.reconnect`.

    Works under Trio and asyncio (anyio). The first connection is not retried.

    Raises:
        UnavailableError (UNAVAILABLE): the server cannot be reached (at the start; or,
            from a call, the client gave up reconnecting).
        UnauthenticatedError (UNAUTHENTICATED): a missing, unknown or revoked key.
        ValidationError (VALIDATION_FAILED): a bad URL, or a protocol version mismatch.
    An exception raised inside the ``async with`` block leaves it unchanged.
    """
    from .client.api import Client
    from .client.follow import LeaderFollower, split_urls
    from .client.reconnect import ReconnectingTransport
    from .transport.connection import Connection

    url, api_key = _resolve(url, api_key)
    policy = _policy(reconnect)

    urls = split_urls(url)
    # several nodes (a replicated or sharded cluster): a leader that stops answering
    # behind a live TCP connection (SIGSTOP, a VM pause) is left after
    # CLUSTER_LIVENESS_S (then tried last), and one address is tried for at most a part
    # of the connect timeout
    several = len(urls) > 1

    async def open_one(u: str, timeout: float) -> Connection:
        c = await Connection.open(u, api_key=api_key, client_name=client_name,
                                  connect_timeout=min(timeout, CLUSTER_ATTEMPT_S) if several else timeout,
                                  tls_ca=tls_ca, ssl_context=ssl_context)
        # a link that dies silently (a dropped NAT entry, a frozen node) is found and
        # re-dialled, with one address too
        c.watch_liveness(CLUSTER_LIVENESS_S if several else LIVENESS_S)
        return c

    follower = LeaderFollower(urls, open_one)

    async def open_connection(timeout: float) -> Connection:
        return await follower.open(timeout)

    conn = await open_connection(connect_timeout)
    if policy is None:
        async with conn:
            if not route:
                yield Client(conn)
                return
            async with _routed(conn, url, open_one, None, connect_timeout) as client:
                yield client
        return
    async with ReconnectingTransport(url, conn, open_connection, policy, connect_timeout) as transport:
        if not route:
            yield Client(transport)
            return
        async with _routed(transport, url, open_one, policy, connect_timeout) as client:
            yield client


@asynccontextmanager
async def _routed(transport, url: str, open_one, policy, connect_timeout: float):
    """A Client over ``transport``; on a sharded cluster's node (its HelloOk names a
    shard), one routing the requests to every shard's leader -- each shard's connection
    reconnecting under ``policy``, or, with ``policy`` None (``reconnect=False``), a plain
    one (routing works without reconnection)."""
    from .client.api import Client
    from .client.follow import LeaderFollower, split_urls
    from .client.reconnect import ReconnectingTransport

    info = transport.server_info
    if getattr(info, "shard", None) is None:  # not a cluster node: one transport for everything
        yield Client(transport)
        return
    import anyio

    from .client.router import open_transport

    try:
        async with anyio.create_task_group() as shards:
            async def run_shard(shard: int, hint, *, task_status=anyio.TASK_STATUS_IGNORED):
                # one shard's transport lives in a task of its own (entered and left there)
                f = LeaderFollower(split_urls(url), open_one, shard=shard, hint=hint)
                c = await f.open(connect_timeout)
                if policy is None:
                    async with c:
                        task_status.started(c)
                        await anyio.sleep_forever()
                async with ReconnectingTransport(url, c, f.open, policy, connect_timeout) as t:
                    task_status.started(t)
                    await anyio.sleep_forever()

            async def open_shard(shard: int, hint):
                return await shards.start(run_shard, shard, hint)

            routed = await open_transport(transport, split_urls(url), open_shard, info.space)
            try:
                yield Client(routed)
            finally:
                shards.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        # the shards' task group wraps what leaves it: the block's own exception (or
        # a shard's, when opening it failed) leaves as itself, as on a single node
        one = _single(eg, anyio.get_cancelled_exc_class())
        if one is None:
            raise
        raise one from one.__cause__


def _single(eg: BaseExceptionGroup, cancelled: type) -> BaseException | None:
    """The one exception in ``eg`` (nested groups and cancellations aside), else None."""
    leaves: list[BaseException] = []
    stack = [eg]
    while stack:
        for e in stack.pop().exceptions:
            (stack.append(e) if isinstance(e, BaseExceptionGroup) else leaves.append(e))
    real = [e for e in leaves if not isinstance(e, cancelled)]
    return real[0] if len(real) == 1 else None


def retention_options(retain_finished: float | None, retain_events: "int | str | None") -> dict:
    """``open_node(retention=...)`` from seconds / a count or age. VALIDATION_FAILED for
    a negative duration or an unreadable ``retain_events``."""
    from .events import DEFAULT_RETAIN_EVENTS, parse_retain_events

    out: dict = {}
    if retain_finished is not None:
        if isinstance(retain_finished, bool) or not isinstance(retain_finished, (int, float)) or retain_finished < 0:
            raise ValidationError(f"retain_finished must be seconds >= 0 (got {retain_finished!r})",
                                  details={"field": "retain_finished"})
        out["retain_finished_ms"] = int(retain_finished * 1000) or None
    if retain_events is None:
        out["retain_events"] = DEFAULT_RETAIN_EVENTS
    else:
        try:
            count, age_ms = parse_retain_events(str(retain_events))
        except ValueError:
            raise ValidationError(f"retain_events must be a count or an age like '24h' (got {retain_events!r})",
                                  details={"field": "retain_events"}) from None
        out["retain_events"] = count if count else None
        out["retain_events_ms"] = age_ms or None
    return out


def _require_trio(what: str) -> None:
    """RuntimeError with a clear message unless the caller runs under Trio."""
    try:
        import sniffio

        library = sniffio.current_async_library()
    except Exception:  # no event loop at all (or sniffio cannot tell)
        library = None
    if library != "trio":
        where = f"under {library}" if library else "outside an event loop"
        raise RuntimeError(
            f"{what} needs Trio: it runs the coordinator inside a Trio program (trio.run), but it was "
            f"called {where}. Under asyncio, run a daemon (`rallypoint serve`) and use rallypoint.connect(url), "
            "which works under asyncio and Trio."
        )


@asynccontextmanager
async def open_embedded(
    data_dir: str | None = None, *, durability: str | None = None, clock=None,
    retain_finished: float | None = None, retain_events: "int | str | None" = None,
    sync_helper: str = "process",
) -> AsyncIterator[Client]:
    """Run the coordinator inside the caller's Trio program; yields the same ``rs`` API.

    ``data_dir=None`` keeps everything in memory (durability ``memory``); with a data dir
    the default durability is ``fsync`` and state is recovered from it.

    ``retain_finished``: seconds a finished run or task is kept after it ended (None or
    0: forever, the embedded default; the daemon's default is 7 days).
    ``retain_events``: events kept per space, a count (default 100,000) or an age such
    as ``"24h"`` (see ``rallypoint serve --retain-events``).
    ``sync_helper``: where the journal's fdatasync runs with a data dir: ``"process"``
    (a small child process, the default; see ``rallypoint serve --sync-helper``),
    ``"thread"`` or ``"inline"`` (on the event loop: faster on a reliably fast disk,
    :mod:`rallypoint.persistence.syncer`).

    Embedded mode needs Trio (``trio.run``): the coordinator's background tasks are Trio
    tasks. Under asyncio (or outside any event loop) it raises RuntimeError saying so;
    from asyncio, run a daemon (``rallypoint serve``) and use :func:`connect`, which
    works under both. Also raises ValidationError (VALIDATION_FAILED) for an unknown
    ``durability`` or ``sync_helper`` and the data dir's errors (e.g. another process holds its lock).
    """
    _require_trio("rallypoint.open_embedded()")
    from .client.api import Client
    from .client.embedded import EmbeddedTransport
    from .node import open_node
    from .persistence.syncer import SYNC_MODES

    if sync_helper not in SYNC_MODES:
        raise ValidationError(f"sync_helper must be one of {', '.join(SYNC_MODES)} (got {sync_helper!r})",
                              details={"field": "sync_helper"})
    from .persistence.errors import DataDirLocked

    try:
        async with open_node(data_dir, durability, clock=clock, sync_helper=sync_helper,
                             retention=retention_options(retain_finished, retain_events)) as node:
            transport = EmbeddedTransport(node.service)
            rs = Client(transport)
            rs.node = node  # for tests and introspection
            try:
                yield rs
            finally:
                await transport.aclose()
    except DataDirLocked as e:  # the message in this API's words (the CLI's says --data-dir)
        raise DataDirLocked(e.data_dir, e.pid, option="data_dir= (open_embedded)") from None
