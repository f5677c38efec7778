"""Replication of a shard's journal to a synchronous standby (``rallypoint serve
--cluster``): :mod:`.leader` ships records and keeps the in-sync set, :mod:`.standby`
follows, :mod:`.roles` runs a recovered data dir as a standby and promotes it, and
:mod:`.wire` / :mod:`.link` are the connection between them. Who leads, at which epoch,
and who is in sync is decided in etcd (:mod:`rallypoint.cluster`), never here."""

from .leader import Deposed, IsrStore, RecordRing, ReplicationLeader
from .link import Link, LinkClosed
from .roles import running_as_standby, take_over
from .standby import Rebuild, Standby, StaleLeader, install_snapshot, truncate_after

__all__ = ["ReplicationLeader", "RecordRing", "IsrStore", "Deposed", "Link", "LinkClosed", "Standby", "Rebuild",
           "StaleLeader", "install_snapshot", "truncate_after", "running_as_standby", "take_over"]
