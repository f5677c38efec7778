"""Shared fixtures: a real daemon subprocess, ``rs`` in both modes (embedded, TCP), and real
etcd (one member, or three) for the cluster tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import rallypoint
from _etcd import EtcdCluster

SLOW = bool(os.environ.get("RALLYPOINT_SLOW"))


class Daemon:
    """A ``rallypoint serve`` subprocess on a free port."""

    def __init__(self, data_dir: str | None, durability: str = "memory", extra: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.durability = durability
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.log_path = None

    def start(self, timeout: float = 20.0) -> "Daemon":
        args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", self.durability]
        if self.data_dir is not None:
            args += ["--data-dir", self.data_dir]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY "):
                words = line.split()
                self.url = words[1]
                self.metrics_url = words[3] if len(words) > 3 and words[2] == "METRICS" else None
                return self
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.proc.stderr.read()}")
        raise RuntimeError("daemon did not become ready")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc and self.proc.poll() is not None else ""


@pytest.fixture(scope="session")
def daemon():
    d = Daemon(None, "memory").start()
    yield d
    rc = d.stop()
    assert rc == 0, d.stderr()


@pytest.fixture(params=["embedded", "tcp"])
async def rs(request):
    """The same API suite runs against an embedded coordinator and a real daemon."""
    if request.param == "embedded":
        async with rallypoint.open_embedded() as client:
            yield client
    else:
        d = request.getfixturevalue("daemon")
        async with rallypoint.connect(d.url) as client:
            yield client


@pytest.fixture
async def ers(autojump_clock):
    """An embedded client under trio's MockClock (autojump): hours pass in milliseconds.

    The test must request ``autojump_clock`` in its own signature too (pytest-trio only
    takes the clock from the test's arguments)."""
    async with rallypoint.open_embedded(clock=None) as client:
        yield client



def direct(coord, session, op):
    """``coord.decide(session, op)``: decide synchronously, bypassing the inboxes."""
    return coord.decide(session, op)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """One etcd member shared by a test module (tests use their own key prefixes);
    skipped without the ``etcd`` binary, failed without it under CI=true."""
    cluster = EtcdCluster(str(tmp_path_factory.mktemp("etcd")), size=1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd_private(tmp_path):
    """A one-member etcd of the test's own, which it may stop and restart."""
    cluster = EtcdCluster(str(tmp_path), size=1).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def etcd3(tmp_path_factory):
    """A three-member etcd cluster shared by a test module (for member-loss tests;
    a test that stops a member must start it again before it ends)."""
    cluster = EtcdCluster(str(tmp_path_factory.mktemp("etcd3")), size=3).start()
    yield cluster
    cluster.stop()
