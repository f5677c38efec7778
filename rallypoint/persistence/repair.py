"""``rallypoint repair``: plan exactly what to cut from a damaged journal, then cut it.

:func:`plan_repair` is read-only: it finds the first damage past the snapshot and says
what a repair keeps and drops -- the file truncated (and at which byte), the files
deleted, the LSN range and number of records that the journal will no longer have, and
whether any of them were not in the snapshot yet. :func:`apply_repair` carries a plan
out; :func:`repair` does both under the data-dir lock. One run is enough: after it the
journal passes :func:`~rallypoint.persistence.journal.scan_journal`.

What is kept: every intact record before the damage (segments before a missing one,
records before a bad one). Damage in records the snapshot already holds is not damage
(start-up skips it). When what is kept ends below the snapshot, the kept segments are
deleted too: all their records are in the snapshot, and the journal continues after it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from .journal import (
    CoveredDamage,
    _analyse,
    _fsync_dir,
    _is_zero,
    _last_valid_lsn,
    _truncate_file,
    list_segments,
    snapshot_lsn_of,
)
from .manifest import Manifest, write_manifest

__all__ = ["RepairPlan", "RepairReport", "plan_repair", "apply_repair", "repair"]

log = logging.getLogger("rallypoint.persistence")


def _lsns(first: int, last: int | None) -> str:
    if last is None:
        return f"from LSN {first} on"
    return f"LSN {first}" if first == last else f"LSN {first}..{last}"


def _records(n: int) -> str:
    return f"{n} record" + ("" if n == 1 else "s")


@dataclass
class RepairPlan:
    """What :func:`apply_repair` will do (all computed read-only by :func:`plan_repair`).

    Attributes:
        data_dir: the data directory.
        snapshot_lsn: the snapshot's LSN (records up to it are safe in the snapshot).
        needed: False when the journal is intact past the snapshot (nothing to do).
        kind: the damage: ``"corrupt"`` (a bad record), ``"torn"`` (an incomplete last
            record), ``"gap"`` (a missing segment), ``"start_gap"`` (records missing
            right after the snapshot), ``"missing_tail"`` (the newest segment is gone),
            ``"short_tail"`` (shorter than its clean close), ``"ahead"`` (the journal
            ends below the snapshot); None when not needed.
        reason: the damage in words; ``damage_path``/``damage_offset``: where.
        truncate: ``(file, byte offset, bytes dropped)`` or None.
        truncate_lsns: ``(first, last)`` LSNs of the valid records in the dropped bytes
            (``last`` None: none found).
        delete: files to delete, in order; ``delete_lsns``: ``(first, last)`` per file.
        missing: ``(first, last)`` LSNs no file holds any more (``last`` None: unknown).
        keep_last_lsn: the journal ends at this LSN after the repair (the next record
            gets ``keep_last_lsn + 1``); at least the snapshot LSN.
        lost_first, lost_last, lost_count: the LSNs past the snapshot the journal will
            not have (None when none are lost; ``lost_last``/``lost_count`` None when
            the end is unknown, e.g. a deleted newest segment after a crash).
        covered_count: records dropped that the snapshot already holds (nothing lost).
        covered_damage: damage skipped because the snapshot holds those records.
        zero_tail: ``(file, byte offset, bytes)`` of the zeros a crash leaves after the
            last segment's records (written ahead by the journal, see *Preallocation* in
            :mod:`.journal`): not damage, nothing to repair (start-up cuts them).
    """

    data_dir: Path
    snapshot_lsn: int
    needed: bool
    kind: str | None = None
    reason: str | None = None
    damage_path: Path | None = None
    damage_offset: int = 0
    truncate: tuple[Path, int, int] | None = None
    truncate_lsns: tuple[int, int | None] | None = None
    delete: list[Path] = field(default_factory=list)
    delete_lsns: list[tuple[int, int]] = field(default_factory=list)
    missing: tuple[int, int | None] | None = None
    keep_last_lsn: int = 0
    lost_first: int | None = None
    lost_last: int | None = None
    lost_count: int | None = None
    covered_count: int = 0
    covered_damage: list[CoveredDamage] = field(default_factory=list)
    zero_tail: tuple[Path, int, int] | None = None

    def describe(self) -> str:
        """The plan in words, one fact per line (what ``rallypoint repair`` prints)."""
        s = self.snapshot_lsn
        if not self.needed:
            lines = [f"the journal is intact past the snapshot (LSN {s}); it ends at LSN {self.keep_last_lsn}"]
            for c in self.covered_damage:
                lines.append(f"  (damage in {c.path} at byte {c.offset} is in records the snapshot holds: "
                             f"ignored)")
            if self.zero_tail is not None:
                path, off, n = self.zero_tail
                lines.append(f"  ({path} ends in {n} zero bytes from byte {off}: space the journal had "
                             f"written ahead of its records; the daemon cuts them when it starts)")
            return "\n".join(lines)
        lines = [f"journal damage: {self.reason}", f"  found in {self.damage_path} at byte {self.damage_offset}",
                 "repair will:"]
        if self.truncate is not None:
            path, off, n = self.truncate
            if self.truncate_lsns is not None and self.truncate_lsns[1] is not None:
                what = f"{_lsns(*self.truncate_lsns)}, {_records(self.truncate_lsns[1] - self.truncate_lsns[0] + 1)}"
            elif self.kind == "torn":
                what = "an incomplete record, never acknowledged"
            else:
                what = f"damaged bytes from {_lsns(self.truncate_lsns[0], self.truncate_lsns[0])}" \
                    if self.truncate_lsns else "damaged bytes"
            lines.append(f"  truncate {path} at byte {off}, dropping {n} bytes ({what})")
        for path, (first, last) in zip(self.delete, self.delete_lsns):
            held = "" if last > s else ", all in the snapshot"
            what = f"{_lsns(first, last)}, {_records(last - first + 1)}{held}" if last >= first else "no records"
            lines.append(f"  delete   {path} ({what})")
        if self.missing is not None:
            lines.append(f"  ({_lsns(*self.missing)} already missing: no file holds them)")
        lines.append(f"the journal will then end at LSN {self.keep_last_lsn} (snapshot at LSN {s}); "
                     f"the next record gets LSN {self.keep_last_lsn + 1}")
        if self.lost_first is None:
            why = ("only an incomplete record is dropped" if self.kind == "torn" and not self.covered_count
                   else f"every record dropped is already in the snapshot (LSN {s})")
            lines.append(f"nothing is lost: {why}")
        elif self.lost_count is None:
            lines.append(f"LOST: records {_lsns(self.lost_first, None)} (how many is unknown: the file that "
                         f"held them is gone)")
        else:
            lines.append(f"LOST: {_lsns(self.lost_first, self.lost_last)}, {_records(self.lost_count)} past the "
                         f"snapshot (acknowledged changes)")
        return "\n".join(lines)


@dataclass
class RepairReport:
    """What :func:`apply_repair` did.

    Attributes:
        file: the segment truncated (None when none was).
        offset: byte offset it was truncated at.
        bytes_dropped: total bytes removed (truncated tail + deleted segments).
        records_dropped_estimate: records past the snapshot lost (exact when known, 0
            when none or unknown -- see ``plan.lost_count``; the name is historical).
        deleted_segments: whole segment files deleted.
        reason: the damage found, or None when the journal was fine.
        last_lsn: the journal ends at this LSN now (at least the snapshot LSN).
        plan: the plan that was carried out.
    """

    file: Path | None
    offset: int
    bytes_dropped: int
    records_dropped_estimate: int
    deleted_segments: list[Path]
    reason: str | None
    last_lsn: int
    plan: RepairPlan | None = None

    @property
    def changed(self) -> bool:
        """True when anything was cut."""
        return self.bytes_dropped > 0 or bool(self.deleted_segments) or bool(self.plan and self.plan.needed)


def plan_repair(data_dir: str | os.PathLike[str], *, snapshot_lsn: int | None = None) -> RepairPlan:
    """Work out, read-only, what repairing the journal of ``data_dir`` does.

    Args:
        data_dir: a stopped server's data directory.
        snapshot_lsn: the snapshot's LSN; read from ``<data_dir>/snapshot`` when None.

    Raises:
        SnapshotCorruptError: the snapshot store cannot be read (``snapshot_lsn`` None).
        OSError: reading failed.
    """
    d = Path(data_dir)
    s = snapshot_lsn_of(d) if snapshot_lsn is None else snapshot_lsn
    a = _analyse(d, s)
    p = a.problem
    if p is None:
        return RepairPlan(d, s, False, keep_last_lsn=max(a.expected - 1, s), covered_damage=a.covered)
    if p.kind == "torn":
        data = p.path.read_bytes()
        if _is_zero(data, p.offset, len(data)):  # a crash's preallocated tail: not damage
            return RepairPlan(d, s, False, keep_last_lsn=max(a.expected - 1, s), covered_damage=a.covered,
                              zero_tail=(p.path, p.offset, len(data) - p.offset))
    plan = RepairPlan(d, s, True, kind=p.kind, reason=p.reason, damage_path=p.path, damage_offset=p.offset,
                      missing=p.missing, covered_damage=a.covered)
    relevant = a.relevant
    highest: list[int] = []  # LSNs known to exist past what is kept
    dropped: list[tuple[int, int]] = []  # LSN ranges of records that exist and are dropped
    if p.kind in ("torn", "corrupt"):
        data = p.path.read_bytes()
        last_in = None if p.kind == "torn" else _last_valid_lsn(data, p.offset, p.lsn)
        plan.truncate = (p.path, p.offset, len(data) - p.offset)
        plan.truncate_lsns = (p.lsn, last_in)
        if last_in is not None:
            highest.append(last_in)
            dropped.append((p.lsn, last_in))
        kept = a.segs[: a.start + p.seg_index + 1]
        later = relevant[p.seg_index + 1:]
        kept_end = a.infos[-1].last_lsn
    elif p.kind in ("gap", "start_gap"):
        kept = a.segs[: a.start + p.seg_index]
        later = relevant[p.seg_index:]
        kept_end = a.expected - 1 if p.kind == "gap" else s
        if p.missing is not None and p.missing[1] is not None:
            highest.append(p.missing[1])
    else:  # missing_tail, short_tail, ahead: nothing to cut; the journal continues after what is there
        kept = list(a.segs)
        later = []
        kept_end = a.expected - 1
        if p.missing is not None and p.missing[1] is not None:
            highest.append(p.missing[1])
    if a.manifest is not None and a.manifest.clean_end_lsn is not None:
        highest.append(a.manifest.clean_end_lsn)  # a clean close: the journal reached this LSN
    deletions: list[tuple[Path, tuple[int, int]]] = []
    for first, path in later:
        last = _last_valid_lsn(path.read_bytes(), 0, first)
        rng = (first, first - 1 if last is None else last)
        deletions.append((path, rng))
        if last is not None:
            highest.append(last)
            dropped.append(rng)
        elif first > 1:
            highest.append(first - 1)
    if kept_end < s or p.kind == "start_gap":
        # What is kept holds only records the snapshot has: drop it too, continue after it.
        plan.truncate = None
        firsts = [f for f, _ in a.segs]
        ends = {info.path: info.last_lsn for info in a.infos}
        for first, path in kept:
            later_firsts = [f for f in firsts if f > first]
            last = ends.get(path, (later_firsts[0] - 1) if later_firsts else first - 1)
            deletions.append((path, (first, last)))
            if last >= first:
                dropped.append((first, last))
        kept_end = s
    order = {path: i for i, (_, path) in enumerate(a.segs)}
    deletions.sort(key=lambda x: order.get(x[0], 0))
    plan.delete = [path for path, _ in deletions]
    plan.delete_lsns = [rng for _, rng in deletions]
    keep = max(kept_end, s)
    plan.keep_last_lsn = keep
    unknown = p.missing is not None and p.missing[1] is None
    top = max(highest) if highest else None
    if unknown:
        plan.lost_first = max(keep + 1, p.missing[0])  # type: ignore[index]
    elif top is not None and top > keep:
        plan.lost_first, plan.lost_last, plan.lost_count = keep + 1, top, top - keep
    plan.covered_count = sum(max(0, min(last, s) - first + 1) for first, last in dropped)
    return plan


def apply_repair(plan: RepairPlan) -> RepairReport:
    """Carry out ``plan`` (take the data-dir lock first: :func:`repair` does). Then
    the journal's manifest names what is left and its end (``plan.keep_last_lsn``).

    Raises: OSError.
    """
    if not plan.needed:
        return RepairReport(None, 0, 0, 0, [], None, plan.keep_last_lsn, plan)
    d = plan.data_dir
    dropped = 0
    cut_file: Path | None = None
    cut_off = 0
    if plan.truncate is not None:
        cut_file, cut_off, n = plan.truncate
        _truncate_file(cut_file, cut_off)
        dropped += n
    deleted: list[Path] = []
    for path in plan.delete:
        try:
            dropped += path.stat().st_size
            path.unlink()
            deleted.append(path)
        except FileNotFoundError:
            pass
    jdir = d / "journal"
    if jdir.exists():
        _fsync_dir(jdir)
        left = list_segments(d)
        write_manifest(d, Manifest(active_segment=left[-1][0] if left else None,
                                   clean_end_lsn=plan.keep_last_lsn))
    if plan.lost_first is None:
        lost = "nothing lost"
    elif plan.lost_count is None:
        lost = f"lost records {_lsns(plan.lost_first, None)}"
    else:
        lost = f"lost {_lsns(plan.lost_first, plan.lost_last)} ({_records(plan.lost_count)})"
    cut = f"truncated {cut_file} at byte {cut_off}" if cut_file is not None else "truncated nothing"
    log.warning("journal repair: %s; %s, deleted %d segment(s)%s, %d bytes dropped; %s; journal now ends "
                "at LSN %d", plan.reason, cut, len(deleted),
                (" (" + ", ".join(p.name for p in deleted) + ")") if deleted else "", dropped, lost,
                plan.keep_last_lsn)
    return RepairReport(cut_file, cut_off, dropped, plan.lost_count or 0, deleted, plan.reason,
                        plan.keep_last_lsn, plan)


def repair(
    data_dir: str | os.PathLike[str], *, snapshot_lsn: int | None = None, lock: bool = True
) -> RepairReport:
    """Plan and apply a repair (see the module docstring): use only after
    :class:`JournalCorruptError`, with the server stopped. ``snapshot_lsn`` defaults to
    the LSN stored in ``<data_dir>/snapshot`` (0 without a snapshot). With ``lock`` the
    data-dir lock is taken for the duration.

    Raises: DataDirLocked (server running), SnapshotCorruptError, OSError.
    """
    from .lock import DataDirLock

    dlock = DataDirLock(data_dir) if lock else None
    if dlock is not None:
        dlock.acquire()
    try:
        return apply_repair(plan_repair(data_dir, snapshot_lsn=snapshot_lsn))
    finally:
        if dlock is not None:
            dlock.release()
