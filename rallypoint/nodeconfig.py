"""A node's configuration, typed, and the one assembly of a serving coordinator.

``rallypoint serve`` fills one :class:`NodeConfig` from its flags (``cli.node_config``);
a single node (:func:`rallypoint.node.open_node`) and a node of a replicated shard
(:class:`rallypoint.cluster.member.ShardMember`, whose ``MemberConfig`` holds the same
:class:`StorageOptions` and :class:`SnapshotOptions`) open their data dir from it, and
whichever comes to serve clients -- the single node at start, a cluster node each time
it wins its shard's leadership -- is set up by :func:`start_serving`, the one place that
gives a coordinator its limits, watch stall, idempotency TTL, live-connection count and
metrics. A coordinator asks its surroundings through typed interfaces, not injected
functions: its live connections through ``coordinator.ConnectionSource`` (the server),
its cluster status and slot map through ``coordinator.ClusterNode`` (the member).

No option dicts: every field is named and typed here, with its unit. This module
imports nothing heavy (the CLI reads it before binding its ports).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (types only: this module stays light)
    from .clock import Clock
    from .cluster.member import MemberConfig
    from .metrics import Metrics
    from .persistence.snapshot import Storage

__all__ = ["RetentionOptions", "StorageOptions", "SnapshotOptions", "ServingOptions", "NodeConfig",
           "start_serving", "DEFAULT_MIN_FREE_BYTES"]

#: Free space below which a journal refuses writes, bytes (``--min-free-mb``, 64 MiB).
DEFAULT_MIN_FREE_BYTES = 64 << 20


@dataclass(frozen=True)
class RetentionOptions:
    """What the coordinator keeps (``--retain-finished``, ``--retain-events``): finished
    runs for ``retain_finished_ms`` (None: forever), at most ``retain_events`` events per
    space (None: no count limit) and none older than ``retain_events_ms`` (None: no age
    limit). A node given none (``StorageOptions.retention`` None) keeps the
    Coordinator's defaults (100,000 events per space, every finished run)."""

    retain_finished_ms: int | None = None
    retain_events: int | None = None
    retain_events_ms: int | None = None

    def coordinator_kwargs(self) -> dict[str, int | None]:
        """The Coordinator's keyword arguments (``open_node(retention=...)``)."""
        return {"retain_finished_ms": self.retain_finished_ms, "retain_events": self.retain_events,
                "retain_events_ms": self.retain_events_ms}


@dataclass(frozen=True)
class StorageOptions:
    """How a node opens its data dir and journal (the arguments of
    :func:`rallypoint.node.recovered` / :func:`~rallypoint.node.open_node`, which
    document each): ``interval_ms`` (the ``interval`` durability's flush period, ms),
    ``retention``, ``min_free_bytes`` / ``ballast_bytes`` / ``preallocate_bytes``
    (bytes), ``sync_helper`` (``"process"`` or ``"thread"``), ``slow_sync_s`` (seconds);
    ``clock``, ``storage`` and ``disk`` replace the real ones (simulators, tests)."""

    interval_ms: int = 10
    retention: RetentionOptions | None = None
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES
    ballast_bytes: int = 0
    preallocate_bytes: int = 1 << 20
    sync_helper: str = "process"
    slow_sync_s: float = 1.0
    clock: "Clock | None" = None
    storage: "Storage | None" = None
    disk: Any = None

    def recovered_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`rallypoint.node.recovered` (and of
        :func:`~rallypoint.node.open_node`, with :meth:`SnapshotOptions.serving_kwargs`)."""
        return {"clock": self.clock, "interval_ms": self.interval_ms, "retention": None if self.retention is None else self.retention.coordinator_kwargs(),
                "min_free_bytes": self.min_free_bytes, "ballast_bytes": self.ballast_bytes,
                "preallocate_bytes": self.preallocate_bytes, "sync_helper": self.sync_helper,
                "slow_sync_s": self.slow_sync_s, "disk": self.disk, "storage": self.storage}


@dataclass(frozen=True)
class SnapshotOptions:
    """When a serving node snapshots: every ``every_records`` records or ``every_s``
    seconds, whichever comes first; a failed snapshot is retried after ``retry_s``
    seconds (``--snapshot-every-records``, ``--snapshot-every-s``, ``--snapshot-retry-s``)."""

    every_records: int = 100_000
    every_s: float = 60.0
    retry_s: float = 5.0

    def serving_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`rallypoint.node.serving`."""
        return {"snapshot_every_records": self.every_records, "snapshot_every_s": self.every_s,
                "snapshot_retry_s": self.retry_s}


@dataclass(frozen=True)
class ServingOptions:
    """What a coordinator that serves clients is set to (:func:`start_serving`):
    ``limits`` (``--limit NAME=VALUE``: limit name -> value, see
    :mod:`rallypoint.limits`), ``watch_stall_s`` (a watcher that takes no event for this
    long is SLOW_CONSUMER, seconds), ``idempotency_ttl_ms`` (how long an HTTP
    Idempotency-Key answer is kept, ms) and ``slow_request_s`` (a request this slow is
    logged, seconds)."""

    limits: dict[str, int] = field(default_factory=dict)
    watch_stall_s: float = 30.0
    idempotency_ttl_ms: int = 24 * 3600 * 1000
    slow_request_s: float = 1.0


@dataclass(frozen=True)
class NodeConfig:
    """Everything ``rallypoint serve`` was told, typed: ``storage`` and ``snapshots``
    (the data dir), ``serving`` (the coordinator once it serves), ``data_dir`` /
    ``durability`` (``memory``, ``interval``, ``fsync``) and, for ``serve --cluster``,
    ``member`` (the replicated shard's :class:`~rallypoint.cluster.member.MemberConfig`,
    built from the same storage and snapshot options); None for a single node."""

    storage: StorageOptions
    snapshots: SnapshotOptions
    serving: ServingOptions
    data_dir: str | None = None
    durability: str = "fsync"
    member: "MemberConfig | None" = None


def start_serving(node, server, opts: ServingOptions) -> "Metrics":
    """Set up the coordinator of ``node`` (a :class:`rallypoint.node.Node`) to serve
    clients through ``server`` (a :class:`rallypoint.transport.server.Server`): its
    limits, watch stall and idempotency TTL from ``opts``, its live-connection count
    from ``server``, and its :class:`~rallypoint.metrics.Metrics` (also the server's
    slow-request log), which it returns. The single node calls it once; a cluster
    node each time it starts leading (a new coordinator, a new server)."""
    from .metrics import Metrics

    coord = node.coordinator
    coord.limits.configure(opts.limits)
    coord.watchers.stall_s = opts.watch_stall_s
    coord.idempotency.ttl_ms = opts.idempotency_ttl_ms
    coord.connections = server
    metrics = Metrics(coord, server, getattr(node, "snapshotter", None), slow_s=opts.slow_request_s)
    server.metrics = metrics
    return metrics
