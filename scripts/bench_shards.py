"""Aggregate lifecycles/s and daemon CPU per lifecycle for 1, 2 and 3 shards, side by side.

For each shard count K (``--shards 1,2,3``, repeated ``--rounds`` times, the counts
alternating within a round so that the machine's changing load spreads over all):
one etcd member (shared by the whole run), ``rallypoint cluster init --slots 64
--shards K`` under a cluster name of its own, K ``rallypoint serve --cluster --shard S``
nodes (one node a shard, loopback, ``--durability`` interval by default), then
``rallypoint bench --scenario lifecycle --connect tcp://<every node> --runs K`` with
``--producers`` and ``--workers`` per shard (so K times as many clients), open loop at
``--rate-per-shard`` lifecycles/s times K (the same load on each daemon whatever K, so
each batches alike; ``0``: closed loop, as fast as the clients go): K unnamed root
runs, which the SDK's router gives the shards in turn, producer and worker i on run
i mod K -- run-local work on every shard, nothing crossing shards but the queue's
definition. Each daemon's CPU (utime + stime, ``/proc/<pid>/stat``) is read before and
after the bench; CPU per lifecycle is the daemons' sum over every lifecycle the bench
finished (warm-up and drain included: ``lifecycles_all``). Each node's idle CPU
(before the load: etcd keepalives and watches) is measured for ``--idle`` seconds;
``daemon_cpu_us_per_lifecycle_net`` takes that rate over the bench's wall time out.

    python scripts/bench_shards.py --json /tmp/shards.json       # open loop, 1000/s a shard
    python scripts/bench_shards.py --rounds 3 --rate-per-shard 0 --json FILE   # closed loop

The JSON: ``{"machine", "loadavg_before", "loadavg_after", "command", "config",
"shards": {"1": {"lifecycles_per_s", "daemon_cpu_us_per_lifecycle", "rounds": [...]},
...}}`` (per shard count the median of its rounds). Asserts nothing; needs the
``etcd`` binary. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from _cluster import ClusterNode, stop_all  # noqa: E402
from _etcd import EtcdCluster  # noqa: E402

SLOTS = 64


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> list[float]:
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def one(etcd: EtcdCluster, root: str, k: int, rnd: int, a: argparse.Namespace) -> dict:
    """One measurement with ``k`` shards: a fresh cluster, the bench, the CPU read."""
    name = f"bench-{k}-{rnd}-{os.getpid()}"
    endpoint = "etcd://" + etcd.endpoints[0].removeprefix("http://")
    subprocess.run([sys.executable, "-m", "rallypoint", "cluster", "init", "--cluster", endpoint,
                    "--cluster-name", name, "--slots", str(SLOTS), "--shards", str(k)],
                   check=True, capture_output=True, timeout=60)
    nodes = [ClusterNode(f"k{k}r{rnd}s{s}", root, etcd.endpoints[0], name,
                         extra=["--shard", str(s), "--durability", a.durability, "--sync-helper", "thread"])
             for s in range(k)]
    try:
        for n in nodes:
            n.start()
        until(lambda: all(n.role == "leader" for n in nodes) or any(not n.running() for n in nodes), 120,
              "a leader on every shard")
        if any(not n.running() for n in nodes):
            raise RuntimeError("a node exited:\n" + "\n".join(n.log_tail() for n in nodes))
        idle0 = [cpu_s(n.pid) for n in nodes]
        time.sleep(a.idle)  # (the idle cost of a node: its etcd keepalives and watches)
        c0 = [cpu_s(n.pid) for n in nodes]
        idle_pct = [round(100 * (x - y) / a.idle, 2) for x, y in zip(c0, idle0)]
        report_path = os.path.join(root, f"{name}.json")
        url = "tcp://" + ",".join(n.address for n in nodes)
        cmd = [sys.executable, "-m", "rallypoint", "bench", "--scenario", "lifecycle", "--connect", url,
               "--runs", str(k), "--duration", str(a.duration), "--warmup", str(a.warmup),
               "--producers", str(a.producers * k), "--workers", str(a.workers * k), "--batch", str(a.batch),
               "--pipeline", str(a.pipeline), "--worker-concurrency", str(a.worker_concurrency),
               "--max-messages", str(a.max_messages), "--progress-every", "1000", "--json", report_path]
        if a.rate_per_shard:
            cmd += ["--rate", str(a.rate_per_shard * k), "--coalesce-ms", str(a.coalesce_ms)]
        load0 = loadavg()
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.warmup + a.duration + 300)
        wall = time.monotonic() - t0
        c1 = [cpu_s(n.pid) for n in nodes]
        if not os.path.exists(report_path):
            raise RuntimeError(f"bench exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        # a report with errors (exit 1) is kept: its errors are in the row, and printed
        rep = json.load(open(report_path))
    finally:
        stop_all(nodes)
    th = rep["throughput"]
    cpu = [round(y - x, 3) for x, y in zip(c0, c1)]
    total = th["lifecycles_all"]
    return {
        "shards": k, "round": rnd,
        "lifecycles_per_s": th["lifecycles_per_s"],
        "offered_per_s": a.rate_per_shard * k if a.rate_per_shard else None,
        "lifecycles_measured": th["lifecycles"], "lifecycles_all": total,
        "daemon_cpu_s": cpu, "daemon_cpu_s_total": round(sum(cpu), 3),
        "daemon_cpu_us_per_lifecycle": round(1e6 * sum(cpu) / total, 1) if total else None,
        "daemon_cpu_share_pct": [round(100 * x / sum(cpu), 1) for x in cpu] if sum(cpu) else None,
        "bench_wall_s": round(wall, 2), "idle_cpu_pct_per_node": idle_pct,
        # the nodes' idle rate over the bench's wall time taken out: the work's own cost
        "daemon_cpu_us_per_lifecycle_net": (round(1e6 * (sum(cpu) - sum(idle_pct) / 100 * wall) / total, 1)
                                            if total else None),
        "unfinished": rep.get("unfinished_lifecycles", 0),
        # requests per lifecycle in the window: the batching (a request's cost is shared by its batch)
        "requests_per_lifecycle": round(rep["throughput"]["ops"] / th["lifecycles"], 3) if th["lifecycles"] else None,
        "errors": rep["errors"]["total"], "error_samples": rep["errors"]["samples"][:2],
        "loadavg_at_start": load0,
        "lifecycle_p50_ms": rep["latency_ms"].get("lifecycle", {}).get("p50_ms"),
        "lifecycle_p99_ms": rep["latency_ms"].get("lifecycle", {}).get("p99_ms"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="1,2,3", help="shard counts, side by side (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the counts (default %(default)s)")
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per bench (default %(default)s)")
    ap.add_argument("--warmup", type=float, default=3.0,
                    help="seconds before measuring: connections, first receives (default %(default)s)")
    ap.add_argument("--producers", type=int, default=1, help="producer processes per shard (default %(default)s)")
    ap.add_argument("--workers", type=int, default=1, help="worker processes per shard (default %(default)s)")
    ap.add_argument("--rate-per-shard", type=float, default=1000.0,
                    help="open loop: lifecycles/s offered to each shard (the same load on every daemon whatever "
                         "the count); 0: closed loop, as fast as the clients go (default %(default)s)")
    ap.add_argument("--coalesce-ms", type=float, default=50.0,
                    help="open loop: arrivals due within this many ms share one submit_many, so a batch holds "
                         "about rate x this whatever the machine's load (default %(default)s)")
    ap.add_argument("--batch", type=int, default=64, help="(default %(default)s)")
    ap.add_argument("--pipeline", type=int, default=2, help="(default %(default)s)")
    ap.add_argument("--worker-concurrency", type=int, default=2, help="(default %(default)s)")
    ap.add_argument("--max-messages", type=int, default=32, help="(default %(default)s)")
    ap.add_argument("--durability", choices=["fsync", "interval"], default="interval", help="(default %(default)s)")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU read per node (default %(default)s)")
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    a = ap.parse_args()
    if shutil.which("etcd") is None:
        print("bench_shards: needs the etcd binary (apt-get install etcd-server)", file=sys.stderr)
        return 2
    counts = [int(x) for x in a.shards.split(",")]
    root = tempfile.mkdtemp(prefix="bench-shards-")
    os.makedirs(os.path.join(root, "etcd"))
    etcd = EtcdCluster(os.path.join(root, "etcd"), size=1).start()
    load_before = loadavg()
    rows: list[dict] = []
    try:
        for rnd in range(a.rounds):
            order = counts if rnd % 2 == 0 else list(reversed(counts))
            for k in order:
                r = one(etcd, root, k, rnd, a)
                rows.append(r)
                print(f"round {rnd} shards {k}: {r['lifecycles_per_s']:,.0f} lifecycles/s, daemon CPU "
                      f"{r['daemon_cpu_us_per_lifecycle']} us/lifecycle (net of idle "
                      f"{r['daemon_cpu_us_per_lifecycle_net']}) ({r['daemon_cpu_s_total']} s over "
                      f"{r['lifecycles_all']:,} lifecycles; per node {r['daemon_cpu_s']} s, idle "
                      f"{r['idle_cpu_pct_per_node']} %), {r['requests_per_lifecycle']} requests/lifecycle, errors {r['errors']}, load {r['loadavg_at_start']}",
                      flush=True)
                for e in r["error_samples"]:
                    print(f"  e.g. {e}", flush=True)
    finally:
        etcd.stop()
        shutil.rmtree(root, ignore_errors=True)
    load_after = loadavg()
    per: dict[str, dict] = {}
    for k in counts:
        rs = [r for r in rows if r["shards"] == k]
        per[str(k)] = {
            "lifecycles_per_s": statistics.median(r["lifecycles_per_s"] for r in rs),
            "daemon_cpu_us_per_lifecycle": statistics.median(r["daemon_cpu_us_per_lifecycle"] for r in rs),
            "daemon_cpu_us_per_lifecycle_net": statistics.median(r["daemon_cpu_us_per_lifecycle_net"] for r in rs),
            "rounds": rs,
        }
    base = per[str(counts[0])]["daemon_cpu_us_per_lifecycle"]
    print(f"\nload average {load_before} before, {load_after} after ({os.cpu_count()} cores)")
    net0 = per[str(counts[0])]["daemon_cpu_us_per_lifecycle_net"]
    print(f"{'shards':>6} {'lifecycles/s':>13} {'daemon CPU us/lifecycle':>24} {'vs ' + str(counts[0]):>8} "
          f"{'net of idle':>12} {'vs ' + str(counts[0]):>8}")
    for k in counts:
        v = per[str(k)]
        print(f"{k:>6} {v['lifecycles_per_s']:>13,.0f} {v['daemon_cpu_us_per_lifecycle']:>24.1f} "
              f"{100 * (v['daemon_cpu_us_per_lifecycle'] / base - 1):>+7.1f}% "
              f"{v['daemon_cpu_us_per_lifecycle_net']:>12.1f} {100 * (v['daemon_cpu_us_per_lifecycle_net'] / net0 - 1):>+7.1f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": shlex.join([sys.executable, *sys.argv]), "machine": {"cores": os.cpu_count()},
                       "loadavg_before": load_before, "loadavg_after": load_after, "config": vars(a),
                       "shards": per}, f, indent=2)
        print(f"written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
