"""Real etcd for tests: one member or three on free 127.0.0.1 ports, each in a temp dir,
and a loopback TCP proxy that can cut or black-hole a link to etcd.

``require_etcd()`` skips when the ``etcd`` binary is missing, but fails under ``CI=true``
(``.ci/run`` installs Debian's ``etcd-server``). Election timeout and heartbeat stay at
etcd's defaults: the minimum lease TTL (2 s) follows from them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import pytest
import trio


def require_etcd() -> str:
    path = shutil.which("etcd")
    if path:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail("etcd is not installed and CI=true: install Debian's etcd-server (.ci/run does)", pytrace=False)
    pytest.skip("etcd is not installed (apt-get install etcd-server)")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def member_status(client_url: str, timeout: float = 0.5) -> dict | None:
    """The member's /v3/maintenance/status as a dict, or None if it does not answer."""
    req = urllib.request.Request(client_url + "/v3/maintenance/status", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


class EtcdMember:
    """One etcd process. ``client_url`` is its gateway; ``stop()``/``start()`` keep the
    data dir and ports, so a restart is the same member."""

    def __init__(self, binary: str, name: str, data_root: str, client_port: int, peer_port: int) -> None:
        self.binary = binary
        self.name = name
        self.data_dir = os.path.join(data_root, name)
        self.log_path = os.path.join(data_root, f"{name}.log")
        self.client_url = f"http://127.0.0.1:{client_port}"
        self.peer_url = f"http://127.0.0.1:{peer_port}"
        self.proc: subprocess.Popen | None = None
        self.stopped = True
        self.initial_cluster = f"{name}={self.peer_url}"

    def start(self) -> "EtcdMember":
        args = [
            self.binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", "rallypoint-test",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.stopped = False
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.stopped = True
        if self.running():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class EtcdCluster:
    """``size`` members (1 or 3) started together; ``endpoints`` their client URLs."""

    def __init__(self, data_root: str, size: int = 1) -> None:
        binary = require_etcd()
        ports = free_ports(2 * size)
        self.members = [
            EtcdMember(binary, f"m{i}", data_root, ports[2 * i], ports[2 * i + 1]) for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def start(self) -> "EtcdCluster":
        for m in self.members:
            m.start()
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Poll until every member that should run answers its status and names a raft
        leader (a condition, polled every 50 ms); raises with the log if one exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = [m for m in self.members if not m.stopped]
            for m in up:
                if not m.running():
                    raise RuntimeError(f"etcd {m.name} exited {m.proc.returncode}:\n{m.log_tail()}")
            statuses = [member_status(m.client_url) for m in up]
            if all(s is not None and int(s.get("leader", 0)) != 0 for s in statuses):
                return
            time.sleep(0.05)
        raise RuntimeError("etcd did not become ready:\n" + "\n".join(m.log_tail() for m in self.members))

    def leader(self) -> EtcdMember:
        """The member that is the raft leader now."""
        for m in self.members:
            s = member_status(m.client_url) if m.running() else None
            if s is not None and s.get("leader") == s["header"]["member_id"]:
                return m
        raise RuntimeError("no etcd member is the leader")

    def stop(self) -> None:
        for m in self.members:
            m.stop()


class TcpProxy:
    """A loopback TCP proxy to ``target_port`` that a test can break.

    ``blackhole()``: connections stay open but nothing is forwarded (a partition: the
    peer hears nothing and no error); ``cut()``: every connection is closed and new ones
    are closed at once (a dead port); ``restore()``: forward again. Run it with
    ``async with TcpProxy(port) as proxy:`` inside the test's Trio run."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.mode = "pass"
        self._changed = trio.Event()
        self._conn_scopes: set[trio.CancelScope] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> "TcpProxy":
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        self._nursery.start_soon(trio.serve_listeners, self._serve, listeners)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._nursery.cancel_scope.cancel()
        await self._nursery_cm.__aexit__(None, None, None)

    def _set(self, mode: str) -> None:
        self.mode = mode
        self._changed.set()
        self._changed = trio.Event()

    def blackhole(self) -> None:
        self._set("blackhole")

    def cut(self) -> None:
        self._set("cut")
        for scope in list(self._conn_scopes):
            scope.cancel()

    def restore(self) -> None:
        self._set("pass")

    async def _serve(self, down: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            self._conn_scopes.add(scope)
            try:
                if self.mode == "cut":
                    return
                up = await trio.open_tcp_stream("127.0.0.1", self.target_port)
                async with up, trio.open_nursery() as n:
                    n.start_soon(self._pump, down, up, n.cancel_scope)
                    n.start_soon(self._pump, up, down, n.cancel_scope)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                self._conn_scopes.discard(scope)
        await down.aclose()

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, link: trio.CancelScope) -> None:
        """Copy src to dst until either side ends, then end the whole link."""
        try:
            while True:
                data = await src.receive_some(65536)
                while self.mode == "blackhole":
                    await self._changed.wait()
                if not data:
                    return
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            link.cancel()
