#!/usr/bin/env python
"""Failover of a replicated shard, and what its standby costs (prints figures, asserts
nothing; issue 29, SCALE-OUT.md §6).

    python scripts/bench_failover.py [--trials 20] [--json FILE] [--cost-duration 10]
                                     [--cost-rounds 2] [--acks 400] [--skip-cost]
                                     [--secure-etcd | --cluster URL [--etcd-ca F ...]]
                                     [--peer-tls] [--impostor] [--peer-tls-cost]
                                     [--handover N]

Everything runs on this machine: a one-member etcd (Debian's ``etcd-server``, as the
tests start it: tests/_etcd.py) and ``rallypoint serve --cluster`` processes
(tests/_cluster.py), each with its own data dir, durability fsync, lease TTL 2 s.
``--peer-tls``: the nodes' replication links run mutual TLS (``cluster certs`` made
for the run); ``--impostor``: an attacker without the cluster secret loops on both
replication ports during the trials (``impostor_*`` figures: it must receive nothing);
``--peer-tls-cost``: a plaintext-link shard and a peer-TLS shard measured in turn, side
by side (``ack_p50_ms_plaintext`` / ``..._peer_tls``...).
``--secure-etcd`` starts that etcd with TLS, client certificates and authentication
(the nodes then run ``serve --cluster https://rallypoint@... --etcd-ca ...``);
``--cluster URL`` and the ``--etcd-*`` flags of ``rallypoint serve`` use an etcd of yours.

* **failover**: two nodes; one client that follows the leader (both addresses) submits
  tasks with idempotency keys back to back and logs every acknowledged one. Each trial
  kill -9s the leader and times from the kill to the first write acknowledged by the
  new leader (a reply carrying its epoch); then the killed node is started again, rejoins
  as a standby and catches up into the in-sync set before the next trial. At the end,
  every acknowledged task is looked up on the node that leads: ``acked_lost`` counts
  those missing.
* **hand-over** (``--handover N``): N SIGTERMs of the leader (it drains, lets its
  standby catch up, resigns) under a producer and a ``consume()`` worker; from each
  SIGTERM to the producer's first acknowledgement and the worker's first delivery from
  the new leader (p50, max).
* **cost**: the same shard with its standby **off** (the leader alone in the in-sync
  set) and **on** (a standby in sync), alternately ``--cost-rounds`` times each:
  ``rallypoint bench --scenario lifecycle`` (closed loop, 2 producers, 2 workers) for
  lifecycles/s, and ``--acks`` single submits one after another for the durable-ack
  latency (a submit is answered once the record is fsynced on the leader and, with the
  standby on, on the standby too). Medians over the rounds. A single node without
  ``--cluster`` is measured once for reference.

Targets (issue 29): failover p50 <= 3 s, max <= 5 s; 0 acknowledged writes lost;
standby on >= 0.6x the lifecycles/s of off, ack p50 <= off + 1.5 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import rallypoint  # noqa: E402
from _cluster import ClusterNode  # noqa: E402
from _etcd import BenchEtcd, add_bench_etcd_arguments  # noqa: E402
from rallypoint.cluster.leader import ShardElection  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def wait_isr(etcd: BenchEtcd, cluster: str, isr: list[str], timeout: float = 120.0) -> None:
    async with etcd.access.client() as client:
        election = ShardElection(client, cluster, 0)
        with trio.fail_after(timeout):
            while True:
                rec = await election.read_replicas()
                if rec is not None and sorted(rec.replicas.isr) == sorted(isr):
                    return
                await trio.sleep(0.02)


# ------------------------------------------------------------------------------ failover
#: the certificates of --peer-tls (made once per run: rallypoint cluster certs)
PKI: dict[str, str] = {}


def make_pki(root: str) -> None:
    from rallypoint.cluster.pki import write_cluster_pki

    d = os.path.join(root, "pki")
    write_cluster_pki(d, ["a", "b", "c1", "c2", "pa", "pb", "ta", "tb"])
    PKI["dir"] = d


def peer_args(name: str) -> list[str]:
    d = PKI["dir"]
    return ["--peer-cert", os.path.join(d, f"{name}.pem"), "--peer-key", os.path.join(d, f"{name}.key"),
            "--peer-ca", os.path.join(d, "ca.pem")]


def node(name: str, root: str, etcd: BenchEtcd, cluster: str, *, tls: bool | None = None) -> ClusterNode:
    """A node of the benchmark; with peer TLS when ``tls`` (None: as --peer-tls says)."""
    if tls is None:
        tls = PKI.get("use") == "yes"
    extra = list(etcd.node_args[1:]) + (peer_args(name) if tls else [])
    return ClusterNode(name, root, etcd.node_args[0], cluster, extra=extra, env=etcd.node_env)


async def leader_and_standby(etcd: BenchEtcd, root: str, cluster: str) -> tuple[ClusterNode, ClusterNode]:
    """Nodes ``a`` (started first: it leads) and ``b`` (its standby), once ``b`` is in
    the in-sync set."""
    a = node("a", root, etcd, cluster)
    b = node("b", root, etcd, cluster)
    a.start()
    await a.wait_ready()
    await a.wait_role("leader")
    b.start()
    await b.wait_ready()
    await b.wait_role("standby")
    await wait_isr(etcd, cluster, ["a", "b"])
    return a, b


async def rejoin(etcd: BenchEtcd, cluster: str, n: ClusterNode) -> None:
    """Start ``n`` (the leader a trial stopped) again, until it is back in sync."""
    n.start()
    await n.wait_ready()
    await n.wait_role("standby")
    await wait_isr(etcd, cluster, ["a", "b"])


async def failover(etcd: BenchEtcd, root: str, trials: int, impostor: bool = False) -> dict:
    from rallypoint.testing.impostor import Impostor

    cluster = f"bench-{uuid.uuid4().hex[:8]}"
    a, b = await leader_and_standby(etcd, root, cluster)
    nodes = [a, b]
    acked: dict[str, str] = {}
    acks: list[tuple[float, int]] = []  # (monotonic s, epoch of the leader that acknowledged)
    times: list[float] = []
    stop = trio.Event()
    try:
        async with rallypoint.connect(f"tcp://{a.address},{b.address}",
                                      reconnect=rallypoint.Reconnect(timeout=60)) as rs:
            jobs = await rs.mailboxes.ensure("bench")
            run = await rs.scopes.create(name="failover")

            async def writer() -> None:
                n = 0
                while not stop.is_set():
                    key = f"w{n}"
                    try:
                        t = await jobs.submit(n, key=key, scope=run)
                    except rallypoint.RallypointError:
                        await trio.sleep(0.01)
                        continue
                    acked[key] = t.id
                    acks.append((time.monotonic(), rs._transport.server_info.epoch))
                    n += 1

            # an attacker without the cluster secret on both replication ports, naming the
            # other node, all along (issue 40)
            impostors = [Impostor("127.0.0.1", x.replication_port, cluster=cluster, shard=0, node=y.name)
                         for x, y in ((a, b), (b, a))] if impostor else []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                for imp in impostors:
                    nursery.start_soon(imp.run)
                leader, standby = a, b
                for i in range(trials):
                    n0 = len(acks)
                    with trio.fail_after(60):
                        while len(acks) < n0 + 20:
                            await trio.sleep(0.01)
                    old_epoch = acks[-1][1]
                    killed_at = time.monotonic()
                    leader.kill()
                    with trio.fail_after(60):
                        while not any(e > old_epoch for _t, e in acks[n0:]):
                            await trio.sleep(0.005)
                    first = min(t for t, e in acks[n0:] if e > old_epoch)
                    times.append(first - killed_at)
                    print(f"trial {i + 1}/{trials}: {leader.name} killed, first write acknowledged by "
                          f"{standby.name} after {first - killed_at:.3f} s", file=sys.stderr, flush=True)
                    await rejoin(etcd, cluster, leader)
                    leader, standby = standby, leader
                stop.set()
                nursery.cancel_scope.cancel()  # (the impostors loop until cancelled)
            await run.cancel()
        # every acknowledged write, looked up on the node that leads now
        lost = 0
        async with rallypoint.connect(leader.url, reconnect=False) as direct:
            for key, tid in acked.items():
                try:
                    info = await direct.task(tid).status()
                    if info.key != key:
                        lost += 1
                except rallypoint.NotFoundError:
                    lost += 1
    finally:
        for n in nodes:
            n.kill()
    extra = {}
    if impostor:
        extra = {"impostor_connections": sum(i.connections for i in impostors),
                 "impostor_challenged": sum(i.challenges for i in impostors),
                 "impostor_frames_received": sum(i.frames for i in impostors),
                 "impostor_welcomes": sum(i.welcomes for i in impostors)}
    return {**extra, "failover_trials": trials, "failover_s": [round(x, 3) for x in times],
            "failover_p50_s": round(statistics.median(times), 3), "failover_max_s": round(max(times), 3),
            "failover_min_s": round(min(times), 3), "acked_ops": len(acked), "acked_lost": lost}


# ------------------------------------------------------------------------------ hand-over
async def handover(etcd: BenchEtcd, root: str, trials: int) -> dict:
    """SIGTERM of the leader (a graceful hand-over) under a producer and a ``consume()``
    worker, each on its own connection given both addresses (issue 42 item 8). Per
    trial: from the SIGTERM to the producer's first submit acknowledged by the new
    leader (``handover_producer_s``) and to the worker's first delivery from it
    (``handover_worker_s``: the handler called on a connection that names the new
    epoch); then the stopped node is started again and catches up."""
    from rallypoint.client.consume import consume

    cluster = f"ho-{uuid.uuid4().hex[:8]}"
    a, b = await leader_and_standby(etcd, root, cluster)
    nodes = [a, b]
    acks: list[tuple[float, int]] = []
    handled: list[tuple[float, int]] = []
    producer_s: list[float] = []
    worker_s: list[float] = []
    addresses = f"tcp://{a.address},{b.address}"
    try:
        async with rallypoint.connect(addresses, reconnect=rallypoint.Reconnect(timeout=60)) as rs, \
                rallypoint.connect(addresses, reconnect=rallypoint.Reconnect(timeout=60)) as ws:
            jobs = await rs.mailboxes.ensure("handover")
            run = await rs.scopes.create(name="handover")

            async def producer() -> None:
                n = 0
                while True:
                    try:
                        await jobs.submit(n, key=f"h{n}", scope=run)
                    except rallypoint.RallypointError:
                        await trio.sleep(0.01)
                        continue
                    acks.append((time.monotonic(), rs._transport.server_info.epoch))
                    n += 1
                    if n % 4 == 0:
                        await trio.sleep(0.005)  # ~ a few hundred tasks/s: the worker keeps up

            async def handler(delivery) -> int:
                handled.append((time.monotonic(), ws._transport.server_info.epoch))
                return 0

            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer)
                nursery.start_soon(lambda: consume(ws, "handover", run.id, handler, concurrency=4,
                                                   lease_seconds=10, wait=5, handle_signals=False))
                leader, standby = a, b
                for i in range(trials):
                    n0, h0 = len(acks), len(handled)
                    with trio.fail_after(60):
                        while len(acks) < n0 + 20 or len(handled) < h0 + 20:
                            await trio.sleep(0.01)
                    old_epoch = acks[-1][1]
                    at = time.monotonic()
                    rc = await leader.terminate(timeout=60)
                    with trio.fail_after(60):
                        while not (any(e > old_epoch for _t, e in acks[n0:])
                                   and any(e > old_epoch for _t, e in handled[h0:])):
                            await trio.sleep(0.005)
                    p_s = min(t for t, e in acks[n0:] if e > old_epoch) - at
                    w_s = min(t for t, e in handled[h0:] if e > old_epoch) - at
                    producer_s.append(p_s)
                    worker_s.append(w_s)
                    print(f"hand-over {i + 1}/{trials}: {leader.name} SIGTERM (exit {rc}); producer "
                          f"{p_s:.3f} s, worker {w_s:.3f} s", file=sys.stderr, flush=True)
                    await rejoin(etcd, cluster, leader)
                    leader, standby = standby, leader
                nursery.cancel_scope.cancel()
    finally:
        for n in nodes:
            n.kill()
    return {"handover_trials": trials, "handover_producer_s": [round(x, 3) for x in producer_s],
            "handover_worker_s": [round(x, 3) for x in worker_s],
            "handover_producer_p50_s": round(statistics.median(producer_s), 3),
            "handover_producer_max_s": round(max(producer_s), 3),
            "handover_worker_p50_s": round(statistics.median(worker_s), 3),
            "handover_worker_max_s": round(max(worker_s), 3)}


# ------------------------------------------------------------------------------ cost
def lifecycle_bench(url: str, duration: float) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, "-m", "rallypoint", "bench", "--scenario", "lifecycle", "--connect", url,
               "--duration", str(duration), "--warmup", "2", "--producers", "2", "--workers", "2", "--json", out]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if not os.path.exists(out):
            raise RuntimeError(f"rallypoint bench failed: {p.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["throughput"]["lifecycles_per_s"]


async def ack_latencies(url: str, n: int) -> list[float]:
    """``n`` keyed single submits one after another; each one's round trip, ms."""
    out = []
    async with rallypoint.connect(url, reconnect=False) as rs:
        jobs = await rs.mailboxes.ensure("acks")
        run = await rs.scopes.create(name="acks")
        for i in range(n):
            t0 = time.perf_counter()
            await jobs.submit(i, key=f"a{i}", scope=run)
            out.append((time.perf_counter() - t0) * 1000)
        await run.cancel()
    return out


