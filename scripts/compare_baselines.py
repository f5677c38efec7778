#!/usr/bin/env python
"""The lifecycle workload against rallypoint, Redis Streams and Dask distributed (not in CI).

One invocation runs the same workload shape on each system, on this machine, over
loopback, and prints a table with ratios to rallypoint:

* producers (separate processes) submit tasks in batches of ``--batch`` with
  ``--pipeline`` batches in flight and wait for each task's result;
* workers (separate processes) take tasks in batches of up to 32, complete them
  (acknowledge) and the producer observes the result;
* a lifecycle is submit → receive → complete → result observed; its latency is from
  the submit call to the moment the producer sees the result.

A second table runs the same lifecycle **open loop** at a fixed rate (``--rate``,
default 5,000 lifecycles/s across producers) for rallypoint and Redis: the k-th arrival
is intended at ``t0 + k/rate`` whatever happened before (no coordinated omission),
arrivals due within ``--coalesce-ms`` share one submit, and latency counts from the
intended time to the producer seeing the result (rallypoint: the batch's last result,
an upper bound for each task; Redis: each task's own result). ``--rate 0`` skips it.

Systems:

* ``rallypoint``: ``rallypoint bench --scenario lifecycle --spawn`` (a daemon with a
  fresh data dir; ``--durability``, default fsync).
* ``redis``: a ``redis-server`` started on loopback with ``--appendonly yes
  --appendfsync always`` (durable like fsync mode); tasks are XADD to a stream, workers
  XREADGROUP (COUNT 32) and XACK, and post the result with XADD to the producer's result
  stream, which the producer reads with XREAD BLOCK. Skipped when there is no
  ``redis-server`` (``apt-get install -y redis-server``).
* ``dask``: a ``distributed.LocalCluster`` with one single-threaded worker process per
  worker; producers are separate processes with their own ``Client`` doing
  ``client.map`` of a no-op over a batch and ``gather``. In memory only: Dask keeps no
  durable record of tasks, so this is a latency/throughput reference, not a like-for-like.

The Python extras (``redis``, ``distributed``: the ``compare`` extra in pyproject.toml)
are installed on demand (their requirements only, so an editable install stays).

    python scripts/compare_baselines.py --pairs 0 [--duration 10] [--producers 1] [--workers 1]
        [--only redis,dask] [--rate 5000] [--repeat 3]

**Interleaved pairs** (the default, ``--pairs 5``; issue 47): the machine is shared and
its load moves more between two runs than the gap being measured, so rallypoint and
Redis run alternately, A B A B ..., ``--pairs`` times per configuration (``--configs``:
``closed:PxW`` a closed loop of P producers and W workers, ``open:RATE`` an open loop
at RATE lifecycles/s with ``--producers`` / ``--workers``), and each pair gives one
ratio: closed loop, rallypoint's lifecycles/s over Redis's; open loop, Redis's p99 over
rallypoint's (both: > 1 means rallypoint is ahead). Reported per configuration: every
pair's ratio, the median ratio and its range (min-max), each system's median figures,
and the 1-minute load average before every run (``os.getloadavg``); ``--json`` keeps
every pair. ``--root`` benches another rallypoint checkout (e.g. main, for a "before"
figure); ``--settle`` is passed to ``rallypoint bench`` (next / separate).

    python scripts/compare_baselines.py --pairs 5 --duration 6 --json out.json \
        [--configs closed:2x2,closed:1x1,open:5000,open:10000] [--root /path/to/checkout]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rallypoint.loadtest.hist import Recorder, merge_encoded, summarize  # noqa: E402
from rallypoint.loadtest.schedule import OpenLoopSchedule  # noqa: E402


def compare_requirements() -> list[str]:
    """The ``compare`` extra of pyproject.toml (redis, distributed)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]["compare"]


