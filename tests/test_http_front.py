"""The HTTP front door (issue 40, "A forwarder forwards only what it routes"; issue 41,
items 5, 6 and 10): what every HTTP listener -- a single node's or a leader's API, a
standby's forwarder, the console -- refuses before anything is routed
(rallypoint/http/guard.py), and what the API refuses of a browser.

Every test is named after the input an attacker sent. Raw sockets where h11 or httpx
would normalise the input (a request-target, framing, a Host header); the listeners are
in-process (``serve_http`` / ``serve_console`` over an embedded coordinator), except
where the log a real daemon writes is the point.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
import ssl
import subprocess
import sys
import time
import types

import httpx
import pytest
import trio

import rallypoint
from rallypoint.console import serve_console
from rallypoint.console.app import _safe_next
from rallypoint.http import serve_http
from rallypoint.http.guard import HostCheck, target_problem
from rallypoint.logutil import TextFormatter, printable

pytestmark = pytest.mark.timeout(120)

#: request-targets that name a host, or are no path (``{port}``: a trap listener's)
HOSTILE_TARGETS = [
    "@127.0.0.1:{port}/metrics",
    "@127.0.0.1:{port}/v1/spaces/default/scopes",
    "http://127.0.0.1:{port}/v1/spaces/default/scopes",
    "https://127.0.0.1:{port}/x",
    "127.0.0.1:{port}",
    "//127.0.0.1:{port}/v1/spaces/default/scopes",
    "/\\127.0.0.1:{port}/v1/spaces/default/scopes",
    "\\\\127.0.0.1:{port}/x",
    "/%2F127.0.0.1:{port}/v1/spaces/default/scopes",
    "/%2f%2f127.0.0.1:{port}/x",
    "/%5C127.0.0.1:{port}/x",
    "%40127.0.0.1:{port}/x",
    "%2F%2F127.0.0.1:{port}/x",
    "*",
]


# ============================================================================ helpers


class Trap:
    """A TCP listener that counts the connections it gets (none must come)."""

    def __init__(self) -> None:
        self.connections = 0

    async def start(self, nursery) -> int:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

        async def handle(stream):
            self.connections += 1
            await stream.aclose()

        nursery.start_soon(trio.serve_listeners, handle, listeners)
        return listeners[0].socket.getsockname()[1]


async def exchange(port: int, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    s = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    with trio.fail_after(timeout):
        await s.send_all(data)
        while True:
            try:
                chunk = await s.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not chunk:
                break
            got += chunk
    await s.aclose()
    return got


def answers(raw: bytes) -> list[tuple[int, dict, bytes]]:
    """The HTTP/1.1 answers (each with a content-length) in ``raw``, in order."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, raw
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(headers.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        raw = rest[n:]
    return out


def one_answer(raw: bytes) -> tuple[int, dict, bytes]:
    got = answers(raw)
    assert len(got) == 1, got
    return got[0]


@contextlib.asynccontextmanager
async def listeners(**http_kw):
    """An embedded (memory) coordinator in open mode with its HTTP API and console on
    127.0.0.1; yields ``api``, ``console``, ``port``, ``cport``, ``rs``, ``nursery``."""
    async with rallypoint.open_embedded() as rs:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            api, urls = await nursery.start(functools.partial(
                serve_http, rs.node.service, "127.0.0.1", 0, shutdown=stop, **http_kw))
            console, curls = await nursery.start(functools.partial(
                serve_console, rs.node.service, "127.0.0.1", 0, shutdown=stop, hosts=http_kw.get("hosts", ())))
            yield types.SimpleNamespace(api=api, console=console, port=int(urls[0].rsplit(":", 1)[1]),
                                        cport=int(curls[0].rsplit(":", 1)[1]), rs=rs, nursery=nursery)
            stop.set()
            nursery.cancel_scope.cancel()  # (a trap listener's task too)


def get(target: str, host: str = "127.0.0.1", method: str = "GET", extra: str = "") -> bytes:
    return f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n{extra}\r\n".encode("latin-1")


def run_count(rs) -> int:
    return len(rs.node.coordinator.runs.table)


# ============================================================ request-targets (issue 40)


@pytest.mark.parametrize("target", HOSTILE_TARGETS)
async def test_a_target_that_is_not_an_origin_form_path_is_400_on_the_api_and_the_console(target):
    async with listeners() as h:
        trap = Trap()
        tport = await trap.start(h.nursery)
        t = target.format(port=tport)
        method = "CONNECT" if t.startswith("127.") else ("OPTIONS" if t == "*" else "GET")
        for port in (h.port, h.cport):
            status, headers, body = one_answer(await exchange(port, get(t, method=method)))
            assert status == 400, (t, body)
            assert json.loads(body)["error"]["code"] == "VALIDATION_FAILED"
            assert headers["connection"] == "close"
        assert trap.connections == 0
        assert h.api.listener.guard.refused["target"] == 1
        assert h.console.listener.guard.refused["target"] == 1


def test_target_problem_takes_one_slash_paths_and_encoded_slashes_inside_a_name():
    for ok in (b"/", b"/v1/spaces/default/scopes", b"/v1/spaces/sp%2F1/runs/a%2Fb", b"/prefix/v1/spaces/x",
               b"/static/console.js"):
        assert target_problem(ok) is None, ok
    for bad in (t.format(port=9).encode() for t in HOSTILE_TARGETS):
        assert target_problem(bad) is not None, bad


# ================================================================ framing (issue 41, 10)


async def test_content_length_and_transfer_encoding_is_400_and_the_request_smuggled_behind_gets_no_answer():
    smuggle = (b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: 60\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
               b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: 2\r\n\r\n{}")
    async with listeners() as h:
        status, headers, body = one_answer(await exchange(h.port, smuggle))  # and then the connection closed
        assert status == 400 and b"Content-Length and Transfer-Encoding" in body
        assert headers["connection"] == "close"
        assert run_count(h.rs) == 0  # neither request ran
        assert h.api.listener.guard.refused["framing"] == 1


@pytest.mark.parametrize("framing,status", [
    (b"content-length: 2\r\ncontent-length: 3", 400),  # conflicting lengths
    (b"transfer-encoding: identity, chunked", 501),  # a coding other than chunked (RFC 9112 §6.1: 501)
    (b"transfer-encoding : chunked", 400),  # a space before the colon
])
async def test_conflicting_framing_is_refused_and_the_next_request_on_the_connection_gets_no_answer(framing, status):
    # (h11's own refusals: pinned here, with the close that must follow)
    req = (b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           + framing + b"\r\n\r\n{}\r\n\r\n"
           + b"GET /v1/spaces/default/scopes/sc_nope HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    async with listeners() as h:
        got, headers, _body = one_answer(await exchange(h.port, req))
        assert got == status and headers["connection"] == "close"
        assert run_count(h.rs) == 0


async def test_pipelined_requests_without_ambiguity_are_each_answered():
    # (what must keep working: two well-framed requests on one connection)
    two = (b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           b"content-length: 2\r\n\r\n{}"
           b"GET /v1/spaces/default/scopes/sc_nope HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
    async with listeners() as h:
        got = answers(await exchange(h.port, two))
        assert [s for s, _, _ in got] == [200, 404]
        assert run_count(h.rs) == 1


# ===================================================================== Host (issue 41, 6)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "10.1.2.3", "[2001:db8::1]:80", "a@127.0.0.1",
                                  "127.0.0.1/x"])
async def test_a_host_header_naming_another_server_is_421_on_the_api_and_the_console(host):
    # DNS rebinding: a page of evil.example whose name now resolves to this host
    async with listeners() as h:
        for port, target in ((h.port, "/v1/spaces/default/scopes/sc_nope"), (h.cport, "/runs")):
            status, headers, body = one_answer(await exchange(port, get(target, host=host)))
            assert status == 421, (host, body)
            assert headers["connection"] == "close"
        post = get("/v1/spaces/default/scopes", host=host, method="POST",
                   extra="content-type: application/json\r\ncontent-length: 2\r\n") + b"{}"
        assert one_answer(await exchange(h.port, post))[0] == 421
        assert run_count(h.rs) == 0


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "localhost.", "127.0.0.1", "127.0.0.1:80",
                                  "127.5.6.7", "[::1]:8080"])
