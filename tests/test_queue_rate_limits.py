"""Rate limits per fairness key (issue 44): ``mailbox.ensure(rate_limits={key: n})``
lets a key's tasks be delivered at most ``n`` a second, in fixed 1-second windows of the
server's clock; a limited key is passed over (its turn and its tasks' places kept), the
other keys go on, a parked receive is woken when the window turns; ``"*"`` limits every
key without its own; the settings and the windows' counts are journaled and in
snapshots. Under trio's MockClock (seconds pass in no real time)."""

from __future__ import annotations

from collections import Counter

import pytest
import trio

import rallypoint
from rallypoint.actors.queue_state import rate_room
from rallypoint.errors import ValidationError

pytestmark = pytest.mark.timeout(120)


async def _window_start(ers) -> None:
    """Sleep to the start of the server's next 1-second window."""
    now_ms = ers.node.coordinator.clock.now_ms()
    await trio.sleep((1000 - now_ms % 1000 + 1) / 1000)


async def test_a_limited_key_is_passed_over_and_the_others_go_on(autojump_clock, ers):
    m = await ers.mailboxes.ensure("rate-a", rate_limits={"slow": 3})
    assert m.info.rate_limits == {"slow": 3}
    run = await ers.scopes.create()
    await m.submit_many([f"s{i}" for i in range(10)], scope=run, fair_key="slow", details=False)
    await m.submit_many([f"f{i}" for i in range(10)], scope=run, fair_key="fast", details=False)
    await _window_start(ers)
    got = await m.receive(run, wait=0, max_messages=20)
    assert Counter(d.fair_key for d in got) == {"slow": 3, "fast": 10}
    assert [d.input for d in got if d.fair_key == "slow"] == ["s0", "s1", "s2"]
    assert await m.receive(run, wait=0, max_messages=20) == []  # the rest of the window: nothing
    await trio.sleep(1)  # the next window
    got = await m.receive(run, wait=0, max_messages=20)
    assert [d.input for d in got] == ["s3", "s4", "s5"]  # FIFO within the key, 3 again
    # a change keeps what the window counted; {} lifts the limit
    await ers.mailboxes.ensure("rate-a", rate_limits={"slow": 4})
    assert [d.input for d in await m.receive(run, wait=0, max_messages=20)] == ["s6"]
    await ers.mailboxes.ensure("rate-a", rate_limits={})
    assert [d.input for d in await m.receive(run, wait=0, max_messages=20)] == ["s7", "s8", "s9"]


async def test_a_star_limits_every_key_without_its_own_and_no_key_is_never_limited(autojump_clock, ers):
    m = await ers.mailboxes.ensure("rate-star", rate_limits={"*": 2, "vip": 5})
    run = await ers.scopes.create()
    for key in ("a", "b", "vip"):
        await m.submit_many([f"{key}{i}" for i in range(8)], scope=run, fair_key=key, details=False)
    await m.submit_many([f"n{i}" for i in range(4)], scope=run, details=False)  # no key
    await _window_start(ers)
    got = await m.receive(run, wait=0, max_messages=100)
    assert Counter(d.fair_key for d in got) == {"a": 2, "b": 2, "vip": 5, None: 4}


async def test_a_rate_limit_does_not_break_priority_order_or_the_shares_of_the_others(autojump_clock, ers):
    """An urgent task of a limited key waits for its window; meanwhile the other keys'
    tasks go in their weights' proportion."""
    m = await ers.mailboxes.ensure("rate-prio", rate_limits={"capped": 1}, weights={"big": 3})
    run = await ers.scopes.create()
    await _window_start(ers)
    await m.submit("c-urgent-0", scope=run, fair_key="capped", priority=1)
    await m.submit("c-urgent-1", scope=run, fair_key="capped", priority=1)
    await m.submit_many([f"b{i}" for i in range(40)], scope=run, fair_key="big", details=False)
    await m.submit_many([f"s{i}" for i in range(40)], scope=run, fair_key="small", details=False)
    got = await m.receive(run, wait=0, max_messages=41)
    assert got[0].input == "c-urgent-0"  # the most urgent, within its limit
    assert Counter(d.fair_key for d in got[1:]) == {"big": 30, "small": 10}
    await trio.sleep(1)
    assert (await m.receive(run, wait=0)).input == "c-urgent-1"  # first again in the next window


