#!/usr/bin/env python
"""Review 12 drafts, keep the first 5 good ones, cancel the rest (an N_ACCEPTED group).

Worker PROCESSES score drafts with ``rallypoint.consume`` on the group's gate run (each
draft takes a while, like a model call); the reviewer (this process) reads each
member's result as it finishes, accepts a draft scoring at least 0.5 and rejects the
others. When 5 are accepted the group finalizes, the gate run is cancelled, and the
drafts still being scored are cancelled: their workers' handlers are stopped at the
next lease renewal. Prints the decision and which members were cancelled.

    python examples/review_drafts.py --connect tcp://127.0.0.1:7411 [--api-key KEY]
    python examples/review_drafts.py --spawn [--quick]
"""

from __future__ import annotations

import hashlib
import time

import trio

import rallypoint
from _common import daemon, join_processes, parser, start_processes

N_DRAFTS = 12
N_ACCEPTED = 5
TOPICS = ["queues", "leases", "fencing tokens", "barriers", "join sets", "timers", "groups", "budgets",
          "quotas", "claims", "pools", "events"]


def draft_text(i: int) -> str:
    return f"Draft {i}: a short explainer on {TOPICS[i % len(TOPICS)]} for the rallypoint docs."


def score(text: str) -> float:
    """A deterministic stand-in for a model's judgement, in [0, 1)."""
    h = hashlib.sha256(text.encode()).digest()
    return round(0.25 + 0.75 * h[0] / 256, 3)


def worker_process(index: int, server: dict, gate_id: str, quick: bool) -> None:
    async def handler(delivery):
        text = delivery.input["text"]
        # "Thinking": the later drafts take longer, so some are still running at the end.
        think = (0.05 if quick else 0.3) * (1 + delivery.input["i"] % 6)
        try:
            await trio.sleep(think)
        except trio.Cancelled:
            print(f"  worker {index}: draft {delivery.input['i']} cancelled while scoring", flush=True)
            raise
        return {"score": score(text), "by": f"worker-{index}"}

    async def main():
        async with rallypoint.connect(**server, client_name=f"scorer-{index}") as rs:
            stats = await rallypoint.consume(rs, "drafts", gate_id, handler, concurrency=2, lease_seconds=6)
            print(f"  worker {index}: stopped ({stats.stop_reason}): {stats.completed} scored, "
                  f"{stats.lost} cancelled", flush=True)

    trio.run(main)


async def review(server: dict, workers: int, quick: bool) -> int:
    async with rallypoint.connect(**server, client_name="reviewer") as rs:
        run = await rs.scopes.create(name="review-drafts")
        mbx = await rs.mailboxes.ensure("drafts")
        group = await run.groups.create(mbx, "N_ACCEPTED", threshold=N_ACCEPTED, expected_members=N_DRAFTS)
        print(f"group {group.id}: N_ACCEPTED {N_ACCEPTED} of {N_DRAFTS}, gate run {group.scope_id}")
        procs = start_processes(worker_process, workers, server, group.scope_id, quick)
        tickets = [await group.submit({"i": i, "text": draft_text(i)}, key=f"draft-{i}") for i in range(N_DRAFTS)]
        names = {t.id: f"draft-{i}" for i, t in enumerate(tickets)}
        t0 = time.monotonic()
        send, recv = trio.open_memory_channel(N_DRAFTS)

        async def watch(t):
            await send.send((t, await t.result(timeout=120)))

        async with trio.open_nursery() as n:
            for t in tickets:
                n.start_soon(watch, t)
            seen = 0
            async for t, info in recv:
                seen += 1
                if info.state == "SUCCEEDED":
                    s = info.outcome["score"]
                    verdict = group.accept if s >= 0.5 else group.reject
                    v = await verdict(t)
                    print(f"  {names[t.id]:9} score {s:.3f} by {info.outcome['by']}: {v.verdict.lower()}"
                          + (" (late)" if v.late else "") + f"  -> group {v.group_state}")
                    if v.group_state == "FINALIZED":
                        break
                if seen == N_DRAFTS:
                    break
            n.cancel_scope.cancel()
        st = await group.wait(timeout=60)
        dt = time.monotonic() - t0
        print(f"\ndecision after {dt:.2f} s: {st.outcome} ({st.outcome_reason})")
        by = {"ACCEPTED": [], "REJECTED": [], "CANCELLED": [], "OTHER": []}
        for m in st.members:
            if m.verdict in ("ACCEPTED", "REJECTED"):
                by[m.verdict].append(names[m.task_id])
            elif m.task_state == "CANCELLED":
                by["CANCELLED"].append(names[m.task_id])
            else:
                by["OTHER"].append(f"{names[m.task_id]} ({m.task_state})")
        print(f"accepted:  {', '.join(by['ACCEPTED'])}")
        print(f"rejected:  {', '.join(by['REJECTED']) or '-'}")
        print(f"cancelled: {', '.join(by['CANCELLED']) or '-'}")
        if by["OTHER"]:
            print(f"finished, not judged: {', '.join(by['OTHER'])}")
        await trio.to_thread.run_sync(join_processes, procs)
        await run.complete()
        return 0 if st.outcome == "SUCCESS" else 1


def main() -> int:
    ap = parser(__doc__.splitlines()[1])
    ap.add_argument("--workers", type=int, default=3, help="scoring processes (default %(default)s)")
    args = ap.parse_args()
    with daemon(args) as server:
        return trio.run(review, server, args.workers, args.quick)


if __name__ == "__main__":
    raise SystemExit(main())
