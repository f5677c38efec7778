#!/usr/bin/env python
"""CPU per task lifecycle in the decide/apply core, in process (no network, no fsync).

    PYTHONPATH=/path/to/tree python scripts/bench_commit_events.py [--batches 300]

Drives an embedded coordinator (memory durability) with ``coord.decide`` directly:
``submit_many`` of 100, ``receive`` of 100, then a ``complete`` per delivery; prints the
process CPU time per lifecycle and the garbage collector's work. Run it with
``PYTHONPATH`` pointing at two trees to compare them (e.g. before and after events:
every lifecycle makes three events here).
"""

from __future__ import annotations

import argparse
import gc
import time

import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.client.api import encode_payload
from rallypoint.service import Session


async def run(batches: int) -> None:
    collections = [0, 0.0]

    def cb(phase, info):
        if phase == "start":
            cb.t = time.perf_counter()
        else:
            collections[0] += 1
            collections[1] += time.perf_counter() - cb.t

    gc.callbacks.append(cb)
    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        s = Session()
        run_ = await rs.scopes.create(name="bench")
        await rs.mailboxes.ensure("q")
        items = [p.SubmitItem(input=encode_payload({"i": i})) for i in range(100)]
        t0 = time.process_time()
        for _ in range(batches):
            coord.decide(s, p.TaskSubmitMany(mailbox="q", scope_id=run_.id, items=items))
            got = coord.decide(s, p.Receive(mailbox="q", scope_id=run_.id, max_messages=100, lease_ms=30000))
            for d in got.deliveries:
                coord.decide(s, p.DeliveryComplete(task_id=d.task_id, token=d.token, outcome=encode_payload(1)))
        dt = time.process_time() - t0
    gc.callbacks.remove(cb)
    n = batches * 100
    events = getattr(getattr(coord, "events", None), "emitted", None)
    print(f"{dt / n * 1e6:.2f} us CPU per lifecycle ({n} lifecycles"
          + (f", {events} events" if events is not None else ", no events in this tree")
          + f"); GC: {collections[0]} collections, {collections[1] * 1000:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=300)
    args = ap.parse_args()
    trio.run(run, args.batches)


if __name__ == "__main__":
    main()