async def test_loopback_names_and_addresses_are_answered(host):
    async with listeners() as h:
        status, _, body = one_answer(await exchange(h.port, get("/v1/spaces/default/scopes/sc_nope", host=host,
                                                                extra="connection: close\r\n")))
        assert status == 404, body
        status, _, _ = one_answer(await exchange(h.cport, get("/runs", host=host, extra="connection: close\r\n")))
        assert status == 200


async def test_names_given_with_http_host_are_answered_and_others_still_refused():
    async with listeners(hosts=["rp.internal", "192.0.2.7"]) as h:
        for host, status in (("rp.internal:8080", 404), ("RP.Internal", 404), ("192.0.2.7", 404),
                             ("rp.internal.evil.example", 421), ("evil.example", 421)):
            got = one_answer(await exchange(h.port, get("/v1/spaces/default/scopes/sc_nope", host=host,
                                                        extra="connection: close\r\n")))
            assert got[0] == status, (host, got)


def test_host_check_matches_the_listen_name_and_the_reached_address_not_a_wildcard():
    hc = HostCheck(listen_host="node1.lan")
    assert hc.allows("node1.lan:9") and hc.allows(None) and hc.allows("")
    assert not hc.allows("node2.lan")
    wild = HostCheck(listen_host="0.0.0.0")
    assert not wild.allows("0.0.0.0") and not wild.allows("192.0.2.9")
    assert wild.allows("192.0.2.9:80", ("192.0.2.9", 80))  # the address the connection reached
    assert wild.allows("[::ffff:192.0.2.9]", ("192.0.2.9", 80))
    with pytest.raises(ValueError, match="not a host name"):
        HostCheck(["rp.internal:8080"])


