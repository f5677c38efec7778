"""A recovered data dir as a standby, and its promotion to leader.

A standby runs its journal (the group-commit flusher: replicated records are fsynced
here before they are acknowledged) and its snapshots, but not its coordinator: no
actor, no activity, no client. :func:`take_over` is what a standby does once etcd made
it the leader, before :func:`rallypoint.node.serving` re-arms the activities and serves:
continue the shard's server time from the old leader's last word and journal the new
epoch as the first record of its term.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from ..records import LeaderEpoch
from .standby import Standby

log = logging.getLogger("rallypoint.replication")

__all__ = ["running_as_standby", "take_over"]


@asynccontextmanager
async def running_as_standby(recovery, *, node: str, cluster: str, shard: int, snapshot_every_records: int,
                             snapshot_every_s: float, snapshot_retry_s: float = 5.0,
                             silence_s: float = 2.0, auth) -> AsyncIterator[Standby]:
    """Run ``recovery``'s journal and snapshots (not its coordinator) and yield a
    :class:`Standby` to follow leaders with (``silence_s``: see :class:`Standby`). At the end the journal is closed (a
    promotion opens a new one: :meth:`rallypoint.node.Recovery.reopen_journal`). ``auth``: the
    node's :class:`~.auth.LinkAuth`."""
    coord = recovery.coordinator
    snap = recovery.snapshotter_for(every_records=snapshot_every_records, every_s=snapshot_every_s,
                                    retry_s=snapshot_retry_s)
    standby = Standby(coord, node=node, cluster=cluster, shard=shard, snapshot_lsn=lambda: snap.last_lsn,
                      data_dir=recovery.data_dir, on_clock=recovery.write_clock, silence_s=silence_s,
                      auth=auth)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(coord.journal.run)
            nursery.start_soon(snap.run)
            try:
                yield standby
            finally:
                nursery.cancel_scope.cancel()
    finally:
        standby.close()
        with trio.CancelScope(shield=True):
            await coord.journal.aclose()


def take_over(coord, *, epoch: int, node: str, clock_pair: tuple[int, int] | None, default_gap_ms: int) -> int:
    """Make a recovered coordinator the shard's leader at ``epoch``: server time continues
    from the old leader's last ``(server ms, wall ms)`` pair (``clock_pair``; None: this
    node's own last heartbeat, as after a restart), and :class:`LeaderEpoch` is
    committed as the first record of the term. Returns the gap (ms) no lease holder
    could be heard in, which the caller gives back to leases (``LeasesExtended``).
    The journal must be open (not necessarily running)."""
    gap_ms = default_gap_ms
    if clock_pair is not None:
        coord.clock.resume(*clock_pair)
        gap_ms = max(0, coord.clock.mono_ms() - clock_pair[0])
    first = coord.journal.last_lsn + 1
    coord.commit([LeaderEpoch(epoch=epoch, node=node, first_lsn=first, at_ms=coord.clock.now_ms(),
                              mono_ms=coord.clock.mono_ms())])
    log.info("%s leads at epoch %d from LSN %d (leases extended by the %.3f s gap)", node, epoch, first,
             gap_ms / 1000, extra={"event": "leader", "epoch": epoch, "node": node, "lsn": first})
    return gap_ms