async def measure(url: str, duration: float, acks: int) -> dict:
    lat = await ack_latencies(url, acks)
    rate = await trio.to_thread.run_sync(lifecycle_bench, url, duration)
    return {"lifecycles_per_s": rate, "ack_p50_ms": round(statistics.median(lat), 3),
            "ack_p99_ms": round(pct(lat, 0.99), 3)}


async def cost(etcd: BenchEtcd, root: str, rounds: int, duration: float, acks: int) -> dict:
    cluster = f"cost-{uuid.uuid4().hex[:8]}"
    a = node("c1", root, etcd, cluster)
    b = node("c2", root, etcd, cluster)
    on: list[dict] = []
    off: list[dict] = []
    try:
        a.start()
        await a.wait_ready()
        await a.wait_role("leader")
        for r in range(rounds):
            # off: the leader alone in the in-sync set
            if b.running():
                b.kill()
                await wait_isr(etcd, cluster, ["c1"])
            off.append(await measure(a.url, duration, acks))
            print(f"cost round {r + 1}: standby off {off[-1]}", file=sys.stderr, flush=True)
            # on: the standby in sync
            b.start()
            await b.wait_ready()
            await wait_isr(etcd, cluster, ["c1", "c2"])
            on.append(await measure(a.url, duration, acks))
            print(f"cost round {r + 1}: standby on  {on[-1]}", file=sys.stderr, flush=True)
    finally:
        a.kill()
        b.kill()
    # for reference: one node without --cluster
    from rallypoint.loadtest.runner import SpawnedDaemon

    single = SpawnedDaemon("fsync")
    url = await trio.to_thread.run_sync(single.start)
    try:
        ref = await measure(url, duration, acks)
    finally:
        await trio.to_thread.run_sync(single.stop)

    def med(xs: list[dict], k: str) -> float:
        return round(statistics.median(x[k] for x in xs), 3 if k.endswith("_ms") else 1)

    res = {
        "lifecycles_per_s_standby_off": med(off, "lifecycles_per_s"),
        "lifecycles_per_s_standby_on": med(on, "lifecycles_per_s"),
        "ack_p50_ms_standby_off": med(off, "ack_p50_ms"),
        "ack_p50_ms_standby_on": med(on, "ack_p50_ms"),
        "ack_p99_ms_standby_off": med(off, "ack_p99_ms"),
        "ack_p99_ms_standby_on": med(on, "ack_p99_ms"),
        "lifecycles_per_s_single_node": ref["lifecycles_per_s"],
        "ack_p50_ms_single_node": ref["ack_p50_ms"],
        "cost_rounds": {"off": off, "on": on},
    }
    res["throughput_ratio_on_off"] = round(res["lifecycles_per_s_standby_on"] / res["lifecycles_per_s_standby_off"], 3)
    res["ack_p50_added_ms"] = round(res["ack_p50_ms_standby_on"] - res["ack_p50_ms_standby_off"], 3)
    return res