def test_host_check_remembers_at_most_1024_answers_under_a_flood_of_distinct_hosts():
    hc = HostCheck(["rp.internal"])
    for i in range(3000):
        assert not hc.allows(f"x{i}.evil.example")
        assert len(hc._seen) <= 1024
    assert hc.allows("rp.internal") and hc.allows("localhost:1") and not hc.allows("x1.evil.example")


def test_serve_refuses_an_http_host_that_is_not_a_name():
    r = subprocess.run([sys.executable, "-m", "rallypoint", "serve", "--durability", "memory", "--http",
                        "127.0.0.1:0", "--http-host", "http://rp.internal/"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--http-host" in r.stderr and "not a host name" in r.stderr, r.stderr
    helptext = subprocess.run([sys.executable, "-m", "rallypoint", "serve", "--help"], capture_output=True,
                              text=True, timeout=60).stdout
    assert "--http-host NAME" in helptext and "DNS rebinding" in " ".join(helptext.split())


# ========================================================= cross-site writes (issue 41, 6)


@pytest.mark.parametrize("ctype", [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/jsonp", "text/json"])
async def test_a_post_a_browser_may_send_cross_site_is_415_and_creates_no_run(ctype):
    # a text/plain fetch(..., {mode: "no-cors"}), a form, a beacon: no preflight, no key
    async with listeners() as h:
        headers = {"content-type": ctype} if ctype else {}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.port}/v1/spaces/default") as c:
            r = await c.post("/scopes", content=b'{"name": "csrf"}', headers=headers)
            assert r.status_code == 415, r.text
            assert r.json()["error"]["code"] == "VALIDATION_FAILED" and "application/json" in r.text
            r = await c.put("/runs/csrf", content=b"{}", headers=headers)
            assert r.status_code == 415
        assert run_count(h.rs) == 0


async def test_a_json_post_or_one_with_a_bearer_key_is_served_in_open_mode():
    async with listeners() as h:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.port}/v1/spaces/default") as c:
            assert (await c.post("/scopes", json={"name": "a"})).status_code == 200
            r = await c.post("/scopes", content=b"{}", headers={"content-type": "application/json; charset=utf-8"})
            assert r.status_code == 200
            r = await c.post("/scopes", content=b"{}", headers={"content-type": "application/merge-patch+json"})
            assert r.status_code == 200
            # the 0.2 SDK's bodyless POSTs: no content-type, but always its bearer
            run = (await c.post("/scopes", json={})).json()["id"]
            r = await c.post(f"/scopes/{run}/cancel", headers={"authorization": "Bearer open-mode"})
            assert r.status_code == 200, r.text
            # a GET needs neither
            assert (await c.get(f"/scopes/{run}")).status_code == 200
        assert run_count(h.rs) == 4


# ================================================================ methods (issue 41, 10)


async def test_a_wrong_method_on_a_known_path_is_405_with_allow():
    async with listeners() as h:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.port}/v1/spaces/default") as c:
            r = await c.delete("/scopes/sc_x")
            assert r.status_code == 405 and r.headers["allow"] == "GET"
            assert r.json()["error"]["details"]["allowed"] == ["GET"]
            r = await c.get("/scopes/sc_x/cancel")
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            assert (await c.get("/nope/at/all")).status_code == 404


# ============================================================= WebSocket (issue 41, 10)

WS = ("sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\nupgrade: websocket\r\n"
      "connection: Upgrade\r\n")


async def test_a_websocket_upgrade_is_400_not_500_on_the_api_and_the_console():
    async with listeners() as h:
        for port, target in ((h.port, "/v1/spaces/default/watch"), (h.cport, "/stream")):
            status, headers, body = one_answer(await exchange(port, get(target, extra=WS)))
            assert status == 400, body
            assert "WebSocket" in json.loads(body)["error"]["message"]
        assert h.api.listener.guard.refused["websocket"] == 1


# ========================================================== logs (issue 41, 5)


def _lines(caplog, level=logging.DEBUG):
    return [r for r in caplog.records if r.levelno >= level and r.name.startswith("rallypoint")]


async def test_percent_ff_in_the_space_is_400_and_logged_once_a_window_with_a_count(caplog):
    caplog.set_level(logging.DEBUG, logger="rallypoint")
    async with listeners() as h:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.port}") as c:
            for path in ["/v1/spaces/%ff/x"] * 50 + ["/v1/spaces/default/scopes/%ff%fe"] * 10:
                r = await c.get(path)
                assert r.status_code == 400 and r.json()["error"]["code"] == "VALIDATION_FAILED", r.text
        assert not [r for r in _lines(caplog, logging.ERROR)], [r.getMessage() for r in _lines(caplog)]
        h.api.flush_logs()
    refused = [r.getMessage() for r in _lines(caplog) if r.getMessage().startswith("HTTP: refused")]
    assert len(refused) == 1 and "not UTF-8" in refused[0], refused
    summary = [r.getMessage() for r in _lines(caplog) if "similar events suppressed" in r.getMessage()]
    assert summary == [s for s in summary if s.startswith("http-bad-path: 59 similar")] and summary, summary
    assert not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize("name", ["x%00.js", "..%2Fapp.py", ".hidden.js", "x%0a.js", "%ff.js", "a%5cb.css"])
