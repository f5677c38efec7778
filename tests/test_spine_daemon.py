"""End to end over TCP against a real ``rallypoint serve`` subprocess: handshake,
version mismatch, the CLI (``status``, ``runs ls|show|cancel``), draining on SIGTERM
and SIGINT, ``--durability memory``, and a daemon killed under a pending call."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import trio

import rallypoint
from rallypoint import wire
from rallypoint._version import __version__
from rallypoint.errors import UnavailableError, ValidationError
from rallypoint.transport.connection import Connection

from conftest import Daemon, parked_waits, until, wait_parked_remote


def cli(*args: str, timeout: float = 30.0, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rallypoint", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


@pytest.fixture(scope="module")
def fresh():
    """A daemon of this module's own (exact counts in `status`)."""
    d = Daemon(None, "memory").start()
    yield d
    assert d.stop() == 0


# --- handshake ----------------------------------------------------------------------


async def test_handshake(daemon):
    conn = await Connection.open(daemon.url, client_name="spine-test")
    async with conn:
        assert conn.server_info.version == wire.PROTOCOL_VERSION
        assert conn.server_info.server_version == __version__
        assert conn.server_info.space == "default"


async def test_protocol_version_mismatch_names_both_versions(daemon, monkeypatch):
    monkeypatch.setattr(wire, "PROTOCOL_VERSION", wire.PROTOCOL_VERSION + 41)
    with pytest.raises(ValidationError) as ei:
        async with rallypoint.connect(daemon.url):
            pass
    msg = ei.value.message
    assert "version" in msg
    assert str(wire.PROTOCOL_VERSION) in msg and str(wire.PROTOCOL_VERSION - 41) in msg
    monkeypatch.undo()
    async with rallypoint.connect(daemon.url) as rs:  # the daemon is fine
        await rs.status()


async def test_connect_to_nothing_is_unavailable():
    with trio.fail_after(10):
        with pytest.raises(UnavailableError) as ei:
            async with rallypoint.connect("tcp://127.0.0.1:1", connect_timeout=3):
                pass
    assert "tcp://127.0.0.1:1" in ei.value.message


# --- CLI ----------------------------------------------------------------------------


async def test_cli_status(fresh):
    async with rallypoint.connect(fresh.url) as rs:
        a = await rs.scopes.create(name="a")
        await rs.scopes.create(name="b")
        await a.child()
        await a.cancel()
        b2 = await rs.scopes.create(name="c")
        await b2.complete()
        r = await trio.to_thread.run_sync(lambda: cli("status", "--connect", fresh.url))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"version     {__version__} (protocol {wire.PROTOCOL_VERSION})" in out
    assert re.search(r"^uptime\s+\d{2}:\d{2}:\d{2}$", out, re.M), out
    m = re.search(r"^connections (\d+)$", out, re.M)
    assert m and int(m.group(1)) >= 1, out  # at least the CLI's own
    assert re.search(r"^runs\s+ACTIVE 2  CANCELLED 1  COMPLETED 1$", out, re.M), out
    assert "durability  memory" in out
    assert not re.search(r"^fsync ", out, re.M), out  # no journal file: no fsync line
    # the actor runtime: actors active/passive (per kind) and the nursery tree's depth
    m = re.search(r"^actors\s+(\d+) active, (\d+) passive, \d+ waiters parked; nursery tree depth (\d+)$", out, re.M)
    assert m, out
    assert int(m.group(1)) >= 1 and int(m.group(1)) + int(m.group(2)) >= 4 and int(m.group(3)) >= 1, out
    assert re.search(r"^  runs\s+\d+ active  \d+ passive", out, re.M), out
    r = await trio.to_thread.run_sync(lambda: cli("status", "--connect", fresh.url, "--json"))
    st = json.loads(r.stdout)
    assert st["runs"] == {"ACTIVE": 2, "CANCELLED": 1, "COMPLETED": 1}
    assert st["version"] == __version__ and st["uptime_s"] >= 0
    assert st["actors"]["runs"]["active"] + st["actors"]["runs"]["passive"] == 4 and st["tree_depth"] >= 1


