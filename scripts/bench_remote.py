"""What crossing shards costs: a run of one shard using its space's home shard.

Starts a one-member etcd (Debian's ``etcd``; tests/_etcd.py) and a sharded cluster of
two shards, one node each, in this process (fsync journals, the sync helper in a
thread), then measures through the SDK's router, sequentially:

- ``claim.acquire`` (then release) by a run of the home shard, by a run of the other
  shard the first time (the home shard links it: ``run.link`` there, a remote run
  here) and again (linked);
- a run's end reaching the home shard: a run of the other shard waits on a claim the
  home shard holds for another run; the time from its cancellation (acknowledged on
  its shard) to the waiter's answer (SCOPE_CANCELLED, through the outbox);
- admission: submit + receive + complete of a task of the other shard with no
  requirements, and with ``{"pools": {"gpu": 1}}`` (a reservation on the home shard
  first, the delivery's start and end told back through the outbox).

Prints p50 / p90 / max in ms per measure (``--json FILE`` writes them too). Everything
shares this process and the machine's cores: read the figures as the relative cost of
the cross-shard steps, not as capacity.

    python scripts/bench_remote.py [--n 200] [--json out.json]
                                   [--secure-etcd | --cluster URL [--etcd-ca F ...]]

``--secure-etcd``: the etcd runs with TLS, client certificates and authentication;
``--cluster`` and the ``--etcd-*`` flags of ``rallypoint serve``: an etcd of yours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from _etcd import BenchEtcd, add_bench_etcd_arguments  # noqa: E402

import rallypoint  # noqa: E402
from rallypoint.actors.sharding import home_slot  # noqa: E402
from rallypoint.cluster.member import MemberConfig, ShardMember  # noqa: E402
from rallypoint.nodeconfig import StorageOptions  # noqa: E402
from rallypoint.cluster.shardmap import init_cluster  # noqa: E402
from rallypoint.errors import ScopeCancelledError  # noqa: E402
from rallypoint.ids import slot_of  # noqa: E402
from rallypoint.transport.server import Server  # noqa: E402


def figures(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": round(statistics.median(xs) * 1000, 3),
            "p90_ms": round(xs[int(len(xs) * 0.9) - 1] * 1000, 3), "max_ms": round(xs[-1] * 1000, 3)}


async def main(args) -> None:
    root = tempfile.mkdtemp(prefix="bench-remote-")
    try:
        with BenchEtcd(args, root) as etcd:
            print(f"etcd: {etcd.describe()}")
            await run(etcd.access, root, args.n, args.json)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def run(access, root: str, n: int, out: str | None) -> None:
    cluster = f"b-{uuid.uuid4().hex[:8]}"
    slots = next(x for x in range(2, 200) if home_slot("default", x) % 2 == 0)  # home shard 0
    async with access.client() as client:
        await init_cluster(client, cluster, slots=slots, shards=2)
    results: dict[str, dict] = {}
    async with trio.open_nursery() as nursery:
        members = []
        for s in (0, 1):
            cfg = MemberConfig(etcd=list(access.endpoints), etcd_access=access, node=f"n{s}", data_dir=os.path.join(root, f"n{s}"),
                               cluster=cluster, shard=s, client=("127.0.0.1", 0), replication=("127.0.0.1", 0),
                               storage=StorageOptions(sync_helper="thread"))
            m = ShardMember(cfg, make_server=lambda d: Server(d))
            await nursery.start(m.run)
            members.append(m)
        with trio.fail_after(60):
            while not all(m.role == "leader" and len(m.leaders) == 2 for m in members):
                await trio.sleep(0.01)
        owners = members[0].slotmap.owners
        urls = "tcp://" + ",".join(f"127.0.0.1:{m.client_port}" for m in members)
        async with rallypoint.connect(urls) as rs:
            async def run_on(shard):
                while True:
                    r = await rs.scopes.create()
                    if owners[slot_of(r.id)] == shard:
                        return r

            async def acquire(run, key):
                t0 = time.perf_counter()
                lease = await run.claims.acquire(key, lease_seconds=30)
                dt = time.perf_counter() - t0
                await lease.release()
                return dt

            local = await run_on(0)
            results["claim_local_run"] = figures([await acquire(local, f"l{i}") for i in range(n)])
            firsts, agains = [], []
            for i in range(n):
                r = await run_on(1)
                firsts.append(await acquire(r, f"f{i}"))
                agains.append(await acquire(r, f"a{i}"))
            results["claim_remote_run_first_use"] = figures(firsts)
            results["claim_remote_run_linked"] = figures(agains)

            ends = []
            blocker = await run_on(0)
            for i in range(max(10, n // 4)):
                key = f"e{i}"
                held = await blocker.claims.acquire(key, lease_seconds=60)
                r = await run_on(1)
                answered = trio.Event()
                stamp = {}

                async def wait(r=r, key=key, answered=answered, stamp=stamp):
                    try:
                        await r.claims.acquire(key, lease_seconds=30, wait=60)
                    except ScopeCancelledError:
                        stamp["at"] = time.perf_counter()
                    answered.set()

                nursery.start_soon(wait)
                home = members[0].node.coordinator
                while not (home.claims.by_key.get(("default", key))
                           and home.claims.line(home.claims.get("default", key))):
                    await trio.sleep(0.001)
                await r.cancel()
                t0 = time.perf_counter()
                await answered.wait()
                ends.append(stamp["at"] - t0)
                await held.release()
            results["run_end_to_home_waiter"] = figures(ends)

            await rs.pools.ensure("gpu", 1)
            jobs = await rs.mailboxes.ensure("jobs")
            worker_run = await run_on(1)

            async def lifecycle(reqs):
                t0 = time.perf_counter()
                await jobs.submit({}, scope=worker_run, requirements=reqs)
                d = await jobs.receive(scope=worker_run, lease_seconds=30, wait=20)
                await d.complete({})
                return time.perf_counter() - t0

            results["task_lifecycle_no_requirements"] = figures([await lifecycle(None) for _ in range(n)])
            results["task_lifecycle_remote_pool_unit"] = figures(
                [await lifecycle({"pools": {"gpu": 1}}) for _ in range(n)])
        nursery.cancel_scope.cancel()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    for k, v in results.items():
        print(f"{k:36s} n={v['n']:4d}  p50 {v['p50_ms']:8.3f} ms  p90 {v['p90_ms']:8.3f} ms  max {v['max_ms']:8.3f} ms")
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="iterations per measure (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    add_bench_etcd_arguments(ap)
    trio.run(main, ap.parse_args())
