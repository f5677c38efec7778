"""Deterministic simulation: one integer seed drives the clients, the clock, the disk,
crashes and restarts of a real rallypoint node, and every step is checked.

Run one seed (replays exactly; ``--trace`` prints what happened)::

    python -m rallypoint.testing.sim --seed 1234 --trace
    python -m rallypoint.testing.sim --seed 1234 --keep 3,7,12-15 --trace   # a shrunk schedule
    python -m rallypoint.testing.sim --seeds 0:10000 --processes 2            # many seeds

What runs is the production stack: :func:`rallypoint.node.open_node` on a data dir (on
tmpfs), its :class:`~rallypoint.service.Service`, the actor runtime, the kinds, the
real journal code and LMDB snapshots, recovery. The seed decides, through one
:class:`random.Random` per concern:

- the *schedule* (:func:`generate`): a list of steps -- a client issues an operation
  (any kind's, see :mod:`rallypoint.testing.kinds`), time advances (to each due
  activity in turn, as the real loop would see it), the event loop stalls, the node
  crashes (process kill, machine crash, clean stop) and restarts after a downtime,
  possibly with its wall clock set back or forward;
- Trio's scheduler (its batch-order random source is seeded), the node's ids, each
  client's network delay (requests of one client stay in order; clients overtake each
  other), and the disk (:mod:`rallypoint.testing.disk`: write/fsync latencies, short
  writes, a failing fsync or write, what a crash keeps);
- fault injection: an apply function that raises (fail-stop must stop the node before
  anything exposes the half-applied state).

Time is Trio's :class:`~trio.testing.MockClock`, moved only by the simulator: a whole
schedule (minutes of virtual time, restarts included) takes milliseconds.

The invariants (a failing one names itself; see ``docs/testing.md``):

- **durability**: a reply leaves only when the journal is durable past the journal's
  last LSN when it was made (checked when it is made and when it is released); every
  fact a reply shows holds in the *durable* state at once (a replay of the durable
  journal prefix: what a crash now would recover) -- so no acknowledged change is lost
  and nothing a client saw can be taken back; facts are re-checked after every step
  and after every restart;
- **limits**: the use of each limit per space, counted by the apply functions, equals
  a recount of the state and what a replay counted (after a restart: from the snapshot
  and the journal's tail);
- **replay**: the live state always equals a replay of its journal; after a clean stop
  the stopped node's memory equals a replay of everything it journaled (nothing applied
  after the journal closed); after a restart the recovered state (snapshot + tail)
  equals a replay of exactly the records the crash left intact (computed from the disk
  model, independently of the recovery code);
- **audit**: every journal record is checked against the state before it: fencing
  (the token, a live lease), decide-once (a group finalizes once, a timer fires once),
  timing (nothing fires early; a lease never expires before the time owed to it after
  downtime and stalls), join-set consumes in order;
- **monotone**: terminal states, group decisions, verdicts, tokens, epochs, join-set
  records never move back (in the live state within a run, in the durable state
  across crashes);
- **quiescence**: when every task is blocked -- no actor has commands in its inbox,
  no parked waiter has an answer (lost wake-up), nothing due is pending (deadlines,
  leases, timers, delays), nothing is pending under an ended run, no waiter is parked
  under an ended run, groups agree with a reference decision table;
- **replies**: a receive answered empty had nothing ready in its subtree, deliveries
  are oldest first, a successful complete used the current token;
- **fail-stop**: an injected raising apply stops the node with FatalError, no snapshot
  is written after it, recovery is clean;
- **liveness**: every request is answered (or its connection dropped by a crash)
  within the drain at the end.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
import trio.testing

from .. import protocol as p
from ..actors import Coordinator, FatalError
from ..actors.api import REPLY_TYPES
from ..actors import claim as _claim_mod
from ..actors import pool as _pool_mod
from ..clock import Clock
from ..errors import RallypointError
from ..ids import IdGenerator, _b32
from ..limits import Limits
from ..node import open_node
from ..persistence import buggify
from ..persistence.errors import PersistenceError
from ..records import decode_commit
from ..service import CallSink, Session
from .disk import DiskFaults, SimDisk, SimStorage
from .kinds import KINDS, Gen, Script, World, ended

__all__ = ["Profile", "Result", "Violation", "generate", "run_seed", "run_seeds", "shrink", "main"]

log = logging.getLogger("rallypoint.sim")

#: wall clock of the first start (2026-01-01T00:00:00Z), seconds
WALL0 = 1_767_225_600.0
DEFAULT_STEPS = 40
#: after the last step: every request is answered within this after it was sent (a wait
#: is <= 15 s here; a slow disk, a network delay and a restart add to it), seconds
DRAIN_S = 40.0
#: requests a busy stop sends (:attr:`Profile.busy_stop`), at most, per clean stop
BUSY_STOP_REQUESTS = 40
#: a schedule that needs more time steps than this is stuck (a guard, not a limit in use)
MAX_MICRO_STEPS = 200_000


# ============================================================================ schedule
@dataclass
class Profile:
    """Everything about a schedule that is not a step, drawn from the seed alone (so a
    shrunk step list keeps it)."""

    mode: str
    clients: list[str]  # per client: "call" (Service.call), "observed" (its own sink), "wire" (TCP frames)
    delays: list[tuple[float, ...]]  # per client: network delays to draw from, seconds
    weights: dict[str, float]
    faults: DiskFaults
    apply_fault_at: int | None  # the n-th live apply (of apply_fault_type, if set) raises
    apply_fault_type: str | None
    snapshot_every_records: int
    snapshot_every_s: float
    wide: bool
    final: str  # how the schedule's last restart happens: clean, process, machine
    quantum: float  # time advances by at least this much at once, seconds
    #: clients keep sending while a clean stop runs: a request lands with every time step
    #: of the stop, the last one (the actors' cancel) included -- requests arriving as a
    #: SIGTERM's shutdown begins
    busy_stop: bool = False

    def describe(self) -> str:
        f = self.faults
        bits = [f"mode={self.mode}", f"clients={','.join(self.clients)}",
                f"snapshot_every={self.snapshot_every_records}rec/{self.snapshot_every_s}s"]
        if f.fail_fsync_at is not None:
            bits.append(f"fsync#{f.fail_fsync_at} fails")
        if f.fail_write_at is not None:
            bits.append(f"write#{f.fail_write_at} fails")
        if self.apply_fault_at is not None:
            bits.append(f"apply#{self.apply_fault_at}{' of ' + self.apply_fault_type if self.apply_fault_type else ''} raises")
        if self.wide:
            bits.append("wide")
        if self.busy_stop:
            bits.append("busy-stop")
        bits.append(f.describe())
        return " ".join(bits)


def _all_ops() -> dict[str, tuple[str, float, Any]]:
    out = {}
    for k in KINDS:
        for name, (w, fn) in k.ops().items():
            out[name] = (k.name, w, fn)
    return out


OPS = _all_ops()


def generate(seed: int, n_steps: int = DEFAULT_STEPS) -> tuple[Profile, list[tuple]]:
    """The profile and the steps of ``seed``. Steps are tuples:

    - ``("op", client, op_name, rnd)``: the client issues op ``op_name``, its arguments
      drawn from ``random.Random(rnd)`` against what the clients know then;
    - ``("tick", seconds)``: virtual time passes (every due activity fires in turn);
    - ``("stall", seconds)``: the event loop stalls (time jumps at once);
    - ``("crash", how, downtime_s, wall_skew_s)``: ``how`` is ``process`` (kill -9),
      ``machine`` (power loss) or ``clean`` (SIGTERM); the node restarts after
      ``downtime_s``, its wall clock moved by ``wall_skew_s``.
    """
    # Separate sources (seeded by strings: the same in every process), so that adding a
    # kind or an op changes the steps of a seed but not its profile.
    rng = random.Random(f"rallypoint-sim:profile:{seed}")
    mode = "interval" if rng.random() < 0.2 else "fsync"
    n_clients = rng.randint(2, 4)
    clients = [rng.choice(("call", "observed", "observed", "wire")) for _ in range(n_clients)]
    delays = [rng.choice(((0.0,), (0.0, 0.001, 0.01), (0.0005, 0.05, 0.3), (0.0, 0.002, 1.5))) for _ in range(n_clients)]
    faults = DiskFaults.draw(rng, allow_fsync_failure=mode == "fsync",
                             space=random.Random(f"rallypoint-sim:disk:{seed}"))
    frng = random.Random(f"rallypoint-sim:fail-stop:{seed}")
    apply_fault_at = apply_fault_type = None
    if frng.random() < 0.08:
        # any apply, or one made by a parked waiter's re-check (a receive leasing, a
        # join_next consuming, a timer wait acknowledging) or by a complete() waiting
        apply_fault_type = frng.choice((None, None, "TaskDelivered", "JoinSetConsumed", "TimerAcked", "ScopeEnded"))
        apply_fault_at = frng.randrange(2, 25) if apply_fault_type is None else frng.randrange(1, 3)
    wide = rng.random() < 0.03
    snap_records = rng.choice((4, 10, 40, 100_000))
    snap_s = rng.choice((1.0, 5.0, 60.0))
    final = rng.choice(("clean", "process", "machine") if mode == "fsync" else ("clean", "process"))
    quantum = rng.choice((0.0, 0.25, 0.5, 0.5, 1.0))
    wrng = random.Random(f"rallypoint-sim:weights:{seed}")
    emphasis = {k.name: wrng.choice((0.3, 1.0, 1.0, 2.5)) for k in KINDS}
    weights = {name: w * emphasis[kind] for name, (kind, w, _) in OPS.items()}
    # (a source of its own: the profiles and steps of the seeds drawn before it stay)
    busy_stop = random.Random(f"rallypoint-sim:busy-stop:{seed}").random() < 0.5
    prof = Profile(
        mode=mode, clients=clients, delays=delays, weights=weights, faults=faults, apply_fault_at=apply_fault_at,
        apply_fault_type=apply_fault_type,
        snapshot_every_records=snap_records, snapshot_every_s=snap_s, wide=wide, final=final, quantum=quantum,
        busy_stop=busy_stop,
    )
    rng = random.Random(f"rallypoint-sim:steps:{seed}")
    names = list(weights)
    cum = []
    acc = 0.0
    for n in names:
        acc += weights[n]
        cum.append(acc)
    steps: list[tuple] = []
    crash_kinds = ("process", "machine", "clean") if mode == "fsync" else ("process", "clean")
    n_crashes = rng.choice((0, 1, 1, 2, 3))
    crash_at = set(rng.sample(range(6, n_steps), min(n_crashes, n_steps - 6))) if n_steps > 6 else set()
    steps += [("op", 0, "mailbox.ensure", rng.getrandbits(32)), ("op", 1, "mailbox.ensure", rng.getrandbits(32)),
              ("op", 0, "scope.create", rng.getrandbits(32)), ("tick", 0.5)]
    if wide:
        steps.append(("op", 0, "fanout", rng.getrandbits(32)))
    while len(steps) < n_steps:
        i = len(steps)
        if i in crash_at:
            skew = 0.0
            if rng.random() < 0.3:
                skew = rng.choice((-40.0, -5.0, 30.0, 600.0))
            steps.append(("crash", rng.choice(crash_kinds), rng.choice((0.05, 0.5, 3.0, 20.0, 60.0)), skew))
            continue
        x = rng.random()
        if x < 0.68:
            name = names[_bisect(cum, rng.random() * acc)]
            steps.append(("op", rng.randrange(n_clients), name, rng.getrandbits(32)))
        elif x < 0.985:
            steps.append(("tick", rng.choice((0.0, 0.001, 0.01, 0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 12.0))))
        else:
            steps.append(("stall", rng.choice((2.5, 6.0, 15.0))))
    return prof, steps


def _bisect(cum: list[float], x: float) -> int:
    lo, hi = 0, len(cum) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _apply_payload(c: Coordinator, payload: bytes) -> None:
    c.replaying = True
    try:
        for rec in decode_commit(payload):
            c._apply[type(rec)](rec)
    finally:
        c.replaying = False
        c.groups.touched.clear()


# ============================================================================ results
class Violation(Exception):
    """An invariant failed: ``invariant`` names it, ``message`` says what was seen."""

    def __init__(self, invariant: str, message: str, step: int | None = None) -> None:
        super().__init__(f"[{invariant}] {message}")
        self.invariant = invariant
        self.message = message
        self.step = step


@dataclass
class Result:
    """The outcome of one schedule."""

    seed: int
    ok: bool
    violation: Violation | None = None
    trace: list[str] = field(default_factory=list)
    digest: str = ""
    steps: int = 0
    stats: dict = field(default_factory=dict)

    def headline(self) -> str:
        if self.ok:
            return f"seed {self.seed}: ok ({self.steps} steps)"
        v = self.violation
        return f"seed {self.seed}: VIOLATION [{v.invariant}] at step {v.step}: {v.message}"


class Check:
    """Where checks report. Inside server code (a sink, a journal append) a failure is
    only recorded; the driver raises it at its next check point."""

    def __init__(self, sim: "Sim") -> None:
        self.sim = sim
        self.failures: list[Violation] = []

    def fail(self, invariant: str, message: str) -> None:
        self.failures.append(Violation(invariant, message, self.sim.step_no))

    def raise_first(self) -> None:
        if self.failures:
            raise self.failures[0]


class SimulatedBug(RuntimeError):
    """The fault injected into an apply function (fail-stop check)."""


class _SeededIds(IdGenerator):
    """The production id generator with the seed's random source instead of urandom."""

    __slots__ = ("_rng",)

    def __init__(self, now_ms, rng: random.Random) -> None:
        super().__init__(now_ms)
        self._rng = rng

    def new(self, prefix: str) -> str:
        ms = self._now_ms()
        if ms <= self._last_ms:
            ms = self._last_ms
            rand = (self._last_rand + 1) & ((1 << 80) - 1)
        else:
            rand = self._rng.getrandbits(80)
        self._last_ms, self._last_rand = ms, rand
        return f"{prefix}_{_b32((ms << 80) | rand)}"


