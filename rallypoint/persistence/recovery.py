"""Start-up recovery: snapshot + journal tail -> what the coordinator must apply.

Call order at start-up (the coordinator's side)::

    lock = DataDirLock(data_dir); lock.acquire()          # DataDirLocked
    rec = recover(data_dir)                                # FormatVersionError, JournalCorruptError
    for key, value in rec.entities: ...decode, install...  # state at rec.snapshot_lsn
    for lsn, payload in rec.records: ...decode, apply...   # in LSN order
    journal = rec.open_journal(mode="fsync")               # appends continue at rec.next_lsn
    await nursery.start(journal.run)
    ... rec.store is the SnapshotStore to write later snapshots to ...
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import lmdb

from .errors import SnapshotCorruptError
from .journal import Journal, JournalStream, ScanResult, TornTail, scan_journal
from .snapshot import SnapshotStore, check_format, open_store

__all__ = ["recover", "Recovered"]


@dataclass
class Recovered:
    """Result of :func:`recover`.

    Attributes:
        data_dir: the data directory.
        format_version: on-disk format version found (or stamped).
        snapshot_lsn: LSN the snapshot entities are valid at (0: no snapshot).
        entities: ``[(key, value), ...]`` from the snapshot, in key order.
        records: the journal records to replay, ``(lsn, payload)`` with
            lsn > snapshot_lsn in order; a lazy re-iterable (``len()`` works) that reads
            one segment at a time, so 1M records do not sit in memory at once. With
            ``recover(..., stream=True)`` a :class:`JournalStream` instead (read once,
            validated as it is read) until :meth:`settle` replaces it by its result.
        next_lsn: LSN for the journal to continue at (None in stream mode until
            :meth:`settle`).
        torn_tail: the torn tail that was cut (file, offset, bytes), or None.
        store: the open SnapshotStore (the caller owns it; ``close()`` at shutdown).
        timing: seconds spent: ``{"snapshot_s", "scan_s", "total_s"}``.
    """

    data_dir: Path
    format_version: int
    snapshot_lsn: int
    entities: list[tuple[bytes, bytes]]
    records: ScanResult | JournalStream
    next_lsn: int | None
    torn_tail: TornTail | None
    store: SnapshotStore
    timing: dict[str, float] = field(default_factory=dict)

    def settle(self) -> None:
        """Stream mode: after the :class:`JournalStream` was read to its end, take its
        verdict (next LSN, torn tail) and make :attr:`records` its :class:`ScanResult`.
        Raises RuntimeError when the stream was not read to its end."""
        if isinstance(self.records, JournalStream):
            scan = self.records.result
            if scan is None:
                raise RuntimeError("the journal stream was not read to its end")
            self.records = scan
            self.next_lsn = scan.next_lsn
            self.torn_tail = scan.torn_tail

    @property
    def record_count(self) -> int:
        """Number of journal records to replay."""
        return self.records.record_count

    def iter_records(self) -> Iterator[tuple[int, bytes]]:
        """Same as iterating :attr:`records`."""
        return self.records.iter_records()

    def open_journal(self, *, mode: str = "fsync", interval_ms: float = 10,
                     segment_bytes: int = 64 << 20, **options) -> Journal:
        """Open the journal for appending at :attr:`next_lsn` (sync). ``options`` are
        :class:`Journal`'s disk-space arguments (``min_free_bytes``, ``ballast_bytes``,
        ``space_poll_s``, ``preallocate_bytes``, ``sync``, ``disk``). Raises ValueError / OSError as :class:`Journal` does."""
        return Journal(self.data_dir, mode=mode, next_lsn=self.next_lsn,
                       interval_ms=interval_ms, segment_bytes=segment_bytes, **options)


def recover(data_dir: str | os.PathLike[str], *, stream: bool = False) -> Recovered:
    """Load the snapshot and validate the journal past it (sync; call before the
    journal is opened, with the data-dir lock held).

    Steps: :func:`check_format`; open the :class:`SnapshotStore`; read its LSN and
    entities; :func:`scan_journal` with ``after_lsn`` = snapshot LSN, which cuts a torn
    tail (logging a warning) and validates everything after the snapshot.

    ``stream=True`` (recovery's replay): no separate validation pass; ``records`` is a
    :class:`JournalStream` that checks each record as it hands it out and gives the
    verdict (the same torn-tail cut, the same JournalCorruptError) when read to its
    end; call :meth:`Recovered.settle` then (``next_lsn`` is None until then). The
    caller must close ``store`` if reading the stream raises.

    Raises:
        FormatVersionError: data written by a newer format.
        SnapshotCorruptError: the LMDB store cannot be read (one line, what to do).
        JournalCorruptError: damage that is not a torn tail (the message says how to
            repair). The snapshot store is closed before raising.
        OSError: I/O failures.
    """
    t0 = time.perf_counter()
    d = Path(data_dir)
    version = check_format(d)
    store = open_store(d)
    try:
        snapshot_lsn = store.load_lsn()
        try:
            entities = list(store.iter_entities())
        except lmdb.Error as exc:
            raise SnapshotCorruptError(str(store.path), str(exc), data_dir=str(d)) from None
        t1 = time.perf_counter()
        if stream:
            records: ScanResult | JournalStream = JournalStream(d, snapshot_lsn)
        else:
            records = scan_journal(d, after_lsn=snapshot_lsn)
        t2 = time.perf_counter()
    except BaseException:
        store.close()
        raise
    return Recovered(
        data_dir=d,
        format_version=version,
        snapshot_lsn=snapshot_lsn,
        entities=entities,
        records=records,
        next_lsn=None if stream else records.next_lsn,
        torn_tail=None if stream else records.torn_tail,
        store=store,
        # stream mode: scan_s is 0, the journal is read (and checked) during the replay
        timing={"snapshot_s": t1 - t0, "scan_s": t2 - t1, "total_s": t2 - t0},
    )
