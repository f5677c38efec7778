"""Deterministic simulation of a replicated shard: two nodes, one seed.

Run one seed (replays exactly; ``--trace`` prints what happened), or many::

    python -m rallypoint.testing.replsim --seed 447 --trace
    python -m rallypoint.testing.replsim --seeds 0:200 --processes 2
    python -m rallypoint.testing.replsim --seeds 0:50 --mutant leader_acks_alone   # must fail

What runs is the production node of a replicated shard, twice, in one Trio run on
virtual time (:class:`~trio.testing.MockClock`, autojump): :class:`rallypoint.cluster.
member.ShardMember` -- its election, epochs, fenced in-sync set, standby following,
takeover (:func:`~rallypoint.replication.take_over`, lease extension, re-arm), rejoin
(truncation, :class:`~rallypoint.replication.Rebuild`) -- with the real replication
code (:mod:`rallypoint.replication`), the real journal on the seeded disk of the
single-node simulator (:mod:`rallypoint.testing.disk`: latencies, kill -9 and power
loss) and the real recovery. Only two things are fakes:

- **etcd** (:mod:`rallypoint.testing.fake_etcd`): an in-memory store with etcd's
  revisions, transactions, leases on the virtual clock and watches; a node can be cut
  off from it;
- **the network** (:class:`SimNet`): the replication connections carry whole link
  messages, each of which the seed may drop, duplicate or delay (a delayed one is
  overtaken: reordered); the link can be cut (a partition TCP does not notice: bytes
  vanish), and a killed process's connections end (EOF) while a crashed machine's go
  silent.

The seed decides the profile (``--min-insync``, the ISR timeout, the network's and the
disk's faults) and a schedule of steps: client writes, time passing, kill -9 or power
loss of the leader, the standby or both, a crash armed at one named step of the next
takeover (:data:`TAKEOVER_POINTS`: every step from winning the campaign to serving), a
cut replication link, a node cut off from etcd, a leader cut off from both, a graceful
hand-over. Crashed nodes restart after a seeded downtime. At the end everything heals
and the cluster must converge: a leader serving, the other node in sync holding every
record, and one more write acknowledged.

The invariants (a failing one names itself):

- **one-leader-per-epoch**: every acknowledged write names the epoch of the leader that
  acknowledged it; one epoch, one node;
- **lost-ack**: every write acknowledged so far is in the state of each node at the
  moment it starts to lead (and at the end), with the very bytes the acknowledging
  leader had journaled up to that write's LSN (a hash chain of the journal's payloads);
- **replicas-agree**: at the end the journals of both nodes, as on their disks, agree
  byte for byte on every LSN up to the highest acknowledged one, and what each journal
  holds is what was appended to it;
- **liveness**: the healed cluster converges and acknowledges a write within
  :data:`DRAIN_S`; no node stops with an error of its own.

:data:`MUTANTS` are deliberate bugs the simulator must catch (``tests/test_replsim.py``
runs each against a few seeds and expects a violation).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import heapq
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import msgspec
import trio
import trio.testing

from .. import protocol as p
from ..actors import claim as _claim_mod
from ..actors import pool as _pool_mod
from ..cluster import peerauth as _peerauth
from ..actors.api import REPLY_TYPES
from ..clock import Clock
from ..cluster.member import MemberConfig, ShardMember
from ..nodeconfig import SnapshotOptions, StorageOptions
from ..errors import RallypointError
from ..persistence.journal import read_journal, snapshot_lsn_of
from ..service import CallSink, Session
from .disk import DiskFaults, SimDisk, SimStorage
from .fake_etcd import FakeEtcd, FakeEtcdClient
from .sim import WALL0, Violation, _SeededIds

__all__ = ["Profile", "Result", "generate", "run_seed", "run_seeds", "main", "TAKEOVER_POINTS", "MUTANTS"]

log = logging.getLogger("rallypoint.replsim")

DEFAULT_STEPS = 30
#: after the last step, everything healed: the cluster converges within this, seconds
DRAIN_S = 60.0
NODES = ("a", "b")
#: the steps of a takeover (and a rejoin) where a node can be crashed
#: (:meth:`rallypoint.cluster.member.ShardMember._probe`)
TAKEOVER_POINTS = ("takeover.won", "takeover.journal_reopened", "takeover.replicas_read", "takeover.epoch_journaled",
                   "takeover.isr_shrunk", "takeover.epoch_synced", "takeover.replicating", "takeover.serving",
                   "rejoin.rebuilt")


# ============================================================================ schedule
@dataclass
class Profile:
    """What the seed decides besides the steps."""

    min_insync: int
    isr_timeout_s: float
    drop_p: float
    dup_p: float
    reorder_p: float
    latency_s: float
    faults: DiskFaults

    def describe(self) -> str:
        return (f"min_insync={self.min_insync} isr_timeout={self.isr_timeout_s}s drop={self.drop_p} dup={self.dup_p} "
                f"reorder={self.reorder_p} latency={self.latency_s}s")


def generate(seed: int, n_steps: int = DEFAULT_STEPS) -> tuple[Profile, list[tuple]]:
    """The profile and the steps of ``seed``. Steps:

    - ``("write", n)``: n clients each write once (to whoever leads now);
    - ``("tick", s)``: s virtual seconds pass;
    - ``("crash", who, how, downtime)``: ``who`` is leader, standby or both, ``how``
      process (kill -9) or machine (power loss); restarted after ``downtime`` s;
    - ``("arm", point, how, downtime)``: the next node to reach takeover step ``point``
      crashes there;
    - ``("cut", s)``: the replication link is cut for s seconds;
    - ``("etcd_cut", who, s)``: leader or standby cannot reach etcd for s seconds;
    - ``("isolate", s)``: the leader is cut off from etcd and from the standby;
    - ``("handover", downtime)``: the leader stops gracefully (SIGTERM), restarted after.
    """
    rng = random.Random(f"rallypoint-replsim:profile:{seed}")
    prof = Profile(
        min_insync=2 if rng.random() < 0.2 else 1,
        isr_timeout_s=rng.choice((0.5, 1.0)),
        drop_p=rng.choice((0.0, 0.0, 0.005, 0.02)),
        dup_p=rng.choice((0.0, 0.0, 0.005, 0.02)),
        reorder_p=rng.choice((0.0, 0.02, 0.1)),
        latency_s=rng.choice((0.0002, 0.001, 0.01)),
        faults=DiskFaults(write_latency_s=rng.choice((0.0, 0.0005)), fsync_latency_s=rng.choice((0.0005, 0.002, 0.01)),
                          slow_fsync_p=rng.choice((0.0, 0.05)), split_write_p=rng.choice((0.0, 0.3)),
                          snapshot_latency_s=0.0),
    )
    rng = random.Random(f"rallypoint-replsim:steps:{seed}")
    steps: list[tuple] = [("write", 2), ("tick", 0.5)]
    while len(steps) < n_steps:
        x = rng.random()
        if x < 0.40:
            steps.append(("write", rng.choice((1, 1, 2, 3))))
        elif x < 0.62:
            steps.append(("tick", rng.choice((0.01, 0.1, 0.3, 0.5, 1.0, 2.0, 4.0))))
        elif x < 0.72:
            steps.append(("crash", rng.choice(("leader", "leader", "standby", "both")),
                          rng.choice(("process", "machine")), rng.choice((0.1, 1.0, 3.0, 8.0))))
        elif x < 0.80:
            steps.append(("arm", rng.choice(TAKEOVER_POINTS), rng.choice(("process", "machine")),
                          rng.choice((0.1, 1.0, 3.0))))
        elif x < 0.87:
            steps.append(("cut", rng.choice((0.3, 1.5, 4.0))))
        elif x < 0.93:
            steps.append(("etcd_cut", rng.choice(("leader", "standby")), rng.choice((0.5, 1.5, 3.0, 6.0))))
        elif x < 0.97:
            steps.append(("isolate", rng.choice((1.0, 3.0, 6.0))))
        else:
            steps.append(("handover", rng.choice((0.1, 1.0))))
    return prof, steps


# ============================================================================ the network
class _Pipe:
    """One direction of a connection: messages with arrival times."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, bytes]] = []
        self.eof = False
        self.changed = trio.Event()

    def kick(self) -> None:
        ev, self.changed = self.changed, trio.Event()
        ev.set()


