"""The activity heap keeps stale entries cheap (issue 18: the daemon's tail latency was a
full GC walking ~600k lease entries of finished tasks): bound methods are stored as codes
so an entry of strings and numbers is untracked by the cyclic GC, and entries a kind
declares stale are dropped when the heap has doubled since its last compaction, without
changing the order of the rest."""

from __future__ import annotations

import gc

import trio
import trio.testing
import pytest

from rallypoint import LeaseLostError

from rallypoint.actors.runtime import PRIO_DEFAULT, PRIO_RUN_DEADLINE, PRIO_WAIT_END, ActivityHeap


class _Kind:
    def __init__(self) -> None:
        self.fired: list = []
        self.live: set = set()

    def on(self, arg) -> None:
        self.fired.append(arg)

    def other(self, arg) -> None:
        self.fired.append(("other", arg))


async def test_entries_with_atomic_args_are_not_tracked_by_the_gc(autojump_clock):
    heap, k = ActivityHeap(), _Kind()
    now = trio.current_time()
    heap.arm(now + 10, k.on, ("tsk_1", 7, 12345))
    heap.arm(now + 10, lambda a: None, ("tsk_2", 1, 2))  # a lambda is stored as itself
    gc.collect()
    bound, plain = sorted(heap._heap, key=lambda e: e[2])
    assert isinstance(bound[3], int) and not gc.is_tracked(bound)
    assert gc.is_tracked(plain)
    # entries() shows the callables themselves
    assert {e[3] for e in heap.entries()} >= {k.on}


async def test_at_one_instant_runs_deadlines_fire_first_and_wait_ends_last(autojump_clock):
    """Whatever order they were armed in, entries due at the same instant fire by
    priority (a wait's end sees what fell due at or before it), then in arm order."""
    heap, k = ActivityHeap(), _Kind()
    due = trio.current_time() + 5
    heap.arm(due, k.on, "wait-end-1", PRIO_WAIT_END)
    heap.arm(due, k.on, "roll-1")
    heap.arm(due, k.on, "wait-end-2", PRIO_WAIT_END)
    heap.arm(due, k.on, "deadline", PRIO_RUN_DEADLINE)
    heap.arm(due, k.on, "roll-2", PRIO_DEFAULT)
    heap.arm(due - 0.001, k.on, "earlier", PRIO_WAIT_END)
    assert heap.fire_due(due) == 6
    assert k.fired == ["earlier", "deadline", "roll-1", "roll-2", "wait-end-1", "wait-end-2"]


async def test_stale_entries_are_dropped_when_the_heap_doubles_and_order_is_kept(autojump_clock):
    heap, k = ActivityHeap(), _Kind()
    heap.stale_when(k.on, lambda arg: arg not in k.live)
    now = trio.current_time()
    n = 3 * ActivityHeap.COMPACT_MIN
    keep = list(range(0, n, 97))
    k.live.update(keep)
    for i in range(n):
        # later arms fall due earlier: the order of the survivors must come from the heap
        heap.arm(now + 100 - i * 0.001, k.on, i)
        heap.arm(now + 100 - i * 0.001, k.other, i) if i % 1000 == 0 else None
    # the heap never holds much more than twice its live entries plus the floor
    assert len(heap) < 2 * ActivityHeap.COMPACT_MIN + len(keep) + n // 1000 + 1
    assert heap.compacted > n - 2 * ActivityHeap.COMPACT_MIN - len(keep)
    # an entry of a kind without a stale test is never dropped
    assert sum(1 for e in heap.entries() if e[3] == k.other) == len(range(0, n, 1000))
    await trio.sleep(200)
    heap.fire_due()
    fired_on = [a for a in k.fired if not isinstance(a, tuple)]
    # everything live fired, latest armed first (earliest due), plus the stale ones not
    # yet compacted away (they would do nothing: their callback re-checks)
    assert set(keep) <= set(fired_on)
    assert [a for a in fired_on if a in k.live] == sorted(keep, reverse=True)
    assert [a for a in k.fired if isinstance(a, tuple)] == [("other", i) for i in sorted(range(0, n, 1000), reverse=True)]


