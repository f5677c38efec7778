"""Fault injection end to end, at the node and daemon level (the journal's own unit
tests are in test_persistence_faults.py): a torn last record is cut and logged, real
corruption refuses to start (embedded and daemon, exit 2) until ``rallypoint repair``,
a newer on-disk format is refused, and a data dir serves one daemon at a time."""

from __future__ import annotations

import logging
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import rallypoint
from rallypoint.errors import NotFoundError
from rallypoint.persistence import FORMAT_VERSION, FormatVersionError, JournalCorruptError
from rallypoint.persistence.journal import HEADER_SIZE, list_segments

from conftest import Daemon

_HDR = struct.Struct("<IIQ")  # length, crc, lsn (journal.py framing)


def record_offsets(path: Path) -> list[tuple[int, int, int]]:
    """``[(offset, length, lsn)]`` of every record framed in a segment file (up to a
    zero header: the preallocated tail a crashed journal's last segment ends in)."""
    data = path.read_bytes()
    out, off = [], 0
    while off + HEADER_SIZE <= len(data):
        length, _crc, lsn = _HDR.unpack_from(data, off)
        if lsn == 0:
            break
        out.append((off, length, lsn))
        off += HEADER_SIZE + length
    return out


async def crashed_dir_with_runs(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    """A data dir as a SIGKILL would leave it: ``n`` runs created (one journal record
    each, acknowledged), no final snapshot."""
    live = tmp_path / "live"
    async with rallypoint.open_embedded(str(live), durability="fsync") as rs:
        ids = [(await rs.scopes.create(name=f"r{i}")).id for i in range(n)]
        j = rs.node.coordinator.journal
        await j.wait_durable(j.last_lsn)
        crashed = tmp_path / "crashed"
        shutil.copytree(live, crashed)
    return crashed, ids


def last_segment(d: Path) -> Path:
    return list_segments(d)[-1][1]


def serve(d: Path, *extra: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--data-dir", str(d), *extra],
        capture_output=True, text=True, timeout=timeout,
    )


async def test_torn_last_record_is_cut_logged_with_its_offset_and_prior_state_is_intact(tmp_path, caplog):
    d, ids = await crashed_dir_with_runs(tmp_path, 5)
    seg = last_segment(d)
    off, length, _lsn = record_offsets(seg)[-1]
    with open(seg, "r+b") as f:  # the crash tore the last record's payload
        f.truncate(off + HEADER_SIZE + length - 3)
    caplog.set_level(logging.INFO)
    async with rallypoint.open_embedded(str(d), durability="fsync") as rs:
        info = rs.node.recovery_info
        assert info["torn_tail"] is not None
        for rid in ids[:-1]:
            assert (await rs.scope(rid).status()).stored_state == "ACTIVE"
        with pytest.raises(NotFoundError):
            await rs.scope(ids[-1]).status()
        # Appends continue after the cut.
        new = await rs.scopes.create(name="after")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert str(seg) in text and f"offset {off}" in text, text
    async with rallypoint.open_embedded(str(d), durability="fsync") as rs:
        assert rs.node.recovery_info["torn_tail"] is None
        assert (await rs.scope(new.id).status()).name == "after"
        assert (await rs.scope(ids[0]).status()).name == "r0"


async def test_bad_crc_mid_journal_refuses_to_start_until_repaired(tmp_path):
    d, ids = await crashed_dir_with_runs(tmp_path, 6)
    seg = last_segment(d)
    off, length, lsn = record_offsets(seg)[3]  # the 4th run's record; good ones follow
    raw = bytearray(seg.read_bytes())
    raw[off + HEADER_SIZE + length // 2] ^= 0xFF
    seg.write_bytes(bytes(raw))

    # Embedded: the StartupError names the file and the offset; nothing changed on disk.
    with pytest.raises(JournalCorruptError) as ei:
        async with rallypoint.open_embedded(str(d), durability="fsync"):
            pass
    assert ei.value.path == str(seg) and ei.value.offset == off
    assert str(seg) in str(ei.value) and f"offset {off}" in str(ei.value)
    assert seg.read_bytes() == bytes(raw)

    # Daemon: exit 2 with the same message.
    p = serve(d)
    assert p.returncode == 2, p.stderr
    assert f"journal corrupt in {seg} at byte offset {off}" in p.stderr
    assert "rallypoint repair" in p.stderr

    # Repair, then the daemon starts and holds the records before the damage.
    r = subprocess.run([sys.executable, "-m", "rallypoint", "repair", "--data-dir", str(d), "--yes"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    daemon = Daemon(str(d), "fsync").start()
    try:
        async with rallypoint.connect(daemon.url) as rs:
            for rid in ids[:3]:
                assert (await rs.scope(rid).status()).stored_state == "ACTIVE"
            for rid in ids[3:]:
                with pytest.raises(NotFoundError):
                    await rs.scope(rid).status()
            await rs.scopes.create(name="after-repair")
    finally:
        assert daemon.stop() == 0, daemon.stderr()


async def test_a_newer_format_is_refused_naming_both_versions(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    newer = FORMAT_VERSION + 1
    (d / "FORMAT").write_text(f"{newer}\n")
    with pytest.raises(FormatVersionError):
        async with rallypoint.open_embedded(str(d)):
            pass
    p = serve(d)
    assert p.returncode == 2, p.stderr
    assert f"format version {newer}" in p.stderr and f"format version {FORMAT_VERSION}" in p.stderr, p.stderr
    assert (d / "FORMAT").read_text().strip() == str(newer)  # never downgraded


def test_a_second_daemon_on_the_same_data_dir_exits_2_naming_the_holder(tmp_path):
    d = tmp_path / "data"
    first = Daemon(str(d), "fsync").start()
    try:
        p = serve(d)
        assert p.returncode == 2, p.stderr
        assert f"process {first.proc.pid}" in p.stderr and str(d) in p.stderr, p.stderr
        assert first.proc.poll() is None  # the holder is untouched
    finally:
        assert first.stop() == 0
