"""Operator views (issue 16, item 5): ``rallypoint watch`` prints events live (and
``--json`` lines), ``rallypoint top`` shows runs, queues, groups and waits, and
``rallypoint bench`` draws a rich progress bar on a terminal (plain lines otherwise)."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time


import rallypoint

from conftest import Daemon, wait_watchers


def rp_popen(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rallypoint", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


async def _work(url: str, n: int = 3) -> str:
    async with rallypoint.connect(url, client_name="views-worker") as rs:
        run = await rs.scopes.create(name="cli-views")
        mbx = await rs.mailboxes.ensure("views")
        await run.groups.create(mbx, "ALL_TERMINAL")
        for i in range(n):
            await mbx.submit({"i": i}, scope=run)
            d = await mbx.receive(run)
            await d.complete({"i": i})
        return run.id


async def test_watch_prints_events_live_and_as_json_lines():
    d = Daemon(None, "memory").start()
    try:
        live = rp_popen("watch", "--connect", d.url, "--types", "task.completed", "--count", "3")
        js = rp_popen("watch", "--connect", d.url, "--json", "--count", "3", "--types", "task.*")
        async with rallypoint.connect(d.url) as rs:
            await wait_watchers(rs, 2, timeout=60)  # both subscribed: "from now" is fixed
        run_id = await _work(d.url)
        out, err = live.communicate(timeout=30)
        assert live.returncode == 0, err
        lines = out.strip().splitlines()
        assert len(lines) == 3 and all("task.completed" in ln and run_id in ln for ln in lines), out
        out, err = js.communicate(timeout=30)
        assert js.returncode == 0, err
        objs = [json.loads(ln) for ln in out.strip().splitlines()]
        assert [o["type"] for o in objs] == ["task.submitted", "task.delivered", "task.completed"]
        assert objs[0]["run"] == run_id and objs[0]["seq"] < objs[1]["seq"] < objs[2]["seq"]
        # the delivery's holder: the worker's client name and address (issue 32 item 2)
        assert objs[1]["data"]["holder"].startswith("views-worker@127.0.0.1:"), objs[1]
        line = subprocess.run([sys.executable, "-m", "rallypoint", "watch", "--connect", d.url, "--from-start",
                               "--types", "task.delivered", "--count", "1"], capture_output=True, text=True,
                              timeout=30, env={**os.environ, "COLUMNS": "250"}).stdout
        assert "task.delivered" in line and f"holder={objs[1]['data']['holder']}" in line, line
        # --from-start replays what is kept; --run filters the subtree
        old = subprocess.run([sys.executable, "-m", "rallypoint", "watch", "--connect", d.url, "--from-start", "--json",
                              "--run", run_id, "--count", "2"], capture_output=True, text=True, timeout=30)
        first = [json.loads(ln) for ln in old.stdout.splitlines()]
        assert [o["type"] for o in first] == ["scope.created", "group.created"]
        expired = subprocess.run([sys.executable, "-m", "rallypoint", "watch", "--connect", d.url, "--cursor",
                                  "999999"], capture_output=True, text=True, timeout=30)
        assert expired.returncode == 1 and "VALIDATION_FAILED" in expired.stderr
    finally:
        assert d.stop() == 0


async def test_top_shows_runs_queues_groups_and_waits():
    d = Daemon(None, "memory").start()
    try:
        run_id = await _work(d.url)
        out = subprocess.run([sys.executable, "-m", "rallypoint", "top", "--connect", d.url, "--once"],
                             capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 0, out.stderr
        text = out.stdout
        for title in ("active runs", "work queues", "open groups (1)", "actors and waits"):
            assert title in text, text
        assert run_id in text and "views" in text and "ALL_TERMINAL" in text
    finally:
        assert d.stop() == 0


def _run_on_a_pty(args: list[str], timeout: float = 90) -> tuple[int, str]:
    master, slave = pty.openpty()
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    p.wait(5)
    os.close(master)
    return p.returncode, out.decode("utf-8", "replace")


def test_bench_draws_a_progress_bar_on_a_terminal_and_plain_lines_otherwise():
    args = [sys.executable, "-m", "rallypoint", "bench", "--spawn", "--durability", "memory", "--duration", "2",
            "--warmup", "0.5", "--producers", "1", "--workers", "1", "--progress-every", "0.5"]
    rc, tty = _run_on_a_pty(args)
    assert rc == 0, tty
    assert "━" in tty and "cycles/s" in tty  # rich's bar and its fields
    plain = subprocess.run(args, capture_output=True, text=True, timeout=90)
    assert plain.returncode == 0, plain.stderr
    assert "━" not in plain.stderr and "\x1b[" not in plain.stderr
    assert "lifecycles+rounds/s" in plain.stderr  # the plain progress lines


def test_status_json_of_a_cluster_node_has_its_cluster_field_as_an_object_not_a_repr():
    # issue 42, item 5: `rallypoint status --json` printed "_ClusterInfo(cluster='rallypoint', ...)"
    import json

    import msgspec

    from rallypoint import protocol as p
    from rallypoint.client import types as t

    view = p.ServerStatusView(
        version="x", protocol_version=1, uptime_s=1.0, connections=1, durability="fsync", runs={}, tasks={},
        entities=0, last_lsn=1, durable_lsn=1, actors={}, tree_depth=0,
        cluster=p.ClusterView(cluster="rallypoint", shard=0, node="a", role="leader", epoch=7, members=["a", "b"],
                              isr=["a", "b"], lease_time_left_s=1.5,
                              standby=p.StandbyView(node="b", state="in_sync", acked_lsn=1, lag_records=0,
                                                    since_progress_s=0.1)))
    info = msgspec.convert(msgspec.to_builtins(view), t.ServerInfo)
    out = json.loads(json.dumps(info.to_dict(), default=str))
    assert out["cluster"]["epoch"] == 7 and out["cluster"]["isr"] == ["a", "b"]
    assert out["cluster"]["standby"]["state"] == "in_sync"
