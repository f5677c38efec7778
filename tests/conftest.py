"""Shared fixtures: a real daemon subprocess, ``rs`` in its modes (embedded, TCP, and a
3-shard cluster through the SDK's router for :data:`CLUSTER_FILES`), and real etcd (one
member, or three) for the cluster tests; and the helpers tests order events
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


#: The single node's semantics suites that also run against a sharded cluster (the
#: ``rs`` fixture's ``cluster3`` mode: etcd, 3 shards, reached through
#: ``rallypoint.connect`` with every node's address, i.e. the SDK's router). Every test
#: of these files that takes ``rs`` runs there unchanged; one that cannot hold in a
#: cluster is marked ``@pytest.mark.not_in_cluster(reason)`` and skipped in that mode with
#: the reason (the list is in docs/architecture.md "Many shards"). The default run (CI) takes
#: :data:`CLUSTER_QUICK_FILES` only; ``RALLYPOINT_SLOW=1`` takes them all.
CLUSTER_FILES = frozenset({
    "test_scopes.py", "test_spine_scopes.py", "test_spine_errors.py", "test_queue_api.py", "test_queue_consume.py",
    "test_groups_api.py", "test_groups_decision.py", "test_joinsets.py", "test_joinset_ends.py",
    "test_joinset_steps.py", "test_barriers.py", "test_timers.py", "test_claims.py", "test_pools.py",
    "test_quotas.py", "test_budgets.py", "test_events.py", "test_messages.py", "test_admission.py",
    "test_mailbox_requirements.py", "test_task_runs.py", "test_consume_outcomes.py", "test_watch_cursor.py",
    "test_did_you_mean.py", "test_seed_errors.py",
})
#: Files of :data:`CLUSTER_FILES` whose every ``rs`` test needs what a sharded cluster
#: does not do yet, and why (a single test says it with ``@pytest.mark.not_in_cluster``).
_OFF_HOME = ("a task's requirements (pool units, budget) of a run off the space's home shard are reserved there "
             "after the receive finds the task (a round trip: a receive with wait=0 admits nothing yet) and are "
             "checked there (an unknown pool or budget is not refused at submission; the task is cancelled)")
CLUSTER_SKIPPED_FILES: dict[str, str] = {
    "test_admission.py": _OFF_HOME,
    "test_mailbox_requirements.py": _OFF_HOME,
}
#: The short form run by default (CI): one file per family of kinds.
CLUSTER_QUICK_FILES = frozenset({
    "test_scopes.py", "test_queue_api.py", "test_groups_api.py", "test_joinset_steps.py", "test_barriers.py",
    "test_claims.py", "test_pools.py", "test_events.py",
})


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`QUICK_FILES` ``quick`` (not those marked ``slow``); keep
    the ``rs[cluster3]`` tests of :data:`CLUSTER_FILES` only (of :data:`CLUSTER_QUICK_FILES`
    without ``RALLYPOINT_SLOW``), the others deselected; skip those marked
    ``not_in_cluster(reason)`` (or of a file in :data:`CLUSTER_SKIPPED_FILES`) with the
    reason; put the files holding a ``slow`` test first."""
    cluster_files = CLUSTER_FILES if SLOW else CLUSTER_QUICK_FILES
    keep, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("rs") == "cluster3" and item.path.name not in cluster_files:
            dropped.append(item)
            continue
        keep.append(item)
        if callspec is not None and callspec.params.get("rs") == "cluster3":
            mark = item.get_closest_marker("not_in_cluster")
            reason = mark.args[0] if mark is not None else CLUSTER_SKIPPED_FILES.get(item.path.name)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"not in a sharded cluster: {reason}"))
        if item.path.name in QUICK_FILES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    # the files that hold a ``slow`` test first (each file's order kept): under
    # ``-n 2 --dist loadfile`` the long ones (the seed run, the soak) start at once
    # instead of leaving one worker alone with them at the end
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    longest = ("test_sim.py", "test_soak.py")  # the two longest, each on its own worker first
    items.sort(key=lambda item: (item.path not in slow_files,
                                 longest.index(item.path.name) if item.path.name in longest else len(longest)))


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