async def peer_tls_cost(etcd: BenchEtcd, root: str, rounds: int, duration: float, acks: int) -> dict:
    """Two shards of two nodes, both standbys in sync, side by side in this run: one with
    a plaintext replication link, one with peer TLS; measured in turn ``rounds`` times
    (ack latency p50/p99 and lifecycles/s, as in :func:`cost`)."""
    pairs = {}
    for label, tls in (("plaintext", False), ("peer_tls", True)):
        cluster = f"tls-{label}-{uuid.uuid4().hex[:6]}"
        x = node(("t" if tls else "p") + "a", root, etcd, cluster, tls=tls)
        y = node(("t" if tls else "p") + "b", root, etcd, cluster, tls=tls)
        pairs[label] = (cluster, x, y)
    got: dict[str, list[dict]] = {"plaintext": [], "peer_tls": []}
    try:
        for label, (cluster, x, y) in pairs.items():
            x.start()
            await x.wait_ready()
            await x.wait_role("leader")
            y.start()
            await y.wait_ready()
            await wait_isr(etcd, cluster, [x.name, y.name])
        for r in range(rounds):
            for label, (_c, x, _y) in pairs.items():
                got[label].append(await measure(x.url, duration, acks))
                print(f"peer TLS round {r + 1}: {label} {got[label][-1]}", file=sys.stderr, flush=True)
    finally:
        for _c, x, y in pairs.values():
            x.kill()
            y.kill()

    def med(xs: list[dict], k: str) -> float:
        return round(statistics.median(v[k] for v in xs), 3 if k.endswith("_ms") else 1)

    out = {}
    for label in got:
        for k in ("ack_p50_ms", "ack_p99_ms", "lifecycles_per_s"):
            out[f"{k}_{label}"] = med(got[label], k)
    out["peer_tls_ack_p50_added_ms"] = round(out["ack_p50_ms_peer_tls"] - out["ack_p50_ms_plaintext"], 3)
    out["peer_tls_ack_p99_added_ms"] = round(out["ack_p99_ms_peer_tls"] - out["ack_p99_ms_plaintext"], 3)
    out["peer_tls_rounds"] = got
    return out