def ensure_extras() -> None:
    """Install the ``compare`` extra on demand. Only its requirements are installed (the
    same set as ``pip install '.[compare]'``), so an editable install of rallypoint
    is left as it is."""
    try:
        import distributed  # noqa: F401
        import redis  # noqa: F401
    except ImportError:
        reqs = compare_requirements()
        print(f"installing the compare extras: pip install {' '.join(reqs)}", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", *reqs])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ rallypoint
def run_rallypoint(a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        root = getattr(a, "root", None) or ROOT
        cmd = [sys.executable, "-m", "rallypoint", "bench", "--scenario", "lifecycle", "--spawn",
               "--durability", a.durability, "--duration", str(a.duration), "--warmup", str(a.warmup),
               "--producers", str(a.producers), "--workers", str(a.workers), "--batch", str(a.batch),
               "--pipeline", str(a.pipeline), "--json", out]
        if a.sync_helper:
            cmd += ["--sync-helper", a.sync_helper]
        if getattr(a, "open_rate", 0):
            cmd += ["--rate", str(a.open_rate), "--coalesce-ms", str(a.coalesce_ms)]
        if getattr(a, "settle", None):
            cmd += ["--settle", a.settle]
        env = {**os.environ, "PYTHONPATH": root}
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
        if p.returncode not in (0, 1) or not os.path.exists(out):
            raise RuntimeError(f"rallypoint bench failed: {p.stderr[-2000:]}")
        r = json.load(open(out))
    return {"lifecycles_per_s": r["throughput"]["lifecycles_per_s"], "latency": r["latency_ms"]["lifecycle"],
            "errors": r["errors"]["total"], "durability": f"{a.durability} (journal{', ' + a.sync_helper if a.sync_helper else ''})",
            "unfinished": r.get("unfinished_lifecycles", 0)}


# ------------------------------------------------------------------------------ redis streams
def _redis_producer(i, port, a, t0, q):
    import redis

    r = redis.Redis(port=port)
    rec, n = Recorder(), 0
    m_start, m_end = t0 + a.warmup, t0 + a.warmup + a.duration
    res_stream, last = f"results:{i}", "0-0"
    seq = 0
    pending: dict[str, float] = {}
    while time.time() < t0:
        time.sleep(0.001)
    while True:
        now = time.time()
        if now < m_end and len(pending) < a.batch * a.pipeline:
            pipe = r.pipeline(transaction=False)
            for _ in range(a.batch):
                tid = f"{i}-{seq}"
                seq += 1
                pending[tid] = now
                pipe.xadd("tasks", {"id": tid, "p": i})
            pipe.execute()
            continue
        if now >= m_end + 10 or (now >= m_end and not pending):
            break
        resp = r.xread({res_stream: last}, count=1000, block=100)
        for _stream, entries in resp or []:
            for eid, fields in entries:
                last = eid
                tid = fields[b"id"].decode()
                ts = pending.pop(tid, None)
                if ts is None:
                    continue
                t1 = time.time()
                if m_start <= t1 < m_end:
                    n += 1
                if m_start <= ts < m_end:
                    rec.record("lifecycle", t1 - ts)
    q.put({"n": n, "hist": rec.encode()})


def _redis_producer_open(i, port, a, t0, q):
    """Open loop: this producer's share of ``a.open_rate`` arrivals, each intended at its
    schedule time; arrivals due within ``a.coalesce_ms`` go out in one pipeline of XADDs."""
    import redis

    r = redis.Redis(port=port)
    rec, n = Recorder(), 0
    m_start, m_end = t0 + a.warmup, t0 + a.warmup + a.duration
    sched = OpenLoopSchedule(a.open_rate, t0, i, a.producers)
    res_stream, last, seq = f"results:{i}", "0-0", 0
    pending: dict[str, float] = {}
    coalesce = a.coalesce_ms / 1000
    while time.time() < t0:
        time.sleep(0.001)
    while True:
        now = time.time()
        nt = sched.next_time()
        if nt < m_end and now >= nt + coalesce:
            pipe = r.pipeline(transaction=False)
            for it in sched.due(now, limit=a.batch):
                tid = f"{i}-{seq}"
                seq += 1
                pending[tid] = it
                pipe.xadd("tasks", {"id": tid, "p": i})
            pipe.execute()
            continue
        if now >= m_end + 10 or (nt >= m_end and not pending):
            break
        wait_ms = max(1, int((nt + coalesce - now) * 1000)) if nt < m_end else 100
        resp = r.xread({res_stream: last}, count=1000, block=wait_ms)
        for _stream, entries in resp or []:
            t1 = time.time()
            for eid, fields in entries:
                last = eid
                it = pending.pop(fields[b"id"].decode(), None)
                if it is None:
                    continue
                if m_start <= t1 < m_end:
                    n += 1
                if m_start <= it < m_end:
                    rec.record("lifecycle", t1 - it)
    q.put({"n": n, "hist": rec.encode(), "unfinished": len(pending)})


def _redis_worker(i, port, a, t0, stop):
    import redis

    r = redis.Redis(port=port)
    while not stop.is_set():
        resp = r.xreadgroup("workers", f"w{i}", {"tasks": ">"}, count=32, block=250)
        for _stream, entries in resp or []:
            pipe = r.pipeline(transaction=False)
            for eid, fields in entries:
                pipe.xack("tasks", "workers", eid)
                pipe.xadd(f"results:{fields[b'p'].decode()}", {"id": fields[b"id"], "ok": 1})
            pipe.execute()


def run_redis(a) -> dict:
    exe = shutil.which("redis-server")
    if not exe:
        raise RuntimeError("no redis-server (apt-get install -y redis-server)")
    import redis

    port = free_port()
    d = tempfile.mkdtemp(prefix="bench-redis-")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", d, "--appendonly", "yes",
                             "--appendfsync", "always", "--save", ""], stdout=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        r.xgroup_create("tasks", "workers", id="0", mkstream=True)
        producer = _redis_producer_open if getattr(a, "open_rate", 0) else _redis_producer
        return _run_procs(a, producer, _redis_worker, port, "appendfsync always (AOF)")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------ dask
def _noop(x):
    return x


def _dask_producer(i, address, a, t0, q):
    from distributed import Client

    rec, n = Recorder(), 0
    m_start, m_end = t0 + a.warmup, t0 + a.warmup + a.duration
    seq = 0
    with Client(address) as c:
        while time.time() < t0:
            time.sleep(0.001)
        inflight = []
        while time.time() < m_end or inflight:
            while time.time() < m_end and len(inflight) < a.pipeline:
                ts = time.time()
                futs = c.map(_noop, [(i, seq + k) for k in range(a.batch)], pure=False)
                seq += a.batch
                inflight.append((ts, futs))
            ts, futs = inflight.pop(0)
            c.gather(futs)
            t1 = time.time()
            if m_start <= t1 < m_end:
                n += len(futs)
            if m_start <= ts < m_end:
                for _ in futs:
                    rec.record("lifecycle", t1 - ts)
    q.put({"n": n, "hist": rec.encode()})


def _dask_worker(i, address, a, t0, stop):  # the LocalCluster owns the workers
    stop.wait()


def run_dask(a) -> dict:
    from distributed import LocalCluster

    with LocalCluster(n_workers=a.workers, threads_per_worker=1, processes=True, dashboard_address=None,
                      host="127.0.0.1") as cluster:
        return _run_procs(a, _dask_producer, None, cluster.scheduler_address, "none (in memory)")


# ------------------------------------------------------------------------------ common
def _run_procs(a, producer, worker, target, durability) -> dict:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    t0 = time.time() + 3.0
    ws = [ctx.Process(target=worker, args=(i, target, a, t0, stop)) for i in range(a.workers)] if worker else []
    ps = [ctx.Process(target=producer, args=(i, target, a, t0, q)) for i in range(a.producers)]
    for p in ws + ps:
        p.start()
    finals = [q.get(timeout=a.warmup + a.duration + 120) for _ in ps]
    stop.set()
    for p in ws + ps:
        p.join(10)
        if p.is_alive():
            p.terminate()
    h = merge_encoded(f["hist"] for f in finals)["lifecycle"]
    return {"lifecycles_per_s": round(sum(f["n"] for f in finals) / a.duration, 1), "latency": summarize(h),
            "errors": 0, "durability": durability, "unfinished": sum(f.get("unfinished", 0) for f in finals)}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r["lifecycles_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "all_lifecycles_per_s": [r["lifecycles_per_s"] for r in runs]}


def _table(title: str, results: dict, base_key: str = "rallypoint") -> None:
    base = results.get(base_key, {}).get("lifecycles_per_s")
    print(f"\n{title}")
    print(f"{'system':<12}{'durability':<26}{'lifecycles/s':>13}{'vs rallypoint':>14}"
          f"{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}{'max ms':>9}{'unfinished':>11}")
    for name, r in results.items():
        ratio = f"{r['lifecycles_per_s'] / base:.2f}x" if base else "-"
        lat = r["latency"]
        print(f"{name:<12}{r['durability']:<26}{r['lifecycles_per_s']:>13,.0f}{ratio:>14}"
              f"{lat['p50_ms']:>9.1f}{lat['p99_ms']:>9.1f}{lat.get('p99_9_ms', float('nan')):>10.1f}"
              f"{lat['max_ms']:>9.1f}{r.get('unfinished', 0):>11}")
        if len(r.get("all_lifecycles_per_s", [])) > 1:
            print(f"{'':<12}runs: {', '.join(f'{x:,.0f}' for x in r['all_lifecycles_per_s'])} (median shown)")


def _load() -> float:
    """The machine's 1-minute load average (a shared machine: say how busy it was)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not on this platform
        return float("nan")


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def parse_configs(text: str) -> list[dict]:
    """``closed:2x2,open:5000`` -> ``[{"mode": "closed", "producers": 2, "workers": 2}, {"mode": "open",
    "rate": 5000.0}]``. ValueError for anything else."""
    out = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        mode, _, arg = part.partition(":")
        if mode == "closed":
            pr, _, wk = arg.partition("x")
            out.append({"name": part, "mode": "closed", "producers": int(pr), "workers": int(wk)})
        elif mode == "open":
            out.append({"name": part, "mode": "open", "rate": float(arg)})
        else:
            raise ValueError(f"a config is closed:PxW or open:RATE (got {part!r})")
    return out


def pair_ratio(cfg: dict, rp: dict, rd: dict) -> float:
    """One pair's ratio, > 1 when rallypoint is ahead: closed loop, its lifecycles/s over
    Redis's; open loop, Redis's p99 over its p99."""
    if cfg["mode"] == "closed":
        return rp["lifecycles_per_s"] / rd["lifecycles_per_s"] if rd["lifecycles_per_s"] else float("nan")
    return rd["latency"]["p99_ms"] / rp["latency"]["p99_ms"] if rp["latency"]["p99_ms"] else float("nan")


def summarize_pairs(cfg: dict, pairs: list[dict]) -> dict:
    """The median ratio and its range over ``pairs``, each system's median figures and
    the load seen."""
    ratios = [p["ratio"] for p in pairs]
    out = {"config": cfg, "pairs": pairs, "median_ratio": round(_median(ratios), 3),
           "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
           "load_1m": [p[k]["load_1m"] for p in pairs for k in ("rallypoint", "redis")]}
    for k in ("rallypoint", "redis"):
        out[k] = {"lifecycles_per_s": _median([p[k]["lifecycles_per_s"] for p in pairs]),
                  "p50_ms": _median([p[k]["latency"]["p50_ms"] for p in pairs]),
                  "p99_ms": _median([p[k]["latency"]["p99_ms"] for p in pairs])}
    return out


def run_pairs(a) -> list[dict]:
    """Every configuration of ``a.configs``: ``a.pairs`` interleaved rallypoint / Redis
    runs; the summaries (:func:`summarize_pairs`), printed as they come."""
    results = []
    for cfg in parse_configs(a.configs):
        if cfg["mode"] == "closed":
            a.producers, a.workers, a.open_rate = cfg["producers"], cfg["workers"], 0
        else:
            a.producers, a.workers, a.open_rate = a.open_producers, a.open_workers, cfg["rate"]
        pairs = []
        for k in range(a.pairs):
            pair: dict = {}
            for name, fn in (("rallypoint", run_rallypoint), ("redis", run_redis)):
                load = _load()
                r = fn(a)
                r["load_1m"] = load
                pair[name] = r
            pair["ratio"] = round(pair_ratio(cfg, pair["rallypoint"], pair["redis"]), 3)
            pairs.append(pair)
            rp, rd = pair["rallypoint"], pair["redis"]
            print(f"{cfg['name']:<14} pair {k + 1}/{a.pairs}: rallypoint {rp['lifecycles_per_s']:>9,.0f}/s "
                  f"p99 {rp['latency']['p99_ms']:6.1f} ms (load {rp['load_1m']:.2f}) | redis "
                  f"{rd['lifecycles_per_s']:>9,.0f}/s p99 {rd['latency']['p99_ms']:6.1f} ms (load {rd['load_1m']:.2f})"
                  f" | ratio {pair['ratio']:.2f}", flush=True)
        sm = summarize_pairs(cfg, pairs)
        results.append(sm)
        ratios = [p["ratio"] for p in pairs]
        what = "throughput rallypoint/redis" if cfg["mode"] == "closed" else "p99 redis/rallypoint"
        print(f"{cfg['name']:<14} median ratio ({what}) {sm['median_ratio']:.2f}x, range "
              f"{sm['ratio_range'][0]:.2f}-{sm['ratio_range'][1]:.2f}; pairs "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; load {min(sm['load_1m']):.2f}-"
              f"{max(sm['load_1m']):.2f} (nproc {os.cpu_count()})", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--durability", default="fsync", choices=["fsync", "interval", "memory"])
    ap.add_argument("--only", default="rallypoint,redis,dask")
    ap.add_argument("--sync-helper", choices=["process", "thread", "inline"], default=None,
                    help="where rallypoint's fdatasync runs (rallypoint serve --sync-helper; default process). "
                         "inline is Redis's own choice under appendfsync always: the fsync on the event loop")
    ap.add_argument("--rate", type=float, default=5000.0,
                    help="open-loop comparison (rallypoint, redis) at this many lifecycles/s; 0 skips it")
    ap.add_argument("--coalesce-ms", type=float, default=2.0,
                    help="open loop: arrivals due within this many ms share one submit (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="closed-loop runs back to back per system, rotating the order; the median is shown")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--pairs", type=int, default=5,
                    help="interleaved rallypoint/Redis pairs per configuration (default %(default)s; 0: the "
                         "single table of --only systems)")
    ap.add_argument("--configs", default="closed:2x2,closed:1x1,open:5000,open:10000",
                    help="pairs mode: closed:PxW and open:RATE configurations (default %(default)s)")
    ap.add_argument("--open-producers", type=int, default=2, help="pairs mode: producers of an open loop")
    ap.add_argument("--open-workers", type=int, default=2, help="pairs mode: workers of an open loop")
    ap.add_argument("--root", default=None, help="the rallypoint checkout to bench (default: this one)")
    ap.add_argument("--settle", choices=["next", "separate"], default=None,
                    help="passed to rallypoint bench --settle (default: the bench's own)")
    a = ap.parse_args()
    if a.pairs > 0:
        try:
            import redis  # noqa: F401
        except ImportError:
            subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "redis"])
        started = time.time()
        results = run_pairs(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "root": a.root or ROOT, "nproc": os.cpu_count(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                           "configs": results}, f, indent=2)
        return 0
    ensure_extras()
    systems = {"rallypoint": run_rallypoint, "redis": run_redis, "dask": run_dask}
    names = a.only.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    a.open_rate = 0
    for k in range(max(1, a.repeat)):
        for name in names[k % len(names):] + names[:k % len(names)]:
            print(f"running {name} ({a.producers} producers, {a.workers} workers, {a.duration:g} s)"
                  f"{f' [{k + 1}/{a.repeat}]' if a.repeat > 1 else ''}...", flush=True)
            try:
                runs[name].append(systems[name](a))
            except Exception as e:  # noqa: BLE001 - report and go on with the others
                print(f"  {name}: skipped: {e}", flush=True)
    closed = {n: _median_run(rs) for n, rs in runs.items() if rs}
    opened: dict[str, dict] = {}
    if a.rate > 0:
        a.open_rate = a.rate
        for name in [n for n in names if n in ("rallypoint", "redis")]:
            print(f"running {name} open loop at {a.rate:,.0f} lifecycles/s...", flush=True)
            try:
                opened[name] = systems[name](a)
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: skipped: {e}", flush=True)
        a.open_rate = 0
    _table(f"closed loop (batches of {a.batch}, {a.pipeline} in flight per producer)", closed)
    if opened:
        _table(f"open loop at {a.rate:,.0f} lifecycles/s (latency from the intended send time; "
               f"coalesce {a.coalesce_ms:g} ms)", opened)
    print(f"\n(nproc {os.cpu_count()}; {a.producers} producers, {a.workers} workers)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "closed_loop": closed, "open_loop": opened}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
