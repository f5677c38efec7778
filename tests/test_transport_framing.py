import struct

import pytest

from rallypoint import wire
from rallypoint.transport.framing import FrameParser, encode_frame, oversize_message, pack_uint

import msgspec


def test_many_frames_in_one_chunk_and_every_split():
    bodies = [bytes([i]) * i for i in range(1, 40)] + [b""]
    stream = b"".join(encode_frame(b) for b in bodies)
    p = FrameParser()
    assert [bytes(f) for f in p.feed(stream)] == bodies
    assert p.buffered == 0
    for cut in range(len(stream) + 1):
        p = FrameParser()
        got = [bytes(f) for f in p.feed(stream[:cut])] + [bytes(f) for f in p.feed(stream[cut:])]
        assert got == bodies, cut


def test_byte_at_a_time():
    bodies = [b"abc", b"", b"x" * 300]
    stream = b"".join(encode_frame(b) for b in bodies)
    p = FrameParser()
    got = []
    for i in range(len(stream)):
        got += [bytes(f) for f in p.feed(stream[i : i + 1])]
    assert got == bodies


def test_max_size_frame_in_chunks_is_linear():
    body = b"z" * wire.MAX_FRAME_BYTES
    stream = encode_frame(body)
    p = FrameParser()
    got = []
    for i in range(0, len(stream), 65536):
        got += p.feed(stream[i : i + 65536])
    assert len(got) == 1 and bytes(got[0]) == body
    assert p.buffered_max <= len(stream)


def test_oversize_header_detected_from_header_alone():
    p = FrameParser()
    ok = encode_frame(b"\x01")
    frames = p.feed(ok + struct.pack(">I", 0xFFFFFFFF))  # no body at all
    assert [bytes(f) for f in frames] == [b"\x01"]
    assert p.oversize == 0xFFFFFFFF
    assert p.buffered == 0
    assert p.feed(b"more") == []  # stays dead
    msg = oversize_message(0xFFFFFFFF)
    assert "4294967295" in msg and str(wire.MAX_FRAME_BYTES) in msg


def test_oversize_header_split_across_chunks():
    p = FrameParser()
    hdr = struct.pack(">I", wire.MAX_FRAME_BYTES + 1)
    assert p.feed(hdr[:2]) == []
    assert p.oversize is None
    assert p.feed(hdr[2:]) == []
    assert p.oversize == wire.MAX_FRAME_BYTES + 1


def test_encode_frame_limit():
    with pytest.raises(ValueError):
        encode_frame(b"x" * (wire.MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize("n", [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40])
def test_pack_uint_is_msgpack(n):
    assert msgspec.msgpack.decode(pack_uint(n)) == n