class _Conn:
    def __init__(self, net: "SimNet", client: str, server: str, n: int) -> None:
        self.net = net
        self.ends = (client, server)
        self.n = n
        self.pipes = {client: _Pipe(), server: _Pipe()}  # the pipe a node receives from
        self.silent = False  # a crashed machine: nothing more either way
        self.closed: set[str] = set()


class SimStream(trio.abc.Stream):
    """One end of a simulated replication connection. Each ``send_all`` is one link
    message (:class:`rallypoint.replication.link.Link` sends a whole frame at once),
    which the network may drop, duplicate or delay."""

    def __init__(self, conn: _Conn, me: str) -> None:
        self.conn = conn
        self.me = me
        self.peer = conn.ends[1] if conn.ends[0] == me else conn.ends[0]

    async def send_all(self, data) -> None:
        conn = self.conn
        await trio.lowlevel.checkpoint()
        if self.me in conn.closed:
            raise trio.ClosedResourceError("closed")
        if self.peer in conn.closed:
            raise trio.BrokenResourceError("the peer closed the connection")
        conn.net.deliver(conn, self.peer, bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes=None) -> bytes:
        conn = self.conn
        pipe = conn.pipes[self.me]
        while True:
            if self.me in conn.closed:
                raise trio.ClosedResourceError("closed")
            now = trio.current_time()
            if pipe.heap and pipe.heap[0][0] <= now:
                data = heapq.heappop(pipe.heap)[2]
                await trio.lowlevel.checkpoint()
                return data
            if pipe.eof and not pipe.heap:
                await trio.lowlevel.checkpoint()
                return b""
            ev = pipe.changed
            with trio.move_on_at(pipe.heap[0][0] if pipe.heap else float("inf")):
                await ev.wait()

    async def aclose(self) -> None:
        conn = self.conn
        if self.me not in conn.closed:
            conn.closed.add(self.me)
            if not conn.silent:
                peer = conn.pipes[self.peer]
                peer.eof = True
                peer.kick()
            conn.pipes[self.me].kick()
        await trio.lowlevel.checkpoint()


class SimListener(trio.abc.Listener):
    """A node's replication listener on the simulated network."""

    def __init__(self, net: "SimNet", node: str) -> None:
        self.net = net
        self.node = node
        self.send, self.recv = trio.open_memory_channel(100)
        self.closed = False

    async def accept(self) -> SimStream:
        try:
            return await self.recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError("listener closed") from None

    async def aclose(self) -> None:
        self.closed = True
        if self.net.listeners.get(self.node) is self:
            del self.net.listeners[self.node]
        self.send.close()
        self.recv.close()
        await trio.lowlevel.checkpoint()