class ShardedCluster:
    """A sharded cluster of real processes on loopback: one etcd member, ``shards``
    shards of ``nodes`` nodes each (``rallypoint serve --cluster --shard S``, durability
    ``interval``), made by ``rallypoint cluster init --slots 64 --shards K``. ``url`` names
    every node (``tcp://a,b,...``): ``rallypoint.connect(url)`` reaches the cluster through
    the SDK's router. Start and stop are blocking (for a session-scoped fixture)."""

    SLOTS = 64

    def __init__(self, root: str, shards: int = 3, nodes: int = 1, name: str = "rs-cluster") -> None:
        from _cluster import ClusterNode

        self.root = root
        self.name = name
        os.makedirs(os.path.join(root, "etcd"), exist_ok=True)
        self.etcd = EtcdCluster(os.path.join(root, "etcd"), size=1)
        self.nodes = [
            ClusterNode(f"n{s}{'abc'[i]}", root, self.etcd.endpoints[0], name,
                        extra=["--shard", str(s), "--durability", "interval", "--sync-helper", "thread"])
            for s in range(shards) for i in range(nodes)
        ]
        self.shards = shards

    @property
    def url(self) -> str:
        return "tcp://" + ",".join(n.address for n in self.nodes)

    def start(self, timeout: float = 120.0) -> "ShardedCluster":
        self.etcd.start()
        endpoint = "etcd://" + self.etcd.endpoints[0].removeprefix("http://")
        subprocess.run([sys.executable, "-m", "rallypoint", "cluster", "init", "--cluster", endpoint,
                        "--cluster-name", self.name, "--slots", str(self.SLOTS), "--shards", str(self.shards)],
                       check=True, capture_output=True, timeout=60)
        for n in self.nodes:
            n.start()

        def ready():
            for n in self.nodes:
                if not n.running():
                    raise RuntimeError(f"{n.name} exited {n.proc.returncode}:\n{n.log_tail()}")
            leaders = {n.name[1] for n in self.nodes if n.role == "leader"}
            return len(leaders) == self.shards and all(n.role in ("leader", "standby") for n in self.nodes)

        until_sync(ready, timeout=timeout, what="a leader on every shard")
        return self

    def stop(self) -> None:
        from _cluster import stop_all

        stop_all(self.nodes)
        self.etcd.stop()


@pytest.fixture(scope="session")
def cluster3(tmp_path_factory):
    """A 3-shard cluster shared by the session (1 node a shard; 2 under RALLYPOINT_SLOW)."""
    c = ShardedCluster(str(tmp_path_factory.mktemp("cluster3")), shards=3, nodes=2 if SLOW else 1)
    try:
        yield c.start()
    finally:
        c.stop()


#: Why a test skips itself in the ``cluster3`` mode (the list in docs/architecture.md).
CROSS_TREE = ("a group of one run tree joins a task, or hangs its gate run under a run, of another tree: refused "
              "in a sharded cluster (no atomic step spans two trees)")


@pytest.fixture(params=["embedded", "tcp", "cluster3"])
async def rs(request):
    """The same API suite runs against an embedded coordinator, a real daemon and (for
    :data:`CLUSTER_FILES`) a 3-shard cluster through the SDK's router; the daemon and
    the cluster are shared, so tests keep apart by names of their own."""
    if request.param == "embedded":
        async with rallypoint.open_embedded() as client:
            yield client
        return
    url = request.getfixturevalue("daemon").url if request.param == "tcp" else request.getfixturevalue("cluster3").url
    async with rallypoint.connect(url) as client:
        yield client
    # The shared daemon ends a closed connection's parked waits; let it finish that
    # before the next test counts parked waits (wait_parked's baseline).
    async with rallypoint.connect(url) as client:
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
