"""Length-prefixed frames: a 4-byte big-endian length, then that many bytes of msgpack.

:class:`FrameParser` is an incremental parser for a byte stream: :meth:`FrameParser.feed`
takes whatever ``receive_some`` returned and gives back every complete frame body in it
(zero-copy ``memoryview`` slices of immutable ``bytes``), keeping a partial trailing frame
in a ``bytearray`` until the rest arrives. A length header larger than the limit is
detected from the header alone: the body is never read or allocated, and the parser
stops (framing is lost; the connection must be closed).

Nothing here does I/O, so the same parser serves the Trio server and the anyio client.

:func:`salvage_request_id` and :func:`split_batch` read a frame that msgspec could not
decode (a bad envelope, or data nested too deeply for its recursive decoder) with an
iterative scanner, so the error reply can still name the request and a batch's other
requests can still be served.
"""

from __future__ import annotations

import struct

import msgspec

from .. import wire

__all__ = [
    "HEADER",
    "NESTING_MESSAGE",
    "SCAN_BUDGET",
    "FrameParser",
    "encode_frame",
    "oversize_message",
    "pack_uint",
    "salvage_request_id",
    "split_batch",
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
    """The VALIDATION_FAILED text for a length header of ``size`` bytes over ``limit``."""
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
        """Add received bytes; return every frame body completed by them, in order
        (empty list if none). After an oversize header, returns [] for good."""
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


# ------------------------------------------------------------------ salvage scanner

#: msgpack values (scalars, containers) the salvage scans visit at most per frame: bounds
#: the CPU a hostile frame costs on the error path (~10 ms), whatever its shape.
SCAN_BUDGET = 100_000

NESTING_MESSAGE = wire.NESTING_MESSAGE

_FIXED, _LEN, _ARR, _MAP, _BAD = range(5)
# How to skip a value whose type byte is 0xc0 + i: (kind, n, extra). _FIXED: n bytes of
# data follow. _LEN: an n-byte length L, then extra + L bytes. _ARR/_MAP: an n-byte count.
_TYPES = (
    (_FIXED, 0, 0), (_BAD, 0, 0), (_FIXED, 0, 0), (_FIXED, 0, 0),  # nil, (unused), false, true
    (_LEN, 1, 0), (_LEN, 2, 0), (_LEN, 4, 0),  # bin 8/16/32
    (_LEN, 1, 1), (_LEN, 2, 1), (_LEN, 4, 1),  # ext 8/16/32 (length, type byte, data)
    (_FIXED, 4, 0), (_FIXED, 8, 0),  # float 32/64
    (_FIXED, 1, 0), (_FIXED, 2, 0), (_FIXED, 4, 0), (_FIXED, 8, 0),  # uint 8..64
    (_FIXED, 1, 0), (_FIXED, 2, 0), (_FIXED, 4, 0), (_FIXED, 8, 0),  # int 8..64
    (_FIXED, 2, 0), (_FIXED, 3, 0), (_FIXED, 5, 0), (_FIXED, 9, 0), (_FIXED, 17, 0),  # fixext 1..16
    (_LEN, 1, 0), (_LEN, 2, 0), (_LEN, 4, 0),  # str 8/16/32
    (_ARR, 2, 0), (_ARR, 4, 0),  # array 16/32
    (_MAP, 2, 0), (_MAP, 4, 0),  # map 16/32
)


class _ScanError(Exception):
    """Truncated or invalid msgpack, or the scan budget is spent."""


class _Scanner:
    """Walks msgpack without recursion (a counter of values still to skip instead)."""

    __slots__ = ("buf", "end", "budget")

    def __init__(self, buf: bytes | memoryview, budget: int = SCAN_BUDGET) -> None:
        self.buf = buf
        self.end = len(buf)
        self.budget = budget

    def container(self, off: int, kind: int) -> tuple[int, int]:
        """``(count, offset after the header)`` of the array (``_ARR``) or map (``_MAP``,
        count of entries) at ``off``; raises _ScanError if it is something else."""
        if off >= self.end:
            raise _ScanError
        b = self.buf[off]
        if kind == _MAP and 0x80 <= b <= 0x8F:
            return b & 0x0F, off + 1
        if kind == _ARR and 0x90 <= b <= 0x9F:
            return b & 0x0F, off + 1
        if 0xC0 <= b <= 0xDF:
            k, n, _ = _TYPES[b - 0xC0]
            if k == kind and off + 1 + n <= self.end:
                return int.from_bytes(self.buf[off + 1 : off + 1 + n], "big"), off + 1 + n
        raise _ScanError

    def skip(self, off: int) -> int:
        """The offset just past the value at ``off``."""
        buf = self.buf
        end = self.end
        budget = self.budget
        pending = 1
        while pending:
            if budget <= 0 or off >= end:
                raise _ScanError
            budget -= 1
            pending -= 1
            b = buf[off]
            if b < 0x80 or b >= 0xE0:  # fixint
                off += 1
            elif b < 0x90:  # fixmap
                pending += 2 * (b & 0x0F)
                off += 1
            elif b < 0xA0:  # fixarray
                pending += b & 0x0F
                off += 1
            elif b < 0xC0:  # fixstr
                off += 1 + (b & 0x1F)
            else:
                kind, n, extra = _TYPES[b - 0xC0]
                if kind == _FIXED:
                    off += 1 + n
                    continue
                if kind == _BAD or off + 1 + n > end:
                    raise _ScanError
                count = int.from_bytes(buf[off + 1 : off + 1 + n], "big")
                off += 1 + n
                if kind == _LEN:
                    off += extra + count
                elif kind == _ARR:
                    pending += count
                else:
                    pending += 2 * count
        self.budget = budget
        if off > end:
            raise _ScanError
        return off

    def scalar(self, start: int, stop: int) -> object:
        """The value in ``buf[start:stop]`` if it is a string or an integer, else None
        (never decodes a container: no recursion)."""
        b = self.buf[start]
        if b < 0x80 or b >= 0xE0 or 0xA0 <= b <= 0xBF or 0xCC <= b <= 0xD3 or 0xD9 <= b <= 0xDB:
            try:
                return msgspec.msgpack.decode(self.buf[start:stop])
            except msgspec.MsgspecError:
                return None
        return None

    def map_entries(self) -> list[tuple[object, int, int]]:
        """``(key, value_start, value_stop)`` for each entry of the top-level map (keys
        that are not strings or integers come back as None)."""
        count, off = self.container(0, _MAP)
        out = []
        for _ in range(count):
            key_stop = self.skip(off)
            key = self.scalar(off, key_stop)
            value_stop = self.skip(key_stop)
            out.append((key, key_stop, value_stop))
            off = value_stop
        return out


def salvage_request_id(frame: bytes | memoryview) -> int:
    """The request id of a frame that failed to decode: the integer under the key
    ``"id"`` of its top-level map, found without recursion (so a body nested far too
    deeply does not hide it). Returns 0 when there is none (not a map, no ``id``, not a
    positive integer, invalid msgpack, or the scan would exceed :data:`SCAN_BUDGET`)."""
    try:
        scan = _Scanner(frame)
        count, off = scan.container(0, _MAP)
        for _ in range(count):
            key_stop = scan.skip(off)
            value_stop = scan.skip(key_stop)
            if scan.scalar(off, key_stop) == "id":
                rid = scan.scalar(key_stop, value_stop)
                return rid if type(rid) is int and rid > 0 else 0
            off = value_stop
    except _ScanError:
        pass
    return 0


def split_batch(frame: bytes | memoryview) -> list[memoryview] | None:
    """The requests of a batch frame ``{"t": "batch", "reqs": [req, ...]}`` as separate
    msgpack slices (each to be decoded, and answered, on its own), found without
    recursion. Returns None if the frame is not such a map (or cannot be scanned within
    :data:`SCAN_BUDGET`)."""
    mv = memoryview(frame)
    try:
        scan = _Scanner(mv)
        entries = scan.map_entries()
        tag = next((scan.scalar(s, e) for k, s, e in entries if k == "t"), None)
        where = next(((s, e) for k, s, e in entries if k == "reqs"), None)
        if tag != "batch" or where is None:
            return None
        count, off = scan.container(where[0], _ARR)
        reqs = []
        for _ in range(count):
            stop = scan.skip(off)
            reqs.append(mv[off:stop])
            off = stop
        return reqs
    except _ScanError:
        return None