async def test_a_console_static_name_with_a_nul_a_dot_or_a_control_is_404_without_a_traceback(name, caplog):
    caplog.set_level(logging.DEBUG, logger="rallypoint")
    async with listeners() as h:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.cport}") as c:
            for _ in range(20):
                r = await c.get(f"/static/{name}")
                assert r.status_code in (400, 404), r.text
            assert (await c.get("/static/console.js")).status_code == 200
            assert (await c.get("/runs/%ff")).status_code == 400
    assert not [r for r in _lines(caplog, logging.ERROR)], [r.getMessage() for r in _lines(caplog)]


def test_the_text_format_escapes_control_characters_in_the_message_and_keeps_the_traceback():
    fmt = TextFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys as _sys

        exc = _sys.exc_info()
    rec = logging.LogRecord("rallypoint.http", logging.INFO, __file__, 1, "refused %s",
                            ("/x\n2026-01-01 ERROR forged\x1b[2J\u202egpj.exe",), exc)
    out = fmt.format(rec)
    first = out.split("\n", 1)[0]
    assert first == "INFO refused /x\\x0a2026-01-01 ERROR forged\\x1b[2J\\u202egpj.exe", first
    assert "Traceback (most recent call last)" in out and out.rstrip().endswith("ValueError: boom")
    assert printable(b"a\x85b" * 100, 5) == "a\\x85ba\\x85...(+295)"


