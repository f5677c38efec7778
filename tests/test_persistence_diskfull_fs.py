"""Disk full on a real (small) filesystem, against a real daemon (issue 12, item 9).

scripts/smallfs.py mounts a tmpfs in a user namespace (no root needed where
unprivileged user namespaces are allowed; skipped elsewhere), runs ``rallypoint serve``
on it, and fills or empties it on demand. The fault-injection tests are in
test_persistence_diskfull.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

import rallypoint.sync
from rallypoint.errors import UnavailableError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import smallfs  # noqa: E402

pytestmark = pytest.mark.skipif(not smallfs.available(), reason="needs unshare and tmpfs in a user namespace")


def start(tmp_path: Path, *flags: str, size: str = "16m") -> tuple[smallfs.SmallFs, str]:
    mnt = tmp_path / "mnt"
    cmd = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0",
           "--data-dir", str(mnt / "data"), *flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    fs = smallfs.SmallFs(mnt, tmp_path / "daemon.log", cmd, size=size, env=env)
    try:
        url = fs.ready()
    except BaseException:
        fs.close()
        raise
    return fs, url


def retry_until_accepted(fn, timeout: float = 30.0):
    """Call ``fn`` until it is not refused, sleeping the ``retry_after`` the server asks
    for (what a client does with UNAVAILABLE)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except UnavailableError as exc:
            if time.monotonic() > deadline:
                raise
            time.sleep(exc.retry_after or 1.0)


def log_text(tmp_path: Path) -> str:
    return (tmp_path / "daemon.log").read_text(errors="replace")


def wait_for_log(tmp_path: Path, needle: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = log_text(tmp_path)
        if needle in text:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"{needle!r} not in the daemon log:\n{text[-3000:]}")
        time.sleep(0.05)


def test_a_full_disk_refuses_writes_serves_reads_and_recovers_by_itself(tmp_path):
    # No preallocation: the write after the fill must hit ENOSPC (the preallocated
    # zeros would take it, see the next test).
    fs, url = start(tmp_path, "--min-free-mb", "1", "--ballast-mb", "1", "--preallocate-kb", "0")
    try:
        with rallypoint.sync.connect(url) as rs:
            run = rs.scopes.create(name="work")
            jobs = rs.mailboxes.ensure("jobs")
            ticket = jobs.submit({"n": 0}, scope=run)
            assert fs.fill(0) < 4096  # completely full: another process took every byte
            # The next write is applied before its journal write hits ENOSPC: the journal
            # gives back its ballast, the write lands, and only then is it acknowledged.
            landed = jobs.submit({"blob": "x" * 12_000}, scope=run)
            assert rs.task(landed.id).status().state == "QUEUED"
            with pytest.raises(UnavailableError) as ei:  # from then on writes are refused
                jobs.submit({"n": 1}, scope=run)
            refused = ei.value
            assert refused.code == "UNAVAILABLE" and refused.retry_after >= 1
            assert refused.message.startswith(f"disk full at {tmp_path / 'mnt' / 'data' / 'journal'}"), refused
            for _ in range(3):
                with pytest.raises(UnavailableError, match="disk full"):
                    rs.scopes.create(name="refused")
            # Reads are answered.
            assert rs.scope(run.id).status().name == "work"
            assert rs.task(ticket.id).status().state == "QUEUED"
            assert rs.status().last_lsn > 0
            fs.free()
            late = retry_until_accepted(lambda: rs.scopes.create(name="after"))
            assert rs.scope(late.id).status().name == "after"
            got = jobs.receive(run, wait=0)
            assert got is not None and got.task_id == ticket.id
        assert fs.stop() == 0
    finally:
        fs.close()
    text = log_text(tmp_path)
    assert "Traceback" not in text, text[-3000:]
    assert "released the 1048576-byte ballast" in text and "writes are accepted again" in text, text[-3000:]


def test_the_preallocated_journal_tail_takes_a_write_on_a_full_disk_without_a_ballast(tmp_path):
    # The journal keeps zeros written ahead of its records (1 MiB): a write on a disk
    # that just filled up lands in them instead of failing with ENOSPC, and the check
    # after it refuses the next writes. No ballast is configured.
    fs, url = start(tmp_path, "--min-free-mb", "1", "--ballast-mb", "0", "--preallocate-kb", "1024")
    try:
        with rallypoint.sync.connect(url) as rs:
            run = rs.scopes.create(name="work")
            jobs = rs.mailboxes.ensure("jobs")
            jobs.submit({"n": 0}, scope=run)
            assert fs.fill(0) < 4096
            landed = jobs.submit({"blob": "x" * 60_000}, scope=run)
            assert rs.task(landed.id).status().state == "QUEUED"
            with pytest.raises(UnavailableError, match="disk full"):
                jobs.submit({"n": 1}, scope=run)
            fs.free()
            retry_until_accepted(lambda: jobs.submit({"n": 2}, scope=run))
        assert fs.stop() == 0
    finally:
        fs.close()
    text = log_text(tmp_path)
    assert "Traceback" not in text, text[-3000:]
    assert "ballast" not in text and "write that waited for disk space" not in text, text[-3000:]


def test_a_daemon_restarted_on_a_full_disk_serves_reads_and_resumes_writes(tmp_path):
    fs, url = start(tmp_path, "--min-free-mb", "1", "--ballast-mb", "0")
    try:
        with rallypoint.sync.connect(url) as rs:
            run = rs.scopes.create(name="before")
        assert fs.stop(close=False) == 0
        assert fs.fill(0) < 4096
        url = fs.restart()  # starts although nothing is free (the data dir exists)
        with rallypoint.sync.connect(url) as rs:
            assert rs.scope(run.id).status().name == "before"  # reads work
            with pytest.raises(UnavailableError, match="disk full"):
                rs.scopes.create(name="refused")
            fs.free()
            retry_until_accepted(lambda: rs.scopes.create(name="after"))
        assert fs.stop() == 0
    finally:
        fs.close()
    assert "Traceback" not in log_text(tmp_path)


def test_a_snapshot_hitting_enospc_does_not_stop_the_daemon(tmp_path):
    # The journal keeps a tiny reserve, so it still has room when LMDB runs out.
    fs, url = start(tmp_path, "--min-free-mb", "0.05", "--ballast-mb", "0", "--snapshot-every-s", "0.3",
                    "--snapshot-retry-s", "0.5", size="12m")
    try:
        with rallypoint.sync.connect(url) as rs:
            run = rs.scopes.create(name="work")
            jobs = rs.mailboxes.ensure("jobs")
            wait_for_log(tmp_path, "snapshot at LSN")
            fs.fill(1_200_000)
            big = "x" * 60_000
            tickets = [jobs.submit({"blob": big, "i": i}, scope=run) for i in range(12)]  # ~720 KB journal
            text = wait_for_log(tmp_path, "snapshot to ")
            assert "failed" in text and "nothing is lost" in text and ("Errno 28" in text or "No space left" in text)
            # The daemon is alive and the journal, whose reserve the snapshot left alone,
            # still takes writes.
            for i in range(5):
                t = jobs.submit({"i": f"after the failed snapshot {i}"}, scope=run)
                assert rs.task(t.id).status().state == "QUEUED"
            fs.free()
            wait_for_log(tmp_path, "snapshot written again")
            assert rs.task(tickets[-1].id).status().input["i"] == 11
        assert fs.stop() == 0
    finally:
        fs.close()
    assert "Traceback" not in log_text(tmp_path)