async def main(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="rallypoint-failover-") as root:
        for sub in ("etcd", "failover", "cost"):
            os.makedirs(os.path.join(root, sub))
        with BenchEtcd(args, root) as etcd:
            out: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": os.getloadavg(),
                         "cpu_count": os.cpu_count(), "command": " ".join(["scripts/bench_failover.py", *sys.argv[1:]]),
                         "etcd": etcd.describe()}
            if args.peer_tls or args.peer_tls_cost:
                make_pki(root)
                PKI["use"] = "yes" if args.peer_tls else "no"
            out["peer_tls"] = bool(args.peer_tls)
            if args.trials:
                out.update(await failover(etcd, os.path.join(root, "failover"), args.trials, args.impostor))
            if args.handover:
                os.makedirs(os.path.join(root, "handover"))
                out.update(await handover(etcd, os.path.join(root, "handover"), args.handover))
            if args.peer_tls_cost:
                os.makedirs(os.path.join(root, "tls"))
                out.update(await peer_tls_cost(etcd, os.path.join(root, "tls"), args.cost_rounds,
                                               args.cost_duration, args.acks))

            if not args.skip_cost:
                out.update(await cost(etcd, os.path.join(root, "cost"), args.cost_rounds,
                                      args.cost_duration, args.acks))
            out["load_average_end"] = os.getloadavg()
            return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="kill -9 trials (default %(default)s; 0: none)")
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    ap.add_argument("--cost-duration", type=float, default=10.0, help="seconds per lifecycle run (default %(default)s)")
    ap.add_argument("--cost-rounds", type=int, default=2, help="off/on rounds (default %(default)s)")
    ap.add_argument("--acks", type=int, default=400, help="single submits per ack-latency run (default %(default)s)")
    ap.add_argument("--skip-cost", action="store_true", help="only the failover trials")
    ap.add_argument("--handover", type=int, default=0, metavar="N",
                    help="N SIGTERM hand-overs under a producer and a consume() worker (default 0: none)")
    ap.add_argument("--peer-tls", action="store_true",
                    help="the nodes' replication links run mutual TLS (certificates made for the run)")
    ap.add_argument("--impostor", action="store_true",
                    help="an attacker without the cluster secret loops on both replication ports during the trials")
    ap.add_argument("--peer-tls-cost", action="store_true",
                    help="also: ack latency p50/p99 and lifecycles/s of a shard with a plaintext link and one with "
                         "peer TLS, side by side")
    add_bench_etcd_arguments(ap)
    args = ap.parse_args()
    result = trio.run(main, args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