class SimNet:
    """The replication network between the nodes (see the module docstring)."""

    def __init__(self, sim: "ReplSim", rng: random.Random, prof: Profile) -> None:
        self.sim = sim
        self.rng = rng
        self.prof = prof
        self.listeners: dict[str, SimListener] = {}
        self.conns: list[_Conn] = []
        self.cut = False
        self.isolated: set[str] = set()
        self.faults_on = True
        self.seq = 0
        self.stats = {"messages": 0, "dropped": 0, "duplicated": 0, "reordered": 0, "lost": 0}

    def _blocked(self, a: str, b: str) -> bool:
        return self.cut or a in self.isolated or b in self.isolated

    def deliver(self, conn: _Conn, to: str, data: bytes) -> None:
        frm = conn.ends[0] if conn.ends[1] == to else conn.ends[1]
        self.stats["messages"] += 1
        if conn.silent or self._blocked(frm, to):
            self.stats["lost"] += 1
            return
        copies = 1
        prof, rng = self.prof, self.rng
        # the faults hit the replication frames (what the leader sends: frames, beats,
        # the handshake's answer); acknowledgements only travel with a latency
        faulty = self.faults_on and to == conn.ends[0]
        if faulty:
            x = rng.random()
            if x < prof.drop_p:
                self.stats["dropped"] += 1
                self.sim.trace(f"net: a message {frm}->{to} dropped")
                return
            if x < prof.drop_p + prof.dup_p:
                copies = 2
                self.stats["duplicated"] += 1
                self.sim.trace(f"net: a message {frm}->{to} duplicated")
        pipe = conn.pipes[to]
        for _ in range(copies):
            delay = prof.latency_s * (0.5 + rng.random())
            if faulty and rng.random() < prof.reorder_p:
                delay += rng.choice((0.002, 0.02, 0.1))
                self.stats["reordered"] += 1
            self.seq += 1
            heapq.heappush(pipe.heap, (trio.current_time() + delay, self.seq, data))
        pipe.kick()

    async def listen(self, node: str) -> list[SimListener]:
        await trio.lowlevel.checkpoint()
        lst = SimListener(self, node)
        self.listeners[node] = lst
        return [lst]

    async def connect(self, node: str, host: str) -> SimStream:
        await trio.sleep(self.prof.latency_s)
        lst = self.listeners.get(host)
        if self._blocked(node, host):
            await trio.sleep(1.0)  # a connect timeout
            raise OSError(f"connect to {host}: timed out (the network is cut)")
        if lst is None or lst.closed:
            raise OSError(f"connect to {host}: connection refused")
        self.seq += 1
        conn = _Conn(self, node, host, self.seq)
        self.conns.append(conn)
        try:
            lst.send.send_nowait(SimStream(conn, host))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            raise OSError(f"connect to {host}: connection refused") from None
        return SimStream(conn, node)

    def kill(self, node: str, machine: bool) -> None:
        """``node`` died: a killed process's connections end (its peers read EOF); a
        crashed machine's go silent (its peers hear nothing more)."""
        lst = self.listeners.pop(node, None)
        if lst is not None:
            lst.closed = True
        for conn in list(self.conns):
            if node not in conn.ends:
                continue
            if machine:
                conn.silent = True
                for p_ in conn.pipes.values():
                    p_.kick()
            else:
                conn.closed.add(node)
                other = conn.ends[0] if conn.ends[1] == node else conn.ends[1]
                conn.pipes[other].eof = True
                conn.pipes[other].kick()
            self.conns.remove(conn)


