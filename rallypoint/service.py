"""The coordinator behind a connection: decode, authorize, dispatch, encode, and hold
the reply until the journal is durable past what the request observed.

Used by the TCP server (as its dispatcher) and by the embedded client (in-process), so
both see exactly the same validation, errors and durability rules.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable

import msgspec

from ._version import __version__
from .actors.api import OPS
from .errors import ForbiddenError, RallypointError, UnauthenticatedError, ValidationError
from .protocol import encoder, op_decoder
from .transport.framing import NESTING_MESSAGE
from .transport.server import Deferred
from .wire import PROTOCOL_VERSION, Hello, HelloOk

log = logging.getLogger("rallypoint.service")

__all__ = ["Session", "Service"]


class Session:
    """Who is on the other end: the space it sees and the permissions it holds."""

    __slots__ = ("space", "permissions", "peer", "key_id")

    def __init__(self, space: str = "default", permissions: frozenset[str] | None = None, peer: str = "", key_id=None):
        self.space = space
        self.permissions = permissions  # None: open mode, everything allowed
        self.peer = peer
        self.key_id = key_id


class Service:
    """The dispatcher for :class:`rallypoint.transport.server.Server`.

    ``dispatch`` returns the encoded reply (bytes) when it can be sent at once, a
    :class:`Deferred` when it must wait for the journal to be durable past an LSN, or an
    awaitable for server-side waits (which resolves to one of the two).
    """

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self._handlers: dict[type, tuple[Any, str]] = {
            t: (getattr(coordinator, spec.handler), spec.permission) for t, spec in OPS.items()
        }

    # -------------------------------------------------------------- handshake
    def hello(self, hello: Hello, peer: str = "") -> tuple[Session, HelloOk]:
        if hello.version != PROTOCOL_VERSION:
            raise ValidationError(
                f"protocol version mismatch: the client speaks version {hello.version}, "
                f"this server (rallypoint {__version__}) speaks version {PROTOCOL_VERSION}; "
                "upgrade the older side",
                details={"field": "version", "client": hello.version, "server": PROTOCOL_VERSION},
            )
        key = self.coordinator.authenticate(hello.api_key)  # UNAUTHENTICATED: closes
        if key is None:  # open mode: the default space, every permission
            session = Session(peer=peer)
        else:
            session = Session(space=key.space, permissions=frozenset(key.permissions), peer=peer, key_id=key.id)
        return session, HelloOk(version=PROTOCOL_VERSION, server_version=__version__, space=session.space)

    def connection_opened(self) -> None:
        self.coordinator.connections += 1

    def connection_closed(self) -> None:
        self.coordinator.connections -= 1

    # -------------------------------------------------------------- requests
    def decode(self, body: msgspec.Raw | bytes):
        try:
            return op_decoder.decode(body)
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid request: {e}", details={"path": _path_of(str(e))}) from None
        except msgspec.DecodeError as e:
            raise ValidationError(f"undecodable request body: {e}") from None
        except RecursionError:  # msgspec recurses; the envelope decoded a few frames up the stack
            raise ValidationError(f"invalid request: {NESTING_MESSAGE}") from None

    def dispatch(self, session: Session, body: msgspec.Raw | bytes) -> bytes | Deferred | Awaitable:
        op = self.decode(body)
        handler, permission = self._handlers[type(op)]
        perms = session.permissions
        if perms is not None:
            if self.coordinator.keys[session.key_id].revoked_at_ms is not None:
                raise UnauthenticatedError("this connection's API key was revoked")
            if permission not in perms and "admin" not in perms:
                raise ForbiddenError(
                    f"this key lacks the permission {permission!r} needed for {op.__struct_config__.tag}",
                    details={"permission": permission},
                )
        result = handler(session, op)
        if isinstance(result, msgspec.Struct):
            return self._finish(result)
        return self._finish_later(result)

    def _finish(self, reply: msgspec.Struct) -> bytes | Deferred:
        data = encoder.encode(reply)
        journal = self.coordinator.journal
        lsn = journal.last_lsn
        if lsn <= journal.durable_lsn:
            return data
        return Deferred(lsn, data)

    async def _finish_later(self, aw) -> bytes:
        reply = await aw
        data = encoder.encode(reply)
        await self.coordinator.journal.wait_durable(self.coordinator.journal.last_lsn)
        return data

    async def wait_durable(self, lsn: int) -> None:
        await self.coordinator.journal.wait_durable(lsn)


def _path_of(msg: str) -> str | None:
    i = msg.rfind("`$")
    if i < 0:
        return None
    j = msg.find("`", i + 1)
    return msg[i + 1 : j] if j > 0 else None