def _short(v) -> str:
    if isinstance(v, str) and len(v) == 30 and v[3] == "_":
        return v[:4] + v[-5:]
    return repr(v) if not isinstance(v, str) else v


def _op_text(op) -> str:
    tag = op.__struct_config__.tag
    parts = []
    for f in op.__struct_fields__:
        v = getattr(op, f)
        if v is None or isinstance(v, msgspec.Raw) or f == "items":
            continue
        parts.append(f"{f}={_short(v)}")
    if isinstance(op, p.TaskSubmitMany):
        parts.append(f"items={len(op.items)}")
    return f"{tag}({', '.join(parts)})"


def _reply_text(reply, err) -> str:
    if err is not None:
        return f"{getattr(err, 'code', type(err).__name__)}"
    if reply is None:
        return "nil"
    name = type(reply).__name__.replace("View", "")
    for f in ("state", "stored_state", "status", "group_state"):
        if hasattr(reply, f):
            extra = ""
            if hasattr(reply, "id"):
                extra = f" {_short(reply.id)}"
            if isinstance(reply, p.JoinNextView):
                extra = f" #{reply.index} {_short(reply.child_id)}"
            return f"{name}{extra} {getattr(reply, f)}"
    if isinstance(reply, p.ReceiveView):
        return "Receive[" + ", ".join(f"{_short(d.task_id)}#{d.token}" for d in reply.deliveries) + "]"
    if isinstance(reply, p.TaskListView):
        return f"Tasks[{len(reply.tasks)}]"
    if isinstance(reply, p.LeaseView):
        return f"Lease {_short(reply.task_id)}#{reply.token}"
    if isinstance(reply, p.JoinSetChildAdded):
        return f"Child {_short(reply.child_id)}"
    return name


# ============================================================================ the simulator
class _Obs:
    def __init__(self, world: World) -> None:
        self.world = world
        self.facts: list[tuple] = []

    def fact(self, *f) -> None:
        self.facts.append(f)


@dataclass
class _Client:
    idx: int
    path: str
    delays: tuple[float, ...]
    rng: random.Random
    session: Session
    last_deliver: float = 0.0


@dataclass
class _Req:
    rid: int
    client: int
    op: Any
    sent: float
    label: str = ""


class _Incarnation:
    def __init__(self, n: int) -> None:
        self.n = n
        self.node = None
        self.coord: Coordinator | None = None
        self.journal = None
        self.storage: SimStorage | None = None
        self.ready = trio.Event()
        self.done = trio.Event()
        self.scope = trio.CancelScope()
        self.stop_clean = trio.Event()
        self.calls: dict[trio.CancelScope, None] = {}
        self.outcome: tuple[str, Any] = ("running", None)
        self.dead = False  # killed: it hears nothing more, even while it unwinds
        self.server = None  # the transport Server of "wire" clients (made on first use)
        self.wire: dict[int, _WireConn] = {}
        self.wire_scopes: list[trio.CancelScope] = []
        self.expected_last: int | None = None