# ============================================================================ the nodes
class _Server:
    """The client port of a member: the simulated clients call its dispatcher."""

    def __init__(self, dispatcher) -> None:
        self.dispatcher = dispatcher

    async def serve(self, _ssl, host, port, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def drain(self, timeout: float | None = None, wait_grace: float | None = None) -> None:
        await trio.lowlevel.checkpoint()


class _Storage(SimStorage):
    """One incarnation's storage: the node's disk; each opening of the journal (a
    recovery, a promotion) cuts the node's mirror of its journal to what survived."""

    def __init__(self, node: "_Node", hook) -> None:
        super().__init__(node.disk, hook=hook)
        self.node = node
        self.dead = False

    def open_journal(self, recovered, mode, interval_ms, **options):
        if not self.dead:
            self.disk.start_incarnation()
            node = self.node
            last = recovered.next_lsn - 1
            if last > len(node.payloads):
                # a snapshot copy of the leader's was installed: this node holds the
                # records up to its LSN as state, not as journal records -- the mirror
                # takes the leader's (checked by state: every acknowledged write there)
                src = next((n for n in node.sim.nodes.values() if n is not node and len(n.payloads) >= last), None)
                if src is None:
                    node.sim.fail("replicas-agree", f"{node.name} recovered records up to LSN {last}; no node "
                                                    "appended that many")
                else:
                    for lsn in range(len(node.payloads) + 1, last + 1):
                        node.on_append(lsn, src.payloads[lsn - 1])
                    node.snapshot_lsn = last
            node.forget_after(last)
            self.node.sim.trace(f"{self.node.name}: journal opened at LSN {recovered.next_lsn} "
                                f"(the mirror holds {len(self.node.payloads)})")
        return super().open_journal(recovered, mode, interval_ms, **options)


class _Node:
    def __init__(self, name: str, data_dir: str, disk: SimDisk) -> None:
        self.name = name
        self.data_dir = data_dir
        self.disk = disk
        self.member: ShardMember | None = None
        self.etcd: FakeEtcdClient | None = None
        self.storage: _Storage | None = None
        self.scope: trio.CancelScope | None = None
        self.done = trio.Event()
        self.done.set()
        self.alive = False
        self.killed = False
        self.incarnation = 0
        self.payloads: list[bytes] = []  # the journal's records, LSN 1 first
        self.chain: list[bytes] = []  # chain[i]: hash of payloads[0..i]
        self.calls: set[trio.CancelScope] = set()
        self.snapshot_lsn = 0  # the LSN of the last snapshot copy installed here

    def on_append(self, lsn: int, payload: bytes) -> None:
        if self.killed:
            return
        del self.payloads[lsn - 1:]
        del self.chain[lsn - 1:]
        if len(self.payloads) != lsn - 1:  # (a journal always appends right after its last)
            raise AssertionError(f"node {self.name}: LSN {lsn} appended after LSN {len(self.payloads)}")
        prev = self.chain[-1] if self.chain else b""
        self.payloads.append(payload)
        self.chain.append(hashlib.sha256(prev + payload).digest())

    def forget_after(self, last: int) -> None:
        del self.payloads[last:]
        del self.chain[last:]

    def chain_at(self, lsn: int) -> bytes | None:
        if lsn == 0:
            return b""
        return self.chain[lsn - 1] if lsn <= len(self.chain) else None

    def leader(self) -> ShardMember | None:
        m = self.member
        if (self.alive and not self.killed and m is not None and m.role == "leader" and m.server is not None
                and m.leadership is not None and m.leadership.is_leader_now()):
            return m
        return None


@dataclass
class Ack:
    """A write a client had acknowledged."""

    i: int
    node: str
    epoch: int
    lsn: int
    chain: bytes
    run_id: str
    at: float


@dataclass
class Result:
    """The outcome of one schedule: ``ok``, the first violation, the trace (with
    ``trace=True``), counters (``acks``, ``takeovers``, ``crashes``, ``armed_crashes``,
    the network's), and a digest of every answer and both journals (the same run, the
    same digest)."""

    seed: int
    ok: bool
    violation: Violation | None = None
    trace: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    digest: str = ""

    def headline(self) -> str:
        if self.ok:
            return f"seed {self.seed}: ok ({self.stats.get('acks', 0)} writes acknowledged, " \
                   f"{self.stats.get('takeovers', 0)} takeovers)"
        v = self.violation
        return f"seed {self.seed}: VIOLATION [{v.invariant}] at step {v.step}: {v.message}"


# ============================================================================ the simulator
class ReplSim:
    """One schedule against two nodes. Construct through :func:`run_seed`."""

    def __init__(self, seed: int, prof: Profile, steps: list[tuple], root: str, trace: bool) -> None:
        self.seed = seed
        self.prof = prof
        self.steps = steps
        self.tracing = trace
        master = random.Random(seed * 104729 + 3)
        self.trio_seed = master.getrandbits(64)
        self.id_rng = random.Random(master.getrandbits(64))
        self.net = SimNet(self, random.Random(master.getrandbits(64)), prof)
        self.etcd = FakeEtcd()
        self.nodes = {n: _Node(n, os.path.join(root, n), SimDisk(os.path.join(root, n), random.Random(
            master.getrandbits(64)), prof.faults)) for n in NODES}
        for node in self.nodes.values():
            node.disk.on_append = node.on_append
            node.sim = self
        self.armed: tuple[str, str, float] | None = None
        self.acks: list[Ack] = []
        self.epoch_node: dict[int, str] = {}
        self.trace_lines: list[str] = []
        self.failures: list[Violation] = []
        self.step_no = -1
        self.next_write = 0
        self.session = Session(peer="replsim")
        self.stats = {"writes": 0, "acks": 0, "refused": 0, "lost_in_flight": 0, "takeovers": 0, "crashes": 0,
                      "armed_crashes": 0}
        self.answers = hashlib.sha256()

    # ----------------------------------------------------------------- reporting
    def trace(self, text: str) -> None:
        if self.tracing:
            self.trace_lines.append(f"[{trio.current_time():9.4f}] #{self.step_no:<3} {text}")

    def fail(self, invariant: str, message: str) -> None:
        self.failures.append(Violation(invariant, message, self.step_no))

    def check(self) -> None:
        if self.failures:
            raise self.failures[0]

    # ----------------------------------------------------------------- nodes
    def leader(self) -> _Node | None:
        for node in self.nodes.values():
            if node.leader() is not None:
                return node
        return None

    def role_of(self, node: _Node) -> str:
        m = node.member
        return m.role if (node.alive and m is not None) else "down"

    def pick(self, who: str) -> list[_Node]:
        alive = [n for n in self.nodes.values() if n.alive]
        if who == "both":
            return alive
        lead = [n for n in alive if n.member is not None and n.member.role in ("leader", "stopping")]
        if who == "leader":
            return lead[:1]
        rest = [n for n in alive if n not in lead]
        return rest[:1]

    def start(self, node: _Node) -> None:
        """Start a new incarnation of ``node`` (everything it is made of exists at once:
        a kill right after this kills it, not the previous one)."""
        if node.alive:
            return
        node.incarnation += 1
        node.alive = True
        node.killed = False
        node.done = trio.Event()
        self._make_member(node)
        self.nursery.start_soon(self._incarnation, node)

    def _on_coordinator(self, coord) -> None:
        coord.ids = _SeededIds(coord.clock.mono_ms, self.id_rng)

    #: the shard the nodes are of, and the host of a node's client port (the cluster
    #: simulator, :mod:`rallypoint.testing.clustersim`, runs one of these per shard)
    shard = 0

    def client_host(self, node: _Node) -> str:
        return node.name

    def make_server(self, node: _Node):
        """``make_server`` of ``node``'s member (a subclass keeps what it serves)."""
        return _Server

    def wire_member(self, node: _Node, member: ShardMember) -> None:
        """More hooks on a new member (nothing here)."""

    def _make_member(self, node: _Node) -> None:
        storage = _Storage(node, self._on_coordinator)
        client = FakeEtcdClient(self.etcd)
        cfg = MemberConfig(
            etcd=["fake"], node=node.name, data_dir=node.data_dir, cluster="sim", shard=self.shard,
            durability="fsync", client=(self.client_host(node), 7411), replication=(node.name, 7412), ttl_s=2,
            isr_timeout_s=self.prof.isr_timeout_s,
            min_insync=self.prof.min_insync, drain_timeout_s=2.0,
            # the simulated network's hosts are names, not loopback addresses; the link is
            # authenticated by the cluster secret as on a real one (no TLS in the simulator)
            insecure=True,
            storage=StorageOptions(storage=storage, clock=Clock(wall_start=WALL0 + trio.current_time()),
                                   interval_ms=10),
            snapshots=SnapshotOptions(every_records=10**9, every_s=10**6))
        member = ShardMember(cfg, make_server=self.make_server(node), on_role=lambda role, m: self._on_role(node, role))
        member.make_etcd = lambda: client
        member.connect = lambda host, port: self.net.connect(node.name, host)
        member.listen = lambda port, host=None: self.net.listen(node.name)
        member.probe = lambda point: self._probe(node, point)
        self.wire_member(node, member)
        node.member, node.etcd, node.storage = member, client, storage
        node.scope = trio.CancelScope()

    async def _incarnation(self, node: _Node) -> None:
        member = node.member
        self.trace(f"node {node.name} #{node.incarnation} starts")
        try:
            with node.scope:
                await member.run()
            if not node.killed:
                self.trace(f"node {node.name} stopped")
        except BaseException as exc:  # noqa: BLE001 - classified here
            if not node.killed:
                inner = exc
                while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
                    inner = inner.exceptions[0]
                if isinstance(inner, (KeyboardInterrupt, SystemExit)):
                    raise
                if not isinstance(inner, trio.Cancelled):
                    import traceback

                    tb = "".join(traceback.format_exception(inner))
                    self.fail("node-error", f"node {node.name} stopped with {inner!r}\n{tb}")
        finally:
            node.alive = False
            node.done.set()

    def kill(self, node: _Node, how: str) -> None:
        """kill -9 (``process``) or power loss (``machine``) of ``node``, now."""
        if not node.alive or node.killed:
            return
        self.stats["crashes"] += 1
        node.killed = True
        self.trace(f"CRASH {node.name} ({how}) as {self.role_of(node)}")
        node.disk.crash(machine=how == "machine")
        node.storage.dead = True
        node.etcd.kill()
        self.net.kill(node.name, machine=how == "machine")
        for cs in list(node.calls):
            cs.cancel()
        node.scope.cancel()

    async def _restart_after(self, node: _Node, downtime: float) -> None:
        await node.done.wait()
        await trio.sleep(downtime)
        if not self.draining_started:
            self.start(node)

    async def _probe(self, node: _Node, point: str) -> None:
        self.trace(f"{node.name}: {point}")
        armed = self.armed
        if armed is not None and armed[0] == point:
            self.armed = None
            self.stats["armed_crashes"] += 1
            self.kill(node, armed[1])
            self.nursery.start_soon(self._restart_after, node, armed[2])
            await trio.sleep_forever()  # (cancelled at once: the node is dead)

    def _on_role(self, node: _Node, role: str) -> None:
        self.trace(f"{node.name} is {role}")
        if role != "leader" or node.killed:
            return
        m = node.member
        self.stats["takeovers"] += 1
        epoch = m.epoch
        # every write acknowledged so far is here, with the bytes its leader journaled
        self._check_acks(node, m.node.coordinator, f"when {node.name} began to lead epoch {epoch}")

    def _check_acks(self, node: _Node, coord, when: str) -> None:
        for a in self.acks:
            if a.run_id not in coord.runs.table:
                self.fail("lost-ack", f"write #{a.i} (acknowledged by {a.node} at epoch {a.epoch}, LSN {a.lsn}) is "
                                      f"missing on {node.name} {when}")
                return
            have = node.chain_at(a.lsn)
            if have != a.chain:
                self.fail("lost-ack", f"the journal of {node.name} up to LSN {a.lsn} is not what {a.node} "
                                      f"acknowledged write #{a.i} with (epoch {a.epoch}) {when}")
                return

    # ----------------------------------------------------------------- clients
    async def write(self) -> "Ack | None":
        """One client write (a new run) to whoever leads now: its :class:`Ack`, or None
        (no leader, refused, lost with its node)."""
        i = self.next_write
        self.next_write += 1
        self.stats["writes"] += 1
        node = self.leader()
        if node is None:
            self.trace(f"w{i}: no leader")
            self.answers.update(b"%d none;" % i)
            return
        m = node.member
        epoch = m.epoch
        disp = m.server.dispatcher
        op = p.ScopeCreate(name=f"w{i}")
        sink = CallSink(1)
        with trio.CancelScope() as cs:
            node.calls.add(cs)
            try:
                disp.submit(self.session, p.encoder.encode(op), sink, 1)
                await sink._event.wait()
                reply = sink.replies[1]
                if not isinstance(reply, BaseException):
                    await disp.wait_durable(sink.lsn)
            except RallypointError as exc:
                reply = exc
            finally:
                node.calls.discard(cs)
        if cs.cancelled_caught:
            self.stats["lost_in_flight"] += 1
            self.trace(f"w{i} -> {node.name}: lost (the node died)")
            self.answers.update(b"%d lost;" % i)
            return
        if isinstance(reply, BaseException):
            self.stats["refused"] += 1
            self.trace(f"w{i} -> {node.name}: {getattr(reply, 'code', type(reply).__name__)} ({str(reply)[:160]})")
            self.answers.update(b"%d %s;" % (i, str(getattr(reply, "code", "error")).encode()))
            return
        view = msgspec.msgpack.decode(reply, type=REPLY_TYPES[type(op)])
        chain = node.chain_at(sink.lsn)
        if chain is None:
            self.fail("replicas-agree", f"write #{i} was acknowledged at LSN {sink.lsn}, past {node.name}'s journal")
            return
        ack = Ack(i, node.name, epoch, sink.lsn, chain, view.id, trio.current_time())
        self.acks.append(ack)
        self.stats["acks"] += 1
        self.answers.update(b"%d ok %d %d;" % (i, epoch, sink.lsn))
        self.trace(f"w{i} -> {node.name}: acknowledged at epoch {epoch}, LSN {sink.lsn}")
        other = self.epoch_node.setdefault(epoch, node.name)
        if other != node.name:
            self.fail("one-leader-per-epoch", f"epoch {epoch}: writes acknowledged by {other} and by {node.name}")
        return ack

    # ----------------------------------------------------------------- steps
    async def _heal_after(self, s: float, fn) -> None:
        await trio.sleep(s)
        fn()

    async def do(self, step: tuple) -> None:
        kind = step[0]
        if kind == "write":
            for _ in range(step[1]):
                self.nursery.start_soon(self.write)
            await trio.sleep(0)
        elif kind == "tick":
            await trio.sleep(step[1])
        elif kind == "crash":
            _, who, how, downtime = step
            for node in self.pick(who):
                self.kill(node, how)
                self.nursery.start_soon(self._restart_after, node, downtime)
        elif kind == "arm":
            _, point, how, downtime = step
            self.trace(f"a crash ({how}) is armed at {point}")
            self.armed = (point, how, downtime)
        elif kind == "cut":
            self.trace(f"the replication link is cut for {step[1]} s")
            self.net.cut = True
            self.nursery.start_soon(self._heal_after, step[1], self._heal_link)
        elif kind == "etcd_cut":
            _, who, s = step
            for node in self.pick(who):
                self.trace(f"{node.name} is cut off from etcd for {s} s")
                client = node.etcd
                client.cut()
                self.nursery.start_soon(self._heal_after, s, client.heal)
        elif kind == "isolate":
            for node in self.pick("leader"):
                self.trace(f"{node.name} (the leader) is cut off from etcd and the standby for {step[1]} s")
                client = node.etcd
                client.cut()
                self.net.isolated.add(node.name)

                def heal(client=client, name=node.name):
                    client.heal()
                    self.net.isolated.discard(name)

                self.nursery.start_soon(self._heal_after, step[1], heal)
        elif kind == "handover":
            for node in self.pick("leader"):
                self.trace(f"{node.name} stops gracefully (hand-over)")
                node.member.stop()
                self.nursery.start_soon(self._restart_after, node, step[1])
        else:  # pragma: no cover
            raise ValueError(f"unknown step {step!r}")

    def _heal_link(self) -> None:
        self.net.cut = False

    # ----------------------------------------------------------------- the run
    async def run(self) -> None:
        trio._core._run._r.seed(self.trio_seed)
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self.draining_started = False
            await nursery.start(self.etcd.run)
            try:
                await self._run()
            except Violation as v:
                self.failures.append(v)
            finally:
                nursery.cancel_scope.cancel()

    async def _run(self) -> None:
        a, b = self.nodes["a"], self.nodes["b"]
        self.start(a)
        with trio.move_on_after(10):
            while self.leader() is None:
                await trio.sleep(0.05)
        self.start(b)
        for i, step in enumerate(self.steps):
            self.step_no = i
            await self.do(step)
            self.check()
        self.step_no = len(self.steps)
        await self.drain()
        self.check()
        await self.final_check()
        self.check()

    async def drain(self) -> None:
        """Heal everything, restart every node, and wait until the cluster converged:
        a leader serving with the other node in sync and holding every record, and one
        more write acknowledged."""
        self.trace("drain: every fault healed, every node restarted")
        self.draining_started = True
        self.armed = None
        self.net.cut = False
        self.net.isolated.clear()
        self.net.faults_on = False
        for node in self.nodes.values():
            if node.etcd is not None:
                node.etcd.heal()
        t0 = trio.current_time()
        acked_before = len(self.acks)
        writing: set[int] = set()
        while True:
            for node in self.nodes.values():
                if not node.alive and node.done.is_set():
                    self.start(node)
            lead = self.leader()
            progress = "no leader"
            if lead is not None:
                repl = lead.member.replication
                other = next(n for n in self.nodes.values() if n is not lead)
                sb = other.member.standby if other.alive and other.member is not None else None
                peer = repl.peer if repl is not None else None
                last = lead.member.node.coordinator.journal.last_lsn
                progress = (f"{lead.name} leads, journal at LSN {last}; standby "
                            f"{peer.state if peer else None}, acknowledged {peer.acked if peer else None}, applied "
                            f"{sb.applied_lsn if sb else None}")
                if (peer is not None and peer.state == "in_sync" and sb is not None
                        and sb.applied_lsn == last and peer.acked == last):
                    if len(self.acks) > acked_before:
                        return
                    if not writing:  # (again if the last one was lost or refused)
                        writing.add(1)
                        self.nursery.start_soon(self._drain_write, writing)
            if trio.current_time() - t0 > DRAIN_S:
                if self.tracing:
                    self.trace_lines += _task_tree()
                states = {n.name: (self.role_of(n), n.member.replication.peer.state
                                   if n.alive and n.member and n.member.replication and n.member.replication.peer
                                   else None) for n in self.nodes.values()}
                raise Violation("liveness", f"the healed cluster did not converge within {DRAIN_S:g} s "
                                            f"(roles and standby states: {states}; {progress}; writes acknowledged "
                                            f"in the drain: {len(self.acks) - acked_before})", self.step_no)
            await trio.sleep(0.1)

    async def _drain_write(self, writing: set) -> None:
        try:
            await self.write()
        finally:
            writing.clear()

    async def final_check(self) -> None:
        """Every acknowledged write on the leader; both journals, as on disk, agree on
        every LSN up to the highest acknowledged one."""
        lead = self.leader()
        self._check_acks(lead, lead.member.node.coordinator, "at the end")
        self.check()
        for node in self.nodes.values():  # kill -9: everything written stays on disk
            self.kill(node, "process")
            await node.done.wait()
        top = max((a.lsn for a in self.acks), default=0)
        disk = {}
        for node in self.nodes.values():
            recs = {lsn: bytes(pl) for lsn, pl in read_journal(node.data_dir, snapshot_lsn_of(node.data_dir))}
            disk[node.name] = recs
            for lsn, pl in recs.items():
                if lsn > len(node.payloads) or node.payloads[lsn - 1] != pl:
                    self.fail("replicas-agree", f"LSN {lsn} on {node.name}'s disk is not the record its journal "
                                                f"appended there")
                    return
        a, b = disk["a"], disk["b"]
        for lsn in range(1, top + 1):
            if lsn in a and lsn in b and a[lsn] != b[lsn]:
                self.fail("replicas-agree", f"the replicas differ at LSN {lsn} (acknowledged up to {top})")
                return
        # (LSNs a snapshot truncated from a journal, or that a node holds only in a
        # snapshot copy, are compared as their journals appended them)
        na, nb = self.nodes["a"], self.nodes["b"]
        if na.chain_at(top) is None or na.chain_at(top) != nb.chain_at(top):
            self.fail("replicas-agree", f"the journals of a and b differ before LSN {top}, the highest acknowledged")
            return
        for node in self.nodes.values():
            for ack in self.acks:
                if node.chain_at(ack.lsn) != ack.chain:
                    self.fail("lost-ack", f"the journal of {node.name} up to LSN {ack.lsn} is not what {ack.node} "
                                          f"acknowledged write #{ack.i} with (epoch {ack.epoch})")
                    return

    def digest(self) -> str:
        h = self.answers.copy()
        for node in self.nodes.values():
            for c in node.chain[-1:]:
                h.update(c)
        return h.hexdigest()[:16]


def _task_tree() -> list[str]:
    """Where every task waits (a liveness failure's trace)."""
    out = []

    def where(coro) -> str:
        frames = []
        while coro is not None:
            f = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
            if f is not None:
                frames.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom",
                                                                                                 None)
        return " > ".join(frames[-4:])

    def walk(task, depth):
        out.append("  " * depth + f"{task.name}: {where(task.coro)}")
        for n in task.child_nurseries:
            for t in n.child_tasks:
                walk(t, depth + 1)

    walk(trio.lowlevel.current_root_task(), 0)
    return out