async def test_cli_runs_ls_show_cancel(fresh):
    async with rallypoint.connect(fresh.url) as rs:
        run = await rs.scopes.create(name="cli-run")
        child = await run.child(name="cli-child")

        r = await trio.to_thread.run_sync(lambda: cli("runs", "--connect", fresh.url, "ls"))
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stdout.splitlines() if run.id in ln)
        assert line.split()[1:4] == ["ACTIVE", "ACTIVE", "1"] and line.endswith("cli-run")
        assert child.id not in r.stdout  # roots only by default

        r = await trio.to_thread.run_sync(lambda: cli("runs", "--connect", fresh.url, "ls", "--parent", run.id, "--json"))
        assert [x["id"] for x in json.loads(r.stdout)] == [child.id]

        r = await trio.to_thread.run_sync(lambda: cli("runs", "--connect", fresh.url, "show", run.id, "--json"))
        assert r.returncode == 0, r.stderr
        shown = json.loads(r.stdout)
        assert (shown["id"], shown["name"], shown["children"]) == (run.id, "cli-run", 1)

        r = await trio.to_thread.run_sync(
            lambda: cli("runs", "--connect", fresh.url, "cancel", run.id, "--reason", "operator")
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"{run.id} CANCELLED (INACTIVE)"
        st = await child.status()
        assert (st.effective, st.inactive_reason) == ("INACTIVE", "ancestor_cancelled")

        r = await trio.to_thread.run_sync(lambda: cli("runs", "--connect", fresh.url, "ls", "--state", "CANCELLED"))
        assert run.id in r.stdout

        r = await trio.to_thread.run_sync(lambda: cli("runs", "--connect", fresh.url, "show", "scp_nope"))
        assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "Traceback" not in r.stderr


def test_cli_against_no_server_is_a_clear_error():
    r = cli("status", "--connect", "tcp://127.0.0.1:1")
    assert r.returncode == 1
    assert "UNAVAILABLE" in r.stderr and "Traceback" not in r.stderr


# --- serve --durability memory --------------------------------------------------------


async def test_serve_memory_writes_no_files(tmp_path):
    d = Daemon(None, "memory")
    old = os.getcwd()
    os.chdir(tmp_path)  # the default --data-dir is ./rallypoint-data
    try:
        d.start()
    finally:
        os.chdir(old)
    try:
        async with rallypoint.connect(d.url) as rs:
            run = await rs.scopes.create(name="m")
            assert (await rs.status()).durability == "memory"
            assert (await run.status()).name == "m"
    finally:
        assert d.stop() == 0
    assert list(tmp_path.iterdir()) == []
    assert "durability memory" in d.stderr()


# --- drain ----------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_signal_drains_answers_inflight_and_exits_0(sig, tmp_path):
    durability = "fsync" if sig == signal.SIGTERM else "memory"
    d = Daemon(str(tmp_path / "data") if durability == "fsync" else None, durability).start()
    outcomes = {}
    try:
        # reconnect=False: this is about the server's drain, seen by a client that does
        # not reconnect (tests/test_reconnect_daemon.py covers the reconnecting client).
        async with rallypoint.connect(d.url, reconnect=False) as rs:
            run = await rs.scopes.create(name="drained")
            mbx = await rs.mailboxes.ensure("spine-drain")
            ticket = await mbx.submit({"n": 1}, scope=run)
            empty = await rs.mailboxes.ensure("spine-drain-empty")

            async def long_wait():
                try:
                    outcomes["long"] = (await ticket.result(timeout=30)).state
                except UnavailableError as e:
                    outcomes["long"] = e
                outcomes["long_at"] = time.monotonic()

            async def short_wait():
                # a server-side wait that ends on its own during the drain: answered
                outcomes["short"] = await empty.receive(run, wait=0.4)

            async def both_sent() -> bool:  # the long wait parked; the short one too, or over
                k = await parked_waits(rs)
                return k >= 2 or (k >= 1 and "short" in outcomes)

            with trio.fail_after(30):
                async with trio.open_nursery() as n:
                    n.start_soon(long_wait)
                    n.start_soon(short_wait)
                    await until(both_sent)
                    t0 = time.monotonic()
                    d.proc.send_signal(sig)
            # the drain does not sit on the 30 s wait: it is answered UNAVAILABLE
            assert isinstance(outcomes["long"], UnavailableError), outcomes
            assert outcomes["long_at"] - t0 < 5
            assert outcomes["short"] is None  # answered normally (no work)
            with pytest.raises(UnavailableError):
                await run.status()
        rc = await trio.to_thread.run_sync(lambda: d.proc.wait(15))
        took = time.monotonic() - t0
    finally:
        d.kill()
    err = d.stderr()
    assert rc == 0, err
    assert took < 8, took
    assert "Traceback" not in err, err
    assert "draining" in err and "stopped cleanly" in err
    if durability == "fsync":  # drained state is durable and recovers
        d2 = Daemon(str(tmp_path / "data"), "fsync").start()
        try:
            async with rallypoint.connect(d2.url) as rs:
                st = await rs.scope(run.id).status()
                assert st.name == "drained" and st.tasks == {"QUEUED": 1}
        finally:
            assert d2.stop() == 0


async def test_transport_drain_ends_long_waits_after_the_grace_only():
    # Server level: with a 30 s drain timeout, a 30 s wait is answered UNAVAILABLE after
    # drain_wait_grace, while a wait that ends within the grace is answered normally.
    from rallypoint.transport.testing import RawClient, running_server

    async with running_server(drain_wait_grace=0.5) as srv:
        c = await RawClient.connect(srv.port)
        await c.request(1, {"op": "sleep", "s": 30})
        await c.request(2, {"op": "sleep", "s": 0.2, "v": "short"})
        await until(lambda: srv.statistics()["requests"] == 2)  # the server has both
        t0 = trio.current_time()
        frames = await c.drain_server(srv, 30.0)
        took = trio.current_time() - t0
    assert sorted((f.id, type(f).__name__, getattr(f, "code", None)) for f in frames) == [
        (1, "Err", "UNAVAILABLE"),
        (2, "Ok", None),
    ]
    assert 0.4 < took < 3, took


async def test_drain_refuses_new_connections(tmp_path):
    d = Daemon(None, "memory").start()
    try:
        async with rallypoint.connect(d.url, reconnect=False) as rs:  # else it would retry for 60 s
            await rs.status()
            d.proc.send_signal(signal.SIGTERM)
            rc = await trio.to_thread.run_sync(lambda: d.proc.wait(15))
            assert rc == 0
            with pytest.raises(UnavailableError):
                await rs.status()
        with pytest.raises(UnavailableError):
            async with rallypoint.connect(d.url, connect_timeout=2):
                pass
    finally:
        d.kill()


# --- a daemon that dies under a pending call ------------------------------------------


@pytest.mark.parametrize("reconnect", [False, rallypoint.Reconnect(timeout=0.5)], ids=["no-reconnect", "gives-up"])
async def test_killed_daemon_fails_pending_long_wait_with_unavailable(reconnect):
    # Without reconnection at once; with it, once the reconnect timeout ran out.
    d = Daemon(None, "memory").start()
    try:
        async with rallypoint.connect(d.url, reconnect=reconnect) as rs:
            run = await rs.scopes.create()
            mbx = await rs.mailboxes.ensure("spine-kill")
            ticket = await mbx.submit(1, scope=run)
            empty = await rs.mailboxes.ensure("spine-kill-empty")
            got = {}

            async def waiter(name, fn):
                try:
                    await fn()
                    got[name] = "returned"
                except UnavailableError as e:
                    got[name] = e

            async with trio.open_nursery() as n:
                n.start_soon(waiter, "result", lambda: ticket.result(timeout=30))
                n.start_soon(waiter, "receive", lambda: empty.receive(run, wait=30))
                await wait_parked_remote(rs, 2)  # both parked on the server
                d.proc.kill()
                with trio.fail_after(10):  # both fail soon, not after their 30 s
                    await until(lambda: len(got) == 2)
            assert isinstance(got["result"], UnavailableError), got
            assert got.keys() == {"result", "receive"}
            assert all(isinstance(v, UnavailableError) for v in got.values()), got
            with pytest.raises(UnavailableError):  # later calls too, at once
                with trio.fail_after(2):
                    await run.status()
    finally:
        d.kill()