class _Sink(CallSink):
    """The sink of an "observed" client: checks every reply at the instant it is made."""

    def __init__(self, sim: "Sim", op) -> None:
        super().__init__(1)
        self.sim = sim
        self.op = op

    def deliver(self, rid: int, reply, lsn: int) -> None:
        self.sim.on_reply_made(self.op, reply, lsn)
        super().deliver(rid, reply, lsn)


class _Lost(Exception):
    """The connection closed before the reply arrived."""


class _WireConn:
    """A client's TCP connection to the node over in-memory streams: the server side is
    the real transport connection (:class:`rallypoint.transport.server._Conn`:
    handshake, framing, pipelining, answers held until durable); the client side speaks
    frames (Hello, Request; Ok/Err by request id)."""

    def __init__(self, sim: "Sim", inc: "_Incarnation", client: "_Client") -> None:
        self.sim = sim
        self.inc = inc
        self.client = client
        self.stream = None
        self.waiting: dict[int, list] = {}
        self.next_rid = 1
        self.closed = False
        self.ready = trio.Event()
        self.send_lock = trio.Lock()
        self.opening = False

    async def open(self) -> None:
        from ..transport.framing import FrameParser, encode_frame
        from ..transport.server import Server, _Conn
        from ..wire import PROTOCOL_VERSION, Hello, ServerFrame

        inc = self.inc
        if inc.server is None:
            inc.server = Server(inc.node.service, idle_ping_interval=None, drain_wait_grace=1.0)
        cs, ss = trio.testing.memory_stream_pair()
        self.stream = cs
        conn = _Conn(inc.server, ss, f"sim-c{self.client.idx}")
        scope = trio.CancelScope()
        inc.wire_scopes.append(scope)

        async def serve():
            with scope:
                await conn.run()

        self.sim.nursery.start_soon(serve)
        self._encode_frame = encode_frame
        decoder = msgspec.msgpack.Decoder(ServerFrame)
        parser = FrameParser()
        await cs.send_all(encode_frame(p.encoder.encode(Hello(PROTOCOL_VERSION, client="sim"))))

        async def reader():
            from ..errors import error_from_wire
            from ..wire import Err, HelloOk, Ok

            try:
                while True:
                    data = await cs.receive_some(65536)
                    if not data:
                        break
                    for frame in parser.feed(data):
                        msg = decoder.decode(frame)
                        if isinstance(msg, HelloOk):
                            self.ready.set()
                        elif isinstance(msg, (Ok, Err)):
                            slot = self.waiting.pop(msg.id, None)
                            if slot is None:
                                continue
                            if isinstance(msg, Ok):
                                slot[1] = (bytes(msg.body), None)
                            else:
                                slot[1] = (None, error_from_wire(msg.code, msg.message, msg.retry_after, msg.details))
                            slot[0].set()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                self.closed = True
                self.ready.set()
                for slot in self.waiting.values():
                    slot[0].set()
                self.waiting.clear()

        rscope = trio.CancelScope()
        inc.wire_scopes.append(rscope)

        async def read():
            with rscope:
                await reader()

        self.sim.nursery.start_soon(read)
        await self.ready.wait()

    async def call(self, op):
        """One request: ``(reply bytes, None)`` or ``(None, RallypointError)``; raises
        :class:`_Lost` if the connection closed first."""
        from ..wire import Request

        if self.stream is None and not self.opening:
            self.opening = True
            async with self.send_lock:
                await self.open()
        await self.ready.wait()
        if self.closed:
            raise _Lost()
        rid = self.next_rid
        self.next_rid += 1
        slot = [trio.Event(), None]
        self.waiting[rid] = slot
        frame = self._encode_frame(p.encoder.encode(Request(rid, msgspec.Raw(p.encoder.encode(op)))))
        try:
            async with self.send_lock:
                await self.stream.send_all(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise _Lost() from None
        await slot[0].wait()
        if slot[1] is None:
            raise _Lost()
        return slot[1]


class Sim:
    """One schedule against one node (and its restarts). :meth:`run` returns a
    :class:`Result`; construct through :func:`run_seed`."""

    def __init__(self, seed: int, profile: Profile, steps: list[tuple], *, trace: bool, data_dir: str,
                 check_every: int = 1) -> None:
        self.seed = seed
        self.profile = profile
        self.steps = steps
        self.tracing = trace
        self.data_dir = data_dir
        self.check_every = check_every
        master = random.Random(seed * 7919 + 17)
        self.trio_seed = master.getrandbits(64)
        self.id_rng = random.Random(master.getrandbits(64))
        self.disk = SimDisk(data_dir, random.Random(master.getrandbits(64)), profile.faults)
        self.disk.on_append = self.on_append
        self.disk.on_durable = self.on_durable
        self.disk.on_snapshot = self.on_snapshot
        self.clients = [
            _Client(i, path, profile.delays[i], random.Random(master.getrandbits(64)), Session(peer=f"sim-c{i}"))
            for i, path in enumerate(profile.clients)
        ]
        self.world = World()
        for k in KINDS:
            k.init_world(self.world)
        self.check = Check(self)
        self.trace_lines: list[str] = []
        self.step_no = -1
        self.payloads: list[bytes] = []
        # every answer a client got, in order (the digest: the same with or without --trace)
        self.answers = hashlib.sha256()
        self.mirror: Coordinator | None = None
        self.shadow: Coordinator | None = None
        self.shadow_lsn = 0
        self.facts: dict[tuple, int] = {}
        self.fact_owner: dict[str, Any] = {name: k for k in KINDS for name in k.facts}
        self.fact_invariant: dict[str, str] = {name: inv for k in KINDS for name, inv in k.fact_invariants.items()}
        self.audit_fns: dict[type, Any] = {}
        for k in KINDS:
            self.audit_fns.update(k.audits())
        self.expected_last: int | None = None
        self.mono_live: dict[str, dict] = {}
        self.mono_durable: dict[str, dict] = {}
        self.leases: dict[tuple[str, int], int] = {}
        self.pending: dict[int, _Req] = {}
        self.next_rid = 1
        self.inc: _Incarnation | None = None
        self.incarnations = 0
        self.wall_skew = 0.0
        self.live_applies = 0
        self.apply_fault_done = False
        self.apply_fault_armed = False
        self.stats = {"requests": 0, "replies": 0, "restarts": 0, "facts": 0, "commits": 0}
        self.clock: trio.testing.MockClock | None = None
        self.quantum = profile.quantum
        self.micro_steps = 0
        self.drain_from = 0.0
        self.mono_stop: int | None = None
        self.stop_rng = random.Random(f"rallypoint-sim:busy-stop:ops:{seed}")
        self.stop_sent = 0

    # ----------------------------------------------------------------- tracing
    def trace(self, text: str) -> None:
        if self.tracing:
            self.trace_lines.append(f"[{trio.current_time():10.4f}] #{self.step_no:<3} {text}")

    # ----------------------------------------------------------------- the node
    def live(self) -> Coordinator | None:
        inc = self.inc
        if inc is None or inc.dead or not inc.ready.is_set() or inc.done.is_set():
            return None
        return inc.coord

    def _on_coordinator(self, coord: Coordinator) -> None:
        coord.ids = _SeededIds(coord.clock.mono_ms, self.id_rng)
        self.inc.coord = coord
        if self.profile.apply_fault_at is not None and not self.apply_fault_done:
            for t, fn in list(coord._apply.items()):
                coord._apply[t] = self._faulty(coord, fn)

    def _faulty(self, coord, fn):
        want = self.profile.apply_fault_type

        def apply(rec):
            fn(rec)
            if (self.apply_fault_armed and not coord.replaying and not self.apply_fault_done
                    and (want is None or type(rec).__name__ == want)):
                self.live_applies += 1
                if self.live_applies >= self.profile.apply_fault_at:
                    self.apply_fault_done = True
                    self.trace(f"FAULT: the apply of {type(rec).__name__} raises (after changing memory)")
                    raise SimulatedBug(f"injected: applying {type(rec).__name__} raised")
        return apply

    def _on_journal_opened(self, storage: SimStorage) -> None:
        """Recovery replayed the data dir; nothing new is appended yet: rebuild the
        mirror and the shadow from exactly the records that survived."""
        last = storage.recovered_next_lsn - 1
        inc = self.inc
        if inc is None:
            return
        if self.expected_last is not None and last != self.expected_last:
            self.check.fail("recovery", f"recovery kept records up to LSN {last}; the disk held every record "
                                        f"up to LSN {self.expected_last} intact and nothing after it")
        # from here on this incarnation writes (a start's own commits: the leases'
        # extension, a schedule's catch-up): a stop before the start completes is judged
        # by a new cut of the disk, not by the last one (seed 4065: a start whose write
        # failed after two records kept the stale LSN and called their recovery a violation)
        self.expected_last = None
        self.disk.start_incarnation()
        self.disk.forget_after(last)
        del self.payloads[last:]
        coord = inc.coord
        self.mirror = self._replayed(coord.clock, last)
        if self.shadow is None or self.shadow_lsn > last:
            if self.shadow is not None:
                self.check.fail("durability", f"the crash lost LSN {last + 1}..{self.shadow_lsn}, which were durable")
            self.shadow = self._replayed(coord.clock, last)
        else:  # every durable record survives a crash: the shadow only moves forward
            while self.shadow_lsn < last:
                _apply_payload(self.shadow, self.payloads[self.shadow_lsn])
                self.shadow_lsn += 1
        self.shadow.clock = coord.clock
        self.shadow_lsn = last
        self.mono_live = {}
        # the lease model: what each outstanding lease is owed across the downtime
        gap = coord.mono_ms() - self.mono_stop if self.mono_stop is not None else 0
        self.leases = {}
        for t in self.mirror.queues.tasks.values():
            if t.state == "RUNNING":
                self.leases[(t.id, t.token)] = t.lease_expires_ms + max(gap, 0)

    def _replayed(self, clock, upto: int) -> Coordinator:
        """A fresh coordinator with the first ``upto`` journal entries applied, record by
        record through the apply functions (not through ``Coordinator.replay`` or
        recovery, which are under test)."""
        c = Coordinator(clock=clock, durability="memory")
        for payload in self.payloads[:upto]:
            _apply_payload(c, payload)
        return c

    async def _server(self, inc: _Incarnation, storage: SimStorage, clock: Clock) -> None:
        prof = self.profile
        try:
            with inc.scope:
                async with open_node(self.data_dir, prof.mode, clock=clock, interval_ms=10,
                                     snapshot_every_records=prof.snapshot_every_records,
                                     snapshot_every_s=prof.snapshot_every_s, storage=storage) as node:
                    inc.node = node
                    inc.journal = node.coordinator.journal
                    inc.ready.set()
                    await inc.stop_clean.wait()
            inc.outcome = ("clean", None) if inc.stop_clean.is_set() else ("killed", None)
        except FatalError as exc:
            inc.outcome = ("fatal", exc)
        except BaseException as exc:  # noqa: BLE001 - classified by the driver
            inner = exc
            while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
                inner = inner.exceptions[0]
            if isinstance(inner, trio.Cancelled):
                inc.outcome = ("killed", None)
            elif isinstance(inner, FatalError):
                inc.outcome = ("fatal", inner)
            else:
                inc.outcome = ("error", inner)
                if not isinstance(inner, Exception):
                    raise
        finally:
            inc.done.set()

    async def start_node(self) -> None:
        """Open the node on the data dir (recovery) and wait until it serves. A node
        stopped during its start by the injected disk fault is started again."""
        for _attempt in range(3):
            if await self._start_once():
                return
            self.trace(f"node #{self.inc.n} stopped while starting: {self.inc.outcome[0]} {self.inc.outcome[1]!r}")
            await self.stop_node("self")
            await self.advance(0.2)
            while self.disk.full_now():  # (a start refused for a full disk: after the window)
                await self.advance(1.0)
        raise Violation("recovery", "the node did not start three times in a row", self.step_no)

    async def _start_once(self) -> bool:
        self.incarnations += 1
        inc = self.inc = _Incarnation(self.incarnations)
        storage = SimStorage(self.disk, hook=self._on_coordinator)
        opened = storage.open_journal

        def open_journal(recovered, mode, interval_ms, **options):
            j = opened(recovered, mode, interval_ms, **options)
            self._on_journal_opened(storage)
            return j

        storage.open_journal = open_journal
        inc.storage = storage
        wall = WALL0 + trio.current_time() + self.wall_skew
        clock = Clock(wall_start=wall)
        self.apply_fault_armed = False
        self.nursery.start_soon(self._server, inc, storage, clock)
        while not (inc.ready.is_set() or inc.done.is_set()):
            await self.settle()
            if not (inc.ready.is_set() or inc.done.is_set()):
                await self._advance_once(1.0)
        if inc.done.is_set():
            what, exc = inc.outcome
            if what == "error" and self._injected_disk_error(exc):
                return False
            raise Violation("recovery", f"the node did not start after a crash: {what} {exc!r}", self.step_no)
        self.apply_fault_armed = True
        self.expected_last = None
        self.mono_stop = None
        self.trace(f"node #{inc.n} up: recovered {inc.node.recovery_info.get('entities')} entities, "
                   f"snapshot LSN {inc.node.recovery_info.get('snapshot_lsn')}, next LSN {storage.recovered_next_lsn}")
        return True

    def _injected_disk_error(self, exc) -> bool:
        from ..persistence.errors import JournalWriteError

        from ..persistence.errors import DiskFullError

        f = self.profile.faults
        if isinstance(exc, DiskFullError):
            # a restart inside a full-disk window whose first commit (the leases'
            # extension) is refused: the node does not start (a known limit, issue 28)
            return bool(f.full)
        return isinstance(exc, JournalWriteError) and (f.fail_fsync_at is not None or f.fail_write_at is not None)

    async def stop_node(self, how: str) -> None:
        """Stop the node: ``clean`` (graceful), ``process`` (kill -9), ``machine``
        (power loss), or account for a node that already stopped by itself."""
        inc = self.inc
        coord = inc.coord
        if not inc.done.is_set():
            self.mono_stop = coord.mono_ms()
            if how == "clean":
                inc.stop_clean.set()
                self.stop_sent = 0
                while not inc.done.is_set():
                    if self.profile.busy_stop:
                        self._send_as_time_steps(self._next_step(5.0))
                    await self._advance_once(5.0)
                self.mono_stop = coord.mono_ms()  # it heard renewals until it stopped
            else:
                inc.dead = True
                coord.heartbeat = None  # a dead process writes nothing more
                for scope in inc.wire_scopes:
                    scope.cancel()
                self.expected_last = self.disk.crash(machine=how == "machine")
                for cs in list(inc.calls):
                    cs.cancel()
                inc.scope.cancel()
                await inc.done.wait()
        else:
            self.mono_stop = coord.mono_ms() if coord is not None else None
        what, exc = inc.outcome
        if what == "fatal":
            if not self.apply_fault_done:
                raise Violation("fail-stop", f"the node stopped with FatalError without an injected fault: {exc!r}",
                                self.step_no)
            if coord is not None and coord.failed is None:
                raise Violation("fail-stop", "FatalError left the coordinator without its failed mark", self.step_no)
        elif what == "error":
            if not self._injected_disk_error(exc):
                raise Violation("crash", f"the node stopped with an unexpected error: {exc!r}", self.step_no)
        elif what == "clean" and coord is not None and coord.failed is None and self.mirror is not None:
            # a clean stop flushed every entry; what the node held in memory then is exactly
            # their replay (a commit applied after the journal closed is memory the journal
            # never got: the actors must stop before the journal does)
            msg = self._replay_differs(coord)
            if msg:
                raise Violation("replay", f"after a clean stop the node's memory differs from a replay of its "
                                          f"journal at {msg}", self.step_no)
            msg = self._limits_differ(coord)
            if msg:
                raise Violation("limits", f"after a clean stop: {msg}", self.step_no)
        for cs in list(inc.calls):
            cs.cancel()
        for scope in inc.wire_scopes:  # connections to a stopped node close
            scope.cancel()
        if self.expected_last is None:
            # stopped by itself or cleanly: the journal closed, flushing what it had; after
            # a failed write or fsync the unsynced part is suspect (a machine crash's cut)
            # (interval mode acknowledged what was written: a failed write does not undo
            # the earlier ones, which the page cache holds)
            failed_io = what == "error" and self.profile.mode == "fsync"
            self.expected_last = self.disk.crash(machine=failed_io)
        self.trace(f"node #{inc.n} stopped ({how}: {what}); the disk keeps LSN <= {self.expected_last}")
        self.stats["restarts"] += 1
        await self.settle()

    # ----------------------------------------------------------------- journal hooks
    def on_append(self, lsn: int, payload: bytes) -> None:
        if self.disk.crashed:
            return
        if lsn != len(self.payloads) + 1:
            self.check.fail("journal", f"append got LSN {lsn}, expected {len(self.payloads) + 1}")
            return
        self.payloads.append(payload)
        self.stats["commits"] += 1
        m = self.mirror
        if m is None:
            return
        coord = self.inc.coord
        now, mono = coord.now_ms(), coord.mono_ms()
        m.replaying = True
        try:
            for rec in decode_commit(payload):
                fn = self.audit_fns.get(type(rec))
                if fn is not None:
                    fn(self.check, m, rec, now, mono)
                m._apply[type(rec)](rec)
        finally:
            m.replaying = False
            m.groups.touched.clear()

    def on_durable(self, lsn: int) -> None:
        sh = self.shadow
        if sh is None:
            return
        while self.shadow_lsn < lsn and self.shadow_lsn < len(self.payloads):
            _apply_payload(sh, self.payloads[self.shadow_lsn])
            self.shadow_lsn += 1

    def on_snapshot(self, lsn: int) -> None:
        # (a snapshot whose cut was made before a failed apply may still complete after it:
        # what it holds is journaled; one cut after it would hold memory the journal does
        # not, which the recovery check -- recovered state == replay of the journal -- sees)
        j = self.inc.journal if self.inc else None
        if j is not None and lsn > j.synced_lsn:
            self.check.fail("snapshot", f"a snapshot at LSN {lsn} is written while the journal is synced only to "
                                        f"{j.synced_lsn}")

    # ----------------------------------------------------------------- leases
    def lease_granted(self, task_id: str, token: int, expires_mono: int) -> None:
        self.leases[(task_id, token)] = expires_mono

    def lease_due(self, task_id: str, token: int) -> int | None:
        return self.leases.get((task_id, token))

    def _stall_leases(self, by_ms: int) -> None:
        coord = self.live()
        if coord is None:
            return
        for t in coord.queues.tasks.values():
            k = (t.id, t.token)
            if t.state == "RUNNING" and k in self.leases:
                self.leases[k] += by_ms

    # ----------------------------------------------------------------- replies
    def on_reply_made(self, op, reply, lsn: int) -> None:
        coord = self.live()
        if coord is None:
            return
        last = coord.journal.last_lsn
        unavailable = isinstance(reply, RallypointError) and reply.code == "UNAVAILABLE"
        if lsn < last and not unavailable:  # "could not do it now" reveals no state: at once
            self.check.fail("durability", f"the reply to {_op_text(op)} was made with LSN {lsn} while the journal's "
                                          f"last LSN was {last}: it could leave before what it shows is durable")
        err = reply if isinstance(reply, BaseException) else None
        view = None
        if isinstance(reply, (bytes, bytearray)):
            view = msgspec.msgpack.decode(reply, type=REPLY_TYPES[type(op)])
        for k in KINDS:
            k.made(self.check, coord, op, view, err)

    def observe(self, op, reply, err) -> None:
        obs = _Obs(self.world)
        for k in KINDS:
            k.observe(obs, op, reply, err)
        sh = self.shadow
        for f in obs.facts:
            if f not in self.facts:
                self.facts[f] = self.step_no
                self.stats["facts"] += 1
            if sh is not None:
                msg = self.check_fact(sh, f)
                if msg:
                    # (a fact of a kind's own invariant that the live state does not hold
                    # either is that invariant's failure, not a durability one)
                    inv, live = self.fact_invariant.get(f[0]), self.live()
                    if inv is not None and live is not None and self.check_fact(live, f):
                        self.check.fail(inv, f"a reply to {_op_text(op)} showed what does not hold: {msg}")
                    else:
                        self.check.fail("durability", f"a reply to {_op_text(op)} showed what the durable state does "
                                                      f"not hold (a crash now would take it back): {msg}")

    def check_fact(self, coord, f: tuple) -> str | None:
        """None when fact ``f`` holds in ``coord``, else why not."""
        if f[0] == "exists":
            eid = f[1]
            if eid.startswith("chd_"):
                return None if eid in coord.joinsets.child_pos else f"{eid} is missing"
            return None if coord.entity(eid) is not None else f"{eid} is missing"
        return self.fact_owner[f[0]].check_fact(coord, f)

    # ----------------------------------------------------------------- requests
    async def request(self, client: _Client, op, label: str = "", at: float | None = None):
        """Send ``op`` from ``client`` (after its network delay, or to land at virtual time
        ``at``; in its order); returns (view, error) once the reply is released, or
        (None, None) if it was lost."""
        rid = self.next_rid
        self.next_rid += 1
        now = trio.current_time()
        at = max(client.last_deliver, now + client.rng.choice(client.delays) if at is None else at)
        client.last_deliver = at
        req = _Req(rid, client.idx, op, now, label)
        self.pending[rid] = req
        self.stats["requests"] += 1
        try:
            await trio.sleep_until(at)
            inc = self.inc
            coord = self.live()
            if coord is None or coord.failed is not None:
                self.trace(f"c{client.idx} -> {_op_text(op)} : node down, UNAVAILABLE")
                return None, None
            self.trace(f"c{client.idx} -> r{rid} {_op_text(op)}")
            journal = coord.journal
            before = journal.last_lsn
            with trio.CancelScope() as cs:
                inc.calls[cs] = None
                try:
                    raw, err = await self._call(inc, client, op)
                finally:
                    inc.calls.pop(cs, None)
            if cs.cancelled_caught or isinstance(err, _Lost):
                self.answers.update(b"%d lost;" % rid)
                self.trace(f"c{client.idx} <- r{rid} lost: the connection closed (node stopped)")
                return None, None
            # (the journal's errors are UNAVAILABLE RallypointErrors: JournalWriteError,
            # JournalClosedError, DiskFullError; any other persistence error is a leak)
            if err is not None and (not isinstance(err, RallypointError)
                                    or (isinstance(err, PersistenceError) and err.code != "UNAVAILABLE")):
                self.check.fail("client-error", f"{_op_text(op)} raised {err!r} in the client: not a RallypointError")
                return None, None
            self.answers.update(b"%d %s;" % (rid, raw if err is None else err.code.encode()))
            if err is not None and err.code == "UNAVAILABLE":
                self.trace(f"c{client.idx} <- r{rid} UNAVAILABLE")
                return None, err
            if journal.durable_lsn < before:
                self.check.fail("durability", f"the reply to {_op_text(op)} was released with the journal durable to "
                                              f"{journal.durable_lsn}, below LSN {before} of before the request")
            view = None
            if err is None:
                view = msgspec.msgpack.decode(raw, type=REPLY_TYPES[type(op)])
            self.stats["replies"] += 1
            self.trace(f"c{client.idx} <- r{rid} {_reply_text(view, err)}")
            self.observe(op, view, err)
            return view, err
        finally:
            self.pending.pop(rid, None)

    async def _call(self, inc: _Incarnation, client: _Client, op):
        service = inc.node.service
        try:
            if client.path == "wire":
                conn = inc.wire.get(client.idx)
                if conn is None:
                    conn = inc.wire[client.idx] = _WireConn(self, inc, client)
                try:
                    return await conn.call(op)
                except _Lost:
                    return None, _Lost()
            if client.path == "call":
                return await service.call(client.session, op), None
            sink = _Sink(self, op)
            service.submit(client.session, p.encoder.encode(op), sink, 1)
            if not sink.replies:
                try:
                    await sink._event.wait()
                except BaseException:
                    sink.abandon()
                    raise
            await service.wait_durable(sink.lsn)
            reply = sink.replies[1]
            if isinstance(reply, BaseException):
                raise reply
            return reply, None
        except RallypointError as exc:
            return None, exc
        except trio.Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - the invariant: only RallypointError reaches a client
            return None, exc

    async def _run_op(self, client: _Client, made) -> None:
        if isinstance(made, Script):
            async def call(op):
                view, err = await self.request(client, op, made.label)
                return err if err is not None else view

            async def call_all(ops):
                out = [None] * len(ops)

                async def one(i, op):
                    out[i] = await call(op)

                async with trio.open_nursery() as n:
                    for i, op in enumerate(ops):
                        n.start_soon(one, i, op)
                        await trio.lowlevel.checkpoint()  # sent in order
                return out

            await made.fn(call, call_all)
            return
        await self.request(client, made)

    # ----------------------------------------------------------------- time
    async def settle(self) -> None:
        """Until every task is blocked (time stands still), then raise a recorded
        violation, if any."""
        await trio.testing.wait_all_tasks_blocked()
        self.check.raise_first()

    async def restart_if_stopped(self) -> None:
        """A node that stopped by itself (fail-stop, a failed journal write) is accounted
        for and restarted after a short downtime."""
        inc = self.inc
        if inc is not None and inc.done.is_set():
            self.trace(f"node #{inc.n} stopped by itself: {inc.outcome[0]} {inc.outcome[1]!r}")
            await self.stop_node("self")
            await self.advance(0.2)
            await self.start_node()

    async def _advance_once(self, limit: float) -> float:
        """Advance to the next due deadline, or ``quantum`` seconds if that is later (at
        most ``limit``): everything due meanwhile wakes together, as on a busy loop;
        returns the time advanced."""
        self.micro_steps += 1
        if self.micro_steps > MAX_MICRO_STEPS:
            raise Violation("liveness", f"the simulation did not settle in {MAX_MICRO_STEPS} time steps", self.step_no)
        dt = self._next_step(limit)
        self.clock.jump(dt)
        await self.settle()
        return dt

    def _next_step(self, limit: float) -> float:
        """The time :meth:`_advance_once` advances by now, seconds."""
        nd = trio.lowlevel.current_statistics().seconds_to_next_deadline
        return min(max(nd, self.quantum, 1e-6), limit)

    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass, stopping at due deadlines (every
        activity fires at its time, give or take the schedule's ``quantum``)."""
        await self.settle()
        left = seconds
        while left > 1e-9:
            left -= await self._advance_once(left)

    # ----------------------------------------------------------------- checks
    def check_quiescent(self, full: bool) -> None:
        chk = self.check
        coord = self.live()
        if coord is None:
            chk.raise_first()
            return
        if coord.journal.refusing is not None:
            # a full disk: nothing due can be journaled (a lease expiry, a timer) until
            # space is back; the checks of a node at rest wait for the window's end
            chk.raise_first()
            return
        if coord.failed is not None:
            if self.disk.waiting:  # on its way down: its last fsync (or file write) takes virtual time
                return
            chk.fail("fail-stop", f"the coordinator failed ({coord.failed!r}) but the node still runs (every task "
                                  "is blocked): fail-stop must end the actor tree and the node")
            chk.raise_first()
        if coord.journal.sync_due:
            chk.fail("sync", f"LSN {coord.journal.synced_lsn + 1}..{coord.journal.durable_lsn} are written but "
                             f"nothing will fdatasync them (no request in flight, no interval armed)")
        rt = coord.runtime
        for a in list(rt.actors.values()):
            if a.inbox:
                chk.fail("wakeup", f"actor {a.id} has {len(a.inbox)} command(s) in its inbox at quiescence "
                                   f"(its task was not woken)")
            if a.n_waiters:
                if not a.status:
                    chk.fail("wakeup", f"actor {a.id} holds {a.n_waiters} waiter(s) with no task")
                owner = self._owner_run(coord, a.id)
                why = ended(coord, owner) if owner else None
                for key, lst in a.waiters.items():
                    live_w = [w for w in lst if not w.done]
                    if not live_w:
                        continue
                    # (a task.results wait parks on its first task's run, whose end does
                    # not answer it when the tasks it waits for are in other runs)
                    if why and not (key == "b" and coord.barriers.table[a.id].state == "RELEASED") and not (
                            isinstance(key, tuple) and key and key[0] == "results"):
                        chk.fail("ended-run", f"{len(live_w)} waiter(s) on {key!r} still parked in {a.id} under an "
                                              f"ended run ({why})")
                    for k in KINDS:
                        due = k.waiter_due(coord, a.id, key, live_w)
                        if due is not None:
                            if due:
                                chk.fail("wakeup", f"lost wake-up: {len(live_w)} waiter(s) on {key!r} in {a.id} "
                                                   f"have an answer but are still parked")
                            break
        for k in KINDS:
            k.quiescent(chk, coord)
        chk.raise_first()
        if not full:
            return
        # the live state is a replay of its journal
        msg = self._replay_differs(coord)
        if msg:
            chk.fail("replay", f"the live state differs from a replay of its journal at {msg}")
        msg = self._limits_differ(coord)
        if msg:
            chk.fail("limits", msg)
        chk.raise_first()
        for f in self.facts:
            msg = self.check_fact(coord, f)
            if msg:
                chk.fail("facts", f"a fact a client saw no longer holds: {msg}")
                break
        self._monotone(coord, self.mono_live, "monotone")
        if self.shadow is not None:
            self._monotone(self.shadow, self.mono_durable, "monotone-durable")
        chk.raise_first()

    def _replay_differs(self, coord) -> str | None:
        """Where ``coord``'s entities differ from the mirror (a replay of every journal
        entry written), as text; None when they are equal."""
        m = self.mirror
        for prefix, (table, _) in coord.entity_tables().items():
            mt = m.entity_tables()[prefix][0]
            if table != mt:
                diff = sorted(set(table) ^ set(mt)) or sorted(i for i in table if table[i] != mt.get(i))
                eid = diff[0]
                return f"{eid}: live {table.get(eid)!r} / replay {mt.get(eid)!r}"
        return None

    def _limits_differ(self, coord) -> str | None:
        """Where the uses of the limits per space (``rallypoint/limits.py``) as the
        apply functions counted them differ from a recount of the live state, or from
        what the mirror's replay counted; None when all three agree. (A recovered node
        counted from its snapshot and its journal's tail: this checks that too.)"""
        live = coord.limits.derived()
        counted = {s: d for s, d in Limits.recount(coord).items() if any(d.values())}
        if live != counted:
            return f"the limits' use counted in apply {live} differs from a recount of the state {counted}"
        replayed = self.mirror.limits.derived() if self.mirror is not None else live
        if live != replayed:
            return f"the limits' use {live} differs from a replay's {replayed}"
        return None

    @staticmethod
    def _owner_run(coord, actor_id: str) -> str | None:
        pre = actor_id[:3]
        if pre == "scp":
            return actor_id
        if pre == "grp":
            return coord.groups.table[actor_id].gate_scope_id
        table = {"bar": coord.barriers.table, "tmr": coord.timers.table, "jst": coord.joinsets.table}.get(pre)
        if table is not None:
            return table[actor_id].scope_id
        return None

    def _monotone(self, coord, ledger: dict, name: str) -> None:
        for k in KINDS:
            now = k.monotone(coord)
            old = ledger.get(k.name)
            if old:
                for eid, was in old.items():
                    new = now.get(eid)
                    if new is None:
                        self.check.fail(name, f"{eid} disappeared")
                        return
                    if new != was:
                        msg = k.regressed(eid, was, new)
                        if msg:
                            self.check.fail(name, msg)
                            return
            ledger[k.name] = now

    # ----------------------------------------------------------------- steps
    async def do(self, step: tuple) -> None:
        kind = step[0]
        if kind == "op":
            _, c, name, rnd = step
            client = self.clients[c % len(self.clients)]
            made = self._make_op(name, rnd)
            if not made:
                self.trace(f"c{c} {name}: nothing to aim at")
                return
            for one in made:
                self.nursery.start_soon(self._run_op, client, one)
        elif kind == "tick":
            self.trace(f"time passes: {step[1]} s")
            await self.advance(step[1])
        elif kind == "stall":
            self.trace(f"event loop stalls for {step[1]} s")
            self._stall_leases(int(step[1] * 1000))
            self.clock.jump(step[1])
        elif kind == "crash":
            _, how, downtime, skew = step
            self.trace(f"CRASH ({how}); down {downtime} s; wall clock moves {skew:+} s")
            if self.inc is not None and not self.inc.done.is_set():
                await self.stop_node(how)
            await self.advance(downtime)
            self.wall_skew += skew
            await self.start_node()
        else:  # pragma: no cover
            raise ValueError(f"unknown step {step!r}")

    def _make_op(self, name: str, rnd: int) -> list:
        """The request(s) op ``name`` makes from ``random.Random(rnd)`` against what the
        clients know now (or what it needs first, when it has nothing to aim at yet)."""
        coord = self.live()
        now_ms = coord.now_ms() if coord is not None else int((WALL0 + trio.current_time() + self.wall_skew) * 1000)
        gen = Gen(self.world, random.Random(rnd), now_ms)
        if name == "fanout":
            made = _fanout(gen)
        else:
            made = OPS[name][2](gen)
            if not made:  # nothing to aim at yet: create what it needs instead
                kind = next(k for k in KINDS if k.name == OPS[name][0])
                for alt in kind.fallbacks(self.world) + ["scope.create"]:
                    made = OPS[alt][2](Gen(self.world, random.Random(rnd + 1), now_ms))
                    if made:
                        break
        if not made:
            return []
        return made if isinstance(made, list) else [made]

    def _send_as_time_steps(self, dt: float) -> None:
        """A busy stop (:attr:`Profile.busy_stop`): one client sends a request that lands
        exactly ``dt`` seconds from now, with whatever the coming time step wakes (the
        shutdown's next move included). At most :data:`BUSY_STOP_REQUESTS` per stop."""
        if self.stop_sent >= BUSY_STOP_REQUESTS:
            return
        rng = self.stop_rng
        names = list(self.profile.weights)
        name = rng.choice(names)
        made = [m for m in self._make_op(name, rng.getrandbits(32)) if not isinstance(m, Script)]
        if not made:
            return
        self.stop_sent += 1
        client = self.clients[rng.randrange(len(self.clients))]
        self.nursery.start_soon(functools.partial(self.request, client, made[0], at=trio.current_time() + dt))

    async def run_schedule(self) -> None:
        trio._core._run._r.seed(self.trio_seed)
        async with trio.open_nursery() as nursery:
            try:
                await self._run_schedule(nursery)
            except BaseException:
                # a violation ends the schedule: the node's shielded shutdown (a journal
                # flushing, a snapshot being written) may sleep, and nobody moves the
                # virtual clock any more -- let it jump by itself so the teardown ends
                self.clock.autojump_threshold = 0
                raise

    async def _run_schedule(self, nursery) -> None:
        self.nursery = nursery
        self.step_no = -1
        await self.start_node()
        for i, step in enumerate(self.steps):
            self.step_no = i
            await self.do(step)
            await self.settle()
            await self.restart_if_stopped()
            self.check_quiescent(full=(i % self.check_every == 0))
        # drain: every wait ends, every fsync completes, every request is answered
        self.step_no = len(self.steps)
        self.trace(f"drain: up to {DRAIN_S} s with no new request")
        self.drain_from = trio.current_time()
        await self.drain()
        self.check_quiescent(full=True)
        if self.pending:
            r0 = next(iter(self.pending.values()))
            raise Violation("liveness", f"{len(self.pending)} request(s) never answered, e.g. c{r0.client} "
                                        f"{_op_text(r0.op)} sent at {r0.sent:.3f}", self.step_no)
        # a last restart: the recovered state must equal the journal's replay
        self.step_no += 1
        self.trace(f"final restart ({self.profile.final})")
        await self.stop_node(self.profile.final)
        await self.advance(1.0)
        await self.start_node()
        await self.settle()
        self.check_quiescent(full=True)
        self.inc.stop_clean.set()
        while not self.inc.done.is_set():
            await self._advance_once(5.0)
        nursery.cancel_scope.cancel()

    async def drain(self) -> None:
        """Let time pass (up to :data:`DRAIN_S`) until every request was answered, no
        waiter is parked and the journal is durable."""
        while True:
            await self.restart_if_stopped()
            coord = self.live()
            if (not self.pending and coord is not None and not coord.runtime.n_waiters
                    and coord.journal.durable_lsn == coord.journal.last_lsn):
                return
            last_sent = max((r.sent for r in self.pending.values()), default=0.0)
            if trio.current_time() - max(last_sent, self.drain_from) > DRAIN_S:
                return
            await self.advance(1.0)

    def digest(self) -> str:
        """What the run did, as 16 hex digits: every answer the clients got (in order)
        and what the journal holds. Tracing does not change it."""
        h = self.answers.copy()
        for payload in self.payloads:
            h.update(payload)
        return h.hexdigest()[:16]


async def _fanout_script(call, call_all, n: int) -> None:
    await call(p.MailboxEnsure(name="wide"))
    root = await call(p.ScopeCreate(name="wide"))
    if not isinstance(root, p.ScopeView):
        return
    made = await call_all([p.ScopeCreate(parent_id=root.id) for _ in range(n)])
    kids = [v.id for v in made if isinstance(v, p.ScopeView)]
    await call_all([p.TaskSubmit(mailbox="wide", scope_id=k, input=msgspec.Raw(b"\x01")) for k in kids])
    for _ in range(3):
        await call(p.Receive(mailbox="wide", scope_id=root.id, max_messages=30, lease_ms=30000))


def _fanout(g: Gen):
    """A run with more than 64 children holding ready work in one work queue, then
    receives on it: the receive's second strategy (walking the subtree)."""
    n = g.rng.randint(65, 80)
    return Script(lambda call, call_all: _fanout_script(call, call_all, n), label=f"fanout({n})")


# ============================================================================ running
def _data_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def run_seed(seed: int, *, keep: set[int] | None = None, trace: bool = False, n_steps: int = DEFAULT_STEPS,
             check_every: int = 1, steps: list[tuple] | None = None) -> Result:
    """Run the schedule of ``seed`` (only the steps in ``keep``, if given; or exactly
    ``steps`` with the seed's profile) and return its :class:`Result` (``ok``, the
    violation, the trace when ``trace``). (A schedule that never ends -- an endless
    loop that never lets time move -- is caught by :func:`run_seeds`, which kills its
    worker.)"""
    profile, generated = generate(seed, n_steps)
    if steps is None:
        steps = generated
        if keep is not None:
            steps = [s for i, s in enumerate(steps) if i in keep]
    root = tempfile.mkdtemp(prefix=f"rpsim-{seed}-", dir=_data_root())
    sim = Sim(seed, profile, steps, trace=trace, data_dir=os.path.join(root, "data"), check_every=check_every)
    quiet = _quiet()
    # Trio's own switch for reproducible runs: each batch of runnable tasks is sorted by
    # creation order, then shuffled by the seeded source (not left in an order that
    # depends on object addresses)
    det = trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING
    trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING = True
    # lease secrets (claims, pool grants) come from ``secrets``: seeded here instead
    token_rng = random.Random(f"rallypoint-sim:tokens:{seed}")
    real_token = _claim_mod.new_token

    def seeded_token() -> int:
        return token_rng.getrandbits(62) + 1

    _claim_mod.new_token = _pool_mod.new_token = seeded_token
    # the production code's fault points (BUGGIFY) fire from a source of their own
    buggify.enable(random.Random(f"rallypoint-sim:buggify:{seed}"))
    try:
        clock = trio.testing.MockClock()
        sim.clock = clock
        trio._core._run._r.seed(sim.trio_seed)
        try:
            trio.run(sim.run_schedule, clock=clock)
            res = Result(seed, False if sim.check.failures else True, sim.check.failures[0] if sim.check.failures
                         else None, steps=len(steps))
        except Violation as v:
            res = Result(seed, False, v, steps=len(steps))
        except BaseException as exc:  # noqa: BLE001 - a crash of the simulated system is a finding too
            inner = exc
            while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) >= 1:
                vs = [e for e in inner.exceptions if isinstance(e, Violation)]
                inner = vs[0] if vs else inner.exceptions[0]
            if isinstance(inner, Violation):
                res = Result(seed, False, inner, steps=len(steps))
            elif isinstance(inner, KeyboardInterrupt):
                raise
            else:
                import traceback

                tb = "".join(traceback.format_exception(inner))
                res = Result(seed, False, Violation("crash", f"the simulation raised {inner!r}\n{tb}", sim.step_no),
                             steps=len(steps))
    finally:
        trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING = det
        _claim_mod.new_token = _pool_mod.new_token = real_token
        buggify.disable()
        quiet()
        shutil.rmtree(root, ignore_errors=True)
    res.trace = sim.trace_lines
    res.digest = sim.digest()
    res.stats = dict(sim.stats)
    res.stats["profile"] = profile.describe()
    return res


def _quiet():
    """Silence rallypoint's loggers while a schedule runs (crashes log by design)."""
    lg = logging.getLogger("rallypoint")
    old = lg.level
    lg.setLevel(logging.CRITICAL + 10)

    def restore():
        lg.setLevel(old)

    return restore


def shrink(seed: int, result: Result, *, n_steps: int = DEFAULT_STEPS, budget_s: float = 60.0) -> tuple[set[int], Result]:
    """Delta debugging over the steps of ``seed``'s failing schedule: the smallest set
    of step indices (greedy, within ``budget_s``) that still fails the same invariant.
    Returns the kept indices and the failing result of that schedule."""
    _, steps = generate(seed, n_steps)
    keep = list(range(len(steps)))
    want = result.violation.invariant
    best = result
    t0 = time.monotonic()

    def fails(idx: list[int]) -> Result | None:
        r = run_seed(seed, keep=set(idx), n_steps=n_steps)
        return r if (not r.ok and r.violation.invariant == want) else None

    n = 2
    while len(keep) >= 2 and time.monotonic() - t0 < budget_s:
        chunk = max(1, len(keep) // n)
        reduced = False
        for i in range(0, len(keep), chunk):
            cand = keep[:i] + keep[i + chunk:]
            if not cand:
                continue
            r = fails(cand)
            if r is not None:
                keep, best = cand, r
                n = max(n - 1, 2)
                reduced = True
                break
            if time.monotonic() - t0 > budget_s:
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(keep), n * 2)
    final = run_seed(seed, keep=set(keep), trace=True, n_steps=n_steps)
    return set(keep), final if not final.ok else best


_SLOT = 0
_SLOTS = None


def _worker_init(seeds, started, counter) -> None:
    global _SLOT, _SLOTS
    with counter.get_lock():
        _SLOT = counter.value
        counter.value += 1
    _SLOTS = (seeds, started)
    try:  # a runaway schedule must not take the machine's memory
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not on every platform
        pass


def _run_chunk(args) -> tuple[int, list[tuple[int, str, str, int]], float]:
    seeds, n_steps = args
    fails = []
    t0 = time.perf_counter()
    for s in seeds:
        if _SLOTS is not None:
            _SLOTS[0][_SLOT] = s
            _SLOTS[1][_SLOT] = time.time()
        r = run_seed(s, n_steps=n_steps)
        if not r.ok:
            fails.append((s, r.violation.invariant, r.violation.message, r.violation.step))
    if _SLOTS is not None:
        _SLOTS[1][_SLOT] = 0.0
    return len(seeds), fails, time.perf_counter() - t0


#: a schedule takes milliseconds; one still running after this (real seconds) loops
#: without letting time move: its worker is killed and the seed reported
HANG_S = 60.0


def run_seeds(seeds, *, processes: int = 2, n_steps: int = DEFAULT_STEPS, chunk: int = 50,
              stop_after: int = 1, progress: bool = False, hang_s: float = HANG_S) -> dict:
    """Run many seeds on ``processes`` worker processes (``PYTHONHASHSEED=0``). Stops
    after ``stop_after`` failures. A seed still running after ``hang_s`` real seconds
    is a ``liveness`` failure (its worker is killed). Returns ``{"run", "failures":
    [(seed, invariant, message, step)], "wall_s", "cpu_s"}`` (``cpu_s``: the workers'
    time in their chunks)."""
    import multiprocessing as mp

    seeds = list(seeds)
    chunks = [(seeds[i:i + chunk], n_steps) for i in range(0, len(seeds), chunk)]
    t0 = time.perf_counter()
    out = {"run": 0, "failures": [], "cpu_s": 0.0}
    old = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = "0"
    try:
        ctx = mp.get_context("spawn")
        current = ctx.Array("q", processes, lock=False)
        started = ctx.Array("d", processes, lock=False)
        counter = ctx.Value("i", 0)
        pool = ctx.Pool(processes, initializer=_worker_init, initargs=(current, started, counter))
        try:
            it = pool.imap_unordered(_run_chunk, chunks)
            while True:
                try:
                    n, fails, cpu = it.next(timeout=2.0)
                except StopIteration:
                    break
                except mp.TimeoutError:
                    now = time.time()
                    hung = [current[i] for i in range(processes) if started[i] and now - started[i] > hang_s]
                    if hung:
                        out["failures"].append((hung[0], "liveness", f"the schedule did not end within {hang_s:.0f} s "
                                                "of real time: something loops without letting time move", -1))
                        break
                    continue
                out["run"] += n
                out["cpu_s"] += cpu
                out["failures"].extend(fails)
                if progress:
                    line = (f"{out['run']}/{len(seeds)} seeds, {len(out['failures'])} failing, "
                            f"{time.perf_counter() - t0:.0f} s")
                    if sys.stderr.isatty():
                        print("\r" + line, end="", file=sys.stderr, flush=True)
                    elif out["run"] // 1000 != (out["run"] - n) // 1000 or out["run"] == len(seeds):
                        print(line, file=sys.stderr, flush=True)  # a log: a line every 1,000 seeds
                if len(out["failures"]) >= stop_after:
                    break
        finally:
            pool.terminate()
            pool.join()
    finally:
        if old is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = old
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)  # end the \r line
    out["failures"].sort()
    out["wall_s"] = time.perf_counter() - t0
    return out


