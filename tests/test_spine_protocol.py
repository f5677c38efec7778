"""Protocol robustness against the REAL daemon (a ``rallypoint serve`` subprocess).

Bad input is answered VALIDATION_FAILED naming the field; the connection is closed only
when framing is lost (oversize header); after every case a fresh connection works and
the daemon is alive.
"""

from urllib.parse import urlsplit

import msgspec
import pytest
import trio

import rallypoint
from rallypoint import wire
from rallypoint.errors import ValidationError
from rallypoint.transport.testing import RawClient

_enc = msgspec.msgpack.encode
_ok_body = msgspec.msgpack.Decoder()


def _port(daemon) -> int:
    return urlsplit(daemon.url).port


async def _connect(daemon) -> RawClient:
    return await RawClient.connect(_port(daemon))


async def _status_works(c: RawClient, rid: int) -> None:
    await c.request(rid, {"op": "server.status"})
    f = await c.recv()
    assert isinstance(f, wire.Ok) and f.id == rid, f
    assert _ok_body.decode(f.body)["protocol_version"] == wire.PROTOCOL_VERSION


async def _alive(daemon) -> None:
    assert daemon.proc.poll() is None, "the daemon died"
    c = await _connect(daemon)
    try:
        await _status_works(c, 1)
    finally:
        await c.aclose()


async def _err(c: RawClient, rid: int, body) -> wire.Err:
    await c.request(rid, body)
    f = await c.recv()
    assert isinstance(f, wire.Err), f
    assert f.id == rid and f.code == "VALIDATION_FAILED", f
    return f


# --- bad operations: answered, connection kept ----------------------------------------


async def test_unknown_op_names_op_and_keeps_the_connection(daemon):
    c = await _connect(daemon)
    f = await _err(c, 7, {"op": "nope"})
    assert "$.op" in f.message and "nope" in f.message
    await _status_works(c, 8)  # same connection still serves
    await c.aclose()
    await _alive(daemon)


async def test_wrong_field_type_names_the_field(daemon):
    c = await _connect(daemon)
    f = await _err(c, 1, {"op": "scope.create", "child_limit": "x"})
    assert "$.child_limit" in f.message
    assert (f.details or {}).get("path") == "$.child_limit"
    await _status_works(c, 2)
    await c.aclose()
    await _alive(daemon)


async def test_missing_field_names_the_field(daemon):
    c = await _connect(daemon)
    f = await _err(c, 1, {"op": "scope.status"})
    assert "scope_id" in f.message
    await _status_works(c, 2)
    await c.aclose()


async def test_unknown_field_is_rejected_naming_it(daemon):
    c = await _connect(daemon)
    f = await _err(c, 1, {"op": "scope.create", "name": "spine-unknown-field", "colour": "red"})
    assert "colour" in f.message
    # ...and nothing was created by the rejected request
    await c.request(2, {"op": "scope.list", "limit": 10000})
    listing = _ok_body.decode((await c.recv()).body)
    assert not [s for s in listing["scopes"] if s["name"] == "spine-unknown-field"]
    await _status_works(c, 3)
    await c.aclose()


async def test_body_that_is_not_an_operation(daemon):
    c = await _connect(daemon)
    for rid, body in enumerate([5, "scope.create", [1, 2], {"no_op": 1}, None], start=1):
        f = await _err(c, rid, body)
        assert f.message
    await _status_works(c, 99)
    await c.aclose()


async def test_bad_request_ids_and_envelopes(daemon):
    c = await _connect(daemon)
    # id 0 is the connection itself
    await c.send(wire.Request(0, msgspec.Raw(_enc({"op": "server.status"}))))
    f = await c.recv()
    assert isinstance(f, wire.Err) and f.id == 0 and "$.id" in f.message
    # an envelope of an unknown type
    await c.send_raw(_frame(_enc({"t": "what", "id": 3})))
    f = await c.recv()
    assert isinstance(f, wire.Err) and f.code == "VALIDATION_FAILED"
    # a second hello
    await c.send(wire.Hello(wire.PROTOCOL_VERSION))
    f = await c.recv()
    assert isinstance(f, wire.Err) and "hello" in f.message
    await _status_works(c, 4)
    await c.aclose()


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


# --- bad bytes ------------------------------------------------------------------------