async def test_a_c1_control_in_host_or_target_is_escaped_in_the_refusal_line(caplog):
    caplog.set_level(logging.DEBUG, logger="rallypoint")
    async with listeners() as h:
        one_answer(await exchange(h.port, get("/x", host="evil\x85forged\x9b31m")))
        one_answer(await exchange(h.port, get("@127.0.0.1:9/%0a2026%20ERROR%20forged")))
    lines = [TextFormatter("%(message)s").format(r) for r in _lines(caplog) if "refused" in r.getMessage()]
    assert len(lines) == 2 and all("\n" not in ln for ln in lines), lines
    assert "evil\\x85forged\\x9b31m" in lines[0], lines


async def test_a_body_sent_on_after_an_early_answer_logs_no_error(caplog):
    # the answer (404, 415, 421) comes before the body is read; the client keeps sending
    caplog.set_level(logging.DEBUG, logger="rallypoint")
    async with listeners() as h:
        for head in (b"POST /v1/spaces/default/nope HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n",
                     b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: 127.0.0.1\r\n",
                     b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: evil.example\r\n"):
            s = await trio.open_tcp_stream("127.0.0.1", h.port)
            await s.send_all(head + b"content-length: 900000\r\n\r\n")
            with trio.move_on_after(1.0):
                try:
                    while True:
                        await s.send_all(b"x" * 16384)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await s.aclose()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.port}") as c:  # still serving
            assert (await c.get("/v1/spaces/default/scopes/sc_x")).status_code == 404
        assert h.api.listener.statistics()["connection_errors"] == 0
    assert not _lines(caplog, logging.WARNING), [r.getMessage() for r in _lines(caplog, logging.WARNING)]


async def test_h2_data_after_an_early_answer_ends_neither_the_connection_nor_the_daemon(tmp_path, caplog):
    # hypercorn's h2 protocol raised KeyError on DATA for a stream it had answered; the
    # error left the connection's task group and the listener's nursery: the whole daemon
    # stopped (found reproducing the early-401 report over TLS)
    import h2.config
    import h2.connection
    import h2.events
    import trustme

    caplog.set_level(logging.DEBUG, logger="rallypoint")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert.configure_cert(server_ctx)
    server_ctx.set_alpn_protocols(["h2", "http/1.1"])
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    client_ctx.set_alpn_protocols(["h2"])
    async with listeners(ssl_context=server_ctx) as h:
        stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", h.port, ssl_context=client_ctx,
                                                     https_compatible=True)
        await stream.do_handshake()
        assert stream.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        hdrs = [(":method", "POST"), (":scheme", "https"), (":authority", "127.0.0.1"),
                (":path", "/v1/spaces/default/nope"), ("content-type", "application/json")]
        conn.send_headers(1, hdrs)
        conn.send_data(1, b"x" * 1000)
        await stream.send_all(conn.data_to_send())
        status = None
        with trio.fail_after(10):
            while status is None:
                for ev in conn.receive_data(await stream.receive_some(65536)):
                    if isinstance(ev, h2.events.ResponseReceived):
                        status = dict(ev.headers)[b":status"]
        assert status == b"404"
        for _ in range(20):  # more body on the answered stream
            try:
                conn.send_data(1, b"y" * 1000)
            except Exception:  # (the stream reset by the server: h2 refuses to send more)
                break
            await stream.send_all(conn.data_to_send())
        # a second request on the same connection is answered
        conn.send_headers(3, [(":method", "GET"), (":scheme", "https"), (":authority", "127.0.0.1"),
                              (":path", "/v1/spaces/default/scopes/sc_x")], end_stream=True)
        await stream.send_all(conn.data_to_send())
        second = None
        with trio.fail_after(10):
            while second is None:
                data = await stream.receive_some(65536)
                assert data, "the connection was closed"
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == 3:
                        second = dict(ev.headers)[b":status"]
                await stream.send_all(conn.data_to_send())
        assert second == b"404"
        await stream.aclose()
        assert h.api.listener.statistics()["connection_errors"] == 0
    assert not _lines(caplog, logging.WARNING), [r.getMessage() for r in _lines(caplog, logging.WARNING)]