# ============================================================================ mutants
def _mutant_standby_acks_early():
    from ..replication import wire
    from ..replication.standby import Standby

    async def send_acks(self, link):  # acknowledges what it appended, not what is durable
        journal = self.coord.journal
        sent = 0
        while True:
            lsn = journal.last_lsn
            if lsn > sent:
                await link.send(wire.Ack(lsn=lsn))
                sent = lsn
                continue
            await trio.sleep(0.001)

    return Standby, "_send_acks", send_acks


def _mutant_leader_acks_alone():
    from ..persistence.journal import Journal

    def set_replica_floor(self, lsn):  # the standby's acknowledgement caps nothing
        self._replica_floor = None
        self._on_progress(self._local_durable, self._synced_lsn)

    return Journal, "set_replica_floor", set_replica_floor


def _mutant_floor_lifted_early():
    from ..replication.leader import ReplicationLeader

    def may_lift(self):  # lifted whenever no session counts, whatever the ISR says
        peer = self.peer
        return peer is None or peer.state not in ("joining", "in_sync")

    return ReplicationLeader, "_may_lift_floor", may_lift


def _mutant_floor_lifted_before_shrink():
    from ..replication.leader import ReplicationLeader

    async def drop_locked(self, peer, why):  # acknowledges without the standby first, asks etcd after
        async with self._isr_lock:
            if self.peer is peer:
                self.peer = None
            was = peer.state
            peer.state = "dropped"
            self.journal.set_replica_floor(None)
            if was == "in_sync" and not await self.isr_store.set_isr([self.node]):
                self._deposed()
            self._update_gate()

    return ReplicationLeader, "_drop_locked", drop_locked


