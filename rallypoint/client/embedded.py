"""The in-process transport: the embedded client calls the coordinator directly.

Requests still go through :class:`rallypoint.service.Service` (encode, decode,
validate, route to the actor's inbox, durability wait), so the embedded API behaves
exactly like the TCP one: same validation messages, same errors, same "reply only once
durable" rule.
"""

from __future__ import annotations

import msgspec

from ..errors import UnavailableError
from ..protocol import encoder
from ..service import CallSink, Service, Session

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
        """One request; the encoded reply once durable. Raises the RallypointError the
        coordinator answered."""
        self._check_open()
        return await self.service.call(self.session, op)

    async def call_many(self, ops: list) -> list:
        """Like a batch frame: every op is queued in order, then the replies are awaited
        together (one durability wait for all, not one per op). Returns replies (bytes)
        or RallypointError instances, in order."""
        self._check_open()
        sink = CallSink(len(ops))
        submit = self.service.submit
        session = self.session
        for i, op in enumerate(ops):
            submit(session, encoder.encode(op), sink, i)
        if len(sink.replies) < len(ops):
            try:
                await sink._event.wait()
            except BaseException:
                sink.abandon()
                raise
        await self.service.wait_durable(sink.lsn)
        return [sink.replies[i] for i in range(len(ops))]

    async def subscribe(self, op: msgspec.Struct, max_events: int = 10_000):
        """Open a subscription (``events.watch``): an object with ``start`` (the encoded
        WatchView), ``await next_batch()`` and ``close()``."""
        self._check_open()
        return await self.service.subscribe(self.session, op, max_bytes=max(4096, max_events * 256))

    async def aclose(self) -> None:
        self.closed = True

