"""The client's liveness watch (Connection.watch_liveness): a server that stops answering
behind a live TCP connection (SIGSTOP, a VM pause) is left like a dropped one, while a
server that parks a request (a server-side wait) but answers pings is not."""

from __future__ import annotations

import msgspec
import pytest
import trio

from rallypoint import protocol as p
from rallypoint import wire
from rallypoint.errors import UnavailableError
from rallypoint.transport.connection import Connection
from rallypoint.transport.framing import FrameParser, encode_frame

_dec = msgspec.msgpack.Decoder(wire.ClientFrame)
_enc = msgspec.msgpack.Encoder()


async def fake_server(pongs: bool, *, task_status=trio.TASK_STATUS_IGNORED):
    """Answers the handshake, then never answers a request; answers pings if ``pongs``."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream):
        parser = FrameParser()
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            for f in parser.feed(data):
                msg = _dec.decode(f)
                if isinstance(msg, wire.Hello):
                    await stream.send_all(encode_frame(_enc.encode(wire.HelloOk(version=1, server_version="t"))))
                elif isinstance(msg, wire.Ping) and pongs:
                    await stream.send_all(encode_frame(_enc.encode(wire.Pong(msg.nonce))))

    async with trio.open_nursery() as n:
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(handle, listeners, handler_nursery=n)


async def test_a_server_that_sends_nothing_while_a_call_waits_is_left():
    async with trio.open_nursery() as n:
        port = await n.start(fake_server, False)
        conn = await Connection.open(f"tcp://127.0.0.1:{port}")
        conn.watch_liveness(0.6)
        async with conn:
            with trio.fail_after(20):
                with pytest.raises(UnavailableError) as e:
                    await conn.call(p.ServerStatus())
            assert "stopped answering" in conn.close_reason
            assert e.value is not None
        n.cancel_scope.cancel()


async def test_a_server_that_parks_a_request_but_answers_pings_is_kept():
    async with trio.open_nursery() as n:
        port = await n.start(fake_server, True)
        conn = await Connection.open(f"tcp://127.0.0.1:{port}")
        conn.watch_liveness(0.6)
        async with conn:
            with trio.move_on_after(2.0) as waited:  # four times the limit: pings keep it
                await conn.call(p.ServerStatus())
            assert waited.cancelled_caught and not conn.closed
        n.cancel_scope.cancel()


async def test_without_a_watch_a_silent_server_is_waited_for():
    async with trio.open_nursery() as n:
        port = await n.start(fake_server, False)
        conn = await Connection.open(f"tcp://127.0.0.1:{port}")
        async with conn:
            with trio.move_on_after(1.0) as waited:
                await conn.call(p.ServerStatus())
            assert waited.cancelled_caught and not conn.closed
        n.cancel_scope.cancel()


async def test_one_address_through_a_silently_dead_link_returns_within_a_bound_and_redials(daemon, monkeypatch):
    # issue 42, item 2: a client with ONE tcp:// address through a proxy that stops
    # forwarding both ways but keeps both sockets open (a dropped NAT entry):
    # task.result(timeout=3), receive(wait=3) and delivery.renew() did not return in 20 s
    import rallypoint
    from rallypoint.client import reconnect
    from rallypoint.testing.proxy import Proxy

    monkeypatch.setattr(rallypoint, "LIVENESS_S", 1.0)
    monkeypatch.setattr(reconnect, "CALL_GRACE_S", 3.0)
    host, port = daemon.url.removeprefix("tcp://").rsplit(":", 1)
    async with trio.open_nursery() as n:
        proxy = Proxy(host, int(port))
        pport = await n.start(proxy.run)
        async with rallypoint.connect(f"tcp://127.0.0.1:{pport}", reconnect=rallypoint.Reconnect(timeout=60),
                                      connect_timeout=2) as rs:
            run = await rs.scopes.create(name="dead-link")
            jobs = await rs.mailboxes.ensure("dead-link")
            ticket = await jobs.submit({"n": 1}, scope=run)
            d = await jobs.receive(run, lease_seconds=60, wait=1)
            proxy.set_mode("hold")
            for call in (lambda: rs.task(ticket.id).result(timeout=3), lambda: jobs.receive(run, wait=3),
                         lambda: d.renew()):
                t0 = trio.current_time()
                with trio.fail_after(15):  # its own timeout (<= 3 s) + the grace (3 s) + slack
                    with pytest.raises((UnavailableError, rallypoint.WaitTimeout)):
                        await call()
                assert trio.current_time() - t0 <= 3 + 3 + 2
            proxy.set_mode("pass")  # the link is back: the client re-dialled and goes on
            with trio.fail_after(30):
                while True:
                    try:
                        await d.renew()
                        break
                    except UnavailableError:
                        await trio.sleep(0.2)
            await d.complete({"ok": True})
            assert (await rs.task(ticket.id).result(timeout=10)).state == "SUCCEEDED"
        n.cancel_scope.cancel()


async def test_the_server_hands_no_delivery_to_a_parked_receive_of_a_peer_gone_silent(daemon, monkeypatch):
    # issue 42, item 2 (server side): with --idle-ping 30 a dead peer was dropped after
    # about 90 s, and a task submitted meanwhile was leased to its parked receive for a
    # whole lease, while a live worker's receive got nothing
    import rallypoint
    from rallypoint.testing.proxy import Proxy
    from rallypoint.transport.server import GONE_AFTER_S

    monkeypatch.setattr(rallypoint, "LIVENESS_S", 1.0)  # the dead one pings within 0.5 s, then goes silent
    host, port = daemon.url.removeprefix("tcp://").rsplit(":", 1)
    async with trio.open_nursery() as n:
        proxy = Proxy(host, int(port))
        pport = await n.start(proxy.run)
        async with rallypoint.connect(daemon.url) as live, \
                rallypoint.connect(f"tcp://127.0.0.1:{pport}", reconnect=False) as doomed:
            run = await live.scopes.create(name="gone-peer")
            jobs = await live.mailboxes.ensure("gone-peer")
            d_jobs = await doomed.mailboxes.ensure("gone-peer")
            got: dict = {}

            async def receive(name, q, wait):
                try:
                    got[name] = await q.receive(run, wait=wait, lease_seconds=300, holder=name)
                except rallypoint.RallypointError as e:
                    got[name] = e

            n.start_soon(receive, "doomed", d_jobs, 60)  # parked first: first in line
            await trio.sleep(1.5)  # it pinged while its receive waited (LIVENESS_S / 2 of server silence)
            proxy.set_mode("hold")  # then nothing more from it (nor its close): its socket stays open
            silent_from = trio.current_time()
            n.start_soon(receive, "live", jobs, 60)
            await trio.sleep_until(silent_from + GONE_AFTER_S + 1)  # the scenario: gone longer than the bound
            ticket = await jobs.submit({"n": 1}, scope=run)
            with trio.fail_after(10):
                while "live" not in got:
                    await trio.sleep(0.02)
            assert got["live"] is not None and got["live"].task_id == ticket.id
            assert (await live.task(ticket.id).status()).holder == "live"
        n.cancel_scope.cancel()