async def test_a_receive_arms_one_lease_entry_and_finished_batches_are_compacted(autojump_clock, ers, monkeypatch):
    """The leases of one receive share one heap entry (arming costs per receive, not per
    delivery); batches whose tasks all finished are dropped when the heap doubles; a live
    lease survives compaction and still expires on time."""
    coord = ers.node.coordinator
    queues = coord.queues

    def lease_entries():
        return [e for e in coord.heap.entries() if e[3] == queues._on_leases]

    run = await ers.scopes.create()
    m = await ers.mailboxes.ensure("heap-leases")
    for i in range(20):
        await m.submit_many(list(range(100)), scope=run)
        ds = await m.receive(run, wait=0, max_messages=100, lease_seconds=300)
        assert len(ds) == 100
        assert len(lease_entries()) == i + 1  # one entry for the 100 deliveries
        assert not any(await m.complete_many([(d, "ok") for d in ds], details=False))
    # compaction drops finished batches (a small floor, so that a test reaches it)
    monkeypatch.setattr(ActivityHeap, "COMPACT_MIN", 64)
    coord.heap._compact_at = 64
    for _ in range(300):
        await m.submit("one", scope=run)
        d = await m.receive(run, wait=0, lease_seconds=300)
        await d.complete("ok")
    assert len(lease_entries()) < 2 * 64 + 1
    assert coord.heap.compacted >= 300 + 20 - 2 * 64
    # a live lease survives compaction and still expires on time
    await m.submit("late", scope=run)
    d = await m.receive(run, wait=0, lease_seconds=30)
    for _ in range(3 * 64):
        coord.heap.arm(trio.current_time() + 1000, queues._on_leases, (0, ["tsk_none"]))
    await trio.sleep(31)
    again = await m.receive(run, wait=0)
    assert again.task_id == d.task_id and again.attempt == 2 and again.token == d.token + 1


async def test_lease_expiry_of_a_batch_expires_only_the_tasks_still_held(autojump_clock, ers):
    """Of one receive's batch, the completed and the renewed tasks are left alone when the
    batch's lease time comes; the others expire (one LeaseExpired each) and are
    delivered again."""
    run = await ers.scopes.create()
    m = await ers.mailboxes.ensure("heap-batch")
    await m.submit_many([f"t{i}" for i in range(6)], scope=run)
    ds = await m.receive(run, wait=0, max_messages=6, lease_seconds=30)
    assert len(ds) == 6
    await ds[0].complete("done")
    await trio.sleep(20)
    await ds[1].renew(60)
    await trio.sleep(11)  # past the batch's 30 s
    again = await m.receive(run, wait=0, max_messages=10)
    assert sorted(d.task_id for d in again) == sorted(d.task_id for d in ds[2:])
    assert all(d.attempt == 2 for d in again)
    with pytest.raises(LeaseLostError):
        await ds[2].complete("late")
    assert (await ds[1].complete("kept")).state == "SUCCEEDED"  # its renewed lease was not touched


async def test_a_refused_activity_is_held_until_its_retry_or_release_held_and_runs_once():
    """An activity refused with UNAVAILABLE is held: tried again at the refusal's
    retry_after, or as soon as release_held() says writes are accepted again; refused
    again it keeps its place (one held entry), and once applied the other retry finds
    nothing to do."""
    from rallypoint.errors import UnavailableError

    heap = ActivityHeap()
    refuse = [2]
    applied: list = []

    class K:
        def act(self, arg):
            if refuse[0]:
                refuse[0] -= 1
                raise UnavailableError("disk full (test)", retry_after=60.0)
            applied.append(arg)

    k = K()
    now = trio.current_time()
    heap.arm(now, k.act, "x")
    heap.fire_due(now)
    assert applied == [] and len(heap._held) == 1
    assert heap.release_held() == 1
    heap.fire_due()  # released, refused again: still one held entry
    assert applied == [] and len(heap._held) == 1 and refuse == [0]
    heap.release_held()
    heap.fire_due()
    assert applied == ["x"] and heap._held == {}
    heap.fire_due(trio.current_time() + 120)  # the timed retries, stale now
    assert applied == ["x"] and len(heap) == 0
