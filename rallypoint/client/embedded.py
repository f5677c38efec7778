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

    def _check_open(self) -> None:
        if self.closed:
            raise UnavailableError("this embedded coordinator was closed (its open_embedded block ended)")

    async def call(self, op: msgspec.Struct):
        self._check_open()
        res = self.service.dispatch(self.session, encoder.encode(op))
        if not isinstance(res, (bytes, Deferred)):
            res = await res  # a server-side wait
        if isinstance(res, Deferred):
            await self.service.wait_durable(res.lsn)
            return res.reply
        await trio.lowlevel.checkpoint()
        return res

    async def call_many(self, ops: list) -> list:
        """Like a batch frame: every op is dispatched in order, then the replies wait
        together (one durability wait for all, not one per op); server-side waits run
        concurrently."""
        self._check_open()
        out: list = [None] * len(ops)
        waits: list = []
        for i, op in enumerate(ops):
            try:
                res = self.service.dispatch(self.session, encoder.encode(op))
            except RallypointError as e:
                out[i] = e
                continue
            if isinstance(res, bytes):
                out[i] = res
            elif isinstance(res, Deferred):
                out[i] = res.reply
            else:
                waits.append((i, res))
        if waits:
            async def run(i, aw):
                try:
                    r = await aw
                    out[i] = r.reply if isinstance(r, Deferred) else r
                except RallypointError as e:
                    out[i] = e

            async with trio.open_nursery() as n:
                for i, aw in waits:
                    n.start_soon(run, i, aw)
        await self.service.wait_durable(self.service.coordinator.journal.last_lsn)
        return out

    async def aclose(self) -> None:
        self.closed = True
