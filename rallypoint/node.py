"""A running coordinator on a data dir: lock, recovery, journal, snapshots, shutdown.

:func:`open_node` is what both the daemon (``rallypoint serve``) and
:func:`rallypoint.open_embedded` stand on. Durability modes (SPEC §11):

- ``memory``: no files; everything is lost when the process ends.
- ``fsync``: every acknowledged change is fsynced to the journal first (group commit).
- ``interval``: the journal is fsynced at most every ``interval_ms`` ms.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from .actors import Coordinator
from .clock import Clock
from .errors import ValidationError
from .service import Service

log = logging.getLogger("rallypoint.node")

__all__ = ["Node", "open_node", "DURABILITY_MODES"]

DURABILITY_MODES = ("memory", "interval", "fsync")


class Node:
    """A coordinator with its service and (for file modes) its persistence."""

    def __init__(self, coordinator: Coordinator, data_dir: str | None, durability: str) -> None:
        self.coordinator = coordinator
        self.service = Service(coordinator)
        self.data_dir = data_dir
        self.durability = durability
        self.recovery_info: dict = {}


@asynccontextmanager
async def open_node(
    data_dir: str | None = None,
    durability: str | None = None,
    *,
    clock: Clock | None = None,
    interval_ms: int = 10,
    snapshot_every_records: int = 100_000,
    snapshot_every_s: float = 60.0,
) -> AsyncIterator[Node]:
    """Open (recover) a coordinator and run its background tasks until the block ends.

    ``durability`` defaults to ``memory`` without a data dir and ``fsync`` with one.
    Raises VALIDATION_FAILED for an unknown mode or a file mode without a data dir.
    """
    if durability is None:
        durability = "memory" if data_dir is None else "fsync"
    if durability not in DURABILITY_MODES:
        raise ValidationError(f"durability must be one of {', '.join(DURABILITY_MODES)} (got {durability!r})")
    if durability != "memory":
        if data_dir is None:
            raise ValidationError(f"durability {durability!r} needs a data dir")
        from .persist import open_persistent_node

        async with open_persistent_node(
            data_dir,
            durability,
            clock=clock,
            interval_ms=interval_ms,
            snapshot_every_records=snapshot_every_records,
            snapshot_every_s=snapshot_every_s,
        ) as node:
            yield node
        return
    coord = Coordinator(clock=clock or Clock(), durability="memory")
    node = Node(coord, data_dir, "memory")
    async with trio.open_nursery() as nursery:
        await nursery.start(coord.run)
        try:
            yield node
        finally:
            nursery.cancel_scope.cancel()
