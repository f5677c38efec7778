"""The command line as an operator meets it: options in either position, keys with
status/runs, and one clear line (never a traceback) for the usual mistakes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import rallypoint
from rallypoint.errors import ValidationError

from conftest import Daemon


def rp(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rallypoint", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_client_options_before_or_after_the_subcommand(daemon):
    a = rp("runs", "ls", "--connect", daemon.url, "--all")
    b = rp("runs", "--connect", daemon.url, "ls", "--all")
    assert a.returncode == b.returncode == 0 and a.stdout.startswith("ID")
    assert json.loads(rp("status", "--json", "--connect", daemon.url).stdout)["version"] == rallypoint.__version__


def test_status_and_runs_take_an_api_key(tmp_path):
    data = str(tmp_path)
    created = rp("keys", "--data-dir", data, "create", "--space", "ops", "--permission", "coordination_read")
    secret = created.stdout.split("secret: ")[1].strip()
    listed = json.loads(rp("keys", "list", "--data-dir", data, "--json").stdout)
    assert isinstance(listed, list) and listed[0]["space"] == "ops" and "secret" not in listed[0]
    d = Daemon(data, "fsync").start()
    try:
        refused = rp("status", "--connect", d.url)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and "Traceback" not in refused.stderr
        ok = rp("status", "--connect", d.url, "--api-key", secret)
        assert ok.returncode == 0 and "runs" in ok.stdout
        assert rp("runs", "ls", "--connect", d.url, "--api-key", secret).returncode == 0
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("args, needle", [
    (["serve", "--listen", "127.0.0.1:99999"], "port 0-65535"),
    (["serve", "--listen", "127.0.0.1:0", "--durability", "memory", "--tls-cert", "/nonexistent",
      "--tls-key", "/nonexistent"], "no such file /nonexistent"),
    (["serve", "--interval-ms", "-1"], "--interval-ms"),
    # a negative value is the option's own error, not argparse's "expected one argument"
    (["serve", "--retain-finished", "-5s"], "--retain-finished must be a duration like"),
    (["serve", "--retain-events", "-3"], "--retain-events must be a count"),
    (["repair", "--data-dir", "/nonexistent/dir"], "not a rallypoint data dir"),
    (["keys", "--data-dir", "/nonexistent/dir", "list"], "not a rallypoint data dir"),
    (["status", "--connect", "tcp://127.0.0.1:99999"], "port 0-65535"),
    (["serve", "--listen", "tls://127.0.0.1:0"], "TLS is --tls-cert/--tls-key"),
    (["serve", "--listen", "unix:///tmp/rp.sock"], "--listen takes HOST:PORT or tcp://HOST:PORT"),
    (["serve", "--listen", "http://127.0.0.1:0"], "--listen takes HOST:PORT or tcp://HOST:PORT"),
    (["serve", "--listen", "127.0.0.1:\u00b2"], "--listen takes HOST:PORT with a port 0-65535"),
    (["serve", "--listen", "127.0.0.1:0", "--metrics", "http://127.0.0.1:9411/metrics"], "--metrics takes an address"),
    (["serve", "--listen", "127.0.0.1:0", "--http", "tcp://127.0.0.1:0"], "--http takes HOST:PORT or http://HOST:PORT"),
])
def test_usual_mistakes_get_one_line_and_exit_2_or_1(args, needle):
    r = rp(*args)
    assert r.returncode in (1, 2), r
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_address_in_use_is_one_line(daemon):
    port = daemon.url.rsplit(":", 1)[1]
    r = rp("serve", "--listen", f"127.0.0.1:{port}", "--durability", "memory")
    assert r.returncode == 2 and "already in use" in r.stderr and "Traceback" not in r.stderr


def test_a_listen_address_may_be_written_as_a_client_url(daemon):
    """``--listen tcp://HOST:PORT`` (the form ``--connect`` and RALLYPOINT_URL take) is
    the address HOST:PORT; it said "cannot start: [Errno -2] Name or service not known"
    (and, without --insecure, called 127.0.0.1 a public address)."""
    from rallypoint.cli import _parse_listen

    assert _parse_listen("tcp://127.0.0.1:7411", "--listen") == ("127.0.0.1", 7411)
    assert _parse_listen("http://127.0.0.1:8411/", "--http") == ("127.0.0.1", 8411)
    assert _parse_listen("tcp://127.0.0.1:7411") == ("127.0.0.1", 7411)
    assert _parse_listen("TCP://[::1]:0") == ("::1", 0)
    assert _parse_listen("http://0.0.0.0:8080/") == ("0.0.0.0", 8080)
    assert _parse_listen(":7411") == ("127.0.0.1", 7411)
    port = daemon.url.rsplit(":", 1)[1]
    r = rp("serve", "--listen", f"tcp://127.0.0.1:{port}", "--durability", "memory")
    assert r.returncode == 2 and "already in use" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_ipv6_listen_address_is_printed_as_a_url(tmp_path):
    """``--listen tcp://[::1]:0``: the READY line is a URL a client can use
    (``tcp://[::1]:PORT``, not ``tcp://::1:PORT``)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    p = subprocess.Popen([sys.executable, "-m", "rallypoint", "serve", "--listen", "tcp://[::1]:0", "--durability",
                          "memory"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("READY tcp://[::1]:"), line + p.stderr.read() if p.poll() is not None else line
        url = line.split()[1]
        st = rp("status", "--connect", url, "--json")
        assert st.returncode == 0, st.stderr
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_address_in_use_is_refused_before_the_data_dir_is_touched(daemon, tmp_path):
    """A second daemon on a taken port does not create (or recover) its data dir first."""
    port = daemon.url.rsplit(":", 1)[1]
    data = tmp_path / "never-made"
    r = rp("serve", "--listen", f"127.0.0.1:{port}", "--data-dir", str(data))
    assert r.returncode == 2 and "already in use" in r.stderr, r.stderr
    assert not data.exists()
    r = rp("serve", "--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{port}", "--data-dir", str(data))
    assert r.returncode == 2 and f"127.0.0.1:{port} (--metrics)" in r.stderr and "already in use" in r.stderr, r.stderr
    assert not data.exists()


def test_sync_helper_with_memory_durability_is_refused():
    # issue 42: `serve --durability memory --sync-helper inline` was accepted silently
    r = rp("serve", "--durability", "memory", "--sync-helper", "inline", "--listen", "127.0.0.1:0")
    assert r.returncode == 2 and "--durability memory has no journal" in r.stderr, r.stderr


def test_a_public_listen_address_without_keys_is_refused_before_the_data_dir_is_made(tmp_path):
    # issue 42: `serve --listen 0.0.0.0` without keys created the data directory before refusing
    data = tmp_path / "new"
    r = rp("serve", "--listen", "0.0.0.0:0", "--data-dir", str(data))
    assert r.returncode == 2 and "without API keys" in r.stderr, r.stderr
    assert not data.exists()


def test_a_data_dir_in_use_is_refused_before_the_second_daemon_binds_its_port(tmp_path):
    # issue 42: a second daemon on a data directory in use accepted TCP connections on
    # its own port for about 1.5 s before it exited "in use by process N"
    import socket

    from _cluster import free_ports

    data = str(tmp_path / "d")
    first = subprocess.Popen([sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--data-dir",
                              data], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().startswith("READY"), first.stderr.read()
        (port,) = free_ports(1)
        second = subprocess.Popen([sys.executable, "-m", "rallypoint", "serve", "--listen", f"127.0.0.1:{port}",
                                   "--data-dir", data], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        accepted = 0
        while second.poll() is None:  # until it exits: its port never takes a connection
            with socket.socket() as c:
                c.settimeout(0.2)
                if c.connect_ex(("127.0.0.1", port)) == 0:
                    accepted += 1
        assert second.returncode == 2 and "is in use by process" in second.stderr.read()
        assert accepted == 0
    finally:
        first.terminate()
        first.wait(timeout=30)


@pytest.fixture
def taken_port():
    """A loopback port another program listens on."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_http_address_in_use_names_the_http_address(taken_port, tmp_path):
    """Issue 31, item 9: ``--http`` on a taken port said "cannot listen on <the --listen
    address>"; it names the HTTP address and flag, before the data dir is touched."""
    data = tmp_path / "never-made"
    r = rp("serve", "--listen", "127.0.0.1:0", "--http", f"127.0.0.1:{taken_port}", "--data-dir", str(data))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot listen on 127.0.0.1:{taken_port} (--http): the address is already in use" in r.stderr, r.stderr
    assert "--listen" not in r.stderr and "127.0.0.1:0" not in r.stderr, r.stderr
    assert not data.exists()


def test_http_bind_failing_in_the_daemon_names_the_http_address(taken_port, monkeypatch, capsys):
    """The same when the early check passed and the listener's own bind fails (another
    program took the port in between): one line naming --http, exit 2."""
    from rallypoint import cli

    monkeypatch.setattr(cli, "_check_listen_free", lambda host, port: None)
    rc = cli.main(["serve", "--listen", "127.0.0.1:0", "--http", f"127.0.0.1:{taken_port}", "--durability", "memory",
                   "--log-level", "ERROR"])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot listen on 127.0.0.1:{taken_port} (--http)" in err and "Traceback" not in err, err


def test_repair_without_an_answer_changes_nothing(tmp_path):
    # a journal with a bad record in the middle; stdin is closed: the prompt reads EOF
    import os

    async def make():
        async with rallypoint.open_embedded(str(tmp_path)) as rs:
            for _ in range(5):
                await rs.scopes.create()

    import trio

    trio.run(make)
    seg = sorted(os.listdir(tmp_path / "journal"))[-1]
    path = tmp_path / "journal" / seg
    raw = bytearray(path.read_bytes())
    if len(raw) > 40:
        raw[30] ^= 0xFF
        path.write_bytes(bytes(raw))
    r = rp("repair", "--data-dir", str(tmp_path))
    assert "Traceback" not in r.stderr
    assert r.returncode in (0, 1)  # intact (the snapshot covered it) or declined


async def test_client_refuses_bad_durations_and_urls(rs):
    run = await rs.scopes.create()
    for bad in (math.inf, 1e300, -1, math.nan):
        with pytest.raises(ValidationError) as ei:
            await run.timers.create(after_seconds=bad)
        assert "after_seconds" in ei.value.message
    with pytest.raises(ValidationError):
        async with rallypoint.connect("tcp://127.0.0.1:99999"):
            pass


async def test_errors_do_not_echo_huge_inputs(rs):
    with pytest.raises(ValidationError) as ei:
        await rs.scopes.create(name="x" * 100_000)
    assert len(ei.value.message) < 300


def test_sync_is_an_attribute_of_the_package():
    assert callable(rallypoint.sync.connect)
