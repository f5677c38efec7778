"""What routing inside a node costs the HTTP API of a sharded cluster.

Starts one etcd member and ``--shards`` one-node shards (``rallypoint serve --cluster
--http``, real processes, open mode, space ``default``), then times HTTP requests sent
one at a time to node 0 only (httpx, keep-alive):

- ``local``: ``GET /scopes/{id}`` of runs of shard 0 (served where they arrive);
- ``forwarded``: the same of runs of the other shards (node 0 forwards the whole request
  to the owning shard's leader's HTTP port and returns its answer);
- ``direct``: the other shards' runs asked of their own node (the baseline the
  forward adds to);
- ``fanout``: ``GET /mailboxes`` (every shard over native connections, counts summed);
- ``events``: ``GET /events?limit=100`` without ``scopeId`` (every shard's page, merged).

Prints p50 / p90 / p99 (ms) per class and the load average; ``--json FILE`` writes them.
Needs the ``etcd`` binary. Usage::

    python3 scripts/bench_http_route.py --requests 500 [--shards 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import httpx  # noqa: E402

from _cluster import ClusterNode, stop_all  # noqa: E402
from _etcd import EtcdCluster  # noqa: E402

SLOTS = 64


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 3)


def until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def timed(client: httpx.Client, url: str, params=None) -> float:
    t0 = time.perf_counter()
    r = client.get(url, params=params)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}: {r.status_code} {r.text[:300]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--requests", type=int, default=500, help="requests per class")
    ap.add_argument("--runs", type=int, default=30, help="runs made (spread over the shards)")
    ap.add_argument("--json", help="write the figures there")
    a = ap.parse_args()
    if shutil.which("etcd") is None:
        print("bench_http_route: needs the etcd binary (apt-get install etcd-server)", file=sys.stderr)
        return 2
    from rallypoint.ids import slot_of

    root = tempfile.mkdtemp(prefix="bench-http-route-")
    os.makedirs(os.path.join(root, "etcd"))
    etcd = EtcdCluster(os.path.join(root, "etcd"), size=1).start()
    name = f"bhr-{os.getpid()}"
    nodes: list[ClusterNode] = []
    try:
        endpoint = "etcd://" + etcd.endpoints[0].removeprefix("http://")
        subprocess.run([sys.executable, "-m", "rallypoint", "cluster", "init", "--cluster", endpoint,
                        "--cluster-name", name, "--slots", str(SLOTS), "--shards", str(a.shards)],
                       check=True, capture_output=True, timeout=60)
        nodes = [ClusterNode(f"s{s}", root, etcd.endpoints[0], name, http=True,
                             extra=["--shard", str(s), "--sync-helper", "thread"]) for s in range(a.shards)]
        for n in nodes:
            n.start()
        until(lambda: all(n.role == "leader" for n in nodes) or any(not n.running() for n in nodes), 120,
              "a leader on every shard")
        bases = [f"{n.http_url}/v1/spaces/default" for n in nodes]
        with httpx.Client(timeout=30) as c:
            # every leader knows every other's HTTP address once a routed request works
            def routed() -> bool:
                try:
                    return c.get(f"{bases[0]}/mailboxes").status_code == 200
                except httpx.HTTPError:
                    return False

            until(routed, 60, "node 0 to route")
            runs = [c.post(f"{bases[0]}/scopes", json={"name": f"r{i}"}).json()["id"] for i in range(a.runs)]
            shard_of = {r: slot_of(r) % a.shards for r in runs}  # (cluster init: slot i on shard i mod K)
            local = [r for r in runs if shard_of[r] == 0]
            far = [r for r in runs if shard_of[r] != 0]
            if not local or not far:
                raise RuntimeError(f"runs on shards {sorted(set(shard_of.values()))}: need shard 0 and others")
            c.put(f"{bases[0]}/mailboxes/by-name/jobs", json={"mode": "WORK"}).raise_for_status()
            for _ in range(50):  # warm-up: every path's connections made
                for r in local[:1] + far[:1]:
                    timed(c, f"{bases[0]}/scopes/{r}")
                timed(c, f"{bases[0]}/mailboxes")
                timed(c, f"{bases[0]}/events", {"limit": 100})
            figures: dict[str, list[float]] = {k: [] for k in ("local", "forwarded", "direct", "fanout", "events")}
            load0 = os.getloadavg()
            for i in range(a.requests):
                r = local[i % len(local)]
                figures["local"].append(timed(c, f"{bases[0]}/scopes/{r}"))
                r = far[i % len(far)]
                figures["forwarded"].append(timed(c, f"{bases[0]}/scopes/{r}"))
                figures["direct"].append(timed(c, f"{bases[shard_of[r]]}/scopes/{r}"))
                figures["fanout"].append(timed(c, f"{bases[0]}/mailboxes"))
                figures["events"].append(timed(c, f"{bases[0]}/events", {"limit": 100}))
        out = {"shards": a.shards, "requests_per_class": a.requests, "loadavg_at_start": [round(x, 2) for x in load0],
               "latency_ms": {k: {"p50": pct(v, 0.5), "p90": pct(v, 0.9), "p99": pct(v, 0.99)}
                              for k, v in figures.items()}}
        for k, v in out["latency_ms"].items():
            print(f"{k:10s} p50 {v['p50']:8.3f} ms  p90 {v['p90']:8.3f} ms  p99 {v['p99']:8.3f} ms")
        print(f"shards {a.shards}, {a.requests} requests per class, load average at start {out['loadavg_at_start']}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    finally:
        stop_all(nodes)
        etcd.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
