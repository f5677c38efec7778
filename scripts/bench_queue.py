#!/usr/bin/env python
"""Benchmark work queues (prints figures, asserts nothing).

    python scripts/bench_queue.py [--parts embedded,tcp,latency,rss] [--durability memory,fsync]
                                  [--tasks 40000] [--producers 2] [--workers 2] [--batch 100]
                                  [--rss-tasks 1000000] [--dir /work/.bench]

A *lifecycle* is submit -> receive -> complete -> result (the producer learns the outcome).

* embedded: producers and workers as Trio tasks in one process around an embedded
  coordinator (``open_embedded``), in memory or fsync durability (tmp data dir).
* tcp: a ``rallypoint serve`` daemon subprocess (tmp data dir for fsync), producer and
  worker PROCESSES over TCP. Producers ``submit_many`` batches and wait for every result;
  workers ``receive(max_messages=batch)`` with several loops each and complete what they
  got (``--complete-batch``: in one batch frame per receive, else one call each).
* latency: the same over TCP at a fixed offered rate (``--rate``, default half of the
  tcp throughput just measured): single submits, p50/p99 of submit-to-result.
* rss: RSS delta of an embedded memory coordinator holding N queued tasks with 100-byte
  inputs, per task and per task beyond its input.

Targets (issue): >= 10k lifecycles/s over TCP with fsync; p50 <= 1 ms at half that load;
<= 1 KiB per queued task beyond its input.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import rallypoint  # noqa: E402
from rallypoint import protocol as p  # noqa: E402
from rallypoint.client import types as t  # noqa: E402
from rallypoint.client.api import encode_payload  # noqa: E402
from rallypoint.errors import LeaseLostError, ScopeInactiveError  # noqa: E402

PAYLOAD = {"data": "x" * 88}  # ~100 bytes encoded


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------------ roles
async def worker_loops(rs, mbx: str, run_id: str, loops: int, batch: int, complete_batch: bool) -> int:
    m = rs.mailbox(mbx)
    done = 0

    async def loop():
        nonlocal done
        while True:
            try:
                ds = await m.receive(run_id, lease_seconds=60, wait=2, max_messages=batch)
            except ScopeInactiveError:
                return
            if not ds:
                continue
            if complete_batch:
                ops = [p.DeliveryComplete(task_id=d.task_id, token=d.token, outcome=encode_payload(1)) for d in ds]
                res = await rs._transport.call_many(ops)
                done += sum(1 for r in res if not isinstance(r, Exception))
            else:
                async with trio.open_nursery() as n:
                    for d in ds:
                        n.start_soon(_complete_one, d)
                done += len(ds)

    async with trio.open_nursery() as n:
        for _ in range(loops):
            n.start_soon(loop)
    return done


async def _complete_one(d) -> None:
    try:
        await d.complete(1)
    except LeaseLostError:
        pass


async def producer_throughput(rs, mbx: str, run_id: str, n_tasks: int, batch: int, loops: int) -> dict:
    """Each loop: submit_many(batch), then wait for the batch's results (one batch frame)."""
    m = rs.mailbox(mbx)
    per_loop = n_tasks // loops
    got = 0

    async def loop():
        nonlocal got
        left = per_loop
        while left > 0:
            k = min(batch, left)
            tickets = await m.submit_many([PAYLOAD] * k, scope=run_id)
            ops = [p.TaskResult(task_id=tk.id, wait_ms=60_000) for tk in tickets]
            for r in await rs._transport.call_many(ops):
                if not isinstance(r, Exception):
                    got += 1
            left -= k

    t0 = time.time()
    async with trio.open_nursery() as n:
        for _ in range(loops):
            n.start_soon(loop)
    return {"start": t0, "end": time.time(), "lifecycles": got}


async def producer_latency(rs, mbx: str, run_id: str, rate: float, seconds: float) -> dict:
    """Single submits at ``rate``/s; latency = submit call to result reply."""
    m = rs.mailbox(mbx)
    lats: list[float] = []

    async def one():
        t0 = time.perf_counter()
        tk = await m.submit(PAYLOAD, scope=run_id)
        await tk.result(timeout=60)
        lats.append(time.perf_counter() - t0)

    t_start = time.perf_counter()
    n = int(rate * seconds)
    async with trio.open_nursery() as nursery:
        for i in range(n):
            due = t_start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await trio.sleep(delay)
            nursery.start_soon(one)
    return {"lat": lats, "offered": n / seconds, "elapsed": time.perf_counter() - t_start}


