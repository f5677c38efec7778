"""Peers that reset their connections or send absurdly nested data, against a REAL
daemon (``rallypoint serve`` subprocess on 127.0.0.1), with its log captured.

- A peer that resets its connection is routine (a killed worker, a load balancer's health
  check): at most one DEBUG line, never an ERROR with a traceback, and a flood of them is
  rate-limited ("N similar events suppressed in the last T s").
- A request nested ~1,000 levels deep cannot be decoded (msgspec recurses): it is
  answered VALIDATION_FAILED with its request id (salvaged without recursion), and the
  connection goes on serving.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from urllib.parse import urlsplit

import msgspec
import trio

import rallypoint
from rallypoint import wire
from rallypoint.transport.framing import encode_frame
from rallypoint.transport.testing import RawClient

from conftest import Daemon

_enc = msgspec.msgpack.encode
#: The server logs at most this many lines per kind of event per window (its default).
BURST = 5


@contextlib.contextmanager
def logged_daemon(*extra: str):
    """A memory daemon with these ``serve`` flags; yields ``(daemon, log_lines)``, the
    list growing as the daemon logs (drained by a thread so the pipe never fills)."""
    d = Daemon(None, "memory", extra=list(extra)).start()
    lines: list[str] = []
    t = threading.Thread(target=lambda: lines.extend(d.proc.stderr), daemon=True)
    t.start()
    try:
        startup_drained(d, lines)
        yield d, lines
        assert d.proc.poll() is None, "the daemon died:\n" + "".join(lines)
    finally:
        rc = d.stop()
        t.join(5)
    assert rc == 0, "".join(lines)


#: The last line the daemon logs at startup (before it prints READY on stdout): which of
#: the two depends on whether API keys are configured.
_LAST_STARTUP_LINE = ("open mode: no API keys", "API keys required")


def startup_drained(d: Daemon, lines: list[str], timeout: float = 30.0) -> None:
    """Wait until the reader thread has taken the startup lines off the pipe.

    The daemon wrote them before READY, but the thread that drains stderr may not have
    read them yet on a loaded machine; a test that takes ``len(lines)`` as its base before
    that would count the startup banner as lines its storm caused (CI saw exactly this)."""
    deadline = time.monotonic() + timeout
    while not any(m in ln for ln in list(lines) for m in _LAST_STARTUP_LINE):
        assert d.proc.poll() is None, "the daemon died:\n" + "".join(lines)
        assert time.monotonic() < deadline, "no startup line logged:\n" + "".join(lines)
        time.sleep(0.01)


def port_of(d: Daemon) -> int:
    return urlsplit(d.url).port


def errors_in(lines: list[str]) -> list[str]:
    return [ln for ln in lines if " ERROR " in ln or "Traceback" in ln or "Exception Group" in ln]


def reset_storm(port: int, cycles: int) -> None:
    """``cycles`` connections closed with a TCP RST (SO_LINGER 0), in three flavours:
    before the hello, right after it, and with requests whose replies are never read."""
    hello = encode_frame(_enc(wire.Hello(wire.PROTOCOL_VERSION)))
    reqs = encode_frame(_enc(wire.Request(1, msgspec.Raw(_enc({"op": "scope.list", "limit": 100}))))) * 20
    for i in range(cycles):
        s = socket.create_connection(("127.0.0.1", port))
        flavour = i % 3
        if flavour >= 1:
            s.sendall(hello)
            s.recv(4096)  # hello_ok: the connection is past the handshake
        if flavour == 2:
            s.sendall(reqs)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()


async def settled(d: Daemon) -> None:
    """Every connection made before this call has been accepted and has ended.

    Signal, not a sleep: the listen queue is FIFO, so once a new connection is served,
    every earlier one was accepted; then the daemon's open-connection count falls to 1
    (this one) once they have all been torn down (and logged)."""
    async with rallypoint.connect(d.url) as rs:
        with trio.fail_after(10):
            while (await rs.status()).connections > 1:
                await trio.sleep(0.02)


def deep(depth: int) -> bytes:
    """msgpack of ``[[[...[1]...]]]``: ``depth`` nested one-element arrays."""
    return b"\x91" * depth + b"\x01"


def raw_request(rid: int | None, body: bytes, *, id_last: bool = False) -> bytes:
    """A request frame built by hand (the body is already msgpack, of any depth)."""
    head = b"\xa1t\xa3req"
    rid_part = b"" if rid is None else b"\xa2id" + _enc(rid)
    body_part = b"\xa4body" + body
    n = 2 + (rid is not None)
    fields = head + (body_part + rid_part if id_last else rid_part + body_part)
    return encode_frame(bytes([0x80 | n]) + fields)


# ------------------------------------------------------------------------ resets (item 10)


async def test_peer_resets_at_default_level_log_nothing():
    """The reported case: at the default log level (INFO), connect/reset cycles before,
    right after and during the handshake add no line at all to the log."""
    with logged_daemon() as (d, lines):
        await settled(d)
        base = len(lines)
        await trio.to_thread.run_sync(reset_storm, port_of(d), 150)
        await settled(d)
        assert lines[base:] == [], "".join(lines[base:])


async def test_peer_reset_is_one_debug_line_and_a_flood_is_rate_limited():
    """At DEBUG, a reset is one line without a traceback; 90 of them within the window
    give at most BURST lines, and the rest are reported as suppressed (here at the clean
    shutdown, which flushes the counts)."""
    with logged_daemon("--log-level", "DEBUG") as (d, lines):
        await settled(d)
        base = len(lines)
        await trio.to_thread.run_sync(reset_storm, port_of(d), 90)
        await settled(d)
        storm = lines[base:]
        assert not errors_in(storm), "".join(storm)
        resets = [ln for ln in storm if "closed by the peer" in ln]
        assert 1 <= len(resets) <= BURST, "".join(storm)
        assert all(" DEBUG " in ln for ln in resets)
        assert "reset" in resets[0].lower()
    summary = [ln for ln in lines if "similar events suppressed" in ln]
    assert len(summary) == 1, "".join(lines[base:])
    suppressed = int(summary[0].split("similar events suppressed")[0].split()[-1])
    assert len(resets) + suppressed >= 60  # most of the 90 resets reached the server as resets
    assert not errors_in(lines), "".join(lines)


# ------------------------------------------------------------------- nesting (item 11)


async def test_deeply_nested_request_is_validation_failed_with_its_id_and_the_connection_lives():
    with logged_daemon() as (d, lines):
        c = await RawClient.connect(port_of(d))
        for rid, depth in ((7, 1_000), (8, 100_000)):
            await c.send_raw(raw_request(rid, deep(depth)))
            err = await c.recv()
            assert isinstance(err, wire.Err), err
            assert (err.id, err.code) == (rid, "VALIDATION_FAILED"), err
            assert "nested too deeply" in err.message
        # the id is salvaged wherever it is in the envelope, and 0 when there is none
        await c.send_raw(raw_request(9, deep(2_000), id_last=True))
        err = await c.recv()
        assert (err.id, err.code) == (9, "VALIDATION_FAILED"), err
        await c.send_raw(raw_request(None, deep(2_000)))
        err = await c.recv()
        assert (err.id, err.code) == (0, "VALIDATION_FAILED"), err
        # the same connection still serves
        await c.request(10, {"op": "server.status"})
        ok = await c.recv()
        assert isinstance(ok, wire.Ok) and ok.id == 10, ok
        await c.aclose()
        assert not errors_in(lines), "".join(lines)


async def test_nesting_at_every_depth_near_the_limit_is_answered_never_internal():
    """Around the decoder's limit (the envelope and the operation are decoded at slightly
    different stack depths) every request gets its own reply: NOT_FOUND while the input
    decodes, VALIDATION_FAILED once it does not; never INTERNAL, never a dropped connection."""
    with logged_daemon() as (d, lines):
        c = await RawClient.connect(port_of(d))
        head = _enc({"op": "task.submit", "mailbox": "nope", "scope_id": "scp_nope"})
        depths = range(900, 1_011)
        for depth in depths:
            body = bytes([head[0] + 1]) + head[1:] + b"\xa5input" + deep(depth)
            await c.send_raw(raw_request(depth, body))
        codes = {}
        for _ in depths:
            r = await c.recv()
            assert isinstance(r, wire.Err), r
            codes[r.id] = r.code
        assert sorted(codes) == list(depths)
        assert set(codes.values()) == {"NOT_FOUND", "VALIDATION_FAILED"}, codes
        assert codes[900] == "NOT_FOUND" and codes[1_010] == "VALIDATION_FAILED"
        await c.request(1, {"op": "server.status"})
        assert isinstance(await c.recv(), wire.Ok)
        await c.aclose()
        assert not errors_in(lines), "".join(lines)


async def test_deeply_nested_request_in_a_batch_fails_alone():
    with logged_daemon() as (d, lines):
        c = await RawClient.connect(port_of(d))
        status = _enc({"op": "server.status"})
        reqs = [
            b"\x83\xa1t\xa3req\xa2id\x01\xa4body" + status,
            b"\x83\xa1t\xa3req\xa2id\x02\xa4body" + deep(5_000),
            b"\x83\xa1t\xa3req\xa2id\x03\xa4body" + status,
        ]
        batch = b"\x82\xa1t\xa5batch\xa4reqs\x93" + b"".join(reqs)
        await c.send_raw(encode_frame(batch))
        got = {}
        for _ in range(3):
            r = await c.recv()
            got[r.id] = r
        assert isinstance(got[1], wire.Ok) and isinstance(got[3], wire.Ok), got
        assert got[2].code == "VALIDATION_FAILED" and "reqs[1]" in got[2].message, got[2]
        await c.aclose()
        assert not errors_in(lines), "".join(lines)


async def test_deeply_nested_hello_is_refused_with_a_reply():
    with logged_daemon() as (d, lines):
        c = await RawClient.connect(port_of(d), hello=False)
        hello = b"\x83\xa1t\xa5hello\xa7version\x01\xa5extra" + deep(3_000)  # unknown fields are skipped
        await c.send_raw(encode_frame(hello))
        frames = await c.expect_eof()
        assert [(f.id, f.code) for f in frames] == [(0, "VALIDATION_FAILED")], frames
        assert "nested too deeply" in frames[0].message
        async with rallypoint.connect(d.url) as rs:
            await rs.status()
        assert not errors_in(lines), "".join(lines)
