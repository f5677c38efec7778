"""``consume()`` rides out refusals that pass by themselves (issue 42, item 1).

The input as found: ``--min-free-mb 16`` on a small filesystem, filled to 10 MiB free
for 8 s then freed; both ``consume(lease_seconds=6)`` loops raised
``UnavailableError("disk full at ...")`` within 2 s -- the idle one on its refused
receive, the busy one on a refused renewal (its handler cancelled) -- and 5 tasks
submitted after the space came back were never run. Here the same on a faulty disk
(tests/test_persistence_diskfull.py's ``FaultyDisk``), and the other kinds of the same
fault: no in-sync standby under ``--min-insync 2`` and a failover (NOT_LEADER), each a
refusal with ``retry_after`` that applied nothing.
"""

from __future__ import annotations

import logging

import pytest
import trio

import rallypoint
from rallypoint.client.consume import _ridden, ConsumeStats
from rallypoint.errors import (
    LimitError,
    NotLeaderError,
    UnavailableError,
    is_transient_refusal,
)

from test_persistence_diskfull import BIG, FaultyDisk, faulty_node, fill_disk

pytestmark = pytest.mark.timeout(120)


class _Kinds(logging.Handler):
    """The ``kind`` of every consume_refused log line."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.kinds: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "consume_refused":
            self.kinds.add(record.kind)


async def wait_until(pred, timeout=60.0):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


async def test_consume_rides_out_a_full_disk_on_its_receive_and_its_renewal_and_runs_what_comes_after(tmp_path):
    disk = FaultyDisk()
    kinds = _Kinds()
    logging.getLogger("rallypoint.consume").addHandler(kinds)
    try:
        async with faulty_node(tmp_path, disk) as rs:
            run = await rs.scopes.create(name="work")
            idle_q = await rs.mailboxes.ensure("idle")
            busy_q = await rs.mailboxes.ensure("busy")
            started = trio.Event()
            go = trio.Event()
            done: list[int] = []

            async def busy(d):
                started.set()
                await go.wait()  # runs across the refusals: its lease must be kept
                return {"ok": d.input["n"]}

            async def idle(d):
                done.append(d.input["n"])
                return d.input["n"]

            stats = {}

            async def serve(name, q, handler):
                stats[name] = await rallypoint.consume(rs, q, run, handler, lease_seconds=5, wait=1,
                                                       handle_signals=False)

            async with trio.open_nursery() as n:
                n.start_soon(serve, "idle", idle_q, idle)
                n.start_soon(serve, "busy", busy_q, busy)
                long_task = await busy_q.submit({"n": 0}, scope=run)
                await started.wait()
                await fill_disk(rs, disk, 50_000)
                # both refused (the idle loop's receive, the busy one's renewal), neither gave up
                await wait_until(lambda: {"receive", "renew"} <= kinds.kinds)
                disk.free = BIG
                await rs.node.coordinator.journal.wait_writable()
                go.set()
                tickets = [await idle_q.submit({"n": i}, scope=run) for i in range(1, 6)]
                for t in tickets:
                    await rs.task(t.id).result(timeout=30)
                info = await rs.task(long_task.id).result(timeout=30)
                assert info.state == "SUCCEEDED" and info.attempt == 1  # the same attempt: its lease was kept
                await run.cancel()
            assert sorted(done) == [1, 2, 3, 4, 5]
            assert stats["busy"].completed == 1 and stats["busy"].lost == 0 and stats["busy"].refused >= 1
            assert stats["idle"].completed == 5 and stats["idle"].refused >= 1
    finally:
        logging.getLogger("rallypoint.consume").removeHandler(kinds)


def test_which_refusals_are_waited_out():
    # passing by themselves, nothing applied: waited out
    assert is_transient_refusal(UnavailableError("disk full", retry_after=1.0, details={"reason": "low"}))
    assert is_transient_refusal(UnavailableError("disk full", retry_after=1.0, details={"reason": "stalled"}))
    assert is_transient_refusal(UnavailableError("no standby", retry_after=1.0, details={"reason": "min_insync"}))
    assert is_transient_refusal(NotLeaderError("a failover", retry_after=0.5))
    assert is_transient_refusal(LimitError("too many", retry_after=2.0))
    # not: the client gave up reconnecting, a request that may have been applied, no retry_after
    assert not is_transient_refusal(UnavailableError("could not be re-established", retry_after=1.0))
    assert not is_transient_refusal(UnavailableError("lost in flight", retry_after=1.0,
                                                     details={"reason": "low", "maybe_applied": True}))
    assert not is_transient_refusal(LimitError("too big"))
    assert not is_transient_refusal(UnavailableError("disk full", details={"reason": "low"}))


async def test_a_refused_call_is_made_again_with_backoff_until_it_is_taken(autojump_clock):
    calls = []
    stats = ConsumeStats()

    async def call():
        calls.append(trio.current_time())
        if len(calls) < 5:
            raise UnavailableError("no in-sync standby", retry_after=1.0, details={"reason": "min_insync"})
        return "taken"

    assert await _ridden(call, "a receive", "receive", stats) == "taken"
    gaps = [round(b - a, 3) for a, b in zip(calls, calls[1:])]
    assert gaps == [1.0, 2.0, 4.0, 8.0] and stats.refused == 4

    async def refused_for_good():
        raise UnavailableError("the connection could not be re-established", retry_after=1.0)

    with pytest.raises(UnavailableError, match="re-established"):
        await _ridden(refused_for_good, "a receive", "receive", stats)
