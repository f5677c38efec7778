"""The cost of the actor runtime itself, in process (no sockets):

* a command through an actor's inbox (``Service.submit`` -> inbox -> the actor's task
  -> decide -> reply), with 1 caller waiting for each answer and with 16 callers at
  once, in CPU microseconds per command (``time.process_time``, so a busy machine
  shifts the figures less than wall time would);
* the same commands decided directly on the caller's task (``Coordinator.decide``, no
  inbox), for comparison: the difference is what the inbox hop costs;
* re-activating a passive run (a command to a run whose actor passivated).

Prints figures, asserts nothing::

    python scripts/bench_actor.py [--commands 20000]
"""

from __future__ import annotations

import argparse
import time

import trio
import trio.testing

import rallypoint
from rallypoint import protocol as p
from rallypoint.service import Session


class _Sink:
    closed = False

    def __init__(self) -> None:
        self.n = 0
        self.want = 0
        self.event = trio.Event()

    def deliver(self, rid, reply, lsn) -> None:
        self.n += 1
        if self.n >= self.want:
            self.event.set()

    def track(self, rid, waiter) -> None:
        pass

    def untrack(self, rid) -> None:
        pass

    def flush(self) -> None:
        pass


async def _through_inbox(service, session, body: bytes, n: int, callers: int) -> float:
    async def caller(k: int) -> None:
        sink = _Sink()
        for i in range(k):
            sink.want, sink.event = sink.n + 1, trio.Event()
            service.submit(session, body, sink, i)
            await sink.event.wait()

    per = n // callers
    t0 = time.process_time()
    async with trio.open_nursery() as nursery:
        for _ in range(callers):
            nursery.start_soon(caller, per)
    return (time.process_time() - t0) / (per * callers) * 1e6


async def main(n: int) -> None:
    async with rallypoint.open_embedded() as rs:
        coord, service, session = rs.node.coordinator, rs.node.service, Session()
        run = await rs.scopes.create()
        op = p.ScopeStatus(scope_id=run.id)
        body = p.encoder.encode(op)
        for callers in (1, 16):
            await _through_inbox(service, session, body, 2000, callers)  # warm-up
            us = await _through_inbox(service, session, body, n, callers)
            print(f"scope.status through the run's inbox, {callers:>2} caller(s): {us:5.1f} us CPU per command")
        t0 = time.process_time()
        for _ in range(n):
            service.decode(body)
            p.encoder.encode(coord.decide(session, op))
        us = (time.process_time() - t0) / n * 1e6
        print(f"scope.status decided on the caller's task (no inbox):   {us:5.1f} us CPU per command")

    # re-activation: runs whose actors passivated, one command each
    async with rallypoint.open_embedded() as rs:
        rt = rs.node.coordinator.runtime
        runs = [await rs.scopes.create() for _ in range(2000)]
        for r in runs:
            await r.status()
        await trio.sleep(rt.idle_s + 1)
        await trio.testing.wait_all_tasks_blocked()
        assert rt.n_active == 0
        before = rt.activations
        t0 = time.process_time()
        for r in runs:
            await r.status()
        us = (time.process_time() - t0) / len(runs) * 1e6
        print(f"a command to a passive run (activation, then the command): {us:5.1f} us CPU "
              f"({rt.activations - before} activations)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commands", type=int, default=20_000)
    a = ap.parse_args()
    trio.run(main, a.commands, clock=trio.testing.MockClock(autojump_threshold=0))
