"""Events over a sharded cluster (3 shards against a real etcd), through the SDK's router:
a watch or a list over the whole space reads every shard and merges (order per shard
exact; across shards by instant, then shard), its cursor is a vector, one position per
shard ("0:120,1:45,2:9"), and resume is exact per shard -- across a new connection and
across one shard's failover. Filters by type and run; errors name their shard
(CURSOR_EXPIRED); ``rallypoint watch`` and ``rallypoint top`` against the cluster.

(rallypoint/client/shardevents.py; docs/events.md "A cluster of several shards".)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trio

import rallypoint
from rallypoint.cluster.member import MemberConfig, ShardMember
from rallypoint.nodeconfig import RetentionOptions, StorageOptions
from rallypoint.errors import CursorExpiredError, ValidationError
from rallypoint.transport.server import Server

from test_cluster_shards import cluster_name, leader, shard_of, start_cluster, urls, wait_until  # noqa: F401

pytestmark = pytest.mark.timeout(300)


def newest(members) -> dict[int, int]:
    """Each shard's newest durable event seq in the default space (its leader's)."""
    out = {}
    for s, ms in members.items():
        coord = leader(ms).node.coordinator
        out[s] = coord.events.stream("default").last_seq
    return out


async def read_until(stream, done, timeout=60.0) -> list:
    """Events from ``stream`` until ``done(events)`` holds (a bounded wait)."""
    got = []
    with trio.fail_after(timeout):
        while not done(got):
            got.append(await stream.next())
    return got


def per_shard(events) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        out.setdefault(e.shard, []).append(e.seq)
    return out


def vector(positions: dict[int, int]) -> str:
    return ",".join(f"{s}:{positions[s]}" for s in sorted(positions))


async def runs_on_every_shard(rs, members, n=6):
    runs = [await rs.scopes.create(name=f"r{i}") for i in range(n)]
    assert {shard_of(members, r.id) for r in runs} == set(members)
    return runs


async def test_a_watch_over_the_space_merges_every_shard_and_resumes_exactly_per_shard(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n)
        async with rallypoint.connect(urls(members)) as rs:
            jobs = await rs.mailboxes.ensure("jobs")
            runs = await runs_on_every_shard(rs, members)
            tasks = [await jobs.submit({"i": i}, scope=r) for i, r in enumerate(runs)]
            last = newest(members)
            assert all(last[s] > 0 for s in members)

            # history: every shard's events, each shard's exactly once and in order, the
            # whole merged by (instant, shard, seq) while catching up
            def caught_up(evs, last=last):
                return all(per_shard(evs).get(s, [0])[-1] >= last[s] for s in last)

            async with rs.events.watch() as stream:
                history = await read_until(stream, caught_up)
                assert stream.cursor == vector(last)
            assert per_shard(history) == {s: list(range(1, last[s] + 1)) for s in last}
            keys = [(e.at, e.shard, e.seq) for e in history]
            assert keys == sorted(keys)
            created = {e.id: e.shard for e in history if e.type == "scope.created"}
            assert all(created[r.id] == shard_of(members, r.id) for r in runs)  # each event says its shard
            submitted = {e.id for e in history if e.type == "task.submitted"}
            assert {t.id for t in tasks} <= submitted

            # a stream read half-way, its client closed; a new client resumes from its cursor
            async with rs.events.watch() as stream:
                first = await read_until(stream, lambda evs: len(evs) >= len(history) // 2)
                half = stream.cursor
        more = []
        async with rallypoint.connect(urls(members)) as rs:
            jobs = rs.mailbox("jobs")
            more = [await jobs.submit({"more": i}, scope=r) for i, r in enumerate(runs)]
            last2 = newest(members)
            async with rs.events.watch(cursor=half) as stream:
                rest = await read_until(stream, lambda evs, last2=last2: all(
                    per_shard(first + evs).get(s, [0])[-1] >= last2[s] for s in last2))
            # exactly once per shard: what the first stream returned and what the second did
            assert per_shard(first + rest) == {s: list(range(1, last2[s] + 1)) for s in last2}
            assert {t.id for t in more} <= {e.id for e in rest if e.type == "task.submitted"}

            # filters: by type (every shard), by run (that run's shard only)
            async with rs.events.watch(types="task.submitted") as stream:
                subs = await read_until(stream, lambda evs: len(evs) >= len(tasks) + len(more))
            assert {e.type for e in subs} == {"task.submitted"}
            assert {e.id for e in subs} == {t.id for t in tasks + more}
            assert {e.shard for e in subs} == set(members)
            target = runs[1]
            home = shard_of(members, target.id)
            async with rs.events.watch(scope=target) as stream:
                mine = await read_until(stream, lambda evs: sum(e.type == "task.submitted" for e in evs) >= 2)
                assert stream.cursor.startswith(f"{home}:") and "," not in stream.cursor
            assert {e.run for e in mine} == {target.id} and {e.shard for e in mine} == {home}

            # live: one shard's leader hands over mid-watch; that shard's part resumes from
            # its own position (no event twice, none missed), the others go on
            async with rs.events.watch(start="now") as stream:
                start = {int(s): int(q) for s, q in (x.split(":") for x in stream.cursor.split(","))}
                victim = shard_of(members, runs[0].id)
                old = leader(members[victim])
                old.stop()
                await wait_until(lambda: any(m.role == "leader" and m is not old for m in members[victim]),
                                 what=lambda: [(m.config.node, m.role) for m in members[victim]])
                after = [await jobs.submit({"after": i}, scope=r) for i, r in enumerate(runs)]
                ids = {t.id for t in after}
                live = await read_until(stream, lambda evs: ids <= {e.id for e in evs if e.type == "task.submitted"})
                assert stream.resumed >= 1  # the victim's subscription was opened again
            for s, seqs in per_shard(live).items():
                assert seqs == list(range(start[s] + 1, start[s] + 1 + len(seqs))), (s, start[s], seqs)
        n.cancel_scope.cancel()


def member_with(etcd, tmp_path, name, cluster, shard, **storage):
    cfg = MemberConfig(etcd=etcd.endpoints, node=name, data_dir=str(tmp_path / name), cluster=cluster, shard=shard,
                       client=("127.0.0.1", 0), replication=("127.0.0.1", 0), isr_timeout_s=0.5,
                       storage=StorageOptions(**{"sync_helper": "thread", **storage}))
    return ShardMember(cfg, make_server=lambda d: Server(d))


async def test_a_list_over_the_space_pages_by_a_vector_cursor_and_errors_name_their_shard(
        etcd, tmp_path, cluster_name, monkeypatch):
    import test_cluster_shards as tcs

    # one node per shard, keeping 40 events each (retention: CURSOR_EXPIRED below)
    monkeypatch.setattr(tcs, "member", lambda e, tp, name, c, s: member_with(e, tp, name, c, s,
                                                                             retention=RetentionOptions(retain_events=40)))
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n, nodes=1)
        async with rallypoint.connect(urls(members)) as rs:
            jobs = await rs.mailboxes.ensure("jobs")
            runs = await runs_on_every_shard(rs, members)
            tasks = [await jobs.submit({"i": i}, scope=r) for i, r in enumerate(runs)]
            last = newest(members)

            # pages of 4 over every shard: each event once, per shard in order, each page
            # merged by (instant, shard), the cursor a vector
            cursor, got, pages = None, [], 0
            while True:
                page = await rs.events.list(cursor=cursor, limit=4)
                assert len(page.events) <= 4 and isinstance(page.next_cursor, str)
                keys = [(e.at, e.shard, e.seq) for e in page.events]
                assert keys == sorted(keys)
                assert not (got and keys) or (got[-1].at, got[-1].shard) <= keys[0][:2]  # pages follow in order
                got += page.events
                pages += 1
                if page.next_cursor == cursor:
                    break
                cursor = page.next_cursor
            assert page.newest == vector(last) == cursor
            assert per_shard(got) == {s: list(range(1, last[s] + 1)) for s in last}
            assert pages >= sum(last.values()) // 4

            # filters: by type over every shard; by run on its shard alone
            page = await rs.events.list(types=["task.submitted"], limit=100)
            assert {e.id for e in page.events} == {t.id for t in tasks}
            target = runs[2]
            page = await rs.events.list(scope=target, limit=100)
            assert {e.run for e in page.events} == {target.id}
            assert page.next_cursor.split(":")[0] == str(shard_of(members, target.id))

            # a cursor of one shard's seq, or naming a shard the cluster lacks: refused
            with pytest.raises(ValidationError):
                await rs.events.list(cursor=3)
            with pytest.raises(ValidationError) as e:
                rs.events.watch(cursor="0:1,7:1")
            assert e.value.details["shard"] == 7

            # one shard's events pass its retention: CURSOR_EXPIRED says which shard
            victim = shard_of(members, runs[0].id)
            old = vector({s: 1 for s in members})
            for i in range(60):  # (trimmed past 40 + 40/16 kept)
                await jobs.submit({"fill": i}, scope=runs[0])
            coord = leader(members[victim]).node.coordinator
            assert coord.events.stream("default").first_seq > 2
            with pytest.raises(CursorExpiredError) as e:
                await rs.events.list(cursor=old)
            assert e.value.details["shard"] == victim and f"shard {victim}" in e.value.message
            with pytest.raises(CursorExpiredError) as e:
                async with rs.events.watch(cursor=old):
                    pass
            assert e.value.details["shard"] == victim
            # the others' positions are still good: drop the victim's to restart only it
            rest = ",".join(x for x in old.split(",") if not x.startswith(f"{victim}:"))
            page = await rs.events.list(cursor=rest, limit=10_000)
            assert min(e.seq for e in page.events if e.shard == victim) == coord.events.stream("default").first_seq
        n.cancel_scope.cancel()


async def test_the_cli_watch_and_top_work_against_a_sharded_cluster(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n, nodes=1)
        url = urls(members)
        async with rallypoint.connect(url) as rs:
            jobs = await rs.mailboxes.ensure("jobs")
            runs = await runs_on_every_shard(rs, members)
            for i, r in enumerate(runs):
                await jobs.submit({"i": i}, scope=r)
        last = newest(members)
        total = sum(last.values())

        def cli(*args):
            return subprocess.run([sys.executable, "-m", "rallypoint", *args], capture_output=True, text=True,
                                  timeout=120)

        half = total // 2
        out = await trio.to_thread.run_sync(lambda: cli("watch", "--connect", url, "--from-start", "--json",
                                                        "--count", str(half)))
        assert out.returncode == 0, out.stderr
        lines = [json.loads(x) for x in out.stdout.splitlines()]
        assert len(lines) == half and {x["shard"] for x in lines} <= set(members)
        cursor = lines[-1]["cursor"]
        assert f"--cursor {cursor}" in out.stderr
        out = await trio.to_thread.run_sync(lambda: cli("watch", "--connect", url, "--cursor", cursor, "--json",
                                                        "--count", str(total - half)))
        assert out.returncode == 0, out.stderr
        lines += [json.loads(x) for x in out.stdout.splitlines()]
        seqs: dict[int, list[int]] = {}
        for x in lines:
            seqs.setdefault(x["shard"], []).append(x["seq"])
        assert seqs == {s: list(range(1, last[s] + 1)) for s in last}  # resumed exactly per shard

        out = await trio.to_thread.run_sync(lambda: cli("watch", "--connect", url, "--cursor", "12"))
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr.startswith("rallypoint: VALIDATION_FAILED: cursor 12 is one shard's position")
        # (an exception leaves the client's block as itself, as on a single node)
        with pytest.raises(KeyError):
            async with rallypoint.connect(url):
                raise KeyError("mine")

        out = await trio.to_thread.run_sync(lambda: cli("top", "--connect", url, "--once"))
        assert out.returncode == 0, out.stderr
        assert f"runs: {len(runs)} active" in out.stdout  # every shard's runs
        assert f"QUEUED {len(runs)}" in out.stdout  # every shard's tasks
        assert f"events {total} " in out.stdout
        n.cancel_scope.cancel()
