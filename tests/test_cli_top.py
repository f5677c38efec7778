"""``rallypoint top`` and ``status`` as an operator reads them (issue 31 item 12): full
run ids with names shortened instead, the busiest queues first, "done since start",
``q`` quits the live view, and ``status``'s per-kind lines aligned whatever the kind's
name."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import rallypoint

from conftest import Daemon

LONG_NAME = "a rather long run name that an operator gave it " * 3


def _setup(url: str) -> tuple[str, str]:
    with rallypoint.sync.connect(url) as rs:
        run = rs.scopes.create(name=LONG_NAME)
        rs.mailboxes.ensure("a-idle")
        busy = rs.mailboxes.ensure("z-busy")
        for i in range(5):
            busy.submit({"i": i}, scope=run)
        group = run.groups.create("z-busy", "ALL_TERMINAL")
        return run.id, group.id


def test_top_keeps_full_ids_shortens_names_and_lists_busy_queues_first(daemon):
    run_id, group_id = _setup(daemon.url)
    out = subprocess.run([sys.executable, "-m", "rallypoint", "top", "--connect", daemon.url, "--once"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "90"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert run_id in text and group_id in text, text  # whole, on one line, in a 90-column terminal
    assert LONG_NAME.strip() not in text and "…" in text, text  # the name is what gives way
    assert "done since start" in text, text
    assert text.index("z-busy") < text.index("a-idle"), text  # 5 queued before 0


def _wait_output(master: int, want: bytes, timeout: float = 60) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while want not in out:
        assert time.monotonic() < deadline, out.decode("utf-8", "replace")[-2000:]
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            out += os.read(master, 65536)
    return out


def test_q_quits_the_live_top(daemon):
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "rallypoint", "top", "--connect", daemon.url, "--interval", "0.2"],
                         stdin=slave, stdout=slave, stderr=slave, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    try:
        # a live frame is on screen (its top: a daemon with many runs crops the queue
        # table off a 24-row terminal)
        _wait_output(master, b"active runs")
        os.write(master, b"q")
        deadline = time.monotonic() + 30
        while p.poll() is None:  # (reading what it draws meanwhile: a full pty would block it)
            assert time.monotonic() < deadline, "top did not quit on q"
            r, _, _ = select.select([master], [], [], 0.1)
            if r:
                try:
                    os.read(master, 65536)
                except OSError:
                    break
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)


def test_status_aligns_every_kind_line():
    from rallypoint.cli import _actor_lines

    actors = {"runs": {"active": 2, "passive": 10}, "idempotency": {"active": 1, "waiters": 3},
              "spaces": {"active": 1}, "timers": {}}
    lines = _actor_lines(actors)
    assert [ln.split()[0] for ln in lines] == ["idempotency", "runs", "spaces"]  # idle kinds left out
    for word in ("active", "passive", "queued", "waiters"):
        assert len({ln.index(word) for ln in lines}) == 1, lines  # each column starts at one place


def test_top_off_a_terminal_draws_wide_and_width_sets_the_columns(daemon):
    # issue 42: piped without $COLUMNS rich drew 80 columns and the run name column vanished
    run_id, _ = _setup(daemon.url)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    wide = subprocess.run([sys.executable, "-m", "rallypoint", "top", "--connect", daemon.url, "--once"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert wide.returncode == 0, wide.stderr
    widest = max(len(line) for line in wide.stdout.splitlines())
    assert 80 < widest <= 200, widest
    assert run_id in wide.stdout and LONG_NAME[:40] in wide.stdout, wide.stdout
    narrow = subprocess.run([sys.executable, "-m", "rallypoint", "top", "--connect", daemon.url, "--once",
                             "--width", "110"], capture_output=True, text=True, timeout=60, env=env)
    assert narrow.returncode == 0, narrow.stderr
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 110, narrow.stdout
    assert LONG_NAME[:11] in narrow.stdout, narrow.stdout  # the name shortened, never dropped
    bad = subprocess.run([sys.executable, "-m", "rallypoint", "top", "--connect", daemon.url, "--width", "10"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--width" in bad.stderr, bad.stderr


def test_top_shows_each_queues_ready_backlog_per_priority_and_its_largest_keys(daemon):
    """Issue 44: a queue's ready tasks per priority and its three largest fairness keys
    (``-``: no key), with how many more keys have ready tasks."""
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create(name="fair")
        m = rs.mailboxes.ensure("fair-top")
        for key, n in (("tenant-a", 4), ("tenant-b", 3), ("tenant-c", 2), ("tenant-d", 1)):
            m.submit_many(list(range(n)), scope=run, fair_key=key, priority=2)
        m.submit("urgent", scope=run, priority=1)
    out = subprocess.run([sys.executable, "-m", "rallypoint", "top", "--connect", daemon.url, "--once"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "ready backlog" in text, text
    line = [x for x in text[text.index("ready backlog"):].splitlines() if "fair-top" in x][0]
    assert "p1 1  p2 10" in line, line
    assert "tenant-a 4  tenant-b 3  tenant-c 2 +1" in line, line
