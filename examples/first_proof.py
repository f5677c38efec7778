#!/usr/bin/env python
"""Proof of work, first one wins (a FIRST_ACCEPTED group over a real CPU search).

Find a nonce whose SHA-256 (of ``prefix + nonce``) starts with K zero bits. The nonce
space is split into ranges, one group member each; worker PROCESSES search them under
``rallypoint.consume`` with a short lease (6 s, renewed every 2 s). The coordinator
accepts the first proof it verifies: the group finalizes FIRST_ACCEPTED, its gate run
is cancelled, and every other worker learns at its next lease renewal that it lost,
so its search is cancelled. Prints how long each loser took to stop.

    python examples/first_proof.py --connect tcp://127.0.0.1:7411 [--api-key KEY] [--bits 22]
    python examples/first_proof.py --spawn --quick
"""

from __future__ import annotations

import hashlib
import os
import time

import trio

import rallypoint
from _common import daemon, join_processes, mp_context, parser, start_processes

LEASE_S = 6.0
CHUNK = 5_000  # hashes between checkpoints (where a cancellation can land)


def leading_zero_bits(digest: bytes) -> int:
    n = int.from_bytes(digest, "big")
    return 256 - n.bit_length()


def worker_process(index: int, server: dict, gate_id: str, q) -> None:
    async def handler(delivery):
        job = delivery.input
        prefix, bits, lo, hi = job["prefix"].encode(), job["bits"], job["lo"], job["hi"]
        sha = hashlib.sha256
        q.put(("started", index, job["range"], 0, time.time()))
        nonce, t0 = lo, time.time()
        try:
            while nonce < hi:
                end = min(nonce + CHUNK, hi)
                for x in range(nonce, end):
                    d = sha(prefix + x.to_bytes(8, "big")).digest()
                    if leading_zero_bits(d) >= bits:
                        q.put(("found", index, job["range"], x, time.time()))
                        return {"nonce": x, "hash": d.hex(), "range": job["range"], "hashes": x - lo + 1,
                                "seconds": round(time.time() - t0, 3)}
                nonce = end
                await trio.sleep(0)  # a checkpoint: the renewer may cancel us here
            return {"nonce": None, "range": job["range"], "hashes": hi - lo}
        except trio.Cancelled:
            q.put(("stopped", index, job["range"], nonce - lo, time.time()))
            raise

    async def main():
        async with rallypoint.connect(**server, client_name=f"miner-{index}") as rs:
            q.put(("ready", index, None, 0, time.time()))
            await rallypoint.consume(rs, "proofs", gate_id, handler, concurrency=1, lease_seconds=LEASE_S)

    trio.run(main)


async def coordinate(server: dict, bits: int, workers: int, ranges: int, q) -> int:
    prefix = f"rallypoint-{os.getpid()}-{time.time_ns()}:"
    span = 1 << (bits + 4)  # ~16x the expected number of hashes per hit
    async with rallypoint.connect(**server, client_name="proof-coordinator") as rs:
        run = await rs.scopes.create(name="first-proof")
        mbx = await rs.mailboxes.ensure("proofs")
        group = await run.groups.create(mbx, "FIRST_ACCEPTED", expected_members=ranges)
        print(f"searching for {bits} leading zero bits over {ranges} ranges of {span:,} nonces, "
              f"{workers} worker processes, lease {LEASE_S:g} s")
        procs = start_processes(worker_process, workers, server, group.scope_id, q)
        stops: list = []
        ready = 0
        while ready < workers:  # every miner connected: a fair start
            msg = await trio.to_thread.run_sync(q.get, True, 60)
            ready += msg[0] == "ready"
        tickets = [await group.submit({"prefix": prefix, "bits": bits, "lo": r * span, "hi": (r + 1) * span,
                                       "range": r}, key=f"range-{r}") for r in range(ranges)]
        t_start = time.time()
        send, recv = trio.open_memory_channel(ranges)

        async def watch(t):
            await send.send((t, await t.result(timeout=600)))

        winner = None
        t_decision = None
        async with trio.open_nursery() as n:
            for t in tickets:
                n.start_soon(watch, t)
            async for t, info in recv:
                if info.state != "SUCCEEDED" or info.outcome.get("nonce") is None:
                    continue
                o = info.outcome
                digest = hashlib.sha256(prefix.encode() + o["nonce"].to_bytes(8, "big")).digest()
                if leading_zero_bits(digest) < bits:
                    await group.reject(t)  # a bad proof
                    continue
                v = await group.accept(t)
                if not v.late:
                    winner, t_decision = o, time.time()
                if v.group_state == "FINALIZED":
                    break
            n.cancel_scope.cancel()
        st = await group.wait(timeout=60)
        print(f"\n{st.outcome} ({st.outcome_reason}) after {t_decision - t_start:.2f} s")
        print(f"winner: range {winner['range']} nonce {winner['nonce']} hash {winner['hash'][:24]}… "
              f"({winner['hashes']:,} hashes in {winner['seconds']} s)")
        await trio.to_thread.run_sync(join_processes, procs, 30)
        import queue as _queue

        while True:
            try:
                stops.append(q.get(timeout=0.5))
            except _queue.Empty:
                break
        cancelled = [m for m in st.members if m.task_state == "CANCELLED"]
        print(f"members cancelled by the decision: {len(cancelled)} of {len(st.members)}")
        events: dict[int, dict] = {}
        for kind, idx, rng, hashes, at in stops:
            events.setdefault(rng, {})[kind] = (idx, hashes, at)
        late = []
        for rng in range(ranges):
            ev = events.get(rng, {})
            if rng == winner["range"]:
                continue
            if "stopped" in ev:
                idx, hashes, at = ev["stopped"]
                took = at - t_decision
                print(f"  range {rng}: worker {idx} stopped {took:5.2f} s after the decision "
                      f"(cancelled at its lease renewal, after {hashes:,} hashes)")
                if took > LEASE_S / 3 + 1.0:
                    late.append(rng)
            elif "found" in ev:
                idx, _h, at = ev["found"]
                print(f"  range {rng}: worker {idx} also found a proof {at - t_decision:+.2f} s after the decision, "
                      "before its renewal; its complete was refused")
            elif "started" in ev:
                print(f"  range {rng}: worker {ev['started'][0]} started but did not report how it ended")
            else:
                print(f"  range {rng}: cancelled before a worker picked it up")
        if late:
            print(f"  {len(late)} worker(s) took longer than one renewal period ({LEASE_S / 3:g} s) to stop")
        await run.complete()
        return 0 if st.outcome == "SUCCESS" and not late else 1


def main() -> int:
    ap = parser(__doc__.splitlines()[1])
    ap.add_argument("--bits", type=int, default=None, help="leading zero bits (default 21; 18 with --quick)")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--ranges", type=int, default=None, help="group members (default: workers)")
    args = ap.parse_args()
    bits = args.bits or (18 if args.quick else 21)
    q = mp_context().Queue()
    with daemon(args) as server:
        return trio.run(coordinate, server, bits, args.workers, args.ranges or args.workers, q)


if __name__ == "__main__":
    raise SystemExit(main())