def _parse_keep(text: str) -> set[int]:
    """``1,3,5-9`` -> {1, 3, 5, 6, 7, 8, 9}; ValueError on anything else."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = (int(x) for x in part.split("-"))
            if a < 0 or b < a:
                raise ValueError(f"bad step range {part!r} (A-B with 0 <= A <= B)")
            out.update(range(a, b + 1))
        else:
            if int(part) < 0:
                raise ValueError(f"bad step index {part!r}")
            out.add(int(part))
    if not out:
        raise ValueError("no step indices")
    return out


def format_keep(keep: set[int]) -> str:
    """Indices as ``1,3,5-9``."""
    out, run = [], []
    for i in sorted(keep):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)))
    return ",".join(out)


def report(seed: int, result: Result, *, n_steps: int = DEFAULT_STEPS, do_shrink: bool = True,
           budget_s: float = 60.0) -> str:
    """A failing seed's report: the violation, the shrunk trace (shrinking for at most
    ``budget_s`` seconds), how to replay."""
    lines = [result.headline(), f"profile: {result.stats.get('profile', '')}"]
    if do_shrink:
        keep, small = shrink(seed, result, n_steps=n_steps, budget_s=budget_s)
        lines.append(f"shrunk to {len(keep)} steps: {small.headline()}")
        lines += small.trace
        lines.append(f"replay: python -m rallypoint.testing.sim --seed {seed} --keep {format_keep(keep)} --trace")
    lines.append(f"replay the whole schedule: python -m rallypoint.testing.sim --seed {seed} --trace")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m rallypoint.testing.sim``: run one seed (``--seed``) or many
    (``--seeds A:B``). Exit status 1 when a seed fails."""
    ap = argparse.ArgumentParser(prog="python -m rallypoint.testing.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, help="run this seed")
    ap.add_argument("--keep", help="only these step indices (a shrunk schedule), e.g. 1,3,5-9")
    ap.add_argument("--trace", action="store_true", help="print the trace")
    ap.add_argument("--seeds", help="run seeds A:B (or N: 0:N)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per schedule")
    ap.add_argument("--no-shrink", action="store_true")
    args = ap.parse_args(argv)
    if args.seed is not None and args.seeds:
        ap.error("give --seed or --seeds, not both")
    if args.steps < 1 or args.processes < 1:
        ap.error("--steps and --processes must be >= 1")
    keep = None
    if args.keep:
        try:
            keep = _parse_keep(args.keep)
        except ValueError as exc:
            ap.error(f"--keep: {exc}")
        if max(keep) >= args.steps:
            ap.error(f"--keep: step {max(keep)} is past the schedule's {args.steps} steps (0 to {args.steps - 1})")
    if args.seeds:
        a, _, b = args.seeds.partition(":")
        try:
            lo, hi = (0, int(a)) if not b else (int(a), int(b))
        except ValueError:
            ap.error(f"--seeds is A:B or N (got {args.seeds!r})")
        if not 0 <= lo < hi:
            ap.error(f"--seeds A:B needs 0 <= A < B (got {args.seeds!r})")
    if os.environ.get("PYTHONHASHSEED") != "0":
        # set iteration order must be the same as in the worker processes
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "rallypoint.testing.sim", *(argv if argv is not None else sys.argv[1:])])
    if args.seed is not None:
        res = run_seed(args.seed, keep=keep, trace=args.trace, n_steps=args.steps)
        if args.trace:
            print(f"profile: {res.stats.get('profile')}")
            print("\n".join(res.trace))
        print(res.headline(), f"digest {res.digest}")
        if not res.ok and not args.no_shrink and keep is None:
            print(report(args.seed, res, n_steps=args.steps))
        return 0 if res.ok else 1
    if args.seeds:
        out = run_seeds(range(lo, hi), processes=args.processes, n_steps=args.steps, progress=True)
        print(f"{out['run']} seeds in {out['wall_s']:.1f} s wall ({out['cpu_s']:.1f} s CPU), "
              f"{len(out['failures'])} failing")
        for seed, inv, msg, step in out["failures"][:5]:
            print(f"seed {seed}: [{inv}] at step {step}: {msg}")
        if out["failures"] and not args.no_shrink:
            seed = out["failures"][0][0]
            print(report(seed, run_seed(seed, n_steps=args.steps), n_steps=args.steps))
        return 0 if not out["failures"] else 1
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