async def test_garbage_inside_a_valid_frame_is_answered_connection_kept(daemon):
    c = await _connect(daemon)
    await c.send_raw(_frame(b"\xc1\xc1\xc1\xc1\xc1"))  # 0xc1 is never valid msgpack
    f = await c.recv()
    assert isinstance(f, wire.Err) and f.code == "VALIDATION_FAILED" and f.id == 0
    await c.send_raw(_frame(b""))  # an empty frame
    f = await c.recv()
    assert isinstance(f, wire.Err) and f.code == "VALIDATION_FAILED"
    await _status_works(c, 1)
    await c.aclose()
    await _alive(daemon)


async def test_garbage_bytes_without_framing_close_the_connection(daemon):
    # An HTTP probe: "GET " read as a length header is ~1.1 GB: framing is lost.
    c = await _connect(daemon)
    await c.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    frames = await c.expect_eof()
    assert [(f.id, f.code) for f in frames] == [(0, "VALIDATION_FAILED")]
    assert "frame limit" in frames[0].message
    await _alive(daemon)


async def test_oversize_length_header_4gib(daemon):
    c = await _connect(daemon)
    await c.send_raw(b"\xff\xff\xff\xff")
    frames = await c.expect_eof()
    assert len(frames) == 1 and frames[0].code == "VALIDATION_FAILED"
    assert str(0xFFFFFFFF) in frames[0].message and str(wire.MAX_FRAME_BYTES) in frames[0].message
    await _alive(daemon)


async def test_garbage_before_hello(daemon):
    c = RawClient(await trio.open_tcp_stream("127.0.0.1", _port(daemon)))
    await c.send_raw(_frame(b"\x93\x01\x02\x03"))
    frames = await c.expect_eof()
    assert len(frames) == 1 and frames[0].code == "VALIDATION_FAILED" and "hello" in frames[0].message
    await _alive(daemon)


async def test_truncated_frame_then_eof(daemon):
    c = await _connect(daemon)
    whole = _frame(_enc({"t": "req", "id": 1, "body": {"op": "server.status"}}))
    await c.send_raw(whole[:-5])  # the server waits for the rest...
    with trio.move_on_after(0.2) as cs:
        await c.recv()
    assert cs.cancelled_caught  # ...without answering or closing
    await _alive(daemon)  # meanwhile other connections are served
    await c.stream.send_eof()  # the peer gives up half-way
    assert await c.expect_eof() == []
    await _alive(daemon)


async def test_truncated_frame_completed_later_is_served(daemon):
    c = await _connect(daemon)
    whole = _frame(_enc({"t": "req", "id": 5, "body": {"op": "server.status"}}))
    for i in range(len(whole)):  # byte by byte
        await c.send_raw(whole[i : i + 1])
    f = await c.recv()
    assert isinstance(f, wire.Ok) and f.id == 5
    await c.aclose()


# --- payload limit ----------------------------------------------------------------------


async def test_payload_over_64kib_names_size_and_limit(daemon):
    async with rallypoint.connect(daemon.url) as rs:
        run = await rs.scopes.create()
        mbx = await rs.mailboxes.ensure("spine-proto-big")
        big = "x" * (70 * 1024)
        with pytest.raises(ValidationError) as ei:
            await mbx.submit(big, scope=run)
        size = len(msgspec.msgpack.encode(big))
        assert str(size) in ei.value.message and str(wire.MAX_PAYLOAD_BYTES) in ei.value.message
        with pytest.raises(ValidationError) as ei:
            await mbx.submit_many([1, big], scope=run)
        assert str(wire.MAX_PAYLOAD_BYTES) in ei.value.message
        assert (await mbx.status()).queued == 0  # all or nothing
        # exactly at the limit is fine
        ok = "y" * (wire.MAX_PAYLOAD_BYTES - 3)  # str16 header: 3 bytes
        assert len(msgspec.msgpack.encode(ok)) == wire.MAX_PAYLOAD_BYTES
        await mbx.submit(ok, scope=run)
        with pytest.raises(ValidationError) as ei:  # one byte more is not
            await mbx.submit(ok + "y", scope=run)
        assert str(wire.MAX_PAYLOAD_BYTES + 1) in ei.value.message
        # and an outcome over the limit is refused too
        d = await mbx.receive(run, wait=1)
        with pytest.raises(ValidationError) as ei:
            await d.complete(big)
        assert str(wire.MAX_PAYLOAD_BYTES) in ei.value.message
        await d.complete("small")
