"""Shared fixtures: a real daemon subprocess, ``rs`` in both modes (embedded, TCP), and real
etcd (one member, or three) for the cluster tests; and the helpers tests order events
with: wait for a condition (N waits parked, N watchers subscribed), never for a stretch
of wall-clock time."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time

import pytest
import trio
import trio.testing

import rallypoint
from _etcd import EtcdCluster

SLOW = bool(os.environ.get("RALLYPOINT_SLOW"))

#: The quick subset, ``python3 -m pytest -q -m quick`` (about 1,000 tests, 1-2 minutes on
#: two idle cores): every kind's semantics embedded and over TCP, events, the runtime,
#: the journal and snapshots, reconnection, the simulator's pinned seeds. Left to the
#: full run: the CLI, HTTP and the runstate SDK, TLS, hostile peers, most crash/restart
#: daemons, property and fuzz runs, the seed run and the soak (``slow``).
QUICK_FILES = frozenset({
    "test_activity_heap.py", "test_admission.py", "test_barriers.py", "test_budgets.py", "test_claims.py",
    "test_consume_outcomes.py", "test_durability_records.py", "test_embedded.py", "test_events.py",
    "test_events_primitives.py", "test_groups_api.py", "test_groups_atomicity.py", "test_groups_decision.py",
    "test_ids.py", "test_joinset_ends.py", "test_joinset_steps.py", "test_joinsets.py",
    "test_mailbox_requirements.py", "test_messages.py", "test_persistence_faults.py",
    "test_persistence_journal.py", "test_persistence_snapshot.py", "test_pools.py", "test_queue_api.py",
    "test_queue_cancel.py", "test_queue_consume.py", "test_queue_takeover.py", "test_quotas.py",
    "test_reconnect.py", "test_reply_durability.py", "test_retention.py", "test_runtime.py", "test_scopes.py",
    "test_sim.py", "test_spine_concurrency.py", "test_spine_errors.py", "test_spine_protocol.py",
    "test_spine_scopes.py", "test_task_runs.py", "test_timers.py", "test_wakeups.py",
})


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`QUICK_FILES` ``quick`` (not those marked ``slow``)."""
    for item in items:
        if item.path.name in QUICK_FILES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


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
        # The shared daemon ends a closed connection's parked waits; let it finish that
        # before the next test counts parked waits (wait_parked's baseline).
        async with rallypoint.connect(d.url) as client:
            with trio.move_on_after(5):
                while await parked_waits(client):
                    await trio.sleep(0.005)


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


# ------------------------------------------------------------------ waiting for a condition
#
# Tests order events by waiting until the server *reports* the state they need (a wait
# parked, a watcher subscribed), as Trio's own tests do with wait_all_tasks_blocked():
# a fixed sleep is too short on a loaded machine and too long on an idle one. Every
# helper polls with a short sleep and fails after ``timeout`` seconds (real or MockClock
# time, whichever the test runs under) instead of hanging.

#: how often the helpers below re-read what they wait for (s)
POLL_S = 0.005


async def wait_parked(coord, n: int, timeout: float = 60.0) -> None:
    """Until at least ``n`` server-side waits are parked in the actors of the in-process
    coordinator ``coord`` (the runtime's own count, ``coord.runtime.n_waiters``) and every
    task is blocked. Raises trio.TooSlowError after ``timeout`` s."""
    with trio.fail_after(timeout):
        while coord.runtime.n_waiters < n:
            await trio.testing.wait_all_tasks_blocked()
            if coord.runtime.n_waiters < n:
                await trio.sleep(POLL_S)


async def parked_waits(rs, kind: str | None = None) -> int:
    """Server-side waits parked now, as the server reports them (``rs.status().actors``,
    per kind ``waiters``): all kinds summed, or only ``kind`` ("runs", "joinsets", ...).
    Works embedded and over TCP (then it counts every client's waits: see
    :func:`wait_parked_remote`)."""
    actors = (await rs.status()).actors
    if kind is not None:
        return actors.get(kind, {}).get("waiters", 0)
    return sum(a.get("waiters", 0) for a in actors.values())


async def wait_parked_remote(rs, n: int, kind: str | None = None, *, base: int = 0,
                             timeout: float = 30.0) -> None:
    """Until at least ``base + n`` waits are parked (:func:`parked_waits`). Over a shared
    daemon pass ``base = await parked_waits(rs, kind)`` read before starting the waits
    (the ``rs`` fixture lets the daemon end an earlier test's waits first). Raises
    trio.TooSlowError after ``timeout`` s."""
    with trio.fail_after(timeout):
        while await parked_waits(rs, kind) < base + n:
            await trio.sleep(POLL_S)


async def wait_parked_at_most(rs, n: int, kind: str | None = None, *, timeout: float = 30.0) -> None:
    """Until at most ``n`` waits are parked (:func:`parked_waits`): the server has ended
    the ones a test abandoned or woke. Raises trio.TooSlowError after ``timeout`` s."""
    with trio.fail_after(timeout):
        while await parked_waits(rs, kind) > n:
            await trio.sleep(POLL_S)


async def wait_watchers(rs, n: int, timeout: float = 30.0) -> None:
    """Until at least ``n`` event watchers are subscribed in ``rs``'s space
    (``rs.overview().events["watchers"]``: the server counts a watcher once its start
    position is fixed, so every event committed after this returns reaches it). Raises
    trio.TooSlowError after ``timeout`` s."""
    with trio.fail_after(timeout):
        while (await rs.overview()).events["watchers"] < n:
            await trio.sleep(POLL_S)


async def until(pred, timeout: float = 30.0, poll_s: float = POLL_S) -> None:
    """Until ``pred()`` is true (a plain or an async predicate: a status read): for a
    state another task or process reaches, where nothing can be awaited directly.
    Raises trio.TooSlowError after ``timeout`` s."""
    with trio.fail_after(timeout):
        while True:
            got = pred()
            if inspect.isawaitable(got):
                got = await got
            if got:
                return
            await trio.sleep(poll_s)


def until_sync(pred, timeout: float = 30.0, poll_s: float = 0.02, what: str = "the condition") -> None:
    """Blocking form of :func:`until` (for tests using ``rallypoint.sync`` or
    subprocesses): until ``pred()`` is true; AssertionError naming ``what`` after
    ``timeout`` s (real time)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll_s)


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """Put the root logger's level and handlers back after each test: a test that runs
    ``cli.main`` in this process (serve, repair) sets them as a daemon would, and a later
    test's ``caplog`` would otherwise miss every record below that level (and the handler
    would write to a captured stream that is already closed)."""
    import logging

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    root.handlers[:] = handlers
