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

from contextlib import asynccontextmanager
from typing import AsyncIterator

from ._version import __version__
from .client.api import Client, Delivery, Group, Mailbox, Run, Ticket
from .client.consume import ConsumeStats, consume
from .client.types import (
    GroupDecision,
    GroupStatus,
    MailboxInfo,
    RunStatus,
    ServerInfo,
    TaskInfo,
    VerdictResult,
)
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from . import sync  # noqa: E402  (rallypoint.sync.connect(url): the blocking client)

__all__ = [
    "__version__",
    "connect",
    "open_embedded",
    "consume",
    "ConsumeStats",
    "sync",
    "Client",
    "Run",
    "Mailbox",
    "Ticket",
    "Delivery",
    "Group",
    "RunStatus",
    "TaskInfo",
    "MailboxInfo",
    "GroupStatus",
    "GroupDecision",
    "VerdictResult",
    "ServerInfo",
    *_errors_all,
]

DEFAULT_URL = "tcp://127.0.0.1:7411"


@asynccontextmanager
async def connect(
    url: str = DEFAULT_URL,
    *,
    api_key: str | None = None,
    client_name: str = "",
    connect_timeout: float = 10.0,
    tls_ca: str | None = None,
    ssl_context=None,
) -> AsyncIterator[Client]:
    """Connect to a rallypoint daemon (``tcp://host:port``, or ``tls://host:port``
    verified against ``ssl_context``, the CA file ``tls_ca``, or the system CAs);
    yields the ``rs`` client.

    Works under Trio and asyncio (anyio). Raises UnavailableError when the server cannot
    be reached; a dropped connection fails pending and later calls with UnavailableError.
    UnauthenticatedError for a missing, unknown or revoked ``api_key``.
    """
    from .transport.connection import connect_transport

    async with connect_transport(
        url, api_key=api_key, client_name=client_name, connect_timeout=connect_timeout,
        tls_ca=tls_ca, ssl_context=ssl_context,
    ) as conn:
        yield Client(conn)


@asynccontextmanager
async def open_embedded(
    data_dir: str | None = None, *, durability: str | None = None, clock=None
) -> AsyncIterator[Client]:
    """Run the coordinator inside the caller's Trio program; yields the same ``rs`` API.

    ``data_dir=None`` keeps everything in memory (durability ``memory``); with a data dir
    the default durability is ``fsync`` and state is recovered from it.
    """
    from .client.embedded import EmbeddedTransport
    from .node import open_node

    async with open_node(data_dir, durability, clock=clock) as node:
        transport = EmbeddedTransport(node.service)
        rs = Client(transport)
        rs.node = node  # for tests and introspection
        try:
            yield rs
        finally:
            await transport.aclose()
