"""SDK configuration (issue 12, item 7): $RALLYPOINT_URL and $RALLYPOINT_API_KEY in the
SDK (async and blocking), the examples' --api-key against a daemon with keys, and a
clear error for the embedded mode outside Trio."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

import rallypoint
from rallypoint.errors import UnauthenticatedError
from rallypoint.transport.testing import TestDispatcher, running_server

from conftest import Daemon

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def test_connect_reads_url_and_key_from_the_environment(monkeypatch):
    d = TestDispatcher()
    async with running_server(d) as srv:
        monkeypatch.setenv("RALLYPOINT_URL", f"tcp://127.0.0.1:{srv.port}")
        monkeypatch.setenv("RALLYPOINT_API_KEY", "from-env")
        async with rallypoint.connect() as rs:
            assert rs._transport.server_info.server_version == "test"
        async with rallypoint.connect(api_key="explicit"):
            pass
        monkeypatch.setenv("RALLYPOINT_API_KEY", "bad")  # TestDispatcher refuses "bad"
        with pytest.raises(UnauthenticatedError):
            async with rallypoint.connect():
                pass
    assert [h.api_key for h, _ in d.hellos] == ["from-env", "explicit"]


async def test_sync_connect_reads_the_environment_too(monkeypatch):
    import trio

    d = TestDispatcher()
    async with running_server(d) as srv:
        monkeypatch.setenv("RALLYPOINT_URL", f"tcp://127.0.0.1:{srv.port}")
        monkeypatch.setenv("RALLYPOINT_API_KEY", "sync-env")

        def blocking():
            with rallypoint.sync.connect(client_name="blocking", reconnect=False):
                pass

        await trio.to_thread.run_sync(blocking)
    assert [(h.api_key, h.client) for h, _ in d.hellos] == [("sync-env", "blocking")]


def test_open_embedded_under_asyncio_says_it_needs_trio():
    async def main():
        async with rallypoint.open_embedded():
            pass

    with pytest.raises(RuntimeError) as ei:
        asyncio.run(main())
    msg = str(ei.value)
    assert "needs Trio" in msg and "asyncio" in msg and "rallypoint.connect" in msg


def test_open_embedded_outside_an_event_loop_says_so():
    cm = rallypoint.open_embedded()
    with pytest.raises(RuntimeError) as ei:
        cm.__aenter__().send(None)
    assert "needs Trio" in str(ei.value)


def test_example_runs_against_a_daemon_with_keys(tmp_path):
    data = str(tmp_path / "data")
    out = subprocess.run(
        [sys.executable, "-m", "rallypoint", "keys", "--data-dir", data, "create", "--space", "examples",
         "--permission", "coordination_read", "--permission", "coordination_write",
         "--permission", "resource_config"],
        capture_output=True, text=True, check=True,
    ).stdout
    secret = out.split("secret: ")[1].strip()
    d = Daemon(data, "fsync").start()
    try:
        script = [sys.executable, os.path.join("examples", "crawl_joinset.py"), "--connect", d.url, "--quick"]
        env = {k: v for k, v in os.environ.items() if k != "RALLYPOINT_API_KEY"}
        env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")  # this checkout's SDK
        refused = subprocess.run(script, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
        ok = subprocess.run(script + ["--api-key", secret], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=env)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "join set CLOSED" in ok.stdout
    finally:
        assert d.stop() == 0