def _mutant_no_truncation():
    from ..replication.leader import ReplicationLeader

    def shared_end(self, hello):  # a rejoining replica keeps whatever it wrote
        return min(hello.last_lsn, self.journal.last_lsn)

    return ReplicationLeader, "shared_end", shared_end


#: deliberate bugs the simulator must catch: name -> () -> (class, attribute, replacement)
MUTANTS = {
    "standby_acks_early": _mutant_standby_acks_early,
    "leader_acks_alone": _mutant_leader_acks_alone,
    "floor_lifted_early": _mutant_floor_lifted_early,
    "floor_lifted_before_shrink": _mutant_floor_lifted_before_shrink,
    "no_truncation": _mutant_no_truncation,
}


def judge_run(sim, seed: int, result_cls):
    """Run ``sim.run`` on a MockClock (autojump) under ``sim.trio_seed``'s deterministic
    scheduling and judge it: ``result_cls(seed, ok, violation)`` -- its first recorded
    failure, a :class:`Violation` it raised, or a crash of the simulated system (a
    finding too, with its traceback). Shared by this simulator and
    :mod:`rallypoint.testing.clustersim`."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    trio._core._run._r.seed(sim.trio_seed)
    try:
        trio.run(sim.run, clock=clock)
        return result_cls(seed, not sim.failures, sim.failures[0] if sim.failures else None)
    except BaseException as exc:  # noqa: BLE001 - a crash of the simulated system is a finding too
        inner = exc
        while isinstance(inner, BaseExceptionGroup) and inner.exceptions:
            vs = [e for e in inner.exceptions if isinstance(e, Violation)]
            inner = vs[0] if vs else inner.exceptions[0]
        if isinstance(inner, KeyboardInterrupt):
            raise
        if sim.failures:
            return result_cls(seed, False, sim.failures[0])
        if isinstance(inner, Violation):
            return result_cls(seed, False, inner)
        import traceback

        tb = "".join(traceback.format_exception(inner))
        return result_cls(seed, False, Violation("crash", f"the simulation raised {inner!r}\n{tb}", sim.step_no))


@contextlib.contextmanager
def mutant(name: str | None):
    """Apply mutant ``name`` (None: nothing) for the block."""
    if name is None:
        yield
        return
    cls, attr, fn = MUTANTS[name]()
    old = cls.__dict__[attr]
    setattr(cls, attr, fn)
    try:
        yield
    finally:
        setattr(cls, attr, old)


# ============================================================================ running
def _quiet():
    lg = logging.getLogger("rallypoint")
    old = lg.level
    lg.setLevel(logging.CRITICAL + 10)
    return lambda: lg.setLevel(old)


async def _inline(fn, *args, **kw):
    """``trio.to_thread.run_sync`` on the loop (one seed decides all)."""
    await trio.lowlevel.checkpoint()
    return fn(*args)


def run_seed(seed: int, *, trace: bool = False, n_steps: int = DEFAULT_STEPS, steps: list[tuple] | None = None,
             mutant_name: str | None = None, profile: Profile | None = None) -> Result:
    """Run the schedule of ``seed`` (or exactly ``steps`` with the seed's profile) and
    return its :class:`Result`."""
    prof, generated = generate(seed, n_steps)
    prof = profile or prof
    steps = generated if steps is None else steps
    root = tempfile.mkdtemp(prefix=f"rpreplsim-{seed}-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    sim = ReplSim(seed, prof, steps, root, trace)
    quiet = _quiet()
    det = trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING
    trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING = True
    token_rng = random.Random(f"rallypoint-replsim:tokens:{seed}")
    real_token = _claim_mod.new_token
    real_thread = trio.to_thread.run_sync
    _claim_mod.new_token = _pool_mod.new_token = lambda: token_rng.getrandbits(62) + 1
    real_nonce = _peerauth.new_nonce
    _peerauth.new_nonce = lambda: token_rng.getrandbits(128).to_bytes(16, "big")  # (the link's handshake)
    trio.to_thread.run_sync = _inline  # (snapshot copies, journal reads: on the loop)
    try:
        with mutant(mutant_name):
            res = judge_run(sim, seed, Result)
    finally:
        trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING = det
        _claim_mod.new_token = _pool_mod.new_token = real_token
        _peerauth.new_nonce = real_nonce
        trio.to_thread.run_sync = real_thread
        quiet()
        shutil.rmtree(root, ignore_errors=True)
    res.trace = sim.trace_lines
    res.stats = dict(sim.stats, **{f"net_{k}": v for k, v in sim.net.stats.items()}, profile=prof.describe())
    res.digest = sim.digest()
    return res


def _run_chunk(args) -> tuple[int, list[tuple[int, str, str, int]], float]:
    seeds, n_steps, mutant_name = args
    fails = []
    t0 = time.perf_counter()
    for s in seeds:
        r = run_seed(s, n_steps=n_steps, mutant_name=mutant_name)
        if not r.ok:
            fails.append((s, r.violation.invariant, r.violation.message.split("\n")[0], r.violation.step))
    return len(seeds), fails, time.perf_counter() - t0


def run_seeds(seeds, *, processes: int = 2, n_steps: int = DEFAULT_STEPS, mutant_name: str | None = None,
              chunk: int = 10, stop_after: int = 1) -> dict:
    """Run many seeds on ``processes`` worker processes (``PYTHONHASHSEED=0``); stops
    after ``stop_after`` failures. Returns ``{"run", "failures": [(seed, invariant,
    message, step)], "wall_s", "cpu_s"}``."""
    seeds = list(seeds)
    chunks = [(seeds[i:i + chunk], n_steps, mutant_name) for i in range(0, len(seeds), chunk)]
    return run_chunks(_run_chunk, chunks, processes=processes, stop_after=stop_after)


def run_chunks(run_chunk, chunks: list, *, processes: int, stop_after: int) -> dict:
    """``run_chunk(chunk) -> (seeds run, failures, CPU seconds)`` over ``chunks``, on
    ``processes`` spawned worker processes (``PYTHONHASHSEED=0``, so a seed replays
    alike in each; ``run_chunk`` a module-level function), until ``stop_after``
    failures: ``{"run", "failures" (sorted), "cpu_s", "wall_s"}``. Shared by this
    simulator and :mod:`rallypoint.testing.clustersim`."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    out = {"run": 0, "failures": [], "cpu_s": 0.0}
    old = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = "0"
    try:
        if processes <= 1:
            results = map(run_chunk, chunks)
            pool = None
        else:
            pool = mp.get_context("spawn").Pool(processes)
            results = pool.imap_unordered(run_chunk, chunks)
        try:
            for n, fails, cpu in results:
                out["run"] += n
                out["cpu_s"] += cpu
                out["failures"].extend(fails)
                if len(out["failures"]) >= stop_after:
                    break
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    finally:
        if old is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = old
    out["failures"].sort()
    out["wall_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m rallypoint.testing.replsim``: one seed (``--seed``) or many
    (``--seeds A:B``). Exit status 1 when a seed fails."""
    ap = argparse.ArgumentParser(prog="python -m rallypoint.testing.replsim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, help="run this seed")
    ap.add_argument("--seeds", help="run seeds A:B (or N: 0:N)")
    ap.add_argument("--trace", action="store_true", help="print the trace (with --seed)")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per schedule")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--mutant", choices=sorted(MUTANTS), help="run with this deliberate bug (it must be caught)")
    args = ap.parse_args(argv)
    if (args.seed is None) == (args.seeds is None):
        ap.error("give --seed or --seeds")
    if args.steps < 1 or args.processes < 1:
        ap.error("--steps and --processes must be >= 1")
    if os.environ.get("PYTHONHASHSEED") != "0":  # set order must be the same in every process
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "rallypoint.testing.replsim",
                                  *(argv if argv is not None else sys.argv[1:])])
    if args.seed is not None:
        res = run_seed(args.seed, trace=args.trace, n_steps=args.steps, mutant_name=args.mutant)
        if args.trace:
            print(f"profile: {res.stats.get('profile')}")
            print("\n".join(res.trace))
        print(res.headline(), f"digest {res.digest}")
        if not res.ok:
            print(f"replay: python -m rallypoint.testing.replsim --seed {args.seed} --steps {args.steps} "
                  f"{'--mutant ' + args.mutant + ' ' if args.mutant else ''}--trace")
        return 0 if res.ok else 1
    a, _, b = args.seeds.partition(":")
    try:
        lo, hi = (0, int(a)) if not b else (int(a), int(b))
    except ValueError:
        ap.error(f"--seeds is A:B or N (got {args.seeds!r})")
    if not 0 <= lo < hi:
        ap.error(f"--seeds A:B needs 0 <= A < B (got {args.seeds!r})")
    out = run_seeds(range(lo, hi), processes=args.processes, n_steps=args.steps, mutant_name=args.mutant)
    print(f"{out['run']} seeds in {out['wall_s']:.1f} s wall ({out['cpu_s']:.1f} s CPU), "
          f"{len(out['failures'])} failing")
    for seed, inv, msg, step in out["failures"][:5]:
        print(f"seed {seed}: [{inv}] at step {step}: {msg}")
        print(f"replay: python -m rallypoint.testing.replsim --seed {seed} --steps {args.steps} "
              f"{'--mutant ' + args.mutant + ' ' if args.mutant else ''}--trace")
    return 0 if not out["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