def role_main(args) -> None:
    async def main():
        async with rallypoint.connect(args.url) as rs:
            if args.role == "worker":
                print(json.dumps({"ready": True}), flush=True)
                done = await worker_loops(rs, args.mbx, args.run, args.loops, args.batch, args.complete_batch)
                print(json.dumps({"completed": done}), flush=True)
            elif args.role == "producer":
                r = await producer_throughput(rs, args.mbx, args.run, args.tasks, args.batch, args.loops)
                print(json.dumps(r), flush=True)
            elif args.role == "latency":
                r = await producer_latency(rs, args.mbx, args.run, args.rate, args.seconds)
                print(json.dumps(r), flush=True)

    trio.run(main)


# ------------------------------------------------------------------------ orchestration
def start_daemon(durability: str, data_dir: str | None) -> tuple[subprocess.Popen, str]:
    prefix = os.environ.get("BENCH_DAEMON_PREFIX", "").split()  # e.g. "-m cProfile -o /tmp/daemon.prof"
    cmd = [sys.executable, *prefix, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", durability]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    while True:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            raise RuntimeError("daemon failed to start")


def spawn(role: str, url: str, mbx: str, run_id: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--role", role, "--url", url, "--mbx", mbx, "--run", run_id]
    for k, v in kw.items():
        if v is True:
            cmd.append("--" + k.replace("_", "-"))
        elif v is not False:
            cmd += ["--" + k.replace("_", "-"), str(v)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def last_json(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=600)
    return json.loads(out.strip().splitlines()[-1])


async def setup_run(url: str, mbx: str) -> str:
    async with rallypoint.connect(url) as rs:
        await rs.mailboxes.ensure(mbx)
        return (await rs.scopes.create(name="bench")).id


async def cancel_run(url: str, run_id: str) -> None:
    async with rallypoint.connect(url) as rs:
        await rs.scope(run_id).cancel()


def tcp_throughput(args, durability: str, data_dir: str | None) -> float:
    proc, url = start_daemon(durability, data_dir)
    try:
        mbx = "bench"
        run_id = trio.run(setup_run, url, mbx)
        workers = [
            spawn("worker", url, mbx, run_id, loops=args.worker_loops, batch=args.batch,
                  complete_batch=args.complete_batch)
            for _ in range(args.workers)
        ]
        for w in workers:
            w.stdout.readline()  # ready
        per = args.tasks // args.producers
        prods = [
            spawn("producer", url, mbx, run_id, tasks=per, batch=args.batch, loops=args.producer_loops)
            for _ in range(args.producers)
        ]
        rs_ = [last_json(pp) for pp in prods]
        trio.run(cancel_run, url, run_id)
        for w in workers:
            last_json(w)
        total = sum(r["lifecycles"] for r in rs_)
        elapsed = max(r["end"] for r in rs_) - min(r["start"] for r in rs_)
        rate = total / elapsed
        print(f"  tcp {durability:6s}: {total} lifecycles in {elapsed:.2f} s = {rate:,.0f}/s "
              f"({args.producers} producer procs x {args.producer_loops} loops, {args.workers} worker procs x "
              f"{args.worker_loops} loops, batch {args.batch}, complete {'batched' if args.complete_batch else 'per call'})")
        return rate
    finally:
        proc.terminate()
        proc.wait()


def tcp_latency(args, durability: str, data_dir: str | None, rate: float) -> None:
    proc, url = start_daemon(durability, data_dir)
    try:
        mbx = "lat"
        run_id = trio.run(setup_run, url, mbx)
        workers = [
            spawn("worker", url, mbx, run_id, loops=args.worker_loops, batch=args.batch,
                  complete_batch=args.complete_batch)
            for _ in range(args.workers)
        ]
        for w in workers:
            w.stdout.readline()
        per = rate / args.producers
        prods = [spawn("latency", url, mbx, run_id, rate=per, seconds=args.lat_seconds) for _ in range(args.producers)]
        rs_ = [last_json(pp) for pp in prods]
        trio.run(cancel_run, url, run_id)
        for w in workers:
            last_json(w)
        lats = [x for r in rs_ for x in r["lat"]]
        achieved = len(lats) / max(r["elapsed"] for r in rs_)
        print(f"  latency {durability:6s} at {rate:,.0f}/s offered ({achieved:,.0f}/s done): "
              f"p50 {pct(lats, 0.5) * 1e3:.2f} ms, p90 {pct(lats, 0.9) * 1e3:.2f} ms, "
              f"p99 {pct(lats, 0.99) * 1e3:.2f} ms (n={len(lats)})")
    finally:
        proc.terminate()
        proc.wait()


async def embedded_throughput(args, durability: str, data_dir: str | None) -> float:
    async with rallypoint.open_embedded(data_dir, durability=durability) as rs:
        await rs.mailboxes.ensure("bench")
        run = await rs.scopes.create()
        res = {}

        async def workers():
            res["done"] = await worker_loops(rs, "bench", run.id, args.worker_loops, args.batch, args.complete_batch)

        async with trio.open_nursery() as n:
            n.start_soon(workers)
            r = await producer_throughput(rs, "bench", run.id, args.tasks, args.batch, args.producer_loops)
            await run.cancel()
        rate = r["lifecycles"] / (r["end"] - r["start"])
        print(f"  embedded {durability:6s}: {r['lifecycles']} lifecycles in {r['end'] - r['start']:.2f} s = "
              f"{rate:,.0f}/s (one process, {args.producer_loops} producer loops, {args.worker_loops} worker loops, "
              f"batch {args.batch})")
        return rate


async def rss_part(n: int) -> None:
    async with rallypoint.open_embedded() as rs:
        m = await rs.mailboxes.ensure("rss")
        run = await rs.scopes.create()
        items = [p.SubmitItem(input=encode_payload(PAYLOAD))] * 1000
        input_len = len(bytes(items[0].input))
        gc.collect()
        before = rss_bytes()
        coord = rs.node.coordinator
        from rallypoint.service import Session

        s = Session()
        t0 = time.perf_counter()
        for _ in range(n // 1000):
            coord.decide(s, p.TaskSubmitMany(mailbox="rss", scope_id=run.id, items=items))
        dt = time.perf_counter() - t0
        gc.collect()
        after = rss_bytes()
        per = (after - before) / n
        print(f"  rss: {n:,} queued tasks ({input_len}-byte inputs): RSS +{(after - before) / 2**20:,.0f} MiB = "
              f"{per:,.0f} B/task, {per - input_len:,.0f} B/task beyond the input "
              f"(submitted in {dt:.1f} s, {n / dt:,.0f}/s through op_task_submit_many)")
        st = await m.status()
        assert st.queued == n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--url")
    ap.add_argument("--mbx")
    ap.add_argument("--run")
    ap.add_argument("--loops", type=int, default=1)
    ap.add_argument("--rate", type=float, default=0)
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--parts", default="embedded,tcp,latency,rss")
    ap.add_argument("--durability", default="memory,fsync")
    ap.add_argument("--tasks", type=int, default=40_000)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--producer-loops", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-loops", type=int, default=4)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--complete-batch", action="store_true")
    ap.add_argument("--lat-seconds", type=float, default=3)
    ap.add_argument("--lat-rate", type=float, default=0)
    ap.add_argument("--rss-tasks", type=int, default=1_000_000)
    ap.add_argument("--dir", default=str(ROOT.parent / ".bench") if (ROOT.parent / ".bench").exists() else None)
    args = ap.parse_args()
    if args.role:
        role_main(args)
        return
    parts = args.parts.split(",")
    print(f"bench_queue: {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    tcp_rates = {}
    for dur in args.durability.split(","):
        for part in parts:
            if part == "rss":
                continue
            data_dir = tempfile.mkdtemp(prefix="rp-bench-", dir=args.dir) if dur != "memory" else None
            try:
                if part == "embedded":
                    trio.run(embedded_throughput, args, dur, data_dir)
                elif part == "tcp":
                    tcp_rates[dur] = tcp_throughput(args, dur, data_dir)
                elif part == "latency":
                    rate = args.lat_rate or tcp_rates.get(dur, 10_000) / 2
                    tcp_latency(args, dur, data_dir, rate)
            finally:
                if data_dir:
                    shutil.rmtree(data_dir, ignore_errors=True)
    if "rss" in parts:
        trio.run(rss_part, args.rss_tasks)


if __name__ == "__main__":
    main()
