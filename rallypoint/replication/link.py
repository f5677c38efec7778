"""A replication connection: msgspec messages in length-prefixed frames over a Trio
stream (the same framing as the client protocol, with a larger limit)."""

from __future__ import annotations

import struct
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import msgspec
import trio

from ..transport.framing import FrameParser
from .wire import MAX_MESSAGE_BYTES, LeaderMessage, StandbyMessage

__all__ = ["Link", "LinkClosed", "StaleLeader", "unwrapped"]

_HEADER = struct.Struct(">I")


class LinkClosed(Exception):
    """The peer closed the replication connection, reset it, or sent a frame that does
    not decode (framing is then lost, so the connection is closed too)."""


class StaleLeader(LinkClosed):
    """The peer sent frames of an epoch older than one this standby has seen, or not the
    epoch etcd named: a deposed leader. The standby drops the connection."""


@asynccontextmanager
async def unwrapped() -> AsyncIterator[None]:
    """Let the one exception of a nursery leave it as itself, not wrapped in an
    ExceptionGroup (Trio's strict exception groups); several stay a group -- except
    several :class:`LinkClosed`: both directions of one connection failing at once
    (a send and a receive, say) are one lost link, raised as the most specific of
    them (a subclass such as StaleLeader before a plain LinkClosed)."""
    try:
        yield
    except BaseExceptionGroup as eg:
        leaves = []
        stack = [eg]
        while stack:
            g = stack.pop()
            for e in g.exceptions:
                (stack.append(e) if isinstance(e, BaseExceptionGroup) else leaves.append(e))
        real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
        if len(real) > 1 and all(isinstance(e, LinkClosed) for e in real):
            real = [next((e for e in real if type(e) is not LinkClosed), real[0])]
        if len(real) == 1:
            raise real[0] from real[0].__cause__
        raise


class Link:
    """One end of a replication connection. ``side`` is ``"leader"`` (it receives the
    standby's messages) or ``"standby"``. ``send`` and ``receive`` may run in two tasks
    at once (one each); neither may run in two."""

    def __init__(self, stream: trio.abc.Stream, side: str, *, max_message: int = MAX_MESSAGE_BYTES) -> None:
        self.stream = stream
        self._parser = FrameParser(max_frame=max_message)
        self._decoder = msgspec.msgpack.Decoder(StandbyMessage if side == "leader" else LeaderMessage)
        self._encoder = msgspec.msgpack.Encoder()
        self._ready: deque[Any] = deque()
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def max_message(self) -> int:
        """The largest message body taken, bytes (small until the peer proved itself)."""
        return self._parser.max_frame

    @max_message.setter
    def max_message(self, n: int) -> None:
        self._parser.max_frame = n

    async def send(self, msg: msgspec.Struct) -> None:
        """Send one message. Raises LinkClosed when the connection is gone."""
        body = self._encoder.encode(msg)
        try:
            await self.stream.send_all(_HEADER.pack(len(body)) + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise LinkClosed(f"replication connection lost while sending: {exc!r}") from None
        self.bytes_sent += len(body) + 4

    async def receive(self) -> Any:
        """The next message. Raises LinkClosed at EOF, on a reset, or on a message that
        does not decode."""
        while not self._ready:
            try:
                data = await self.stream.receive_some(1 << 20)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise LinkClosed(f"replication connection lost: {exc!r}") from None
            if not data:
                raise LinkClosed("the peer closed the replication connection")
            self.bytes_received += len(data)
            frames = self._parser.feed(data)
            if self._parser.oversize is not None:
                raise LinkClosed(f"a replication message of {self._parser.oversize} bytes is over the "
                                 f"{self._parser.max_frame}-byte limit")
            for f in frames:
                try:
                    self._ready.append(self._decoder.decode(f))
                except msgspec.DecodeError as exc:
                    raise LinkClosed(f"a replication message does not decode: {exc}") from None
        return self._ready.popleft()

    async def aclose(self) -> None:
        """Close the connection (idempotent)."""
        with trio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
