"""Real ``rallypoint serve --cluster`` processes for the fault tests
(tests/test_cluster_daemon.py) and the failover benchmark (scripts/bench_failover.py).

:class:`ClusterNode` runs one node of a replicated shard as a subprocess (its own data
dir, fixed loopback ports so a restart comes back at the same addresses) and reads its
stdout in a thread: the ``READY`` line (client, replication and HTTP addresses) and
every ``ROLE <role> epoch=<n>`` line, each stamped with ``time.monotonic()`` when read,
so a test can wait for a role and compare when two nodes changed roles. Waits are on
those conditions (polled every 10 ms), never on fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import trio


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stop_all(nodes: "list[ClusterNode]", timeout: float = 30.0) -> None:
    """SIGTERM every running node at once (leaders hand over), then reap each; one still
    running after ``timeout`` seconds is killed (SIGKILL)."""
    for n in nodes:
        if n.running():
            n.signal(signal.SIGTERM)
    for n in nodes:
        if n.proc is not None:
            try:
                n.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                n.kill()


@dataclass(frozen=True)
class RoleLine:
    """One ``ROLE`` line: ``at`` (``time.monotonic()`` when read, s), ``role``, ``epoch``,
    ``start`` (which start of the process printed it, from 1)."""

    at: float
    role: str
    epoch: int
    start: int


class ClusterNode:
    """``python -m rallypoint serve --cluster etcd://...`` as a subprocess.

    ``etcd``: the etcd endpoint this node talks to (``http://host:port``, a proxy's in
    the split-brain test; ``https://root@host:port`` for a TLS + auth etcd); ``cluster``: the
    cluster name (one per test); ports are picked free once (``client_port``,
    ``replication_port``, ``http_port`` with ``http=True``) and kept across restarts.
    ``advertise_replication``: ``host:port`` to advertise for the replication listener (a
    proxy in front of it). ``extra``: more ``serve`` options (``--etcd-ca FILE`` ...);
    ``env``: more environment variables (``RALLYPOINT_ETCD_PASSWORD``). Logs (stderr) go
    to ``<data_dir>.log``.
    """

    def __init__(self, name: str, root: str, etcd: str, cluster: str, *, lease_ttl: int = 2,
                 isr_timeout: float = 0.5, http: bool = False, advertise_replication: str | None = None,
                 extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.data_dir = os.path.join(root, name)
        self.log_path = self.data_dir + ".log"
        self.etcd = etcd
        self.cluster = cluster
        ports = free_ports(3)
        self.client_port, self.replication_port = ports[0], ports[1]
        self.http_port = ports[2] if http else None
        self.lease_ttl = lease_ttl
        self.isr_timeout = isr_timeout
        self.advertise_replication = advertise_replication
        self.extra = list(extra or [])
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.roles: list[RoleLine] = []
        self.ready_at: float | None = None
        self.lines: list[str] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ addresses
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"tcp://{self.address}"

    @property
    def http_url(self) -> str:
        assert self.http_port is not None
        return f"http://127.0.0.1:{self.http_port}"

    # ------------------------------------------------------------------ process
    def args(self) -> list[str]:
        a = [sys.executable, "-m", "rallypoint", "serve", "--cluster", self.etcd, "--cluster-name", self.cluster,
             "--node", self.name, "--data-dir", self.data_dir, "--durability", "fsync",
             "--listen", self.address, "--replication", f"127.0.0.1:{self.replication_port}",
             "--lease-ttl", str(self.lease_ttl), "--isr-timeout", str(self.isr_timeout),
             "--drain-timeout", "5"]
        if self.advertise_replication:
            a += ["--advertise-replication", self.advertise_replication]
        if self.http_port is not None:
            a += ["--http", f"127.0.0.1:{self.http_port}"]
        return a + self.extra

    def start(self) -> "ClusterNode":
        """Start (again, on the same data dir and ports); returns at once (see
        :meth:`wait_ready`)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        self.ready_at = None
        log = open(self.log_path, "a")
        log.write(f"===== start {self.starts}: {' '.join(self.args())}\n")
        log.flush()
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                                     env={**os.environ, **self.env} if self.env else None)
        log.close()
        threading.Thread(target=self._read, args=(self.proc, self.starts), daemon=True).start()
        return self

    def _read(self, proc: subprocess.Popen, start: int) -> None:
        for line in proc.stdout:
            now = time.monotonic()
            line = line.strip()
            with self._lock:
                self.lines.append(line)
                if line.startswith("READY "):
                    self.ready_at = now
                elif line.startswith("ROLE "):
                    words = line.split()
                    epoch = int(words[2].split("=", 1)[1]) if len(words) > 2 else 0
                    self.roles.append(RoleLine(now, words[1], epoch, start))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, and reap."""
        if self.running():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    async def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (a leader hands over first); the exit code."""
        self.signal(signal.SIGTERM)
        return await self.wait_exit(timeout)

    async def wait_exit(self, timeout: float = 60.0) -> int:
        with trio.fail_after(timeout):
            while self.proc.poll() is None:
                await trio.sleep(0.01)
        return self.proc.returncode

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ roles
    def role_lines(self, start: int | None = None) -> list[RoleLine]:
        """ROLE lines so far (of one start, if given)."""
        with self._lock:
            return [r for r in self.roles if start is None or r.start == start]

    @property
    def role(self) -> str | None:
        """The latest role printed by the current start, or None."""
        lines = self.role_lines(self.starts)
        return lines[-1].role if lines else None

    async def wait(self, pred, what: str, timeout: float = 60.0) -> None:
        """Wait until ``pred()`` holds (checked every 10 ms); fail with this node's log
        tail after ``timeout`` seconds or if the process exits meanwhile."""
        try:
            with trio.fail_after(timeout):
                while not pred():
                    await trio.sleep(0.01)
        except trio.TooSlowError:
            raise AssertionError(f"{self.name}: timed out waiting for {what}; roles "
                                 f"{[(r.role, r.epoch, r.start) for r in self.role_lines()]}\n{self.log_tail()}")

    async def wait_ready(self, timeout: float = 60.0) -> None:
        def ready():
            if self.ready_at is not None:
                return True
            if not self.running():
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            return False

        await self.wait(ready, "READY", timeout)

    async def wait_role(self, role: str, *, after: int = 0, timeout: float = 60.0) -> RoleLine:
        """The first ROLE line ``role`` of the current start at index ``after`` or later
        of :meth:`role_lines` (the current start's); waits for it."""
        start = self.starts
        found: list[RoleLine] = []

        def seen():
            lines = self.role_lines(start)[after:]
            hit = [r for r in lines if r.role == role]
            if hit:
                found.append(hit[0])
                return True
            return False

        await self.wait(seen, f"ROLE {role}", timeout)
        return found[0]
