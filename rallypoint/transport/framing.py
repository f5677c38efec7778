"""Length-prefixed frames: a 4-byte big-endian length, then that many bytes of msgpack.

:class:`FrameParser` is an incremental parser for a byte stream: :meth:`FrameParser.feed`
takes whatever ``receive_some`` returned and gives back every complete frame body in it
(zero-copy ``memoryview`` slices of immutable ``bytes``), keeping a partial trailing frame
in a ``bytearray`` until the rest arrives. A length header larger than the limit is
detected from the header alone: the body is never read or allocated, and the parser
stops (framing is lost; the connection must be closed).

Nothing here does I/O, so the same parser serves the Trio server and the anyio client.
"""

from __future__ import annotations

import struct

from .. import wire

__all__ = [
    "HEADER",
    "FrameParser",
    "encode_frame",
    "oversize_message",
    "pack_uint",
]

_HEADER = struct.Struct(">I")
_unpack_from = _HEADER.unpack_from
pack_header_into = _HEADER.pack_into
#: Size of the length prefix, bytes.
HEADER = 4
#: Placeholder for a length prefix patched in after encoding the body in place.
HEADER_PLACEHOLDER = b"\0\0\0\0"


def encode_frame(body: bytes | bytearray | memoryview) -> bytes:
    """Prefix an encoded msgpack body with its 4-byte big-endian length."""
    n = len(body)
    if n > wire.MAX_FRAME_BYTES:
        raise ValueError(f"frame body is {n} bytes, larger than the {wire.MAX_FRAME_BYTES}-byte limit")
    return _HEADER.pack(n) + bytes(body)


def oversize_message(size: int, limit: int = wire.MAX_FRAME_BYTES) -> str:
    return (
        f"frame length header announces {size} bytes, larger than the frame limit of "
        f"{limit} bytes (1 MiB); framing is lost, closing the connection"
    )


def pack_uint(n: int) -> bytes:
    """msgpack encoding of a non-negative int (request ids in hand-built envelopes)."""
    if n < 0x80:
        return bytes((n,))
    if n < 0x100:
        return b"\xcc" + bytes((n,))
    if n < 0x10000:
        return b"\xcd" + n.to_bytes(2, "big")
    if n < 0x100000000:
        return b"\xce" + n.to_bytes(4, "big")
    return b"\xcf" + n.to_bytes(8, "big")


class FrameParser:
    """Incremental frame parser.

    ``feed(data)`` returns the list of complete frame bodies found so far. If a length
    header over ``max_frame`` is seen, parsing stops for good: the frames before it are
    still returned, and :attr:`oversize` holds the announced size (else ``None``).
    """

    __slots__ = ("_buf", "_need", "max_frame", "oversize", "buffered_max")

    def __init__(self, max_frame: int = wire.MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        # Bytes the buffer must hold before it contains at least one more frame
        # (header, or header + body once the header is known).
        self._need = HEADER
        self.max_frame = max_frame
        self.oversize: int | None = None
        #: Largest partial-frame buffer seen (bytes), for statistics.
        self.buffered_max = 0

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[memoryview]:
        if self.oversize is not None:
            return []
        buf = self._buf
        if buf:
            buf += data
            n = len(buf)
            if n > self.buffered_max:
                self.buffered_max = n
            if n < self._need:
                return []
            work = bytes(buf)
            buf.clear()
        else:
            work = data
        frames: list[memoryview] = []
        append = frames.append
        mv = memoryview(work)
        end = len(work)
        max_frame = self.max_frame
        off = 0
        while True:
            if end - off < HEADER:
                break
            (size,) = _unpack_from(work, off)
            if size > max_frame:
                self.oversize = size
                self._need = HEADER
                return frames
            stop = off + HEADER + size
            if stop > end:
                break
            append(mv[off + HEADER : stop])
            off = stop
        if off < end:
            rest = mv[off:]
            buf += rest
            if end - off >= HEADER:
                self._need = HEADER + _unpack_from(work, off)[0]
            else:
                self._need = HEADER
            if len(buf) > self.buffered_max:
                self.buffered_max = len(buf)
        else:
            self._need = HEADER
        return frames
