"""Calls between the shards of a sharded cluster, made by each shard's leader.

- :class:`Peers`: one connection per other shard, to that shard's leader's client port
  (as etcd advertises it), authenticated by a one-use token of the cluster's **node
  secret** (etcd, ``/rallypoint/<cluster>/node_secret``:
  :func:`rallypoint.cluster.shardmap.node_secret`; the token:
  :func:`rallypoint.cluster.peerauth.make_token`, the secret itself is never sent);
  a call follows a failover (it waits for the next leader and sends again: every call
  made here is idempotent).
- :class:`RemoteRuns` (the home shard's side): a request of a run of another shard for
  a claim, a pool, a quota or a budget (``Service.submit``) waits while the run is
  linked -- ``run.link`` on the run's shard, ``run.adopt_remote`` here -- then is
  submitted again, and runs as any request of a local run.
- :class:`Reserver` (the run's shard's side): a ready task whose requirements are its
  space's home shard's, that a receive could not deliver, gets a reservation there
  (``admission.reserve``, idempotent per (task, delivery token), leased) which this
  shard journals (``admission.hold``); the receive then delivers it, and the delivery's
  start and end reach the home shard through the outbox.
- :class:`OutboxSender` (the run's shard's side): delivers the outbox to each home
  shard at least once, from its oldest entry, once what it sends is durable here;
  journals each answer (``outbox.ack``). A new leader starts it again from what its
  journal holds.

See :mod:`rallypoint.actors.outbox` for the records and docs/architecture.md, "Many
shards", for the decisions.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import msgspec
import trio

from ..errors import NotLeaderError, RallypointError, UnavailableError
from ..ids import slot_of
from ..logutil import RateLimitedLogger
from ..protocol import (
    AdmissionHold,
    AdmissionReserve,
    AdmissionReserveView,
    OutboxAck,
    OutboxDeliver,
    OutboxDeliverView,
    RemoteRunAdopt,
    RunLink,
)

log = logging.getLogger("rallypoint.cluster")

__all__ = ["Peers", "RemoteRuns", "OutboxSender", "Reserver"]

#: outbox entries sent in one call
BATCH = 256


class Peers:
    """Connections to the other shards' leaders. ``leader_address(shard)``: the
    shard's leader's client address as etcd says now (None: none known); ``secret``:
    the node secret (each connection's handshake carries a fresh token of it for
    ``cluster``, this ``node`` and the callee's shard); ``nursery``: where the
    connections run (the leader's term); ``timeout_s``: how long a call may wait for a
    leader that answers (seconds)."""

    def __init__(self, leader_address: Callable[[int], str | None], secret: str, nursery: trio.Nursery, *,
                 cluster: str, node: str, timeout_s: float = 10.0) -> None:
        self.leader_address = leader_address
        self.secret = secret
        self.cluster = cluster
        self.node = node
        self.nursery = nursery
        self.timeout_s = timeout_s
        self._conns: dict[int, tuple[str, Any, trio.CancelScope]] = {}
        #: opens a connection (``Connection.open``'s signature; None: a real one over
        #: TCP). The cluster simulator (:mod:`rallypoint.testing.clustersim`) sets its
        #: in-memory connections here (``ShardMember.open_peer``)
        self.open_connection: Callable[..., Any] | None = None
        self.calls = 0
        self.reconnects = 0

    async def call(self, shard: int, op: msgspec.Struct) -> msgspec.Raw:
        """``op`` on ``shard``'s leader: its encoded answer, or the RallypointError it
        answered. UNAVAILABLE when no leader answered within ``timeout_s`` (a
        connection lost with the call in flight is sent again: the calls are
        idempotent)."""
        deadline = trio.current_time() + self.timeout_s
        last: RallypointError | None = None
        while True:
            address = self.leader_address(shard)
            if address is not None:
                try:
                    conn = await self._conn(shard, address)
                    self.calls += 1
                    return await conn.call(op)
                except (UnavailableError, NotLeaderError, OSError) as e:
                    self._drop(shard)
                    last = e if isinstance(e, RallypointError) else UnavailableError(str(e))
            if trio.current_time() >= deadline:
                raise UnavailableError(f"shard {shard}'s leader could not be reached within {self.timeout_s:g} s "
                                       f"({last.message if last else 'no leader known'})", retry_after=1.0,
                                       details={"shard": shard})
            await trio.sleep(0.1)

    async def _conn(self, shard: int, address: str):
        have = self._conns.get(shard)
        if have is not None:
            addr, conn, _scope = have
            if addr == address and not conn.closed:
                return conn
            self._drop(shard)
        self.reconnects += 1
        conn, scope = await self.nursery.start(self._hold, f"tcp://{address}", shard)
        self._conns[shard] = (address, conn, scope)
        return conn

    def _drop(self, shard: int) -> None:
        have = self._conns.pop(shard, None)
        if have is not None:
            have[2].cancel()

    async def _hold(self, url: str, shard: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from ..transport.connection import Connection
        from .peerauth import make_token

        with trio.CancelScope() as scope:
            token = make_token(self.secret, purpose="session", cluster=self.cluster, node=self.node, target=str(shard))
            opener = self.open_connection or Connection.open
            conn = await opener(url, api_key=token, client_name="rallypoint-peer", connect_timeout=2.0)
            try:
                async with conn:
                    task_status.started((conn, scope))
                    await conn.wait_closed()
            except Exception as e:  # a lost peer: the next call opens another connection
                log.debug("peer connection to %s ended: %s", url, e)

    def close(self) -> None:
        for shard in list(self._conns):
            self._drop(shard)


class RemoteRuns:
    """The home shard's side of a remote run (see the module docstring): ``service``
    is this node's :class:`~rallypoint.service.Service`, ``peers`` a :class:`Peers`."""

    def __init__(self, service, peers: Peers, nursery: trio.Nursery) -> None:
        self.service = service
        self.peers = peers
        self.nursery = nursery
        self.linked = 0

    def link(self, session, body, sink, rid: int, run_id: str) -> None:
        """Link run ``run_id`` (of another shard), then submit ``body`` again; an error
        of either step is the request's answer."""
        self.nursery.start_soon(self._link, session, body, sink, rid, run_id)

    async def _link(self, session, body, sink, rid: int, run_id: str) -> None:
        from ..service import Session

        service = self.service
        coord = service.coordinator
        sh = coord.sharding
        try:
            if sh is None:
                raise UnavailableError("this node no longer serves a sharded cluster", retry_after=1.0)
            shard = sh.owners[slot_of(run_id) % sh.slots]
            await self.peers.call(shard, RunLink(scope_id=run_id, space=session.space, shard=sh.shard))
            await service.call(Session(space=session.space, local=True),
                               RemoteRunAdopt(scope_id=run_id, space=session.space, shard=shard))
        except RallypointError as e:
            sink.deliver(rid, e, coord.journal.last_lsn)
            return
        except Exception as e:  # a bug: answer INTERNAL, keep serving
            coord.internal_error(e)
            coord.reply(sink, rid, e)
            return
        self.linked += 1
        if run_id not in coord.runs.table:  # (cannot happen: adopted, or its end came first)
            sink.deliver(rid, UnavailableError(f"run {run_id} could not be linked here; retry", retry_after=0.5),
                         coord.journal.last_lsn)
            return
        service.submit(session, body, sink, rid)


class OutboxSender:
    """Delivers this shard's outbox (see the module docstring) while this node leads.
    ``service``: the node's Service; ``peers``: a :class:`Peers`; ``shard``: this
    shard's number. Attributes ``delivered`` (entries acknowledged) and ``failures``
    (calls that failed; each is tried again) are for tests and status."""

    def __init__(self, service, peers: Peers, shard: int, *, retry_s: float = 0.2) -> None:
        self.service = service
        self.peers = peers
        self.shard = shard
        self.retry_s = retry_s
        self.delivered = 0
        self.failures = 0
        self._wake = trio.Event()
        self.limiter = RateLimitedLogger(log, window_s=10.0, burst=3)

    def poke(self) -> None:
        self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from ..service import Session

        coord = self.service.coordinator
        outbox = coord.outbox
        outbox.on_change = self.poke
        local = Session(local=True)
        task_status.started()
        try:
            while True:
                pending = outbox.pending()
                if not pending:
                    self._wake = trio.Event()
                    if not outbox.pending():
                        await self._wake.wait()
                    continue
                # an entry leaves only once the record that made it is durable here: a
                # run's end this shard might lose in a failover is never told
                try:
                    await self.service.wait_durable(coord.journal.last_lsn)
                except RallypointError:
                    await trio.sleep(self.retry_s)  # (the node is stopping)
                    continue
                failed = False
                for dest, items in sorted(pending.items()):
                    batch = items[:BATCH]
                    try:
                        raw = await self.peers.call(dest, OutboxDeliver(source=self.shard, items=batch))
                        got = msgspec.msgpack.decode(raw, type=OutboxDeliverView)
                        upto = min(got.received, batch[-1].seq)
                        if upto >= batch[0].seq:
                            await self.service.call(local, OutboxAck(shard=dest, seq=upto))
                            self.delivered += upto - batch[0].seq + 1
                            if outbox.on_want is not None and any(
                                    x.reason == "delivery_ended" and x.seq <= upto for x in batch):
                                outbox.on_want()  # units went back there: a waiting reservation may fit now
                    except RallypointError as e:
                        failed = True
                        self.failures += 1
                        self.limiter.log(logging.WARNING, f"outbox-{dest}", "shard %d: delivering %d outbox entries "
                                         "to shard %d failed (%s); again", self.shard, len(batch), dest, e.message)
                if failed:
                    await trio.sleep(self.retry_s)
        finally:
            if outbox.on_change == self.poke:
                outbox.on_change = None


#: codes of a reservation the home shard can never grant (the task is cancelled)
_REFUSED = ("NOT_FOUND", "VALIDATION_FAILED")


class Reserver:
    """Reservations on the home shard for this shard's tasks (see the module
    docstring), while this node leads. ``lease_ms``: how long a reservation waits for
    its delivery on the home shard; a reservation is used here only within half of what
    is left of it when the answer comes (``usable_ms``; a re-sent reserve finds the
    same reservation, older), so the delivery's confirmation has the other half to
    arrive; with less than ``min_usable_ms`` left it is let lapse and asked again.
    A task no receive asked for in ``forget_after_ms`` (2 min, as a pool's admission
    line on one node) is not asked for any more (until a receive asks again).
    ``retry_s``: how soon a reservation that did not fit (WAITING) or failed is asked
    again. Attributes ``granted``, ``waiting``, ``refused`` count answers."""

    def __init__(self, service, peers: Peers, *, lease_ms: int = 30_000, retry_s: float = 0.25,
                 min_usable_ms: int = 1_000, forget_after_ms: int = 120_000) -> None:
        self.service = service
        self.peers = peers
        self.lease_ms = lease_ms
        self.min_usable_ms = min_usable_ms
        self.forget_after_ms = forget_after_ms
        self.retry_s = retry_s
        self.granted = 0
        self.waiting = 0
        self.refused = 0
        self._wake = trio.Event()
        self.limiter = RateLimitedLogger(log, window_s=10.0, burst=3)

    def poke(self) -> None:
        self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from ..service import Session

        coord = self.service.coordinator
        outbox = coord.outbox
        outbox.on_want = self.poke
        local = Session(local=True)
        task_status.started()
        try:
            while True:
                if not outbox.wanted:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                again = False
                for tid in list(outbox.wanted):
                    t = coord.queues.tasks.get(tid)
                    req = t.requirements.remote if t is not None and t.requirements is not None else None
                    asked = outbox.wanted.get(tid)
                    if (t is None or t.state != "QUEUED" or req is None or asked is None
                            or coord.mono_ms() - asked > self.forget_after_ms):
                        outbox.wanted.pop(tid, None)  # gone, or no receive wants it any more
                        continue
                    if outbox.requirement_fits(req, {}, t):
                        outbox.wanted.pop(tid, None)  # held already (a receive will take it)
                        continue
                    token = t.token + 1
                    hold = AdmissionHold(task_id=t.id, token=token, shard=req.shard)
                    try:
                        raw = await self.peers.call(req.shard, AdmissionReserve(
                            space=t.space, scope_id=t.scope_id, task_id=t.id, token=token, lease_ms=self.lease_ms,
                            **coord.admission.named(req)))
                        got = msgspec.msgpack.decode(raw, type=AdmissionReserveView)
                    except RallypointError as e:
                        if e.code in _REFUSED:
                            self.refused += 1
                            hold.refused = e.message
                            log.warning("shard %d: the home shard refused the requirements of task %s for good (%s): "
                                        "the task is cancelled", self.service.shard or 0, t.id, e.message)
                        else:
                            again = True
                            self.limiter.log(logging.WARNING, "reserve", "reserving task %s's requirements on shard "
                                             "%d failed (%s); again", t.id, req.shard, e.message)
                            continue
                    else:
                        if got.status != "GRANTED" or got.lease_left_ms // 2 < self.min_usable_ms:
                            self.waiting += 1  # (or too little of an older reservation is left: it lapses)
                            again = True
                            continue
                        self.granted += 1
                        hold.grants, hold.reservations = got.grants, got.reservations
                        hold.usable_ms = got.lease_left_ms // 2
                    try:
                        await self.service.call(local, hold)
                    except RallypointError as e:
                        again = True
                        self.limiter.log(logging.WARNING, "hold", "keeping the reservation of task %s failed (%s)",
                                         t.id, e.message)
                if again:  # again after retry_s, or sooner when this shard gave units back
                    self._wake = trio.Event()
                    with trio.move_on_after(self.retry_s):
                        await self._wake.wait()
        finally:
            if outbox.on_want == self.poke:
                outbox.on_want = None