# =============================================================== the console's next (10)


@pytest.mark.parametrize("nxt", ["/\t/evil.example", "/\n/evil.example", "/\\evil.example", "//evil.example",
                                 "/ /evil.example", "https://evil.example/", "/\u3000/evil.example", "\t//evil.example",
                                 "/login?next=//evil.example", "javascript:alert(1)", "/%0d%0a/x\r\nset-cookie: a=b"])
async def test_a_login_next_that_may_leave_the_origin_is_replaced_by_runs(nxt):
    assert _safe_next(nxt) == "/runs"
    async with listeners() as h:  # open mode: the login redirects at once, to next
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.cport}") as c:
            r = await c.post("/login", data={"next": nxt, "key": ""})
            assert r.status_code == 303 and r.headers["location"] == "/runs", r.headers


def test_a_login_next_of_this_console_is_kept():
    for nxt in ("/runs", "/runs/sc_1?part=tree", "/queues/a%2Fb", "/runs/%E5%90%8D", "/live?types=a,b"):
        assert _safe_next(nxt) == nxt


# ========================================================= a real daemon (issue 41, 5, 6)


class _Daemon:
    """``rallypoint serve --http 127.0.0.1:0 --console 127.0.0.1:0 --durability memory``
    (open mode) with ``extra`` flags; ``lines``: its stderr, as it comes."""

    def __init__(self, *extra: str) -> None:
        import threading

        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
             "--console", "127.0.0.1:0", "--durability", "memory", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
        self._drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._drain.start()
        for line in self.proc.stdout:
            if line.startswith("HTTP "):
                self.http = int(line.split()[1].rsplit(":", 1)[1])
            elif line.startswith("CONSOLE "):
                self.console = int(line.split()[1].rsplit(":", 1)[1])
                return
        raise RuntimeError("the daemon did not start: " + "".join(self.lines))

    def stop(self) -> int:
        self.proc.terminate()
        rc = self.proc.wait(60)
        self._drain.join(5)
        return rc


