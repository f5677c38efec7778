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


# ------------------------------------------------------------- salvage scanner

from hypothesis import given, settings, strategies as st  # noqa: E402

from rallypoint.transport.framing import SCAN_BUDGET, _Scanner, salvage_request_id, split_batch  # noqa: E402

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=300), st.binary(max_size=300),
    st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=300)),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=20), st.dictionaries(st.text(max_size=5), inner, max_size=20)),
    max_leaves=60,
)


@settings(max_examples=200, deadline=None)
@given(_values, st.binary(max_size=8))
def test_scanner_skips_exactly_one_value_of_any_shape(value, trailer):
    data = msgspec.msgpack.encode(value)
    assert _Scanner(data + trailer).skip(0) == len(data)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 2**64 - 1), _values)
def test_salvaged_id_is_the_envelope_id(rid, body):
    frame = msgspec.msgpack.encode(wire.Request(rid, msgspec.Raw(msgspec.msgpack.encode(body))))
    assert salvage_request_id(frame) == rid


def test_scanner_skips_the_32_bit_length_forms():
    for value in (b"x" * 70_000, "y" * 70_000, list(range(70_000)), {str(i): i for i in range(70_000)}):
        data = msgspec.msgpack.encode(value)
        assert _Scanner(data, budget=1 << 20).skip(0) == len(data)


def test_salvage_finds_the_id_behind_data_too_deep_to_decode():
    deep = b"\x91" * 50_000 + b"\x01"
    frame = b"\x83\xa1t\xa3req\xa4body" + deep + b"\xa2id\xcd\x01\x00"
    with pytest.raises(RecursionError):
        msgspec.msgpack.decode(frame)
    assert salvage_request_id(frame) == 256


@pytest.mark.parametrize("frame", [
    b"",                                     # nothing
    b"\x93\x01\x02\x03",                     # not a map
    b"\x81\xa2id\xa5seven",                  # id not an integer
    b"\x81\xa2id\xff",                       # id negative (-1)
    b"\x81\xa2id\x00",                       # id 0
    b"\x82\xa1t\xa3req\xa2id",               # truncated before the id's value
    b"\x82\xa1t\xc1\xa2id\x05",              # invalid type byte 0xc1 before the id
    b"\x81\xa2id" + b"\x91" * 20,            # the id is a (truncated) nested array
])
def test_salvage_gives_0_when_there_is_no_usable_id(frame):
    assert salvage_request_id(frame) == 0


def test_salvage_is_bounded_by_the_scan_budget():
    # the id sits behind more values than the budget allows: given up, 0
    many = b"\xdd" + (SCAN_BUDGET + 10).to_bytes(4, "big") + b"\x01" * (SCAN_BUDGET + 10)
    frame = b"\x82\xa4body" + many + b"\xa2id\x07"
    assert salvage_request_id(frame) == 0
    assert salvage_request_id(b"\x82\xa4body\x93\x01\x02\x03\xa2id\x07") == 7


def test_split_batch_returns_each_request_even_the_undecodable_ones():
    good = msgspec.msgpack.encode(wire.Request(1, msgspec.Raw(b"\x01")))
    deep = b"\x83\xa1t\xa3req\xa2id\x02\xa4body" + b"\x91" * 5_000 + b"\xc0"
    frame = b"\x82\xa1t\xa5batch\xa4reqs\x93" + good + deep + good
    assert [bytes(r) for r in split_batch(frame)] == [good, deep, good]
    assert split_batch(msgspec.msgpack.encode(wire.Batch([wire.Request(3, msgspec.Raw(b"\x02"))]))) is not None
    assert split_batch(good) is None                                  # not a batch
    assert split_batch(b"\x82\xa1t\xa5batch\xa4reqs\x93" + good) is None  # truncated
    assert split_batch(b"\x82\xa1t\xa5batch\xa4reqs\x07") is None        # reqs not an array
