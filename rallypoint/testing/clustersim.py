"""Deterministic simulation of a sharded cluster: several replicated shards, one seed.

Run one seed (replays exactly; ``--trace`` prints what happened), or many::

    python -m rallypoint.testing.clustersim --seed 12 --trace
    python -m rallypoint.testing.clustersim --seeds 0:200
    python -m rallypoint.testing.clustersim --seeds 0:20 --mutant outbox_no_dedup   # must fail

What runs, in one Trio run on virtual time (:class:`~trio.testing.MockClock`), is
``--shards`` (2 or 3) replicated shards of one cluster, each two production nodes as
:mod:`rallypoint.testing.replsim` runs them (one :class:`~rallypoint.testing.replsim.
ReplSim` per shard, reused whole: the real :class:`~rallypoint.cluster.member.
ShardMember` -- election, epochs, fenced in-sync set, standby, takeover, rejoin --, the
real replication, the real journal on the seeded disk, the real recovery), plus what
crosses the shards, all production code: each leader's :class:`~rallypoint.cluster.
peers.Peers`, :class:`~rallypoint.cluster.peers.RemoteRuns` (``run.link`` /
``run.adopt_remote``), :class:`~rallypoint.cluster.peers.OutboxSender` and the outbox
kind (:mod:`rallypoint.actors.outbox`: entries made by the apply that ends a run,
delivered at least once, applied once), the node tokens of the cluster secret
(:mod:`rallypoint.cluster.peerauth`, checked by the callee's ``Service.hello``), the
slot map (``cluster init``'s :func:`~rallypoint.cluster.shardmap.create_cluster`) and the
sharded ids. The fakes:

- **etcd**: one :class:`~rallypoint.testing.fake_etcd.FakeEtcd` for the cluster (leases
  expiring on the virtual clock, watches -- delayed for one node at times --, a node cut
  off from it);
- **the replication network** of each shard: replsim's :class:`~rallypoint.testing.
  replsim.SimNet` (link messages dropped, duplicated, delayed, reordered; the link cut);
- **the connections between shards** (:class:`_PeerConn`, given to ``Peers`` through
  ``ShardMember.open_peer``): a connection to the callee's client-port dispatcher (the
  one the member serves: :class:`~rallypoint.cluster.member._Fenced` while it leads, the
  NOT_LEADER redirect while it stands by), its handshake the production ``hello``; each
  request and reply travels with a seeded latency, is held while its direction is cut
  (TCP retransmits until the path heals: a partition, a one-way loss), ends the
  connection when the callee's process dies (a killed process's peers read EOF, a
  crashed machine's hear nothing until it is back), and may be **reset** after the
  callee applied the request (the caller sends it again: the idempotency of every call
  between shards is exercised). The client port itself is no TCP server: clients call
  the member's dispatcher in process, as replsim's do, and take an answer -- a read's
  too -- only once the journal is durable past it, as the server sends it (a client
  gives up after :data:`READ_WAIT_S`).

The seed decides the profile (replsim's, plus the peer latency and reset rate) and a
schedule: runs created on the shards that are not the space's home shard, pool units
and claims of the home shard acquired by those runs (the first request of a run links
it: ``run.link`` on its shard), released, runs ended (the outbox carries each end to the
home shard, which frees what the run held there), pages of the space's events merged
over the shards, reads sent to every node that believes it leads (as a client with
stale routing would), and faults: kill -9 or power loss of either node of any shard, a
shard's replication link cut, a node cut off from etcd, a leader isolated from etcd and
every node, the leaders of two shards partitioned from each other, one direction between
them lost, a node's etcd watches delayed, a graceful hand-over. At the end everything
heals, each shard converges (replsim's drain), and every run end told by the outbox must
have reached the home shard.

The invariants (a failing one names itself):

- replsim's per shard: **lost-ack** (every acknowledged write in the state of each node
  when it starts to lead, and on both journals at the end, byte for byte),
  **replicas-agree**, **one-leader-per-epoch** (for writes), **liveness**;
- **one-leader-per-epoch** for every answer, reads included: one (shard, epoch), one node;
- **one-leader-answering**: once a node of a shard answered at epoch e (at admission
  time t), no node of that shard answers a request admitted at or after t at an epoch
  below e (a deposed leader's stale state is never served);
- **outbox-once**: the home shard's journal (on each node, at each takeover and at the
  end) applies each outbox entry of each source shard once, in order, without a gap
  (``RemoteRunEnded`` / ``RemoteDeliveryNoted`` with ``seq`` 1, 2, 3, ...);
- **outbox-delivered**: after the drain, every run whose end was acknowledged and that
  the home shard had linked is ended on the home shard's leader;
- **events-once**: the space's events, paged by the SDK's own merge over the shards
  (:func:`~rallypoint.client.shardevents.list_events`, the client's vector cursor kept
  from page to page, and paged to the end after the drain), give each shard's events
  once, in ``seq`` order, without a gap;
- **over-granted**: at no moment do the home shard's grants of the pool, as clients hold
  them, exceed its units, nor two runs hold one claim key. A client counts a grant held
  from its answer until the earliest of its lease's end as the client can bound it (the
  request's admission time + ``lease_ms``: the server's grant is later, a takeover only
  extends leases), the sending of its release, or the sending of its run's cancel: a
  client's count never exceeds the server's.

:data:`MUTANTS` are deliberate bugs the simulator must catch (``tests/test_clustersim.py``
runs each against a few seeds and expects a violation). Not covered yet: budgets,
quotas and admission holds of tasks (``admission.reserve``), ``events.watch`` (the
merged stream), the router's other merges, HTTP.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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

from .. import ids as _ids_mod
from .. import protocol as p
from ..actors import claim as _claim_mod
from ..actors import pool as _pool_mod
from ..actors.api import REPLY_TYPES
from ..actors.sharding import home_slot
from ..cluster import peerauth as _peerauth
from ..cluster.shardmap import SlotMap, create_cluster
from ..errors import NotLeaderError, RallypointError, UnavailableError
from ..records import RemoteDeliveryNoted, RemoteRunEnded, decode_commit
from ..service import CallSink, Session
from ..wire import PROTOCOL_VERSION, Hello
from . import replsim as _rs
from .fake_etcd import FakeEtcdClient
from .sim import Violation

__all__ = ["Profile", "Result", "generate", "run_seed", "run_seeds", "main", "MUTANTS", "home_shard"]

DEFAULT_STEPS = 60
DEFAULT_SHARDS = 2
#: slots of the simulated cluster's map (slot i -> shard i mod shards)
SLOTS = 8
#: the pool of the home shard (units) and the claim keys
POOL = "gpu"
POOL_UNITS = 2
CLAIM_KEYS = ("deploy", "migrate")
#: lease of every grant and claim the clients take, milliseconds
LEASE_MS = 20_000
#: after the drain: every run end reaches the home shard within this, seconds
DELIVER_S = 30.0
SPACE = "default"
#: a client gives up on an answer the server holds (not yet durable) this long, seconds
READ_WAIT_S = 10.0
#: events a page of the client's ``events.list`` asks for
EVENTS_PAGE = 20
#: virtual seconds between a client's step and the next step
CLIENT_GAP_S = 0.05


def home_shard(shards: int) -> int:
    """The home shard of :data:`SPACE` in a simulated cluster of ``shards`` shards
    (``cluster init``'s map: slot i on shard i mod ``shards``)."""
    return home_slot(SPACE, SLOTS) % shards


# ============================================================================ schedule
@dataclass
class Profile:
    """What the seed decides besides the steps: each shard's replsim profile (``rs``),
    the latency of a message between shards (``peer_latency_s``, seconds) and the chance
    that a connection between shards is reset after its request was applied
    (``reset_p``)."""

    rs: _rs.Profile
    peer_latency_s: float
    reset_p: float

    def describe(self) -> str:
        return f"{self.rs.describe()} peer_latency={self.peer_latency_s}s reset={self.reset_p}"


def generate(seed: int, n_steps: int = DEFAULT_STEPS, shards: int = DEFAULT_SHARDS) -> tuple[Profile, list[tuple]]:
    """The profile and the steps of ``seed``. Steps (``sh``: a shard number):

    - ``("run", n)``: n runs created on shards other than the home shard;
    - ``("acquire", what)``: a live run asks the home shard for a pool unit (``pool``)
      or a claim key (``claim:<key>``), ``wait_ms`` 0;
    - ``("release",)``: a grant or claim a client holds is released;
    - ``("end",)``: a live run is cancelled on its shard (its end reaches the home
      shard through the outbox);
    - ``("read", sh)``: a read sent to every node of ``sh`` that believes it leads;
    - ``("events",)``: the client's next page of the space's events over every shard;
    - ``("tick", s)``: s virtual seconds pass;
    - ``("crash", sh, who, how, downtime)``: replsim's crash, in shard ``sh``;
    - ``("cut", sh, s)``: shard ``sh``'s replication link cut for s seconds;
    - ``("etcd_cut", sh, who, s)``: a node of ``sh`` cut off from etcd;
    - ``("isolate", sh, s)``: the leader of ``sh`` cut off from etcd, its standby and
      every other shard;
    - ``("partition", a, b, s)``: the nodes of shards a and b cannot reach each other;
    - ``("oneway", a, b, s)``: what shard a's nodes send to shard b's is lost (held);
    - ``("handover", sh, downtime)``: the leader of ``sh`` stops gracefully;
    - ``("watch_lag", sh, who, delay, s)``: every etcd watch event reaches the leader or
      the standby of ``sh`` ``delay`` seconds late, for s seconds.
    """
    rs_prof, _ = _rs.generate(seed)
    rng = random.Random(f"rallypoint-clustersim:profile:{seed}")
    prof = Profile(rs=rs_prof, peer_latency_s=rng.choice((0.0005, 0.002, 0.02)),
                   reset_p=rng.choice((0.0, 0.05, 0.2, 0.4)))
    rng = random.Random(f"rallypoint-clustersim:steps:{seed}")
    sh = lambda: rng.randrange(shards)  # noqa: E731
    steps: list[tuple] = [("tick", 1.0), ("run", 2), ("tick", 0.3), ("acquire", "pool"),
                          ("acquire", f"claim:{CLAIM_KEYS[0]}"), ("tick", 0.3)]
    while len(steps) < n_steps:
        x = rng.random()
        if x < 0.12:
            steps.append(("run", rng.choice((1, 1, 2))))
        elif x < 0.30:
            steps.append(("acquire", rng.choice(("pool", "pool", *(f"claim:{k}" for k in CLAIM_KEYS)))))
        elif x < 0.37:
            steps.append(("release",))
        elif x < 0.46:
            steps.append(("end",))
        elif x < 0.50:
            steps.append(("read", sh()))
        elif x < 0.54:
            steps.append(("events",))
        elif x < 0.66:
            steps.append(("tick", rng.choice((0.01, 0.1, 0.5, 1.0, 2.0, 4.0))))
        elif x < 0.74:
            steps.append(("crash", sh(), rng.choice(("leader", "leader", "standby", "both")),
                          rng.choice(("process", "machine")), rng.choice((0.1, 1.0, 3.0, 8.0))))
        elif x < 0.78:
            steps.append(("cut", sh(), rng.choice((0.3, 1.5, 4.0))))
        elif x < 0.82:
            steps.append(("etcd_cut", sh(), rng.choice(("leader", "standby")), rng.choice((0.5, 1.5, 3.0, 6.0))))
        elif x < 0.88:
            steps.append(("isolate", sh(), rng.choice((1.0, 3.0, 6.0))))
        elif x < 0.93:
            a = sh()
            steps.append(("partition", a, (a + 1 + rng.randrange(shards - 1)) % shards, rng.choice((0.5, 2.0, 5.0))))
        elif x < 0.97:
            a = sh()
            steps.append(("oneway", a, (a + 1 + rng.randrange(shards - 1)) % shards, rng.choice((0.5, 2.0, 5.0))))
        else:
            steps.append(("handover", sh(), rng.choice((0.1, 1.0))))
    # watches delayed: from a stream of its own, so the other steps stay as they were
    lag = random.Random(f"rallypoint-clustersim:lag:{seed}")
    for _ in range(lag.choice((0, 0, 1, 2))):
        steps.insert(lag.randrange(4, len(steps) + 1), ("watch_lag", lag.randrange(shards),
                                                        lag.choice(("leader", "standby")),
                                                        lag.choice((0.2, 0.5, 1.5)), lag.choice((2.0, 5.0, 10.0))))
    return prof, steps


# ============================================================================ the client port
class _Port:
    """A member's client port (``make_server``): what it serves (``dispatcher``) while
    its ``serve`` runs -- the peers' connections and the clients reach it there."""

    def __init__(self, node, dispatcher) -> None:
        self.node = node
        self.dispatcher = dispatcher
        self.closed = False

    async def serve(self, _ssl, host, port, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.node.port = self
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self.closed = True
            if self.node.port is self:
                self.node.port = None

    async def drain(self, timeout: float | None = None, wait_grace: float | None = None) -> None:
        await trio.lowlevel.checkpoint()


# ============================================================================ between the shards
class _PeerConn:
    """A connection of ``Peers`` from node ``src`` to ``dst``'s client port (see the
    module docstring): ``Connection``'s ``call``, ``closed``, ``wait_closed``."""

    def __init__(self, sim: "ClusterSim", src, dst, port: _Port, session: Session) -> None:
        self.sim = sim
        self.src = src
        self.dst = dst
        self.port = port
        self.session = session
        self.incarnation = dst.incarnation
        self._closed = False

    @classmethod
    async def open(cls, sim: "ClusterSim", src, url: str, *, api_key=None, client_name="", connect_timeout=10.0,
                   **_):
        host = url.split("://", 1)[-1].rsplit(":", 1)[0]
        dst = sim.by_host.get(host)
        await trio.sleep(sim.prof.peer_latency_s)
        if dst is None:
            raise UnavailableError(f"{url}: no such host")
        if sim.blocked(src, dst) or sim.blocked(dst, src):
            await trio.sleep(connect_timeout)
            raise UnavailableError(f"connect to {url}: timed out (the network is cut)")
        port = dst.port
        if not dst.alive or dst.killed or port is None or port.closed:
            raise UnavailableError(f"connect to {url}: connection refused")
        # the production handshake: a node token of the cluster secret, checked by the
        # callee's Service.hello (or NOT_LEADER from a standby's redirect)
        session, _ok = port.dispatcher.hello(Hello(PROTOCOL_VERSION, api_key, client_name), f"{src.host}:1")
        await trio.sleep(sim.prof.peer_latency_s)
        return cls(sim, src, dst, port, session)

    async def __aenter__(self) -> "_PeerConn":
        return self

    async def __aexit__(self, *exc) -> None:
        self._closed = True

    async def aclose(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        dst = self.dst
        if self._closed or self.port.closed or dst.port is not self.port:
            return True
        if dst.incarnation != self.incarnation or dst.killed or not dst.alive:
            # a killed process: EOF at once; a crashed machine: silent until it is back
            return dst.how != "machine" or dst.alive
        return False

    async def wait_closed(self) -> None:
        while not self.closed:
            await trio.sleep(0.25)

    def _lost(self, why: str) -> UnavailableError:
        self._closed = True
        return UnavailableError(f"the connection to {self.dst.host} ended ({why})")

    async def _travel(self, a, b) -> None:
        await trio.sleep(self.sim.prof.peer_latency_s * (0.5 + self.sim.peer_rng.random()))
        while self.sim.blocked(a, b):  # (TCP sends again until the path heals)
            if self.closed:
                raise self._lost("closed while the path was cut")
            await trio.sleep(0.1)
        if self.closed:
            raise self._lost("closed")

    async def call(self, op: msgspec.Struct) -> msgspec.Raw:
        sim = self.sim
        await self._travel(self.src, self.dst)
        sink = CallSink(1)
        self.port.dispatcher.submit(self.session, p.encoder.encode(op), sink, 1)
        while not sink._event.is_set():
            if self.closed:
                raise self._lost("the callee went away with the call in flight")
            with trio.move_on_after(0.1):
                await sink._event.wait()
        reply = sink.replies[1]
        if not isinstance(reply, BaseException):
            done = trio.Event()

            async def durable():
                with contextlib.suppress(RallypointError):
                    await self.port.dispatcher.wait_durable(sink.lsn)
                done.set()

            sim.nursery.start_soon(durable)
            while not done.is_set():
                if self.closed:
                    raise self._lost("the callee went away before its answer was durable")
                with trio.move_on_after(0.1):
                    await done.wait()
        if sim.faults_on and sim.peer_rng.random() < sim.prof.reset_p:
            sim.stats["peer_resets"] += 1
            sim.trace(f"net: the connection {self.src.host}->{self.dst.host} is reset after "
                      f"{op.__struct_config__.tag} was applied")
            raise self._lost("reset")
        await self._travel(self.dst, self.src)
        sim.stats["peer_calls"] += 1
        if isinstance(reply, BaseException):
            raise reply
        return msgspec.Raw(reply)


class _EventsTransport:
    """What :func:`~rallypoint.client.shardevents.list_events` needs of the SDK's
    :class:`~rallypoint.client.router.ShardedTransport`: the map, the shards, and one
    call to a shard's leader (here: to the node of the shard that believes it leads)."""

    def __init__(self, sim: "ClusterSim") -> None:
        self.sim = sim
        self.map = SlotMap(owners=[i % len(sim.shards) for i in range(SLOTS)])

    def event_shards(self, op) -> list[int]:
        return list(range(len(self.sim.shards)))

    async def call_shard(self, shard: int, op) -> bytes:
        got = await self.sim.request(self.sim.shards[shard], op, read=True, raw=True)
        if got is None:
            raise UnavailableError(f"shard {shard}: no leader answered", details={"shard": shard})
        if isinstance(got, RallypointError):
            raise got
        return got[0]


# ============================================================================ one shard
class ShardSim(_rs.ReplSim):
    """One shard of the cluster: replsim's two-node simulator, on the cluster's etcd,
    with its nodes' client ports and peer connections (see the module docstring)."""

    def __init__(self, cluster: "ClusterSim", shard: int, root: str) -> None:
        self.cluster = cluster
        self.shard = shard
        super().__init__(cluster.seed * 7919 + shard, cluster.prof.rs, [], root, cluster.tracing)
        self.etcd = cluster.etcd
        self.failures = cluster.failures
        for node in self.nodes.values():
            node.host = f"s{shard}{node.name}"
            node.shard = shard
            node.port = None
            node.how = None
            cluster.by_host[node.host] = node

    def trace(self, text: str) -> None:
        self.cluster.trace(f"s{self.shard} {text}")

    def fail(self, invariant: str, message: str) -> None:
        self.cluster.fail(invariant, f"shard {self.shard}: {message}")

    def client_host(self, node) -> str:
        return node.host

    def make_server(self, node):
        return lambda dispatcher: _Port(node, dispatcher)

    def wire_member(self, node, member) -> None:
        cluster = self.cluster

        async def open_peer(url, **kw):
            return await _PeerConn.open(cluster, node, url, **kw)

        member.open_peer = open_peer

    def _on_coordinator(self, coord) -> None:
        pass  # the production id generator (slots of the map; its randomness is seeded: run_seed)

    def kill(self, node, how: str) -> None:
        if node.alive and not node.killed:
            node.how = how
        super().kill(node, how)

    def _on_role(self, node, role: str) -> None:
        super()._on_role(node, role)
        if role == "leader" and not node.killed and self.shard == self.cluster.home:
            self.cluster.check_outbox(node, f"when {self.shard}/{node.name} began to lead")

    def leaders_believed(self) -> list:
        """The nodes that believe they lead (serving, whatever their lease says)."""
        out = []
        for n in self.nodes.values():
            m = n.member
            if n.alive and not n.killed and m is not None and m.role == "leader" and m.server is not None:
                out.append(n)
        return out


# ============================================================================ results
@dataclass
class Grant:
    """A grant or claim lease a client holds (times: Trio seconds)."""

    what: str  # "pool" or "claim:<key>"
    run_id: str
    units: int
    answered_at: float
    until: float  # the earliest the lease may end (admission + lease)
    grant_id: str | None
    token: int
    ended_at: float | None = None


@dataclass
class Result:
    """The outcome of one schedule: ``ok``, the first violation, the trace, counters,
    and a digest of every answer and journal (the same run, the same digest)."""

    seed: int
    ok: bool
    violation: Violation | None = None
    trace: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    digest: str = ""

    def headline(self) -> str:
        if self.ok:
            s = self.stats
            return (f"seed {self.seed}: ok ({s.get('acks', 0)} writes, {s.get('grants', 0)} grants, "
                    f"{s.get('remote_ends', 0)} run ends delivered, {s.get('takeovers', 0)} takeovers)")
        v = self.violation
        return f"seed {self.seed}: VIOLATION [{v.invariant}] at step {v.step}: {v.message}"


# ============================================================================ the cluster
class ClusterSim:
    """One schedule against ``shards`` shards. Construct through :func:`run_seed`."""

    def __init__(self, seed: int, prof: Profile, steps: list[tuple], root: str, trace: bool, shards: int) -> None:
        self.seed = seed
        self.prof = prof
        self.steps = steps
        self.tracing = trace
        master = random.Random(seed * 15485863 + 11)
        self.trio_seed = master.getrandbits(64)
        self.peer_rng = random.Random(master.getrandbits(64))
        self.pick_rng = random.Random(master.getrandbits(64))
        self.etcd = _rs.FakeEtcd()
        self.trace_lines: list[str] = []
        self.failures: list[Violation] = []
        self.step_no = -1
        self.by_host: dict[str, object] = {}
        self.faults_on = True
        self.cut: set[frozenset] = set()  # pairs of shards that cannot reach each other
        self.oneway: set[tuple[int, int]] = set()  # (a, b): what a sends to b is lost
        self.isolated: set[str] = set()  # hosts cut off from every other node
        self.home = 0
        self.shards = [ShardSim(self, s, os.path.join(root, f"s{s}")) for s in range(shards)]
        self.runs: dict[str, int] = {}  # live runs (acknowledged, not cancelled) -> their shard
        self.linked: set[str] = set()  # runs the home shard answered a request of
        self.ended: list[str] = []  # runs whose cancel was acknowledged
        self.grants: list[Grant] = []
        self.epoch_node: dict[tuple[int, int], str] = {}
        self.top_answer: dict[int, tuple[int, float, str]] = {}
        self.answers = hashlib.sha256()
        self.events_cursor: str | None = None  # the client's vector cursor over the shards
        self.events_seen: dict[int, int] = {}  # shard -> the last seq the client was given
        self.events_lock = trio.Lock()
        self.stats = {"events": 0, "peer_calls": 0, "peer_resets": 0, "grants": 0, "refused": 0, "answers": 0,
                      "remote_ends": 0, "reads": 0}

    # ----------------------------------------------------------------- reporting
    def trace(self, text: str) -> None:
        if self.tracing:
            self.trace_lines.append(f"[{trio.current_time():9.4f}] #{self.step_no:<3} {text}")

    def fail(self, invariant: str, message: str) -> None:
        self.failures.append(Violation(invariant, message, self.step_no))

    def check(self) -> None:
        if self.failures:
            raise self.failures[0]

    # ----------------------------------------------------------------- network
    def blocked(self, a, b) -> bool:
        """True while what node ``a`` sends node ``b`` is lost (held)."""
        if a.host in self.isolated or b.host in self.isolated:
            return True
        return frozenset((a.shard, b.shard)) in self.cut or (a.shard, b.shard) in self.oneway

    # ----------------------------------------------------------------- invariants
    def answered(self, sh: ShardSim, node, epoch: int, admitted: float) -> None:
        """Node ``node`` of ``sh`` answered (not NOT_LEADER) a request admitted at
        ``admitted`` while it led ``epoch``."""
        self.stats["answers"] += 1
        other = self.epoch_node.setdefault((sh.shard, epoch), node.name)
        if other != node.name:
            self.fail("one-leader-per-epoch", f"shard {sh.shard} epoch {epoch}: answers from {other} and from "
                                              f"{node.name}")
        top = self.top_answer.get(sh.shard)
        if top is not None and epoch < top[0] and admitted >= top[1]:
            self.fail("one-leader-answering", f"shard {sh.shard}: {node.name} answered at epoch {epoch} a request "
                                              f"admitted at {admitted:.4f}, after {top[2]} answered at epoch {top[0]} "
                                              f"(admitted at {top[1]:.4f})")
        if top is None or epoch > top[0]:
            self.top_answer[sh.shard] = (epoch, admitted, node.name)

    def check_outbox(self, node, when: str) -> None:
        """outbox-once on ``node``'s journal (a node of the home shard)."""
        seen: dict[int, int] = {}
        for lsn, payload in enumerate(node.payloads, 1):
            try:
                recs = decode_commit(payload)
            except Exception:  # noqa: BLE001 - (a record of another kind: not a commit)
                continue
            for r in recs:
                if isinstance(r, (RemoteRunEnded, RemoteDeliveryNoted)):
                    last = seen.get(r.shard, 0)
                    if r.seq != last + 1:
                        what = "again" if r.seq <= last else f"after {last} (a gap)"
                        self.fail("outbox-once", f"the journal of home node {node.host} applies outbox entry "
                                                 f"{r.seq} of shard {r.shard} {what} at LSN {lsn} {when}")
                        return
                    seen[r.shard] = r.seq

    def over_granted(self, g: Grant) -> None:
        at = g.answered_at
        held = [x for x in self.grants if x.what == g.what and x is not g and x.answered_at <= at
                and at < x.until and (x.ended_at is None or at < x.ended_at)
                and not (x.run_id == g.run_id and x.token == g.token)]  # (the same lease answered again)
        cap = POOL_UNITS if g.what == "pool" else 1
        if sum(x.units for x in held) + g.units > cap:
            self.fail("over-granted", f"{g.what}: run {g.run_id[-6:]} was granted {g.units} at {at:.4f} while "
                                      f"{', '.join(x.run_id[-6:] for x in held)} held "
                                      f"{sum(x.units for x in held)} of {cap}")

    # ----------------------------------------------------------------- clients
    async def request(self, sh: ShardSim, op, *, read: bool = False, raw: bool = False):
        """``op`` to the node of ``sh`` that believes it leads (a read: to every one).
        Returns the decoded answer of the last node that answered, a RallypointError, or
        None (no leader, lost); records each answer."""
        targets = sh.leaders_believed()
        if not targets:
            return None
        if not read:
            return await self._one(sh, targets[0], op, read, raw)
        got: dict[int, object] = {}

        async def one(i, node):
            got[i] = await self._one(sh, node, op, read, raw)

        async with trio.open_nursery() as nursery:
            for i, node in enumerate(targets):
                nursery.start_soon(one, i, node)
        out = None
        for i in range(len(targets)):
            if got.get(i) is not None:
                out = got[i]
        return out

    async def _one(self, sh: ShardSim, node, op, read: bool, raw: bool = False):
        m = node.member
        epoch = m.epoch
        disp = m.server.dispatcher
        sink = CallSink(1)
        admitted = trio.current_time()
        reply = None
        with trio.CancelScope() as cs:
            node.calls.add(cs)
            try:
                disp.submit(sh.session, p.encoder.encode(op), sink, 1)
                await sink._event.wait()
                reply = sink.replies[1]
                if not isinstance(reply, BaseException):
                    # the server holds every reply, reads included, until the journal is
                    # durable past what it saw (transport/server.py, ``durability``); a
                    # client gives up on one held longer than READ_WAIT_S
                    with trio.move_on_after(READ_WAIT_S) as held:
                        await disp.wait_durable(sink.lsn)
                    if held.cancelled_caught:
                        self.trace(f"{op.__struct_config__.tag} -> {node.host}: held past {READ_WAIT_S:g} s "
                                   "(not durable); given up")
                        return None
            except RallypointError as exc:
                reply = exc
            finally:
                node.calls.discard(cs)
        tag = op.__struct_config__.tag
        if cs.cancelled_caught:
            self.trace(f"{tag} -> {node.host}: lost (the node died)")
            return None
        if isinstance(reply, (NotLeaderError, UnavailableError)):
            self.trace(f"{tag} -> {node.host}: {reply.code}")
            self.answers.update(f"{tag} {reply.code};".encode())
            return None
        self.answered(sh, node, epoch, admitted)
        if isinstance(reply, BaseException):
            code = getattr(reply, "code", type(reply).__name__)
            self.trace(f"{tag} -> {node.host}: {code} (epoch {epoch})")
            self.answers.update(f"{tag} {code};".encode())
            return reply if isinstance(reply, RallypointError) else None
        self.answers.update(f"{tag} ok {epoch};".encode())
        self.trace(f"{tag} -> {node.host}: ok (epoch {epoch}, admitted at {admitted:.4f})")
        if raw:
            return bytes(reply), admitted
        view = msgspec.msgpack.decode(reply, type=REPLY_TYPES[type(op)])
        return view, admitted

    def _run_shards(self) -> list[ShardSim]:
        return [s for s in self.shards if s.shard != self.home]

    async def new_run(self) -> None:
        sh = self.pick_rng.choice(self._run_shards())
        ack = await sh.write()
        if ack is not None:
            self.runs[ack.run_id] = sh.shard

    async def acquire(self, what: str) -> None:
        if not self.runs:
            return
        run_id = self.pick_rng.choice(sorted(self.runs))
        if what == "pool":
            op = p.PoolAcquire(pool=POOL, scope_id=run_id, units=1, lease_ms=LEASE_MS)
        else:
            op = p.ClaimAcquire(scope_id=run_id, key=what.split(":", 1)[1], lease_ms=LEASE_MS)
        got = await self.request(self.shards[self.home], op)
        if got is None or isinstance(got, RallypointError):
            if isinstance(got, RallypointError):
                self.stats["refused"] += 1
                if got.code not in ("SCOPE_CANCELLED", "NOT_FOUND", "UNAVAILABLE"):
                    self.linked.add(run_id)  # (answered by the run: it was linked)
            return
        view, admitted = got
        self.linked.add(run_id)
        if view.status != "ACQUIRED":
            return
        if what == "pool":
            g = Grant(what, run_id, view.grant.units, trio.current_time(), admitted + LEASE_MS / 1000,
                      view.grant.id, view.grant.token)
        else:
            g = Grant(what, run_id, 1, trio.current_time(), admitted + LEASE_MS / 1000, None, view.token)
        if run_id not in self.runs:  # (its cancel was sent meanwhile: the home shard learns of it later)
            g.ended_at = trio.current_time()
        self.stats["grants"] += 1
        self.over_granted(g)
        self.grants.append(g)

    async def release(self) -> None:
        now = trio.current_time()
        held = [g for g in self.grants if g.ended_at is None and now < g.until]
        if not held:
            return
        g = self.pick_rng.choice(held)
        g.ended_at = now  # (counted released from the moment it is sent)
        if g.what == "pool":
            op = p.GrantRelease(grant_id=g.grant_id, token=g.token)
        else:
            op = p.ClaimRelease(key=g.what.split(":", 1)[1], token=g.token)
        await self.request(self.shards[self.home], op)

    async def end_run(self) -> None:
        if not self.runs:
            return
        run_id = self.pick_rng.choice(sorted(self.runs))
        shard = self.runs.pop(run_id)
        now = trio.current_time()
        for g in self.grants:
            if g.run_id == run_id and g.ended_at is None:
                g.ended_at = now
        got = await self.request(self.shards[shard], p.ScopeCancel(scope_id=run_id))
        if got is not None and not isinstance(got, RallypointError):
            self.ended.append(run_id)

    async def read(self, shard: int) -> None:
        self.stats["reads"] += 1
        if shard == self.home:
            op = p.PoolGet(name=POOL)
        else:
            known = [r for r, s in sorted(self.runs.items()) if s == shard] or [None]
            run_id = self.pick_rng.choice(known)
            op = p.ScopeStatus(scope_id=run_id) if run_id is not None else p.ScopeList(limit=5)
        await self.request(self.shards[shard], op, read=True)

    async def events(self, *, to_end: bool = False) -> bool:
        """One page of the space's events merged over the shards by the SDK's own
        :func:`~rallypoint.client.shardevents.list_events`, after the client's vector
        cursor (every page: ``to_end``); events-once on what it returns. False when a
        shard did not answer."""
        async with self.events_lock:  # (one client: each page after the last one's answer)
            return await self._events(to_end)

    async def _events(self, to_end: bool) -> bool:
        from ..client.shardevents import list_events

        while True:
            try:
                page = await list_events(_EventsTransport(self), p.EventsList(limit=EVENTS_PAGE), self.events_cursor)
            except RallypointError as e:
                self.trace(f"events.list over the shards: {e.code}")
                return False
            for ev in page.events:
                last = self.events_seen.get(ev.shard, 0)
                if ev.seq <= last or (last and ev.seq != last + 1):
                    what = "again" if ev.seq <= last else f"after {last} (a gap, or out of the shard's order)"
                    self.fail("events-once", f"the merged events of space {SPACE!r} gave event {ev.seq} of shard "
                                             f"{ev.shard} {what} (cursor {self.events_cursor})")
                    return True
                self.events_seen[ev.shard] = ev.seq
            self.stats["events"] += len(page.events)
            self.trace(f"events.list over the shards: {len(page.events)} events, cursor {page.next_cursor}")
            self.events_cursor = page.next_cursor
            if not to_end or not page.events:
                return True

    # ----------------------------------------------------------------- steps
    async def _heal_after(self, s: float, fn) -> None:
        await trio.sleep(s)
        fn()

    async def do(self, step: tuple) -> None:
        kind = step[0]
        n = self.nursery
        # a client's step runs on (its answer may wait out a failover); the next step
        # comes CLIENT_GAP_S later
        if kind == "run":
            for _ in range(step[1]):
                n.start_soon(self.new_run)
            await trio.sleep(CLIENT_GAP_S)
        elif kind == "acquire":
            n.start_soon(self.acquire, step[1])
            await trio.sleep(CLIENT_GAP_S)
        elif kind == "release":
            n.start_soon(self.release)
            await trio.sleep(CLIENT_GAP_S)
        elif kind == "end":
            n.start_soon(self.end_run)
            await trio.sleep(CLIENT_GAP_S)
        elif kind == "read":
            n.start_soon(self.read, step[1])
            await trio.sleep(CLIENT_GAP_S)
        elif kind == "events":
            n.start_soon(self.events)
            await trio.sleep(CLIENT_GAP_S)
        elif kind == "tick":
            await trio.sleep(step[1])
        elif kind in ("crash", "handover", "etcd_cut"):
            await self.shards[step[1]].do((kind, *step[2:]))
        elif kind == "cut":
            await self.shards[step[1]].do(("cut", step[2]))
        elif kind == "isolate":
            sh = self.shards[step[1]]
            for node in sh.pick("leader"):
                self.trace(f"{node.host} (the leader of shard {sh.shard}) is cut off from etcd and every node for "
                           f"{step[2]} s")
                client = node.etcd
                client.cut()
                sh.net.isolated.add(node.name)
                self.isolated.add(node.host)

                def heal(client=client, node=node, sh=sh):
                    client.heal()
                    sh.net.isolated.discard(node.name)
                    self.isolated.discard(node.host)

                n.start_soon(self._heal_after, step[2], heal)
        elif kind == "watch_lag":
            _, shard, who, delay, s = step
            for node in self.shards[shard].pick(who):
                self.trace(f"{node.host}'s etcd watches lag {delay} s for {s} s")
                client = node.etcd
                client.watch_delay_s = delay

                def heal(client=client):
                    client.watch_delay_s = 0.0

                n.start_soon(self._heal_after, s, heal)
        elif kind == "partition":
            _, a, b, s = step
            pair = frozenset((a, b))
            self.trace(f"shards {a} and {b} cannot reach each other for {s} s")
            self.cut.add(pair)
            n.start_soon(self._heal_after, s, lambda: self.cut.discard(pair))
        elif kind == "oneway":
            _, a, b, s = step
            self.trace(f"what shard {a} sends shard {b} is lost for {s} s")
            self.oneway.add((a, b))
            n.start_soon(self._heal_after, s, lambda: self.oneway.discard((a, b)))
        else:  # pragma: no cover
            raise ValueError(f"unknown step {step!r}")

    # ----------------------------------------------------------------- the run
    async def run(self) -> None:
        trio._core._run._r.seed(self.trio_seed)
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            for sh in self.shards:
                sh.nursery = nursery
                sh.draining_started = False
            await nursery.start(self.etcd.run)
            try:
                await self._run()
            except Violation as v:
                if v not in self.failures:
                    self.failures.append(v)
            finally:
                nursery.cancel_scope.cancel()

    def _set_step(self, i: int) -> None:
        self.step_no = i
        for sh in self.shards:
            sh.step_no = i

    async def _run(self) -> None:
        async with FakeEtcdClient(self.etcd) as client:
            m, _ = await create_cluster(client, "sim", slots=SLOTS, shards=len(self.shards))
        self.home = m.owners[home_slot(SPACE, SLOTS)]
        assert self.home == home_shard(len(self.shards)), "the slot map is not cluster init's"
        self.trace(f"cluster: {len(self.shards)} shards, {SLOTS} slots, space {SPACE!r} at home on shard {self.home}")
        for sh in self.shards:
            sh.start(sh.nodes["a"])
        with trio.move_on_after(15):
            while any(sh.leader() is None for sh in self.shards):
                await trio.sleep(0.05)
        for sh in self.shards:
            sh.start(sh.nodes["b"])
        home = self.shards[self.home]
        await self._ensure_pool(home)
        for i, step in enumerate(self.steps):
            self._set_step(i)
            await self.do(step)
            self.check()
        self._set_step(len(self.steps))
        await self.drain()
        self.check()
        for sh in self.shards:
            await sh.final_check()
            self.check()
        for node in home.nodes.values():
            self.check_outbox(node, "at the end")
        self.check()

    async def _ensure_pool(self, home: ShardSim) -> None:
        with trio.move_on_after(10):
            while True:
                got = await self.request(home, p.PoolEnsure(name=POOL, units_total=POOL_UNITS))
                if got is not None and not isinstance(got, RallypointError):
                    return
                await trio.sleep(0.1)
        raise Violation("liveness", "the home shard never took the pool", self.step_no)

    async def drain(self) -> None:
        """Heal everything; each shard converges (replsim's drain); then every run end
        the clients had acknowledged reaches the home shard."""
        self.trace("drain: every fault healed")
        self.faults_on = False
        self.cut.clear()
        self.oneway.clear()
        self.isolated.clear()
        for sh in self.shards:
            for node in sh.nodes.values():
                if node.etcd is not None:
                    node.etcd.watch_delay_s = 0.0
        for sh in self.shards:
            await sh.drain()
            sh.check()
        home = self.shards[self.home]
        t0 = trio.current_time()
        delivered = False
        while True:
            lead = home.leader()
            missing = []
            if lead is not None and not delivered:
                table = lead.member.node.coordinator.runs.table
                missing = [r for r in self.ended if r in self.linked and (r not in table or table[r].state == "ACTIVE")]
                delivered = not missing
            if delivered and await self.events(to_end=True):
                self.stats["remote_ends"] = sum(1 for r in self.ended if r in self.linked)
                return
            if trio.current_time() - t0 > DELIVER_S:
                if delivered:
                    self.fail("liveness", f"the space's events could not be paged to the end within {DELIVER_S:g} s "
                                          f"of the drain (cursor {self.events_cursor})")
                elif lead is None:
                    self.fail("liveness", f"the home shard (shard {self.home}) had no leader {DELIVER_S:g} s after "
                                          "the drain")
                else:
                    self.fail("outbox-delivered", f"{len(missing)} run end(s) the clients had acknowledged never "
                                                  f"reached the home shard (shard {self.home}) within {DELIVER_S:g} s "
                                                  f"of the drain: {', '.join(r[-6:] for r in missing[:5])}")
                return
            await trio.sleep(0.1)

    def digest(self) -> str:
        h = self.answers.copy()
        for sh in self.shards:
            h.update(sh.digest().encode())
        return h.hexdigest()[:16]


# ============================================================================ mutants
def _mutant_outbox_no_dedup():
    from ..actors.outbox import Outbox

    def received(self, shard):  # the receiver forgets what it holds: every entry sent is applied
        return 0

    return Outbox, "received", received


def _mutant_no_self_fence():
    from ..cluster.leader import Leadership

    def is_leader_now(self):  # only etcd's word deposes it: no deadline of its own clock
        return self.lost_reason is None

    return Leadership, "is_leader_now", is_leader_now


def _mutant_no_self_fence_loop():
    from ..cluster.leader import Leadership

    async def fence_loop(self):
        await trio.sleep_forever()

    return Leadership, "_fence_loop", fence_loop


def _mutant_campaign_ignores_epoch():
    from ..cluster.etcd import EtcdUnavailableError, Put, Range
    from ..cluster.leader import Leadership, ShardElection

    async def acquire(self, me, ttl_s, margin_s, interval_s):
        # the campaign checks no epoch: neither that no leader key exists when it reads
        # nor in its transaction (``create_revision == 0``); a node of the in-sync set
        # takes the key over while its leader holds it (the key keeps its create
        # revision: both lead one epoch)
        value = msgspec.json.encode(me)
        while True:
            try:
                state = await self.read()
                if state.replicas is not None and me.node in state.replicas.replicas.isr:
                    sent = trio.current_time()
                    grant = await self.client.lease_grant(ttl_s)
                    r = await self.client.txn([], [Put(self.leader_key, value, lease=grant.lease_id),
                                                   Range(self.leader_key)], [])
                    kvs = r.responses[-1].kvs
                    return Leadership(self, me, kvs[0].create_revision, grant.lease_id, grant.ttl_s, sent, margin_s,
                                      interval_s)
                await self._wait_for_change(state.revision)
            except EtcdUnavailableError:
                await trio.sleep(0.1)

    return ShardElection, "_acquire", acquire


def _mutant_isr_not_shrunk():
    from ..replication.leader import ReplicationLeader

    async def shrink_isr_alone(self):  # takes the in-sync set as itself alone, but never writes it to etcd
        async with self._isr_lock:
            if self.min_insync >= 2:
                return True
            self.isr_store.isr = [self.node]
            self.journal.set_replica_floor(None)
            return True

    return ReplicationLeader, "shrink_isr_alone", shrink_isr_alone


def _mutant_events_cursor_to_newest():
    from ..client import shardevents

    orig = shardevents.list_events

    async def list_events(transport, op, cursor):  # a page's cursor jumps to what each shard keeps newest
        page = await orig(transport, op, cursor)
        return msgspec.structs.replace(page, next_cursor=page.newest)

    return shardevents, "list_events", list_events


def _mutant_pool_one_unit_more():
    from ..actors.pool import Pools

    def free(self, pool):  # a unit more than the pool has
        return pool.units_total + 1 - self.used.get(pool.id, 0)

    return Pools, "free", free


def _mutant_outbox_never_sent():
    from ..actors.outbox import Outbox

    def pending(self):  # the sender finds nothing to send: a run's end never leaves its shard
        return {}

    return Outbox, "pending", pending


#: deliberate bugs the simulator must catch:
#: name -> () -> (class or module, attribute, replacement[, (attribute, replacement)...])
MUTANTS = {
    # the receiver of the outbox applies an entry it already holds (dedup by seq gone)
    "outbox_no_dedup": _mutant_outbox_no_dedup,
    # a leader cut off from etcd keeps answering past its lease (the self-fence gone)
    "no_self_fence": lambda: (*_mutant_no_self_fence(), _mutant_no_self_fence_loop()[1:]),
    # the campaign does not check the leader key's epoch: two nodes lead one epoch
    "campaign_ignores_epoch": _mutant_campaign_ignores_epoch,
    # a new leader does not shrink the in-sync set to itself before acknowledging alone
    "isr_not_shrunk": _mutant_isr_not_shrunk,
    # the merged events' next cursor skips what a full page left of each shard
    "events_cursor_to_newest": _mutant_events_cursor_to_newest,
    # the outbox's sender finds nothing to send
    "outbox_never_sent": _mutant_outbox_never_sent,
    # the home shard's pool grants one unit more than it has
    "pool_one_unit_more": _mutant_pool_one_unit_more,
}


@contextlib.contextmanager
def mutant(name: str | None):
    """Apply mutant ``name`` (None: nothing) for the block."""
    if name is None:
        yield
        return
    cls, attr, fn, *more = MUTANTS[name]()  # (cls: a class, or a module)
    patches = [(attr, fn), *more]
    olds = [(a, vars(cls)[a]) for a, _ in patches]
    for a, f in patches:
        setattr(cls, a, f)
    try:
        yield
    finally:
        for a, old in olds:
            setattr(cls, a, old)


# ============================================================================ running
class _SeededOs:
    """``os`` for :mod:`rallypoint.ids` with the seed's random bytes."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def urandom(self, n: int) -> bytes:
        return self.rng.getrandbits(8 * n).to_bytes(n, "big")


def run_seed(seed: int, *, trace: bool = False, n_steps: int = DEFAULT_STEPS, shards: int = DEFAULT_SHARDS,
             steps: list[tuple] | None = None, mutant_name: str | None = None,
             profile: Profile | None = None) -> Result:
    """Run the schedule of ``seed`` (or exactly ``steps`` with the seed's profile) over
    ``shards`` shards and return its :class:`Result`."""
    prof, generated = generate(seed, n_steps, shards)
    prof = profile or prof
    steps = generated if steps is None else steps
    root = tempfile.mkdtemp(prefix=f"rpclustersim-{seed}-",
                            dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    sim = ClusterSim(seed, prof, steps, root, trace, shards)
    quiet = _rs._quiet()
    det = trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING
    trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING = True
    token_rng = random.Random(f"rallypoint-clustersim:tokens:{seed}")
    real_token, real_nonce, real_thread = _claim_mod.new_token, _peerauth.new_nonce, trio.to_thread.run_sync
    real_os = _ids_mod.os
    _claim_mod.new_token = _pool_mod.new_token = lambda: token_rng.getrandbits(62) + 1
    _peerauth.new_nonce = lambda: token_rng.getrandbits(128).to_bytes(16, "big")
    _ids_mod.os = _SeededOs(random.Random(f"rallypoint-clustersim:ids:{seed}"))
    trio.to_thread.run_sync = _rs._inline
    try:
        with mutant(mutant_name):
            res = _rs.judge_run(sim, seed, Result)
    finally:
        trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING = det
        _claim_mod.new_token = _pool_mod.new_token = real_token
        _peerauth.new_nonce = real_nonce
        _ids_mod.os = real_os
        trio.to_thread.run_sync = real_thread
        quiet()
        shutil.rmtree(root, ignore_errors=True)
    res.trace = sim.trace_lines
    st = dict(sim.stats)
    for k in ("acks", "takeovers", "crashes", "armed_crashes", "writes"):
        st[k] = sum(sh.stats.get(k, 0) for sh in sim.shards)
    st["profile"] = prof.describe()
    res.stats = st
    res.digest = sim.digest()
    return res


def _run_chunk(args) -> tuple[int, list[tuple[int, str, str, int]], float]:
    seeds, n_steps, shards, mutant_name = args
    fails = []
    t0 = time.process_time()
    for s in seeds:
        r = run_seed(s, n_steps=n_steps, shards=shards, mutant_name=mutant_name)
        if not r.ok:
            fails.append((s, r.violation.invariant, r.violation.message.split("\n")[0], r.violation.step))
    return len(seeds), fails, time.process_time() - t0


def run_seeds(seeds, *, processes: int = 1, n_steps: int = DEFAULT_STEPS, shards: int = DEFAULT_SHARDS,
              mutant_name: str | None = None, chunk: int = 10, stop_after: int = 1) -> dict:
    """Run many seeds on ``processes`` worker processes (``PYTHONHASHSEED=0``); stops
    after ``stop_after`` failures. Returns ``{"run", "failures": [(seed, invariant,
    message, step)], "wall_s", "cpu_s"}`` (:func:`rallypoint.testing.replsim.run_chunks`)."""
    seeds = list(seeds)
    chunks = [(seeds[i:i + chunk], n_steps, shards, mutant_name) for i in range(0, len(seeds), chunk)]
    return _rs.run_chunks(_run_chunk, chunks, processes=processes, stop_after=stop_after)


def main(argv: list[str] | None = None) -> int:
    """``python -m rallypoint.testing.clustersim``: one seed (``--seed``) or many
    (``--seeds A:B``). Exit status 1 when a seed fails."""
    ap = argparse.ArgumentParser(prog="python -m rallypoint.testing.clustersim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, help="run this seed")
    ap.add_argument("--seeds", help="run seeds A:B (or N: 0:N)")
    ap.add_argument("--trace", action="store_true", help="print the trace (with --seed)")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per schedule")
    ap.add_argument("--shards", type=int, default=DEFAULT_SHARDS, choices=(2, 3), help="shards of the cluster")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--mutant", choices=sorted(MUTANTS), help="run with this deliberate bug (it must be caught)")
    args = ap.parse_args(argv)
    if (args.seed is None) == (args.seeds is None):
        ap.error("give --seed or --seeds")
    if args.steps < 1 or args.processes < 1:
        ap.error("--steps and --processes must be >= 1")
    if os.environ.get("PYTHONHASHSEED") != "0":  # set order must be the same in every process
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "rallypoint.testing.clustersim",
                                  *(argv if argv is not None else sys.argv[1:])])
    extra = f"--steps {args.steps} --shards {args.shards} {'--mutant ' + args.mutant + ' ' if args.mutant else ''}"
    if args.seed is not None:
        res = run_seed(args.seed, trace=args.trace, n_steps=args.steps, shards=args.shards, mutant_name=args.mutant)
        if args.trace:
            print(f"profile: {res.stats.get('profile')}")
            print("\n".join(res.trace))
        print(res.headline(), f"digest {res.digest}")
        if not res.ok:
            print(f"replay: python -m rallypoint.testing.clustersim --seed {args.seed} {extra}--trace")
        return 0 if res.ok else 1
    a, _, b = args.seeds.partition(":")
    try:
        lo, hi = (0, int(a)) if not b else (int(a), int(b))
    except ValueError:
        ap.error(f"--seeds is A:B or N (got {args.seeds!r})")
    if not 0 <= lo < hi:
        ap.error(f"--seeds A:B needs 0 <= A < B (got {args.seeds!r})")
    out = run_seeds(range(lo, hi), processes=args.processes, n_steps=args.steps, shards=args.shards,
                    mutant_name=args.mutant)
    print(f"{out['run']} seeds in {out['wall_s']:.1f} s wall ({out['cpu_s']:.1f} s CPU, "
          f"{out['run'] / max(out['cpu_s'], 1e-9):.2f} seeds/s of CPU), {len(out['failures'])} failing")
    for seed, inv, msg, step in out["failures"][:5]:
        print(f"seed {seed}: [{inv}] at step {step}: {msg}")
        print(f"replay: python -m rallypoint.testing.clustersim --seed {seed} {extra}--trace")
    return 0 if not out["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
