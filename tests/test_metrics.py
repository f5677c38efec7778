"""Metrics and structured logs (issue 16, items 4 and 6): ``serve --metrics`` serves
Prometheus text made by prometheus-client that its parser reads, with requests by op
and code, latency, journal fsyncs and group commits, snapshots, actors, tasks by state,
connections and event-loop lag; ``--log-format json`` writes one JSON object a line."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import rallypoint
from rallypoint.errors import NotFoundError

from conftest import Daemon, until


def _scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fam, **labels) -> float:
    for s in fam.samples:
        if all(s.labels.get(k) == v for k, v in labels.items()) and s.name == fam.name + (
                "_total" if fam.type == "counter" else ""):
            return s.value
    raise KeyError(labels)


async def test_the_metrics_endpoint_parses_and_counts(tmp_path):
    d = Daemon(str(tmp_path / "data"), "fsync", ["--metrics", "127.0.0.1:0", "--snapshot-every-s", "0.5"]).start()
    try:
        async with rallypoint.connect(d.url) as rs:
            run = await rs.scopes.create(name="m")
            mbx = await rs.mailboxes.ensure("m")
            await mbx.submit_many([{"i": i} for i in range(10)], scope=run)
            for _ in range(10):
                dl = await mbx.receive(run)
                await dl.complete(1)
            # issue 44: the ready backlog per priority and the keys with ready tasks
            await mbx.submit_many([1, 2], scope=run, priority=1, fair_key="a")
            await mbx.submit(3, scope=run, fair_key="b")
            # 12 more keys and a task without one: the 10 largest get a series, the rest one
            for i in range(12):
                await mbx.submit(i, scope=run, priority=5, fair_key=f"k{i:02}")
            await mbx.submit("no key", scope=run, priority=5)
            with pytest.raises(NotFoundError):
                await rs.scope("scp_01m8p6k63gq5b40a5mf0wxyjsz").status()
            fams: dict = {}

            async def snapshot_and_lag_seen() -> bool:  # (snapshots every 0.5 s; lag sampled)
                fams.clear()
                fams.update(await trio.to_thread.run_sync(_scrape, d.metrics_url))
                lag = [s for s in fams["rallypoint_event_loop_lag_seconds"].samples if s.name.endswith("_count")]
                return _value(fams["rallypoint_snapshots"]) >= 1 and lag[0].value > 0

            await until(snapshot_and_lag_seen, poll_s=0.1)
    finally:
        assert d.stop() == 0
    assert _value(fams["rallypoint_requests"], op="task.submit_many", code="OK") == 2  # (one for the backlog)
    assert _value(fams["rallypoint_requests"], op="delivery.complete", code="OK") == 10
    assert _value(fams["rallypoint_requests"], op="scope.status", code="NOT_FOUND") == 1
    lat = fams["rallypoint_request_duration_seconds"]
    counts = [s for s in lat.samples if s.name.endswith("_count") and s.labels["op"] == "delivery.receive"]
    assert counts and counts[0].value == 10
    fsync = fams["rallypoint_journal_fsync_duration_seconds"]
    assert [s for s in fsync.samples if s.name.endswith("_count")][0].value > 0
    assert "rallypoint_journal_group_commit_records" in fams
    wait = fams["rallypoint_journal_commit_wait_seconds"]  # what replies waited for durability
    n_wait = [s for s in wait.samples if s.name.endswith("_count")][0].value
    sum_wait = [s for s in wait.samples if s.name.endswith("_sum")][0].value
    assert n_wait > 0 and sum_wait > 0
    assert _value(fams["rallypoint_tasks"], state="SUCCEEDED") == 10
    assert _value(fams["rallypoint_ready_tasks"], mailbox="m", priority="1") == 2
    assert _value(fams["rallypoint_ready_tasks"], mailbox="m", priority="3") == 1
    assert _value(fams["rallypoint_ready_tasks"], mailbox="m", priority="5") == 13
    assert _value(fams["rallypoint_ready_fair_keys"], mailbox="m") == 14  # (no key is not a key)
    by_key = {(s.labels["bucket"], s.labels["fair_key"]): s.value
              for s in fams["rallypoint_ready_tasks_by_fair_key"].samples if s.labels["mailbox"] == "m"}
    # the 10 largest keys (ties by name), the other 4 summed, the task without a key
    assert by_key == {("key", "a"): 2, ("key", "b"): 1, **{("key", f"k{i:02}"): 1 for i in range(8)},
                      ("other", ""): 4, ("none", ""): 1}
    assert _value(fams["rallypoint_actors"], kind="runs", state="active") + \
        _value(fams["rallypoint_actors"], kind="runs", state="passive") == 1
    assert _value(fams["rallypoint_connections"]) >= 0
    assert [s for s in fams["rallypoint_event_loop_lag_seconds"].samples if s.name.endswith("_count")][0].value > 0
    assert _value(fams["rallypoint_snapshots"]) >= 1
    assert [s for s in fams["rallypoint_snapshot_duration_seconds"].samples if s.name.endswith("_count")][0].value >= 1
    assert _value(fams["rallypoint_events_emitted"]) >= 22


def test_json_logs_are_one_object_a_line(tmp_path):
    data = str(tmp_path / "data")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    secret = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "create", "--data-dir", data, "--space",
                             "default", "--permission", "operator", "--secret-only"],
                            capture_output=True, text=True, env=env, check=True).stdout.strip()
    d = Daemon(data, "fsync", ["--log-format", "json", "--snapshot-every-s", "0.3", "--slow-request-ms", "0.001"])
    d.start()
    early: list[str] = []  # the log lines read while waiting for the first snapshot's

    def read_until_a_snapshot_is_logged() -> None:
        for line in d.proc.stderr:
            early.append(line)
            if line.strip() and json.loads(line).get("event") == "snapshot":
                return

    try:
        async def body():
            async with rallypoint.connect(d.url, api_key=secret) as rs:
                await rs.scopes.create(name="x")
                await rs._transport.call(rallypoint.protocol.KeyCreate(space="default", permissions=["admin"]))
                with trio.fail_after(30):  # (snapshots every 0.3 s once there is a change)
                    await trio.to_thread.run_sync(read_until_a_snapshot_is_logged, abandon_on_cancel=True)
            with pytest.raises(rallypoint.UnauthenticatedError):
                async with rallypoint.connect(d.url, api_key="wrong", reconnect=False) as rs:
                    pass
        trio.run(body)
    finally:
        assert d.stop() == 0
    lines = [ln for ln in "".join(early).splitlines() + d.proc.stderr.read().splitlines() if ln.strip()]
    objs = [json.loads(ln) for ln in lines]  # every line is one JSON object
    events = {o.get("event") for o in objs}
    assert {"startup", "recovery", "snapshot", "key_created", "auth_failed", "slow_request"} <= events, events
    for o in objs:
        assert {"ts", "level", "logger", "msg"} <= set(o)
    start = next(o for o in objs if o.get("event") == "startup")
    assert start["durability"] == "fsync" and start["retain_finished_ms"] == 7 * 86400 * 1000


# ------------------------------------------------------------------ slow requests (issue 31, item 3)

async def _parked(coord, n: int) -> None:
    """Until ``n`` server-side waits are parked in actors (the runtime's own count)."""
    with trio.fail_after(30):
        while coord.runtime.n_waiters < n:
            await trio.testing.wait_all_tasks_blocked()
            if coord.runtime.n_waiters < n:
                await trio.sleep(0.001)


async def test_a_wait_the_client_asked_for_is_never_a_slow_request(caplog):
    # Every request over TCP (and over HTTP) takes longer than the threshold (1 us): the
    # waits the client asked for -- task.results, claim.acquire and pool.acquire with
    # wait_ms, each parked until another client frees what it waits for; a task.result
    # long poll over HTTP -- are not logged "slow request"; a delivery.complete is,
    # although its name ends like a wait's (the old rule matched op-name suffixes: it
    # missed task.results and exempted every *.complete).
    import msgspec
    import trio.testing

    from rallypoint import protocol as p
    from rallypoint.actors import Coordinator
    from rallypoint.actors.api import REPLY_TYPES
    from rallypoint.http.app import HttpApi
    from rallypoint.metrics import Metrics
    from rallypoint.service import Service, Session
    from rallypoint.transport.testing import running_server

    coord = Coordinator()
    service = Service(coord)
    session = Session()

    async def local(op):  # in process: no connection, so never observed by the metrics
        return msgspec.msgpack.decode(await service.call(session, op), type=REPLY_TYPES[type(op)])

    caplog.set_level(logging.WARNING, logger="rallypoint.metrics")
    async with trio.open_nursery() as n:
        await n.start(coord.run)
        async with running_server(service) as srv:
            metrics = srv.metrics = Metrics(coord, srv, slow_s=1e-6)
            run = await local(p.ScopeCreate(name="slow"))
            await local(p.MailboxEnsure(name="m"))
            task = await local(p.TaskSubmit(mailbox="m", scope_id=run.id, input=msgspec.Raw(b"\x01")))
            held = await local(p.ClaimAcquire(scope_id=run.id, key="k"))
            await local(p.PoolEnsure(name="gpu", units_total=1))
            grant = (await local(p.PoolAcquire(pool="gpu", scope_id=run.id))).grant
            async with rallypoint.connect(f"tcp://127.0.0.1:{srv.port}", reconnect=False) as rs:
                call = rs._transport.call
                async with trio.open_nursery() as waits:
                    waits.start_soon(call, p.TaskResults(task_ids=[task.id], wait_ms=30_000))
                    waits.start_soon(call, p.ClaimAcquire(scope_id=run.id, key="k", wait_ms=30_000))
                    waits.start_soon(call, p.PoolAcquire(pool="gpu", scope_id=run.id, wait_ms=30_000))
                    await _parked(coord, 3)
                    d = (await local(p.Receive(mailbox="m", scope_id=run.id))).deliveries[0]
                    await call(p.DeliveryComplete(task_id=d.task_id, token=d.token))  # over TCP: not a wait
                    await local(p.ClaimRelease(key="k", token=held.token))
                    await local(p.GrantRelease(grant_id=grant.id, token=grant.token))
            # the HTTP layer observes its calls the same way: a long poll is not slow either
            http = HttpApi(service)
            http.metrics = metrics
            second = await local(p.TaskSubmit(mailbox="m", scope_id=run.id, input=msgspec.Raw(b"\x01")))
            async with trio.open_nursery() as waits:
                waits.start_soon(http.call_op, session, p.TaskResult(task_id=second.id, wait_ms=30_000))
                await _parked(coord, 1)
                d = (await local(p.Receive(mailbox="m", scope_id=run.id))).deliveries[0]
                await http.call_op(session, p.DeliveryComplete(task_id=d.task_id, token=d.token))
        n.cancel_scope.cancel()
    slow = [r.op for r in caplog.records if r.getMessage().startswith("slow request")]
    assert slow == ["delivery.complete", "delivery.complete"], slow
    for tag in ("task.results", "claim.acquire", "pool.acquire", "task.result"):
        h = metrics.latency[tag]
        assert sum(h.counts) == 1 and h.sum > metrics.slow_s, tag  # answered, and slower than the threshold


def test_top_fair_keys_bounds_the_series_and_keeps_the_sum():
    """Any number of tenants gives at most ``n + 2`` rows, largest first, adding up to
    the queue's ready backlog."""
    from rallypoint.metrics import METRIC_TOP_KEYS, top_fair_keys

    by_key = {f"t{i:05}": i % 7 + 1 for i in range(10_000)}
    by_key[None] = 5
    rows = top_fair_keys(by_key)
    assert len(rows) == METRIC_TOP_KEYS + 2
    assert [b for b, _k, _n in rows] == ["key"] * METRIC_TOP_KEYS + ["other", "none"]
    assert [n for b, _k, n in rows if b == "key"] == [7] * METRIC_TOP_KEYS
    assert [k for b, k, _n in rows if b == "key"][:2] == ["t00006", "t00013"]  # ties by name
    assert sum(n for _b, _k, n in rows) == sum(by_key.values())
    assert top_fair_keys({"a": 3, "b": 1}, n=1) == [("key", "a", 3), ("other", "", 1)]
    assert top_fair_keys({None: 2}) == [("none", "", 2)]
    assert top_fair_keys({}) == []
