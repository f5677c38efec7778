"""One node of a replicated shard: a standby until etcd makes it the leader, the leader
until it is deposed or stopped, then a standby again.

::

      start ──▶ recover the data dir ──▶ STANDBY ─────── campaign won ──────▶ LEADER
                  ▲     (snapshot + journal)   │ follows whoever leads:          │ journals its epoch,
                  │                            │ frames in, acks out,           │ shrinks the ISR to
                  │                            │ replay-apply                   │ itself (fenced), re-arms,
                  │   Rebuild: truncate past   │                                │ serves clients, ships
                  ├── its last epoch, or ◀─────┘                                │ frames to the standby
                  │   install a snapshot copy                                   │
                  └────────────────── deposed (lease lost, fence refused) ◀─────┘
                                      or SIGTERM (hand-over, then exit)

Etcd decides who leads (:mod:`rallypoint.cluster.leader`): a node campaigns only while
it is in the in-sync set, and the campaign is one transaction. The cluster's API keys
live in etcd too (:mod:`rallypoint.cluster.keystore`): a leader takes every key record
before it serves a client, then watches them (``key.adopt``), so a key made or revoked
there reaches every shard within one watch round trip; the standby has them through
the journal. The data path is ours
(:mod:`rallypoint.replication`). While a standby, the node's client port answers every
handshake with NOT_LEADER naming the leader, and its HTTP port forwards to the
leader's (:mod:`rallypoint.cluster.forward`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import trio

from ..backoff import Backoff
from ..errors import ConflictError, NotLeaderError, RallypointError, UnavailableError, ValidationError
from ..logutil import RateLimitedLogger
from ..node import recovered, serving
from ..nodeconfig import SnapshotOptions, StorageOptions
from ..replication import (
    LinkClosed,
    Rebuild,
    ReplicationLeader,
    StaleLeader,
    install_snapshot,
    running_as_standby,
    take_over,
    truncate_after,
)
from ..replication.auth import LinkAuth, Unauthenticated
from ..replication.link import unwrapped
from ..wire import PROTOCOL_VERSION
from .etcd import EtcdAccess, EtcdClient, EtcdError
from ..actors.sharding import Sharding
from .leader import (DEFAULT_REPLICATION_FACTOR, LeaderInfo, LeaderRecord, Leadership, LeadershipLostError,
                     ReplicasRecord, ShardElection, check_replication_factor)
from .keystore import KeyRecord, watch_keys
from .noderole import NodeRole, RoleMachine
from .presence import NodePresence
from .shardmap import SlotMap, read_config, reinit_revision, watch_leaders, watch_map

log = logging.getLogger("rallypoint.cluster")

__all__ = ["MemberConfig", "ShardMember", "EtcdIsr", "StaleDataError"]


class StaleDataError(ConflictError):
    """CONFLICT: the node's data dir holds records of a cluster of the same name that
    ``cluster init --force`` deleted (its newest epoch is older than the re-creation);
    ``details``: ``node``, ``epoch``, ``reinit_revision``. Start the node on an empty
    data dir (or move the old one away)."""


@dataclass
class MemberConfig:
    """What a node of a replicated shard needs (``rallypoint serve --cluster``).

    ``etcd``: endpoints (``http://host:port``); ``etcd_access``: the
    :class:`~rallypoint.cluster.etcd.EtcdAccess` (TLS, user) when etcd needs more than
    plaintext endpoints (it then wins over ``etcd``); ``cluster``: the cluster's name (the
    etcd key prefix ``/rallypoint/<cluster>/``); ``shard``; ``node``: this node's name,
    unique in the shard; ``data_dir``/``durability`` (``fsync`` or ``interval``);
    ``client``/``replication``/``http``: ``(host, port)`` to listen on (port 0: a free
    one), ``advertise_host``: the host other nodes and clients reach this one at
    (default: the listen host); ``advertise_replication``: ``host:port`` a standby
    connects to for replication, when that is not the listener's own address (a proxy
    or a port forward in front of it; default: ``advertise_host`` and the listener's
    port); ``ttl_s``: the leader lease's TTL (s, etcd's minimum is
    2); ``isr_timeout_s``: a standby silent this long (s) leaves the in-sync set;
    ``min_insync``: 2 refuses writes rather than run without a standby;
    ``peer_tls``/``insecure``: the replication link's TLS (see the fields);
    ``replicas``: how many nodes the shard has (1 or 2), given only to the node that
    creates the shard (None: the cluster's ``cluster init --replicas``, else 2; a value
    that differs from the one the shard records refuses the node);
    ``storage``: how the data dir and journal are opened, ``snapshots``: when a leader
    snapshots (:class:`~rallypoint.nodeconfig.StorageOptions`,
    :class:`~rallypoint.nodeconfig.SnapshotOptions`: the same as a single node's)."""

    etcd: list[str]
    node: str
    data_dir: str
    cluster: str = "rallypoint"
    shard: int = 0
    durability: str = "fsync"
    client: tuple[str, int] = ("127.0.0.1", 7411)
    replication: tuple[str, int] = ("127.0.0.1", 0)
    http: tuple[str, int] | None = None
    advertise_host: str | None = None
    advertise_replication: str | None = None
    ttl_s: int = 2
    isr_timeout_s: float = 1.0
    min_insync: int = 1
    replicas: int | None = None
    drain_timeout_s: float = 10.0
    #: the replication link's mutual TLS (``--peer-cert/--peer-key/--peer-ca``,
    #: :class:`~rallypoint.cluster.peerauth.PeerTls`); None: plaintext (loopback only
    #: unless ``insecure``), authenticated by the cluster secret all the same
    peer_tls: Any = None
    #: ``--insecure``: a plaintext replication link on a non-loopback address
    insecure: bool = False
    etcd_access: EtcdAccess | None = None
    storage: StorageOptions = field(default_factory=StorageOptions)
    snapshots: SnapshotOptions = field(default_factory=SnapshotOptions)


class EtcdIsr:
    """The in-sync set of a leadership, written through etcd (fenced by its epoch).
    ``members`` (the shard's configured replica set) is etcd's: nodes join it at their
    first start (:meth:`ShardElection.join`), never through an in-sync set update."""

    #: :meth:`members_now` reads etcd at most this often (seconds)
    MEMBERS_REFRESH_S = 0.5

    def __init__(self, leadership: Leadership, members: list[str], isr: list[str]) -> None:
        self.leadership = leadership
        self.members = list(members)
        self.isr = list(isr)
        self._members_read_at = -math.inf

    async def set_isr(self, isr: list[str]) -> bool:
        try:
            rec = await self.leadership.update_isr(isr)
        except LeadershipLostError:
            return False
        except ValidationError as e:  # a standby removed from the members while linked: end its session
            raise LinkClosed(f"the in-sync set {isr} was not written: {e.message}") from None
        except EtcdError as e:
            log.warning("in-sync set update failed (%s); treating this node as deposed", e.message)
            return False
        self.members = list(rec.replicas.members)
        self.isr = list(rec.replicas.isr)
        return True

    async def members_now(self) -> list[str]:
        """The shard's members as etcd holds them (read again at most every
        :attr:`MEMBERS_REFRESH_S`; the last list read while etcd does not answer): the
        replication listener lets in only these (``ReplicationLeader(members=...)``)."""
        now = trio.current_time()
        if now - self._members_read_at >= self.MEMBERS_REFRESH_S:
            self._members_read_at = now
            try:
                rec = await self.leadership.election.read_replicas()
            except EtcdError as e:
                log.info("reading the shard's members failed (%s); using the last ones read", e.message)
            else:
                if rec is not None:
                    self.members = list(rec.replicas.members)
        return list(self.members)


class _Redirect:
    """The client port's dispatcher while this node does not lead: every handshake is
    answered NOT_LEADER with the leader's addresses (the SDK follows it)."""

    def __init__(self, member: "ShardMember") -> None:
        self.member = member

    def hello(self, hello, peer):
        raise self.member.not_leader_error()

    def submit(self, session, body, sink, rid):  # never reached: no handshake succeeds
        raise self.member.not_leader_error()

    def durable_lsn(self) -> int:
        return 0

    async def wait_durable(self, lsn: int) -> None:
        await trio.lowlevel.checkpoint()


class _Fenced:
    """The client port's dispatcher while this node leads: the node's
    :class:`~rallypoint.service.Service` behind the self-fence (SCALE-OUT.md §4.4, layer
    2). Every handshake and every request first asks :meth:`Leadership.is_leader_now`
    (the Trio clock against the last answered keepalive's deadline); once it is false
    they are answered NOT_LEADER, before the service sees them; and every batch of
    replies asks it again before it is written (:meth:`may_reply`). So a leader stopped past
    its lease (SIGSTOP, a VM stall) answers nothing from its stale state when it runs
    again -- not even in the first batch after it resumes, before its fence task has run
    and torn the port down. (Writes are fenced anyway: no in-sync standby acknowledges
    them. This keeps reads from answering too.) Everything else is the service's."""

    def __init__(self, service, lead: Leadership, member: "ShardMember") -> None:
        self._service = service
        self._lead = lead
        self._member = member

    def refusal(self) -> NotLeaderError:
        """NOT_LEADER without a hint: a node past its fence cannot know who leads now."""
        c = self._member.config
        return NotLeaderError(f"node {c.node} no longer leads shard {c.shard} (its leadership at epoch "
                              f"{self._lead.epoch} lapsed: {self._lead.lost_reason or 'the self-fence deadline passed'}"
                              "); retry shortly on the shard's other nodes", retry_after=0.5,
                              details={"shard": c.shard, "epoch": self._lead.epoch, "leader": None})

    def hello(self, hello, peer):
        if not self._lead.is_leader_now():
            raise self.refusal()
        return self._service.hello(hello, peer)

    def submit(self, session, body, sink, rid):
        if not self._lead.is_leader_now():
            sink.deliver(rid, self.refusal(), 0)
            return
        self._service.submit(session, body, sink, rid)

    def may_reply(self) -> bool:
        """The server's reply gate: asked before every batch of replies is written, so a
        reply computed before the deadline (a read admitted in time, a parked receive,
        a watch's push) is not sent after it: the connection closes instead (SCALE-OUT
        §4.4 layer 2: "re-checks before each reply batch"). A refusal built by
        :meth:`submit` goes out with the batch it is in only while the fence holds."""
        return self._lead.is_leader_now()

    def __getattr__(self, name: str):
        return getattr(self._service, name)


class ShardMember:
    """Runs one node of a replicated shard (see the module docstring) until cancelled
    or :meth:`stop` (a graceful stop: a leader hands over to an in-sync standby first).

    ``make_server(dispatcher)`` builds the TCP :class:`~rallypoint.transport.server.Server`
    for the client port (the daemon passes its options); ``on_leader(node, member)`` is
    called with the serving :class:`~rallypoint.node.Node` each time this node starts to
    lead (the daemon starts metrics and the HTTP API there) and may return an async
    callable run while it leads.

    Attributes: ``role`` (a :class:`~rallypoint.cluster.noderole.NodeRole`: starting,
    standby, leader, stopping, stopped; moved only along its table), ``leader``
    (the current :class:`LeaderRecord` as last seen, or None), ``epoch`` (this node's,
    while it leads), ``standby`` / ``replication`` (the live objects of the role),
    ``client_port`` / ``replication_port`` / ``http_port`` (bound ports),
    ``keys_adopted`` (key records of etcd this node journaled while leading),
    ``replica_set`` / ``presence`` (what :meth:`admit` found and holds).

    Before it binds a port or opens its data dir, a node is admitted (:meth:`admit`):
    it must be a member of the shard's configured replica set (or join it while it has
    room) and no other live process may hold its name. Otherwise :meth:`run` raises
    NotAMemberError or DuplicateNodeError (CONFLICT), whose message is the one line the
    daemon prints; a data dir of a cluster deleted by ``cluster init --force`` raises
    StaleDataError once it is opened."""

    def __init__(self, config: MemberConfig, *, make_server: Callable[[Any], Any],
                 on_leader: Callable[[Any, "ShardMember"], Any] | None = None,
                 on_role: Callable[[str, "ShardMember"], None] | None = None) -> None:
        if config.durability not in ("fsync", "interval"):
            raise ValidationError("a replicated shard needs a data dir: --durability fsync or interval")
        if config.min_insync not in (1, 2):
            raise ValidationError(f"--min-insync must be 1 or 2 (got {config.min_insync})")
        if config.replicas is not None:
            check_replication_factor(config.replicas)
        if config.peer_tls is not None and config.node not in config.peer_tls.names:
            raise ValidationError(f"--peer-cert {config.peer_tls.cert} does not name node {config.node!r} (its "
                                  f"names: {', '.join(sorted(config.peer_tls.names)) or 'none'}): a peer is "
                                  "accepted only under a name its certificate carries; `rallypoint cluster certs "
                                  f"--nodes {config.node}` makes one")
        if config.peer_tls is None and not config.insecure:
            for what, host in (("--replication", config.replication[0]),
                               ("--advertise-replication", _host_of(config.advertise_replication)),
                               ("--advertise", config.advertise_host)):
                if host is not None and not _loopback(host):
                    raise ValidationError(
                        f"{what} {host} is not a loopback address and the replication link has no TLS: give "
                        "--peer-cert, --peer-key and --peer-ca (`rallypoint cluster certs` makes them), or "
                        "--insecure for a plaintext link on a network you trust")
        self.config = config
        self.make_server = make_server
        self.on_leader = on_leader
        self.on_role = on_role
        self._roles = RoleMachine()  # the role, moved only along noderole.ROLE_MOVES
        self.leader: LeaderRecord | None = None
        self.epoch: int | None = None
        self.standby = None
        self.replication: ReplicationLeader | None = None
        self.leadership: Leadership | None = None
        self.node = None
        self.server = None  # the client port's Server while leading
        self.client_port: int | None = None
        self.replication_port: int | None = None
        self.http_port: int | None = None
        self.last_epoch_seen = 0
        self.changes = 0  # role changes, for tests and status
        #: a sharded cluster's slot map and every shard's leader, as watched in etcd
        self.slotmap: SlotMap | None = None
        self.leaders: dict[int, LeaderRecord] = {}
        self._map_seen = trio.Event()
        self._etcd: EtcdClient | None = None
        #: key records taken from etcd (``key.adopt``) while leading, for tests and status
        self.keys_adopted = 0
        #: a sharded cluster's leader: the outbox's sender (rallypoint.cluster.peers)
        self.outbox_sender = None
        #: how the node reaches etcd, the leader's replication address and listens for
        #: standbys (the two-node simulator, :mod:`rallypoint.testing.replsim`, replaces
        #: them with an in-memory etcd and a seeded network)
        self.make_etcd: Callable[[], Any] = lambda: (config.etcd_access or EtcdAccess(tuple(config.etcd))).client()
        self.connect: Callable[[str, int], Any] = trio.open_tcp_stream
        self.listen: Callable[..., Any] = trio.open_tcp_listeners
        #: ``await probe(point)`` at each step of a takeover and a rejoin (None: nothing;
        #: the simulator crashes the node there)
        self.probe: Callable[[str], Any] | None = None
        #: opens a connection to another shard's leader (``Connection.open``'s signature;
        #: None: over TCP): the cluster simulator's in-memory connections
        self.open_peer: Callable[..., Any] | None = None
        #: a sharded cluster's leader: reservations on home shards (rallypoint.cluster.peers)
        self.reserver = None
        #: the cluster secret (etcd), read at start; the replication link's credentials
        self.secret: str | None = None
        self.link_auth: LinkAuth | None = None
        self._link_refusals = RateLimitedLogger(log, window_s=30.0, burst=1)
        #: admission (:meth:`admit`): the shard's replica set as this node joined it,
        #: and this process's presence key
        self.replica_set: ReplicasRecord | None = None
        self.presence: NodePresence | None = None
        self._admit_started = False
        self._admitted = trio.Event()
        self._reinit_revision = 0
        self._stop = trio.Event()
        self._role_changed = trio.Event()
        self._leader_changed = trio.Event()
        self._stopped = trio.Event()

    # ------------------------------------------------------------------ addresses
    def _host(self, listen_host: str) -> str:
        return self.config.advertise_host or listen_host

    def info(self) -> LeaderInfo:
        c = self.config
        http = None
        if c.http is not None and self.http_port is not None:
            http = f"{self._host(c.http[0])}:{self.http_port}"
        return LeaderInfo(node=c.node, client_address=f"{self._host(c.client[0])}:{self.client_port}",
                          replication_address=c.advertise_replication
                          or f"{self._host(c.replication[0])}:{self.replication_port}",
                          http_address=http)

    def not_leader_error(self) -> NotLeaderError:
        rec = self.leader
        if rec is None or rec.info.node == self.config.node:
            return NotLeaderError(f"node {self.config.node} does not lead shard {self.config.shard} and no "
                                  "leader is known right now (a failover is under way); retry shortly",
                                  retry_after=0.5,
                                  details={"shard": self.config.shard, "epoch": self.last_epoch_seen, "leader": None})
        return NotLeaderError(
            f"node {self.config.node} is a standby of shard {self.config.shard}; the leader is {rec.info.node} at "
            f"{rec.info.client_address}", retry_after=0.0,
            details={"shard": self.config.shard, "epoch": rec.epoch,
                     "leader": {"node": rec.info.node, "address": rec.info.client_address,
                                "http_address": rec.info.http_address}})

    def status(self):
        """This node as a :class:`~rallypoint.protocol.ClusterView` (the leader's server
        status carries it: ``rallypoint status``, ``rallypoint cluster status``)."""
        from ..protocol import ClusterView, StandbyView

        c = self.config
        repl = self.replication
        lead = self.leadership
        standby = None
        members: list[str] = []
        isr: list[str] = []
        if repl is not None:
            st = repl.statistics()
            if st["standby"] is not None:
                standby = StandbyView(**st["standby"])
            members = list(repl.isr_store.members)
            isr = list(repl.isr_store.isr)
        left = lead.statistics().fence_time_left_s if lead is not None else 0.0
        return ClusterView(cluster=c.cluster, shard=c.shard, node=c.node, role=self.role,
                           epoch=self.epoch or self.last_epoch_seen, members=members, isr=isr,
                           lease_time_left_s=round(left, 3), min_insync=c.min_insync, standby=standby,
                           leading_for_s=None if (t := self._roles.leading_for(trio.current_time())) is None
                           else round(t, 1))

    @property
    def role(self) -> NodeRole:
        """This node's :class:`~rallypoint.cluster.noderole.NodeRole` (a str enum)."""
        return self._roles.role

    def _set_role(self, role: NodeRole) -> None:
        # raises IllegalTransition for a move noderole.ROLE_MOVES does not list
        if self._roles.move(role, trio.current_time()):
            self.changes += 1
            log.info("node %s of shard %d is now %s", self.config.node, self.config.shard, role,
                     extra={"event": "role", "role": role, "node": self.config.node})
            if self.on_role is not None:
                self.on_role(role, self)
            ev, self._role_changed = self._role_changed, trio.Event()
            ev.set()

    async def wait_leader_change(self) -> None:
        """Return at the next change of :attr:`leader` or of this node's role."""
        a, b = self._leader_changed, self._role_changed
        async with trio.open_nursery() as n:
            n.start_soon(_wait_then_cancel, a, n.cancel_scope)
            n.start_soon(_wait_then_cancel, b, n.cancel_scope)

    async def wait_role(self, role: str) -> None:
        """Return once this node has the given role (for tests and tools)."""
        while self.role != role:
            await self._role_changed.wait()

    def stop(self) -> None:
        """A graceful stop: a leader drains, waits for its in-sync standby to hold every
        record, resigns (the standby campaigns at once), then the node exits."""
        self._stop.set()

    # ------------------------------------------------------------------ admission
    async def admit(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Admit this node to its shard, then hold its presence key until cancelled.

        1. Join the shard's configured replica set (:meth:`ShardElection.join`): a
           member already, or added while the set has room, or the shard created with
           this node as its first member (its replication factor: ``config.replicas``,
           else the cluster's from ``cluster init``, else 2). Raises NotAMemberError
           (CONFLICT) when the set is full without this node, ValidationError when
           ``config.replicas`` differs from the shard's.
        2. Claim the node's presence key (:class:`~rallypoint.cluster.presence.NodePresence`):
           waits out the lease of a process of this name killed a moment ago (at most
           its TTL plus 1 s); raises DuplicateNodeError (CONFLICT) if another process of
           this name is alive.

        ``task_status.started()`` once both hold; then the lease is renewed until
        cancelled (revoked on the way out) -- DuplicateNodeError if the name was lost
        to another process meanwhile. Etcd out of reach: waited for. Binds nothing and
        opens no data dir, so the daemon runs it before its listeners (:meth:`run`
        runs it itself when nobody did)."""
        self._admit_started = True
        c = self.config
        async with self.make_etcd() as etcd:
            election = ShardElection(etcd, c.cluster, c.shard)
            presence = NodePresence(etcd, c.cluster, c.shard, c.node, ttl_s=c.ttl_s)
            try:
                await self._join(etcd, election)
                await presence.claim()
                self.presence = presence
                self._admitted.set()
                task_status.started()
                await presence.keep()
            finally:
                await presence.release()

    def _recovered(self):
        c = self.config
        return recovered(c.data_dir, c.durability, **c.storage.recovered_kwargs())

    def _check_not_stale(self, epoch: int) -> None:
        """StaleDataError if ``epoch`` (the data dir's newest) predates the last
        ``cluster init --force`` of this cluster's name (0: a node that never was in a
        shard, or a single node's data: never stale)."""
        c = self.config
        if epoch and epoch < self._reinit_revision:
            raise StaleDataError(
                f"node {c.node}: its data dir {c.data_dir} holds the records of an earlier cluster named "
                f"{c.cluster!r} (its newest epoch, {epoch}, is older than the `cluster init --force` that deleted "
                f"that cluster at etcd revision {self._reinit_revision}): start the node on an empty data dir, "
                "or move this one away", details={"node": c.node, "epoch": epoch,
                                                  "reinit_revision": self._reinit_revision})

    async def _check_data_before_joining(self, election: ShardElection) -> None:
        """After a ``cluster init --force``, a node not yet a member that brings a data
        dir with records is checked before it joins (it would otherwise create the shard
        with itself as its only in-sync node, then be refused, and leave the shard
        without a node that may lead): its data dir is opened once to read its newest
        epoch. Fresh data dirs and members are not opened here."""
        import os

        c = self.config
        if not self._reinit_revision or not os.path.isdir(c.data_dir) or not os.listdir(c.data_dir):
            return
        current = await election.read_replicas()
        if current is not None and c.node in current.replicas.members:
            return
        async with self._recovered() as rec:
            epoch = rec.coordinator.epochs.current
        self._check_not_stale(epoch)

    async def _join(self, etcd, election: ShardElection) -> None:
        c = self.config
        backoff = Backoff(0.1, 1.0)
        while True:
            try:
                cfg = await read_config(etcd, c.cluster)
                self._reinit_revision = await reinit_revision(etcd, c.cluster)
                await self._check_data_before_joining(election)
                self.replica_set = await election.join(
                    c.node, replication_factor=c.replicas,
                    create_with=cfg.replication_factor if cfg is not None else DEFAULT_REPLICATION_FACTOR)
                return
            except EtcdError as e:
                log.warning("node %s waits for etcd to join shard %d (%s)", c.node, c.shard, e.message)
                await backoff.sleep()

    # ------------------------------------------------------------------ main loop
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until :meth:`stop` or cancelled. ``task_status.started()`` once the
        client port is bound and the node knows its role. Admits the node first
        (:meth:`admit`, unless the caller runs it): NotAMemberError,
        DuplicateNodeError, StaleDataError (CONFLICT) end it."""
        c = self.config
        started = False
        try:
            async with unwrapped(), trio.open_nursery() as admission:
                if not self._admit_started:
                    await admission.start(self.admit)
                await self._admitted.wait()
                # the ports are reserved once (the leader key advertises them)
                self.client_port = await _reserve(c.client)
                self.replication_port = await _reserve(c.replication)
                if c.http is not None:
                    self.http_port = await _reserve(c.http)
                async with self.make_etcd() as etcd, trio.open_nursery() as watches:
                    self._etcd = etcd
                    election = ShardElection(etcd, c.cluster, c.shard)
                    watches.start_soon(self._watch_map, etcd)
                    watches.start_soon(self._watch_leaders, etcd)
                    await self._map_seen.wait()
                    self.secret = await self._read_secret(etcd)
                    self.link_auth = LinkAuth(self.secret, cluster=c.cluster, shard=c.shard, tls=c.peer_tls)
                    while not self._stop.is_set():
                        try:
                            async with unwrapped():
                                await self._one_term(election, task_status if not started else None)
                            started = True
                        except Rebuild as rb:
                            started = True
                            self._rebuild(rb)
                            await self._probe("rejoin.rebuilt")
                        except LeadershipLostError as e:
                            started = True
                            log.warning("node %s lost the leadership of shard %d (%s); rejoining as a standby",
                                        c.node, c.shard, e)
                        if not started:
                            started = True
                    watches.cancel_scope.cancel()
                admission.cancel_scope.cancel()
        finally:
            self._set_role(NodeRole.STOPPED)
            self._stopped.set()

    async def _watch_map(self, etcd: EtcdClient) -> None:
        """Keep :attr:`slotmap` (and, while leading, the coordinator's sharding) current."""
        while True:
            try:
                async for m in watch_map(etcd, self.config.cluster):
                    self.slotmap = m
                    node = self.node
                    if m is not None and node is not None and node.coordinator.sharding is not None:
                        node.coordinator.sharding.update(m.owners, m.version)
                    self._map_seen.set()
            except EtcdError as e:
                log.warning("watching the slot map failed (%s); again", e.message)
                self._map_seen.set()
                await trio.sleep(0.5)

    async def _watch_leaders(self, etcd: EtcdClient) -> None:
        while True:
            try:
                async for leaders in watch_leaders(etcd, self.config.cluster):
                    self.leaders = leaders
            except EtcdError as e:
                log.warning("watching the shards' leaders failed (%s); again", e.message)
                await trio.sleep(0.5)

    def cluster_map_view(self):
        """``cluster.map``: the slot map and every shard's leader (a single shard without
        a slot map: no owners, this shard only)."""
        from ..protocol import ClusterMapView, ShardView

        m = self.slotmap
        shards = m.shards if m is not None else [self.config.shard]
        out = []
        for s in shards:
            rec = self.leaders.get(s)
            out.append(ShardView(shard=s, leader=rec.info.node if rec else None,
                                 address=rec.info.client_address if rec else None, epoch=rec.epoch if rec else 0))
        return ClusterMapView(cluster=self.config.cluster, version=m.version if m else 0,
                              owners=list(m.owners) if m else [], shards=out)

    async def _read_secret(self, etcd) -> str:
        """The cluster secret (made now if the cluster has none), waiting for etcd."""
        from .shardmap import node_secret

        while True:
            try:
                return await node_secret(etcd, self.config.cluster)
            except EtcdError as e:
                log.warning("reading the cluster secret from etcd failed (%s); again", e.message)
                await trio.sleep(0.5)

    def _rebuild(self, rb: Rebuild) -> None:
        c = self.config
        if rb.truncate_to is not None:
            truncate_after(c.data_dir, rb.truncate_to)
        elif rb.snapshot_dir is not None:
            install_snapshot(c.data_dir, rb.snapshot_dir)
            log.warning("node %s replaced its data with the leader's snapshot at LSN %d", c.node, rb.snapshot_lsn)

    async def _one_term(self, election: ShardElection, task_status) -> None:
        """Recover, stand by until this node wins the campaign, then lead until the
        leadership ends or the node stops."""
        c = self.config
        async with self._recovered() as rec:
            mine = rec.coordinator.epochs.current
            self._check_not_stale(mine)
            self.last_epoch_seen = max(self.last_epoch_seen, mine)
            won = trio.Event()
            done = trio.Event()
            holder: dict[str, Leadership] = {}

            async def campaigner() -> None:
                async with election.campaign(self.info(), ttl_s=c.ttl_s) as lead:
                    holder["lead"] = lead
                    won.set()
                    await done.wait()

            async with trio.open_nursery() as term:
                term.start_soon(campaigner)
                # ---- standby
                async with running_as_standby(rec, node=c.node, cluster=c.cluster, shard=c.shard,
                                              auth=self.link_auth, **self._snap_opts()) as sb:
                    self.standby = sb
                    async with unwrapped(), trio.open_nursery() as standing:
                        await standing.start(self._serve_redirect)
                        self._set_role(NodeRole.STANDBY)
                        if task_status is not None:
                            task_status.started()
                            task_status = None
                        standing.start_soon(self._follow_leaders, sb, election)
                        stop_or_won = trio.Event()
                        standing.start_soon(_set_when, won, stop_or_won)
                        standing.start_soon(_set_when, self._stop, stop_or_won)
                        await stop_or_won.wait()
                        standing.cancel_scope.cancel()
                    clock_pair = sb.clock_pair
                    self.standby = None
                if self._stop.is_set() and not won.is_set():
                    term.cancel_scope.cancel()
                    return
                # ---- leader
                lead = holder["lead"]
                self.leadership = lead
                try:
                    await self._lead(rec, lead, clock_pair)
                finally:
                    self.leadership = None
                    self.replication = None
                    self.epoch = None
                    self.node = None
                    self.server = None
                    done.set()

    def _snap_opts(self) -> dict:
        return {**self.config.snapshots.serving_kwargs(),
                # a silent link ends (and is opened again) after twice the ISR timeout
                "silence_s": max(2.0, 2 * self.config.isr_timeout_s)}

    async def _follow_leaders(self, sb, election: ShardElection) -> None:
        """Follow whoever leads (as etcd says), reconnecting as needed; stop taking
        frames the moment the leader key goes. While etcd cannot be reached, the watch
        is opened again (backing off up to 2 s) and the leader already followed, if
        any, is kept: a standby does not stop because etcd is briefly out of reach."""
        c = self.config
        async with trio.open_nursery() as nursery:
            scope: trio.CancelScope | None = None
            backoff = Backoff(0.1, 2.0)
            while True:
                try:
                    async with election.watch_leader() as leaders:
                        async for rec in leaders:
                            backoff.reset()
                            if rec == self.leader and (scope is not None or rec is None):
                                continue  # the same leader, read again after a new watch
                            self.leader = rec
                            ev, self._leader_changed = self._leader_changed, trio.Event()
                            ev.set()
                            if scope is not None:
                                scope.cancel()  # a new leader, or none: frames of the old one stop here
                                scope = None
                            if rec is not None:
                                self.last_epoch_seen = max(self.last_epoch_seen, rec.epoch)
                            if rec is None or rec.info.node == c.node:
                                continue
                            scope = trio.CancelScope()
                            nursery.start_soon(self._follow_one, sb, rec, scope)
                except EtcdError as e:
                    log.warning("node %s cannot watch the leader of shard %d in etcd (%s); trying again in %g s",
                                c.node, c.shard, e.message, backoff.current)
                    await backoff.sleep()

    async def _follow_one(self, sb, rec: LeaderRecord, scope: trio.CancelScope) -> None:
        host, port = _split(rec.info.replication_address)
        backoff = Backoff(0.05, 1.0)
        with scope:
            while True:
                try:
                    stream = await self.connect(host, port)
                except OSError as e:
                    log.info("standby %s: cannot reach leader %s at %s (%s)", self.config.node, rec.info.node,
                             rec.info.replication_address, e)
                else:
                    try:
                        await sb.follow(stream, rec.epoch, leader=rec.info.node)
                    except StaleLeader as e:
                        log.warning("standby %s: %s", self.config.node, e)
                    except Unauthenticated as e:
                        self._link_refusals.log(logging.WARNING, "link-unauthenticated", "standby %s: the link to "
                                                "%s at %s is not authenticated: %s", self.config.node, rec.info.node,
                                                rec.info.replication_address, e)
                    except LinkClosed as e:
                        log.info("standby %s: replication link to %s ended: %s", self.config.node, rec.info.node, e)
                    else:
                        backoff.reset()
                await backoff.sleep()

    async def _serve_redirect(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        server = self.make_server(_Redirect(self))
        c = self.config
        await server.serve(None, c.client[0], self.client_port, task_status=task_status)

    async def _lead(self, rec, lead: Leadership, clock_pair) -> None:
        c = self.config
        await self._probe("takeover.won")
        await rec.reopen_journal()
        await self._probe("takeover.journal_reopened")
        replicas = await lead.election.read_replicas()
        await self._probe("takeover.replicas_read")
        members = list(replicas.replicas.members) if replicas else [c.node]
        isr_now = list(replicas.replicas.isr) if replicas else [c.node]
        isr = EtcdIsr(lead, members, isr_now)
        box: dict[str, ReplicationLeader] = {}

        def before(coord) -> None:
            repl = ReplicationLeader(coord, epoch=lead.epoch, node=c.node, cluster=c.cluster, shard=c.shard,
                                     isr=isr, snapshot_store=rec.rec.store, isr_timeout_s=c.isr_timeout_s,
                                     min_insync=c.min_insync, auth=self.link_auth, on_deposed=lambda: lead._lose(
                                         "a fenced in-sync set update was refused"), members=isr.members_now)
            repl.attach()
            box["repl"] = repl
            if self.slotmap is not None:  # a sharded cluster: ids name slots, requests are checked
                coord.sharding = Sharding(c.shard, self.slotmap.owners, self.slotmap.version,
                                          released=coord.epochs.released)
            coord.keys.store = (self._store_url(), c.cluster)  # keys are made in etcd, not over the wire
            # without a leader's beat to continue from (this node led last, or nobody
            # led since it recovered: an etcd outage), the gap is every moment since a
            # lease holder was last heard here -- measured now, at the takeover, not
            # when the data dir was recovered for this term
            box["gap"] = take_over(coord, epoch=lead.epoch, node=c.node, clock_pair=clock_pair,
                                   default_gap_ms=rec.unheard_ms())
            # the time no leader heard a lease holder goes back to every lease (not this
            # node's own last heartbeat: a standby's first start has none, and then
            # leases were not extended at all)
            return box["gap"]

        # the ISR becomes this node alone (fenced) before anything is acknowledged: the
        # old leader is gone, and a standby joins again once it has caught up
        async with serving(rec, before_rearm=before, gap_ms=None, **c.snapshots.serving_kwargs()) as node:
            repl = box["repl"]
            self.replication = repl
            self.epoch = lead.epoch
            self.node = node
            node.snapshotter.hold_lsn = repl.hold_lsn
            await self._probe("takeover.epoch_journaled")
            if not await repl.shrink_isr_alone():
                raise LeadershipLostError(str(c.shard), lead.epoch, "the in-sync set could not be written")
            await self._probe("takeover.isr_shrunk")
            # the epoch record fsynced here before anything is served (not acknowledged:
            # under --min-insync 2 that waits for a standby, which connects below)
            journal = node.coordinator.journal
            await journal.wait_synced(journal.last_lsn)
            await self._probe("takeover.epoch_synced")
            node.service.shard = c.shard
            node.service.epoch = lead.epoch
            node.coordinator.cluster = self  # its status, its slot map (coordinator.ClusterNode)
            listeners = await self.listen(self.replication_port, host=c.replication[0])
            server = self.make_server(_Fenced(node.service, lead, self))
            self.server = server
            async with trio.open_nursery() as nursery:
                await nursery.start(repl.serve, listeners)
                if self.slotmap is not None:  # a sharded cluster: calls between the shards
                    await nursery.start(self._serve_peers, node)
                await self._probe("takeover.replicating")
                # every key of etcd is this shard's before any client is served (a
                # cluster with keys is never in open mode on a new leader), then watched
                await nursery.start(self._keep_keys, node)
                await nursery.start(server.serve, None, c.client[0], self.client_port)
                extra = self.on_leader(node, self) if self.on_leader is not None else None
                if extra is not None:
                    nursery.start_soon(extra)
                self._set_role(NodeRole.LEADER)
                await self._probe("takeover.serving")
                await self._stop.wait()
                # graceful stop: drain clients, let the in-sync standby hold every record,
                # then resign so it campaigns at once (no lease-TTL wait). Parked waits
                # (workers' long-poll receives) are answered UNAVAILABLE at once, with no
                # grace: they are re-issued to the new leader, and the single node's 1 s
                # grace held the resignation back (workers paused 1.2 s; issue 42 item 8)
                self._set_role(NodeRole.STOPPING)
                with trio.move_on_after(c.drain_timeout_s + 5.0):
                    await server.drain(timeout=c.drain_timeout_s, wait_grace=0.0)
                last = node.coordinator.journal.last_lsn
                with trio.move_on_after(c.drain_timeout_s):
                    handed = await repl.wait_standby_caught_up(last)
                    log.info("leader %s: %s", c.node, "the in-sync standby holds every record; resigning"
                             if handed else "no in-sync standby; resigning")
                await lead.resign()
                nursery.cancel_scope.cancel()


    async def _serve_peers(self, node, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """While leading a shard of a sharded cluster: the node secret from etcd (so
        the other shards' leaders are let in before the client port opens), the
        linking of other shards' runs, and the outbox's sender."""
        from .peerauth import TokenVerifier
        from .peers import OutboxSender, Peers, RemoteRuns, Reserver

        c = self.config
        secret = self.secret

        def address(shard: int) -> str | None:
            rec = self.leaders.get(shard)
            return rec.info.client_address if rec is not None else None

        service = node.service
        async with trio.open_nursery() as nursery:
            peers = Peers(address, secret, nursery, cluster=c.cluster, node=c.node)
            peers.open_connection = self.open_peer
            service.node_secret = secret
            service.node_tokens = TokenVerifier(secret, c.cluster)
            service.remote_runs = RemoteRuns(service, peers, nursery)
            self.outbox_sender = OutboxSender(service, peers, c.shard)
            await nursery.start(self.outbox_sender.run)
            self.reserver = Reserver(service, peers)
            await nursery.start(self.reserver.run)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                service.remote_runs = None
                service.node_tokens = None
                peers.close()

    async def _probe(self, point: str) -> None:
        if self.probe is not None:
            await self.probe(point)

    def _store_url(self) -> str:
        """The cluster's etcd as ``rallypoint keys --cluster`` takes it: ``etcd://h:p,...``,
        or ``https://[user@]h:p,...`` followed by the ``--etcd-ca``/``--etcd-cert``/
        ``--etcd-key`` this node uses (the password never)."""
        return " ".join((self.config.etcd_access or EtcdAccess(tuple(self.config.etcd))).cli_args()[1:])

    async def _keep_keys(self, node, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """While leading: take every key record of etcd this shard lacks (or has live
        while etcd revoked it), ``task_status.started()`` once all of them were taken,
        then each change as etcd reports it. Etcd out of reach: tried again every 0.5 s
        (the leader does not serve before the first read)."""
        from ..protocol import KeyAdopt
        from ..service import Session

        c = self.config
        session = Session(local=True)
        keys = node.coordinator.keys

        async def adopt(rec: KeyRecord) -> None:
            k = keys.table.get(rec.id)
            if k is not None and (rec.revoked_at_ms is None or k.revoked_at_ms is not None):
                return  # this shard has it as etcd does
            op = KeyAdopt(id=rec.id, space=rec.space, permissions=list(rec.permissions),
                          secret_sha256=rec.secret_sha256, created_at_ms=rec.created_at_ms, name=rec.name,
                          revoked_at_ms=rec.revoked_at_ms)
            while True:
                try:
                    await node.service.call(session, op)
                    self.keys_adopted += 1
                    return
                except UnavailableError as e:  # (a full disk, a stall): the key must not be skipped
                    log.warning("shard %d could not take API key %s yet (%s); again", c.shard, rec.id, e.message)
                    await trio.sleep(0.5)
                except RallypointError as e:
                    log.warning("key record %s in etcd was not taken by shard %d: %s", rec.id, c.shard, e)
                    return

        started = False
        while True:
            try:
                async for records, deleted in watch_keys(self._etcd, c.cluster):
                    for rec in records:
                        await adopt(rec)
                    for kid in deleted:
                        log.warning("the record of API key %s was deleted from etcd by hand: shard %d keeps the key "
                                    "as it has it; revoke it with `rallypoint keys revoke`", kid, c.shard)
                    if not started:
                        started = True
                        task_status.started()
            except EtcdError as e:
                log.warning("reading the cluster's API keys from etcd failed (%s); again", e.message)
                await trio.sleep(0.5)


async def _wait_then_cancel(ev: trio.Event, scope: trio.CancelScope) -> None:
    await ev.wait()
    scope.cancel()


async def _set_when(ev: trio.Event, out: trio.Event) -> None:
    await ev.wait()
    out.set()


def _host_of(address: str | None) -> str | None:
    return None if address is None else _split(address)[0]


def _loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal."""
    import ipaddress

    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def _reserve(addr: tuple[str, int]) -> int:
    """A port for ``addr`` (port 0: a free one, found by binding and closing)."""
    host, port = addr
    if port:
        return port
    listeners = await trio.open_tcp_listeners(0, host=host)
    port = listeners[0].socket.getsockname()[1]
    for lst in listeners:
        await lst.aclose()
    return port