async def test_a_parked_receive_is_woken_when_the_window_turns(autojump_clock, ers):
    m = await ers.mailboxes.ensure("rate-park", rate_limits={"k": 1})
    run = await ers.scopes.create()
    await m.submit_many(["x0", "x1"], scope=run, fair_key="k", details=False)
    await _window_start(ers)
    t0 = ers.node.coordinator.clock.now_ms()
    assert (await m.receive(run, wait=0)).input == "x0"
    d = await m.receive(run, wait=30)  # parks: x1 is ready but its key is at its limit
    took = ers.node.coordinator.clock.now_ms() - t0
    assert d.input == "x1" and 990 <= took <= 1100, took


@pytest.mark.parametrize("via", ["journal", "snapshot"])
async def test_the_limits_and_the_windows_counts_survive_a_journal_replay_and_a_snapshot(tmp_path, autojump_clock,
                                                                                          via):
    """``journal``: the deliveries are replayed; ``snapshot``: they were made between two
    snapshots, so only the second snapshot holds their count."""
    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data) as rs:
        m = await rs.mailboxes.ensure("rate-dur", rate_limits={"k": 5, "*": 2})
        run = await rs.scopes.create()
        await m.submit_many([f"k{i}" for i in range(9)], scope=run, fair_key="k", details=False)
        await m.submit_many([f"o{i}" for i in range(9)], scope=run, fair_key="other", details=False)
        if via == "snapshot":
            await rs.node.snapshotter.snapshot()
        await _window_start(rs)
        assert len(await m.receive(run, wait=0, max_messages=3)) == 3  # counted in this window
        q = rs.node.coordinator.queues.table[m.info.id]
        used, window = dict(q.rate_used), q.rate_window
        assert used == {"k": 2, "other": 1}  # (stride: k, other, k)
        if via == "snapshot":
            await rs.node.snapshotter.snapshot()
    async with rallypoint.open_embedded(data) as rs:
        q = rs.node.coordinator.queues.table[m.info.id]
        assert q.rate_limits == {"*": 2, "k": 5}
        assert (q.rate_window, q.rate_used) == (window, used)
        at = window * 1000 + 500  # what is left of that window, as the server judges it
        assert (rate_room(q, "k", at), rate_room(q, "other", at), rate_room(q, None, at)) == (3, 1, None)
        assert (await rs.mailboxes.get("rate-dur")).info.rate_limits == {"*": 2, "k": 5}


async def test_bad_rate_limits_are_refused_with_the_field(autojump_clock, ers):
    for limits, field in (({"k": 0}, "rate_limits['k']"), ({"k": 100_001}, "rate_limits['k']"),
                          ({"": 1}, "rate_limits")):
        with pytest.raises(ValidationError) as ei:
            await ers.mailboxes.ensure("rate-bad", rate_limits=limits)
        assert ei.value.details["field"] == field, limits


@pytest.mark.parametrize("limited", [10, "many"])
async def test_on_an_aging_queue_a_limited_keys_aged_tasks_do_not_hold_up_the_others(autojump_clock, ers, limited):
    """Aging serves a level's oldest task first; when that task's key is at its limit
    the oldest task of a free key is served instead. Past more limited tasks than one
    pick sets aside (:data:`~rallypoint.actors.queue_ready.MAX_PARKED`) that pick serves
    the level by its turns without aging (``new0`` first), and the next pick, looking
    further, finds the aged task."""
    from rallypoint.actors.queue_ready import MAX_PARKED

    n = MAX_PARKED + 50 if limited == "many" else limited
    m = await ers.mailboxes.ensure("rate-aging", aging_seconds=10, rate_limits={"old": 1})
    run = await ers.scopes.create()
    await m.submit_many([f"old{i}" for i in range(n)], scope=run, fair_key="old", priority=5, details=False)
    await m.submit("old-other", scope=run, fair_key="other-old", priority=5)
    await trio.sleep(35)  # the old ones aged 3 levels: effective priority 2
    await m.submit_many([f"new{i}" for i in range(3)], scope=run, fair_key="new", priority=3, details=False)
    await _window_start(ers)
    got = [d.input for d in await m.receive(run, wait=0, max_messages=6)]
    if limited == "many":
        assert got == ["old0", "new0", "old-other", "new1", "new2"]
    else:
        assert got == ["old0", "old-other", "new0", "new1", "new2"]
    await trio.sleep(1)
    assert [d.input for d in await m.receive(run, wait=0, max_messages=6)] == ["old1"]
