"""The in-process transport: the embedded client calls the coordinator directly.

Requests still go through :class:`rallypoint.service.Service` (encode, decode,
validate, dispatch, durability wait), so the embedded API behaves exactly like the TCP
one: same validation messages, same errors, same "reply only once durable" rule.
"""

from __future__ import annotations

import msgspec
import trio

from ..errors import RallypointError, UnavailableError
from ..protocol import encoder
from ..service import Service, Session
from ..transport.server import Deferred

__all__ = ["EmbeddedTransport"]


class EmbeddedTransport:
    """``call(op) -> bytes`` against a local coordinator (Trio only)."""

    def __init__(self, service: Service, session: Session | None = None) -> None:
        self.service = service
        self.session = session or Session(peer="embedded")
        self.closed = False

    async def call(self, op: msgspec.Struct):
        if self.closed:
            raise UnavailableError("this embedded coordinator was closed (its open_embedded block ended)")
        res = self.service.dispatch(self.session, encoder.encode(op))
        if isinstance(res, bytes):
            await trio.lowlevel.checkpoint()
            return res
        if isinstance(res, Deferred):
            await self.service.wait_durable(res.lsn)
            return res.reply
        res = await res
        if isinstance(res, Deferred):
            await self.service.wait_durable(res.lsn)
            return res.reply
        return res

    async def call_many(self, ops: list) -> list:
        out: list = []
        for op in ops:
            try:
                out.append(await self.call(op))
            except RallypointError as e:
                out.append(e)
        return out

    async def aclose(self) -> None:
        self.closed = True