def _send(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return got


def test_a_flood_of_malformed_requests_is_a_few_escaped_lines_a_window_and_no_traceback():
    # before: GET /v1/spaces/%ff/x was a 500 and a 12-line ERROR traceback each time
    # (~500 KB/s of log from one client); /static/x%00.js the same; a %0a forged lines
    import re

    d = _Daemon("--log-level", "DEBUG")
    try:
        floods = [
            (d.http, b"GET /v1/spaces/%ff/x HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n", 400),
            (d.console, b"GET /static/x%00.js HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n", 404),
            (d.console, b"GET /runs/%ff%0a2026-01-01%20ERROR%20forged HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                        b"connection: close\r\n\r\n", 400),
            (d.http, b"GET @127.0.0.1:9/%0a2026-01-01%20ERROR%20forged HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n", 400),
            (d.http, b"GET /v1/spaces/default/scopes/x HTTP/1.1\r\nhost: evil\x85\x9b2J.example\r\n\r\n", 421),
            (d.http, b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: text/plain\r\n"
                     b"connection: close\r\ncontent-length: 2\r\n\r\n{}", 415),
        ]
        before = sum(len(ln) for ln in d.lines)
        for port, req, status in floods:
            for _ in range(60):
                got = _send(port, req)
                assert got.startswith(b"HTTP/1.1 %d" % status), got[:200]
    finally:
        assert d.stop() == 0, "".join(d.lines)
    logged = "".join(d.lines)
    assert "Traceback" not in logged and " ERROR " not in logged.replace("%20ERROR%20", ""), logged[-3000:]
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")
    assert all(stamp.match(ln) for ln in d.lines), [ln for ln in d.lines if not stamp.match(ln)]
    refusals = [ln for ln in d.lines if "refused" in ln or "similar events suppressed" in ln]
    assert len(refusals) <= 2 * len(floods), refusals  # a line and a count per kind
    assert sum(len(ln) for ln in d.lines) - before < 8000, logged[-3000:]
    assert "evil\\x85\\x9b2J.example" in logged


def test_a_page_of_another_site_creates_no_run_and_a_rebound_name_reads_nothing(tmp_path):
    # issue 41, item 6, in a real browser: a page of evil.example POSTs with no-cors fetch,
    # a beacon and a text/plain form (no preflight for any of them); then evil.example
    # "rebinds" to this host (Chromium's --host-resolver-rules) and the page reads the API
    # and the console under its own name
    import http.server
    import threading

    from _browser import CHROMIUM_ARGS, require_browser

    path = require_browser()
    from playwright.sync_api import sync_playwright

    d = _Daemon()
    page_html = b""
    try:
        api = f"http://127.0.0.1:{d.http}/v1/spaces/default"
        page_html = f"""<!doctype html><html><body>
<iframe name="sink"></iframe>
<form id="f" method="post" enctype="text/plain" action="{api}/scopes" target="sink">
<input name='{{"name": "csrf-form", "x": "' value='"}}'></form>
<script>
fetch("{api}/scopes", {{method: "POST", mode: "no-cors", body: '{{"name": "csrf-fetch"}}'}});
fetch("{api}/runs/csrf-put", {{method: "PUT", mode: "no-cors", body: "{{}}",
      headers: {{"content-type": "application/json"}}}});
navigator.sendBeacon("{api}/scopes", '{{"name": "csrf-beacon"}}');
document.getElementById("f").submit();
</script></body></html>""".encode()

        class Evil(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", str(len(page_html)))
                self.end_headers()
                self.wfile.write(page_html)

            def log_message(self, *a):
                pass

        evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
        threading.Thread(target=evil.serve_forever, daemon=True).start()
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=path,
                    args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP evil.example 127.0.0.1"])
                try:
                    page = browser.new_page()
                    page.goto(f"http://evil.example:{evil.server_address[1]}/")
                    # the three POSTs and the PUT reached the daemon, and were refused
                    deadline = time.monotonic() + 30
                    while not _refused_writes(d):
                        assert time.monotonic() < deadline, "".join(d.lines)
                        time.sleep(0.05)
                    page.wait_for_timeout(500)
                    # DNS rebinding: the API and the console under the attacker's name
                    for url in (f"http://evil.example:{d.http}/v1/spaces/default/ops/waits",
                                f"http://evil.example:{d.console}/runs"):
                        r = page.goto(url)
                        assert r.status == 421, (url, r.status)
                        assert "csrf" not in page.content()
                finally:
                    browser.close()
        finally:
            evil.shutdown()
        with httpx.Client(base_url=api) as c:  # the daemon's own view: none of those runs
            assert c.post("/scopes", json={"name": "legit"}).status_code == 200
            html = httpx.get(f"http://127.0.0.1:{d.console}/runs").text
            assert "legit" in html and "csrf" not in html, html
    finally:
        assert d.stop() == 0, "".join(d.lines)
    assert any("http-not-json" in ln for ln in d.lines) or any("refused POST" in ln for ln in d.lines), d.lines


def _refused_writes(d) -> list[str]:
    return [ln for ln in d.lines if "refused POST" in ln or "refused PUT" in ln]
