"""Cancelling a run with many parked waiters below it: the event-loop stall and the time
until every waiter is answered.

A root run gets ``--children`` child runs; under each, parked server-side waits of four
kinds (a receive on the child run, a task result, a barrier wait, a timer wait), in
total ``--waiters``. Requests go straight to ``Service.submit`` with a counting sink (no
client tasks: what is measured is the server). Then the root run is cancelled, and a
monitor task that sleeps 1 ms in a loop records the longest gap between its wake-ups
(the stall), while the sink counts answers.

Prints figures, asserts nothing::

    python scripts/bench_cancel.py [--waiters 10000] [--children 100]
"""

from __future__ import annotations

import argparse
import time

import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.service import Session


class CountingSink:
    closed = False

    def __init__(self) -> None:
        self.answers = 0
        self.errors: dict[str, int] = {}
        self.last_answer = 0.0

    def deliver(self, rid, reply, lsn) -> None:
        self.answers += 1
        self.last_answer = time.perf_counter()
        if not isinstance(reply, bytes):
            self.errors[reply.code] = self.errors.get(reply.code, 0) + 1

    def track(self, rid, waiter) -> None:
        pass

    def untrack(self, rid) -> None:
        pass

    def flush(self) -> None:
        pass


async def main(n_waiters: int, n_children: int) -> None:
    async with rallypoint.open_embedded() as rs:
        coord, service = rs.node.coordinator, rs.node.service
        session = Session()
        mbx = await rs.mailboxes.ensure("bench-cancel")
        root = await rs.scopes.create(name="root")
        children = [await root.child() for _ in range(n_children)]
        per_child = n_waiters // n_children
        ops = []
        for c in children:
            b = await c.barriers.create(per_child + 1)
            tm = await c.timers.create(after_seconds=3600)
            tickets = await mbx.submit_many([{"n": i} for i in range(per_child // 4 + 1)], scope=c)
            held = await mbx.receive(c, wait=0, max_messages=100)  # leased: results wait
            assert held
            for i in range(per_child):
                kind = i % 4
                if kind == 0:
                    ops.append(p.Receive(mailbox=mbx.name, scope_id=c.id, wait_ms=60_000))
                elif kind == 1:
                    ops.append(p.TaskResult(task_id=tickets[(i // 4) % len(tickets)].id, wait_ms=60_000))
                elif kind == 2:
                    ops.append(p.BarrierWait(barrier_id=b.id, wait_ms=60_000))
                else:
                    ops.append(p.TimerWait(timer_id=tm.id, wait_ms=60_000))
        sink = CountingSink()
        for rid, op in enumerate(ops, 1):
            service.submit(session, p.encoder.encode(op), sink, rid)
        with trio.fail_after(120):
            while coord.runtime.n_waiters < len(ops) - sink.answers:
                await trio.sleep(0.01)
        parked = coord.runtime.n_waiters
        stalls: list[float] = []
        stop = trio.Event()

        async def monitor():
            last = trio.current_time()
            while not stop.is_set():
                await trio.sleep(0.001)
                now = trio.current_time()
                stalls.append(now - last)
                last = now

        async with trio.open_nursery() as n:
            n.start_soon(monitor)
            await trio.sleep(0.05)
            before = len(stalls)
            t0 = time.perf_counter()
            await root.cancel()
            t_reply = time.perf_counter()
            with trio.fail_after(60):
                while sink.answers < len(ops):
                    await trio.sleep(0.001)
            t_all = sink.last_answer
            await trio.sleep(0.05)
            stop.set()
        during = stalls[before:]
        print(f"waiters parked below the run: {parked:,} ({n_children} child runs); "
              f"actors active before the cancel: {coord.runtime.statistics()['activations']:,} activations")
        print(f"cancel reply after {(t_reply - t0) * 1000:.1f} ms; every waiter answered after "
              f"{(t_all - t0) * 1000:.1f} ms")
        print(f"longest event-loop stall during the cancel: {max(during) * 1000:.1f} ms "
              f"(monitor sleeping 1 ms; p50 gap {sorted(during)[len(during) // 2] * 1000:.2f} ms)")
        print(f"answers by kind: {dict(sorted(sink.errors.items()))} + {sink.answers - sum(sink.errors.values())} ok replies")
        print(f"tasks left under the run: {coord.runtime.tasks_below(root.id)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waiters", type=int, default=10_000)
    ap.add_argument("--children", type=int, default=100)
    a = ap.parse_args()
    trio.run(main, a.waiters, a.children)
