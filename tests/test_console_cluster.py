"""The console on a sharded cluster (issue 46): 3 shards x 2 real ``rallypoint serve
--cluster --shard S --console`` processes against a real etcd, in Chromium (Playwright,
as tests/test_console.py).

What it shows: a standby's console (node ``n0b``) shows the runs of every shard, each
saying which shard and node serves it, the tree expanded lazily across the router; the
health page names every shard's leader and epoch as etcd holds them; a kill -9 of shard
1's leader while the Live page is open: the page says what happened and its stream
resumes at the new leader with no event missed or doubled (every event id the page
showed is compared with every event the shards kept); the health page then names the
new leader and its newer epoch. A raw ``/stream`` with ``Last-Event-ID`` resumes after
the vector cursor exactly. Last (it ends the cluster's open mode): a key made in etcd
is needed to sign in, a read key sees its own space, and its revocation in etcd signs
the console out.

Screenshots go to ``$RALLYPOINT_SCREENSHOTS`` when set (the docs' are made by
``scripts/console_screenshots_cluster.py``)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
import uuid

import httpx
import msgspec
import pytest
import trio

import rallypoint
from rallypoint.cluster.etcd import EtcdClient
from rallypoint.cluster.leader import ShardElection
from rallypoint.cluster.shardmap import init_cluster, read_map
from rallypoint.ids import slot_of

from _browser import CHROMIUM_ARGS, require_browser
from _cluster import ClusterNode, free_ports, stop_all

pytestmark = pytest.mark.timeout(600)

SLOTS = 64


async def wait_until(pred, timeout=60.0, what=""):
    try:
        with trio.fail_after(timeout):
            while not await pred():
                await trio.sleep(0.05)
    except trio.TooSlowError:
        raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}") from None


async def shard_leader(endpoints, name, shard):
    """``(leader node, epoch)`` of ``shard`` as etcd has it."""
    async with EtcdClient(endpoints) as client:
        lead = await ShardElection(client, name, shard).read_leader()
    return (lead.info.node, lead.epoch) if lead else (None, None)


class Cluster:
    """3 shards of 2 nodes; node ``b`` of shard 0 (a standby) and ``a`` of shard 2
    serve the console."""

    def __init__(self, etcd, root: str) -> None:
        self.etcd = etcd
        self.name = f"con-{uuid.uuid4().hex[:10]}"
        self.console_ports = dict(zip(("n0b", "n2a"), free_ports(2)))
        self.nodes: dict[int, list[ClusterNode]] = {}
        for s in range(3):
            self.nodes[s] = []
            for x in "ab":
                nm = f"n{s}{x}"
                extra = ["--shard", str(s), "--sync-helper", "thread"]
                if nm in self.console_ports:
                    extra += ["--console", f"127.0.0.1:{self.console_ports[nm]}"]
                self.nodes[s].append(ClusterNode(nm, root, etcd.endpoints[0], self.name, extra=extra))
        self.owners: list[int] = []

    def console(self, node: str = "n0b") -> str:
        return f"http://127.0.0.1:{self.console_ports[node]}"

    @property
    def url(self) -> str:
        return "tcp://" + ",".join(n.address for s in range(3) for n in self.nodes[s] if n.running())

    def shard_of(self, entity_id: str) -> int:
        return self.owners[slot_of(entity_id)]

    async def start(self) -> None:
        async with EtcdClient(self.etcd.endpoints) as client:
            await init_cluster(client, self.name, slots=SLOTS, shards=3)
            self.owners = (await read_map(client, self.name)).owners
        for s in range(3):
            self.nodes[s][0].start()
        for s in range(3):
            await self.nodes[s][0].wait_ready()
            await self.nodes[s][0].wait_role("leader")
        for s in range(3):
            self.nodes[s][1].start()
        for s in range(3):
            await self.nodes[s][1].wait_ready()
            await self.nodes[s][1].wait_role("standby")
        for s in range(3):  # in sync: a kill -9 of a leader loses nothing acknowledged
            async def isr(s=s):
                async with EtcdClient(self.etcd.endpoints) as client:
                    reps = await ShardElection(client, self.name, s).read_replicas()
                return reps is not None and sorted(reps.replicas.isr) == [f"n{s}a", f"n{s}b"]

            await wait_until(isr, what=f"shard {s} in sync")

    def stop(self) -> None:
        stop_all([n for s in range(3) for n in self.nodes[s]])


async def _workload(c: Cluster) -> dict:
    """A root run on every shard (named ``root-S``), each with two children and a task;
    a queue ``jobs``."""
    out: dict = {"roots": {}, "children": {}, "tasks": {}, "groups": {}, "joinsets": {}}
    async with rallypoint.connect(c.url) as rs:
        jobs = await rs.mailboxes.ensure("jobs")
        while len(out["roots"]) < 3:
            r = await rs.scopes.create()
            s = c.shard_of(r.id)
            if s not in out["roots"]:
                out["roots"][s] = r.id
        for s, rid in sorted(out["roots"].items()):
            root = rs.scope(rid)
            kids = [await root.child(name=f"child-{s}-{i}") for i in range(2)]
            out["children"][s] = [k.id for k in kids]
            out["tasks"][s] = (await jobs.submit({"shard": s}, scope=root)).id
            out["groups"][s] = (await root.groups.create(jobs, "FIRST_ACCEPTED")).id
            out["joinsets"][s] = (await root.join_sets.create(name=f"js-{s}")).id
    return out


@pytest.fixture(scope="module")
def cluster(etcd, tmp_path_factory):
    require_browser()
    c = Cluster(etcd, str(tmp_path_factory.mktemp("console-cluster")))
    try:
        trio.run(c.start)
        c.ids = trio.run(_workload, c)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def chromium():
    path = require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def _shot(page, name: str) -> None:
    where = os.environ.get("RALLYPOINT_SCREENSHOTS")
    if where:
        os.makedirs(where, exist_ok=True)
        page.screenshot(path=os.path.join(where, name + ".png"), full_page=True)


def _page(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    return ctx, page, errors


def _wait_page(page, pred, what: str, timeout_s: float = 30.0) -> None:
    """Let the page run (its callbacks come in) until ``pred()`` holds."""
    import time

    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        page.wait_for_timeout(50)


def _live(page) -> None:
    page.wait_for_selector("body[data-live=on]", timeout=15_000)


# ============================================================================ in a browser
def test_a_standbys_console_shows_the_runs_tree_of_every_shard_and_who_serves_it(chromium, cluster):
    c = cluster
    ctx, page, errors = _page(chromium)
    try:
        page.goto(c.console("n0b") + "/runs")
        _live(page)
        for s, rid in c.ids["roots"].items():
            row = page.locator(f'table.runs tr[data-run="{rid}"]')
            assert row.count() == 1, (s, rid)
            assert row.locator(".where").get_attribute("data-shard") == str(s)
            assert f"shard {s} · n{s}a" in row.inner_text()
        # the tree of shard 2's root, from the console of a standby of shard 0
        rid = c.ids["roots"][2]
        page.goto(c.console("n0b") + f"/runs/{rid}")
        assert "shard 2 · n2a" in page.inner_text(".part-summary")
        tree = page.inner_text(".part-tree")
        assert all(f"child-2-{i}" in tree for i in range(2)), tree
        # a task of shard 1's run, its history read from shard 1
        page.goto(c.console("n0b") + f"/tasks/{c.ids['tasks'][1]}")
        assert "task.submitted" in page.inner_text("main")
        # the queue's counts summed over the shards
        page.goto(c.console("n0b") + "/queues")
        assert "jobs" in page.inner_text("main")
        page.goto(c.console("n0b") + "/queues/jobs")
        assert "NOT_FOUND" not in page.inner_text("h1") and "jobs" in page.inner_text("h1")
        # groups and join sets: every shard's in one list, each page read from its shard
        page.goto(c.console("n0b") + "/groups")
        assert all(gid in page.inner_text("main") for gid in c.ids["groups"].values())
        page.goto(c.console("n0b") + "/joinsets")
        assert all(f"js-{s}" in page.inner_text("main") for s in range(3))
        page.goto(c.console("n0b") + f"/groups/{c.ids['groups'][1]}")
        assert "FIRST_ACCEPTED" in page.inner_text("main")
        page.goto(c.console("n0b") + f"/joinsets/{c.ids['joinsets'][2]}")
        assert "js-2" in page.inner_text("h1")
        # another node's console (a leader of shard 2) shows the same
        page.goto(c.console("n2a") + "/runs")
        assert all(page.locator(f'tr[data-run="{r}"]').count() == 1 for r in c.ids["roots"].values())
        assert not errors, errors
    finally:
        ctx.close()


def _health(page) -> dict[int, tuple[str, int]]:
    out = {}
    for row in page.locator("table.shards tbody tr").all():
        out[int(row.get_attribute("data-shard"))] = (row.get_attribute("data-leader"),
                                                     int(row.get_attribute("data-epoch")))
    return out


def test_the_health_page_names_every_shards_leader_epoch_and_in_sync_set(chromium, cluster):
    c = cluster
    ctx, page, errors = _page(chromium)
    try:
        page.goto(c.console("n0b") + "/cluster")
        truth = {s: trio.run(shard_leader, c.etcd.endpoints, c.name, s) for s in range(3)}
        assert _health(page) == truth
        text = page.inner_text("table.shards")
        for s in range(3):
            row = page.locator(f'table.shards tr[data-shard="{s}"]').inner_text()
            assert f"n{s}a, n{s}b" in row, row  # members and the in-sync set
            assert "records behind" in row, row  # open mode: the standby's lag is shown
        assert "Served by node n0b of shard 0 (standby)" in page.inner_text("main"), text
        assert "Cluster" in page.inner_text("header nav")
        assert not errors, errors
    finally:
        ctx.close()


async def _events_kept(c: Cluster, after: dict[int, int]) -> dict[int, list[int]]:
    """Every event each shard kept after ``after[shard]``, read through the SDK (its
    vector cursor)."""
    out: dict[int, list[int]] = {s: [] for s in after}
    cursor = ",".join(f"{s}:{after[s]}" for s in sorted(after))
    async with rallypoint.connect(c.url) as rs:
        while True:
            page = await rs.events.list(cursor=cursor, limit=1000)
            for e in page.events:
                out[e.shard].append(e.seq)
            if not page.events:
                return out
            cursor = page.next_cursor


async def _submit(c: Cluster, n: int, tag: str) -> list[str]:
    """``n`` tasks on each shard's root (keyed: one the failover cut off is sent again,
    not made twice)."""
    from rallypoint.errors import UnavailableError

    ids = []
    async with rallypoint.connect(c.url) as rs:
        jobs = await rs.mailboxes.ensure("jobs")
        for i in range(n):
            for s, rid in sorted(c.ids["roots"].items()):
                for _ in range(100):
                    try:
                        ids.append((await jobs.submit({"tag": tag, "i": i}, key=f"{tag}-{s}-{i}",
                                                      scope=rs.scope(rid))).id)
                        break
                    except UnavailableError:
                        await trio.sleep(0.1)
    return ids


def test_a_failover_while_the_live_page_is_open_misses_and_doubles_no_event(chromium, cluster):
    c = cluster
    ctx, page, errors = _page(chromium)
    try:
        page.goto(c.console("n0b") + "/live")
        _live(page)
        page.wait_for_selector("body[data-charted=yes]")  # the stats of every shard's queues, each second
        seen: list[str] = []
        page.expose_function("rpSeen", lambda ids: seen.extend(ids))
        page.evaluate("""() => new MutationObserver(ms => {
            const ids = [];
            for (const m of ms) for (const n of m.addedNodes) if (n.dataset && n.dataset.id) ids.push(n.dataset.id);
            if (ids.length) window.rpSeen(ids); })
          .observe(document.getElementById('events'), {childList: true})""")
        before = trio.run(_submit, c, 3, "before")
        page.wait_for_selector(f'#events tr >> text={before[-1]}')
        health_before = trio.run(shard_leader, c.etcd.endpoints, c.name, 1)
        during: list[str] = []  # tasks submitted on every shard across the kill
        t = threading.Thread(target=lambda: during.extend(trio.run(_submit, c, 15, "during")))
        n0 = len(seen)
        t.start()
        _wait_page(page, lambda: len(seen) >= n0 + 6, "the page shows tasks submitted across the kill")
        c.nodes[1][0].kill()  # kill -9 shard 1's leader while the page streams and tasks are submitted
        trio.run(c.nodes[1][1].wait_role, "leader")
        t.join(120)
        after = trio.run(_submit, c, 3, "after")  # on every shard; shard 1's to its new leader
        for tid in during + after:
            try:
                page.wait_for_selector(f'#events tr >> text={tid}', timeout=60_000)
            except Exception as e:  # say which task, and what the page had shown per shard
                per_shard = {}
                for x in seen:
                    s, q = x.split(":")
                    per_shard.setdefault(s, []).append(int(q))
                notes = page.inner_text("#cluster-notes")
                raise AssertionError(
                    f"task {tid} ({'during' if tid in during else 'after'} the kill) never shown; "
                    f"event ids shown per shard: { {s: (min(v), max(v), len(v)) for s, v in per_shard.items()} }; "
                    f"notes: {notes!r}") from e
        # the page said what happened: the failover, then the resume at the new leader
        page.wait_for_selector("#cluster-notes li.resumed[data-shard=\"1\"]", timeout=15_000)
        notes = page.inner_text("#cluster-notes")
        assert "shard 1: n1a" in notes and "→ n1b" in notes, notes
        _shot(page, "cluster-live")
        # every event id shown, once; and each shard's, from the first shown on, all it kept
        ids = [tuple(map(int, x.split(":"))) for x in seen]
        assert len(ids) == len(set(ids)), sorted(x for x in ids if ids.count(x) > 1)
        first = {}
        for s, q in ids:
            first[s] = min(first.get(s, q), q)
        assert set(first) == {0, 1, 2}, first
        kept = trio.run(_events_kept, c, {s: q - 1 for s, q in first.items()})
        shown = {s: sorted(q for t, q in ids if t == s) for s in first}
        assert shown == {s: kept[s] for s in first}, (shown, kept)
        # the health page: shard 1 led by n1b at a newer epoch, the failover listed
        page.goto(c.console("n0b") + "/cluster")
        now = _health(page)
        assert now[1][0] == "n1b" and now[1][1] > health_before[1], (now, health_before)
        assert now[0][0] == "n0a" and now[2][0] == "n2a"
        fo = page.locator('table.failovers tr[data-shard="1"]')
        assert fo.count() >= 1 and "n1b" in fo.first.inner_text()
        _shot(page, "cluster")
        assert not errors, errors
    finally:
        ctx.close()


def test_a_stream_resumes_after_its_last_event_id_exactly(cluster):
    """The SSE ``id`` of an ``events`` message is the vector cursor; a reconnection
    with it as ``Last-Event-ID`` gets exactly the events after it, per shard."""
    c = cluster

    async def main():
        got: list[dict] = []
        async with httpx.AsyncClient(base_url=c.console("n2a"), timeout=30) as http:
            async def read(headers, want):
                out, last_id = [], None
                async with http.stream("GET", "/stream?mode=events", headers=headers) as r:
                    assert r.status_code == 200
                    event = None
                    ready = False
                    async for line in r.aiter_lines():
                        if line.startswith("id: "):
                            last_id = line[4:]
                        elif line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: "):
                            if event == "ready":
                                ready = True
                                got.append({"ready": True})
                            elif event == "events":
                                out += msgspec.json.decode(line[6:])["events"]
                                if len(out) >= want:
                                    return out, last_id
                    assert ready
                return out, last_id

            async with trio.open_nursery() as n:
                res = {}

                async def first():
                    res["a"] = await read({}, 6)

                n.start_soon(first)
                await wait_until(lambda: _true(got), what="ready")
                await _submit(c, 2, "sse-1")  # 6 tasks (3 shards)
            evs, last_id = res["a"]
            assert last_id and re.fullmatch(r"\d+:\d+(,\d+:\d+)*", last_id)
            # more, while no stream is open; then resume after the last id seen
            more = await _submit(c, 1, "sse-2")
            vec = dict(tuple(map(int, x.split(":"))) for x in last_id.split(","))
            kept = await _events_kept(c, {s: vec.get(s, 0) for s in range(3)})
            want = sum(len(v) for v in kept.values())
            again, _ = await read({"last-event-id": last_id}, want)
            assert sorted((e["shard"], e["seq"]) for e in again) == sorted((s, q) for s, v in kept.items() for q in v)
            assert all(any(t == e["id"] for e in again) for t in more)
            r = await http.get("/stream?mode=events", headers={"last-event-id": "7:1"})
            assert r.status_code == 400  # a cursor of another cluster

    trio.run(main)


def test_the_host_check_and_the_open_mode_rule_are_the_single_nodes(cluster, etcd):
    """A Host the console was not named by is refused, as on one node; a cluster with
    no key in etcd gets no console on a non-loopback address without --insecure."""
    from rallypoint.cluster.etcd import EtcdAccess
    from rallypoint.console.clusterview import serve_cluster_console
    from rallypoint.errors import ValidationError

    r = httpx.get(cluster.console("n0b") + "/runs", headers={"host": "evil.example"})
    assert r.status_code in (400, 421), r.status_code
    assert httpx.get(cluster.console("n0b") + "/runs").status_code == 200

    class Member:  # what the console reads of a node: its etcd, its cluster's name
        config = type("C", (), {"cluster": f"nokeys-{uuid.uuid4().hex[:8]}", "shard": 0, "node": "x"})()
        slotmap = None
        leaders: dict = {}

        def make_etcd(self):
            return EtcdAccess(tuple(etcd.endpoints)).client()

    async def main():
        refused = []
        try:
            with trio.move_on_after(30):  # (served instead: no refusal)
                async with trio.open_nursery() as n:
                    await n.start(functools.partial(serve_cluster_console, Member(), "0.0.0.0", 0, loopback=False))
                    n.cancel_scope.cancel()
        except* ValidationError as eg:
            while isinstance(eg, BaseExceptionGroup):
                eg = eg.exceptions[0]
            refused.append(eg)
        assert refused and "without API keys" in refused[0].message, refused
        async with trio.open_nursery() as n:  # --insecure: served
            _app, urls = await n.start(functools.partial(serve_cluster_console, Member(), "127.0.0.1", 0,
                                                         loopback=False, insecure=True))
            assert urls
            n.cancel_scope.cancel()

    trio.run(main)


async def _true(got) -> bool:
    return bool(got)


def test_sign_in_needs_a_key_of_the_clusters_and_a_revoke_in_etcd_signs_out(chromium, cluster):
    """(Last: it ends the cluster's open mode.) Keys live in etcd; the console checks them
    there as a single node checks its own, and calls each shard under the login's key."""
    c = cluster
    etcd_url = "etcd://" + c.etcd.endpoints[0].removeprefix("http://")

    def keys(*args):
        r = subprocess.run([sys.executable, "-m", "rallypoint", "keys", *args, "--cluster", etcd_url,
                            "--cluster-name", c.name], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    viewer = keys("create", "--space", "default", "--permission", "coordination_read", "--name", "viewer",
                  "--secret-only", "--force")  # (a first key that is not admin: open mode ends)
    ctx, page, errors = _page(chromium)
    try:
        async def closed():  # open mode ended on the console: sign in
            async with httpx.AsyncClient() as http:
                return (await http.get(c.console("n0b") + "/runs")).status_code == 303

        trio.run(wait_until, closed)

        async def strangers_stream():  # no session: refused before its Last-Event-ID is read
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.get(c.console("n0b") + "/stream?mode=events", headers={"last-event-id": "0:0"})
                return r.status_code, r.text

        status, body = trio.run(strangers_stream)
        assert status == 401 and "event:" not in body, (status, body)
        page.goto(c.console("n0b") + "/runs")
        assert "/login" in page.url
        page.fill("input[name=key]", "rpk_not_a_key")
        page.click("main button")
        assert "Unknown or revoked API key." in page.inner_text("main")
        page.fill("input[name=key]", viewer)
        page.click("main button")
        page.wait_for_url(re.compile(r"/runs$"))
        assert all(page.locator(f'tr[data-run="{r}"]').count() == 1 for r in c.ids["roots"].values())
        page.goto(c.console("n0b") + "/cluster")
        assert "need an operator key" in page.inner_text("table.shards")  # a read key: no server-wide figures
        page.goto(c.console("n0b") + "/live")
        _live(page)
        listed = msgspec.json.decode(keys("list", "--json"))
        (vid,) = [k["id"] for k in listed if k.get("name") == "viewer"]
        keys("revoke", vid)
        page.wait_for_url(re.compile(r"/login"), timeout=15_000)  # the stream said signedOut
        errors.clear()
    finally:
        ctx.close()


def test_a_cluster_of_one_replicated_shard_gets_the_console_too(etcd, tmp_path):
    """No slot map (no ``cluster init --shards``): the console reads the one shard's
    leader, from its standby too, and its stream resumes per the shard's cursor."""
    name = f"one-{uuid.uuid4().hex[:10]}"
    port = free_ports(1)[0]
    nodes = [ClusterNode("a", str(tmp_path), etcd.endpoints[0], name, extra=["--sync-helper", "thread"]),
             ClusterNode("b", str(tmp_path), etcd.endpoints[0], name,
                         extra=["--sync-helper", "thread", "--console", f"127.0.0.1:{port}"])]
    base = f"http://127.0.0.1:{port}"

    async def main():
        nodes[0].start()
        await nodes[0].wait_ready()
        await nodes[0].wait_role("leader")
        nodes[1].start()
        await nodes[1].wait_ready()
        await nodes[1].wait_role("standby")
        async with rallypoint.connect("tcp://" + ",".join(n.address for n in nodes)) as rs:
            run = await rs.scopes.create(name="solo")
            jobs = await rs.mailboxes.ensure("jobs")
            task = await jobs.submit({"x": 1}, scope=run)
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            page = (await http.get("/runs")).text
            assert run.id in page and "shard 0 · a" in page
            assert task.id in (await http.get(f"/runs/{run.id}")).text
            assert "task.submitted" in (await http.get(f"/tasks/{task.id}")).text
            health = (await http.get("/cluster")).text
            assert 'data-shard="0" data-leader="a"' in health and "a, b" in health
            live = (await http.get("/live")).text
            assert task.id in live  # the recent events, from the shard's leader
            async with http.stream("GET", "/stream?mode=events", headers={"last-event-id": "0:0"}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and task.id in line:
                        break  # from the shard's first event on: its history, then live

    try:
        trio.run(main)
    finally:
        stop_all(nodes)
