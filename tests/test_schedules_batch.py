"""Schedules due at one instant (issue 45, the fire-lag goal): one heap entry per fire
instant, fired in group commits (one journal entry per :data:`STEP_FIRES` schedules,
each fire with its run in it), a full disk part-way through a group leaving no schedule
unfired nor fired twice; and :meth:`Coordinator.grouped` itself. Embedded under trio's
MockClock (autojump); ``STEP_FIRES`` is made small so a few schedules make several
groups."""

from __future__ import annotations

import pytest
import trio

import rallypoint.actors.schedule as schedule_mod
from rallypoint.errors import UnavailableError
from rallypoint.records import ScheduleFired, ScopeCreated
from rallypoint.clock import ms_to_datetime

from test_schedules import capture_commits, coord, sleep_to, until

N = 25
STEP = 10


async def make(ers, n: int = N) -> list[str]:
    """``n`` schedules every minute (allow_all); their ids."""
    ids = []
    for i in range(n):
        s = await ers.schedules.create(f"s{i:02d}", cron="* * * * *", overlap="allow_all")
        ids.append(s.info.id)
    return ids


def bucket_entries(c) -> list:
    return [e for e in c.heap.entries() if e[3] == c.schedules._on_bucket]


def fires_at(c, t_ms: int) -> dict[str, int]:
    """schedule id -> how many actions it has for scheduled time ``t_ms``."""
    out: dict[str, int] = {}
    for a in c.schedules.actions.values():
        if a.scheduled_ms == t_ms:
            out[a.schedule_id] = out.get(a.schedule_id, 0) + 1
    return out


async def test_schedules_due_at_one_instant_are_one_heap_entry_fired_in_group_commits(
        autojump_clock, ers, monkeypatch):
    monkeypatch.setattr(schedule_mod, "STEP_FIRES", STEP)
    c = coord(ers)
    ids = await make(ers)
    t = c.schedules.next_due[ids[0]][0]
    assert {c.schedules.next_due[i] for i in ids} == {(t, t)}
    entries = bucket_entries(c)
    assert len(entries) == 1 and entries[0][4] == t  # one heap entry for the 25 schedules
    assert list(c.schedules.buckets[t]) == ids  # in creation (arm) order
    commits = capture_commits(ers)
    await sleep_to(ms_to_datetime(t), ers)
    await until(lambda: len(fires_at(c, t)) == N)
    assert fires_at(c, t) == {i: 1 for i in ids}
    groups = [recs for recs in commits if any(type(r) is ScheduleFired for r in recs)]
    assert [sum(type(r) is ScheduleFired for r in g) for g in groups] == [10, 10, 5]  # 3 journal entries
    fired_order = []
    for g in groups:  # every fire with its run, adjacent, in the same entry
        assert [type(r) for r in g] == [ScopeCreated, ScheduleFired] * (len(g) // 2)
        for run, fire in zip(g[::2], g[1::2]):
            assert fire.run_id == run.id and fire.scheduled_ms == t
            fired_order.append(fire.schedule_id)
    assert fired_order == ids
    # the lag of each fire is taken once its group is journaled; every schedule is armed
    # again, all in the one next bucket
    k = c.schedules
    assert sum(k.lag_counts) == k.fires == N and len(k.lag_samples) == N and min(k.lag_samples) >= 0
    assert t not in k.buckets and list(k.buckets[t + 60_000]) == ids
    assert len(bucket_entries(c)) == 1


async def test_a_full_disk_part_way_through_a_bucket_fires_every_schedule_once_when_writes_return(
        autojump_clock, ers, monkeypatch):
    monkeypatch.setattr(schedule_mod, "STEP_FIRES", STEP)
    c = coord(ers)
    ids = await make(ers)
    t = c.schedules.next_due[ids[0]][0]
    journal = c.journal
    orig = journal.check_writable
    calls = {"n": 0, "refused": 0}

    def check_writable():
        if c.now_ms() >= t:
            calls["n"] += 1
            if calls["n"] == STEP + 5:  # the 15th fire: the 2nd group, part-way
                calls["refused"] += 1
                raise UnavailableError("disk full", retry_after=0.5)
        return orig()

    monkeypatch.setattr(journal, "check_writable", check_writable)
    commits = capture_commits(ers)
    await sleep_to(ms_to_datetime(t), ers)
    await until(lambda: len(fires_at(c, t)) == N, timeout=30)
    assert calls["refused"] == 1
    assert fires_at(c, t) == {i: 1 for i in ids}  # none missed, none twice
    groups = [sum(type(r) is ScheduleFired for r in recs) for recs in commits]
    groups = [g for g in groups if g]
    # 10; the 4 applied before the refusal (journaled all the same); the 11 left, retried
    assert groups == [10, 4, 10, 1]
    await sleep_to(ms_to_datetime(t + 60_000), ers)
    await until(lambda: len(fires_at(c, t + 60_000)) == N, timeout=30)
    assert fires_at(c, t + 60_000) == {i: 1 for i in ids}


async def test_grouped_applies_each_commit_at_once_and_journals_them_as_one_entry(autojump_clock, ers):
    c = coord(ers)
    a = await ers.schedules.create("a", cron="0 0 1 1 *")
    b = await ers.schedules.create("b", cron="0 0 1 1 *")
    commits = capture_commits(ers)
    k = c.schedules
    before = c.journal.last_lsn
    seen = []

    def decide():
        for s in (a, b):
            st = k.table[s.info.id]
            c.commit(k._fire_records(st, c.now_ms(), "trigger", False, c.now_ms()))
            seen.append(len(st.running))  # applied at once: the next read sees it
        return "done"

    assert c.grouped(decide) == "done"
    assert seen == [1, 1] and c.journal.last_lsn == before + 1
    assert len(commits) == 1 and sum(type(r) is ScheduleFired for r in commits[0]) == 2

    def fails():
        st = k.table[a.info.id]
        c.commit(k._fire_records(st, c.now_ms() + 1, "trigger", False, c.now_ms()))
        raise ValueError("after one commit")

    with pytest.raises(ValueError):
        c.grouped(fails)
    # what it applied is journaled all the same: memory is never ahead of the journal
    assert c.journal.last_lsn == before + 2 and len(commits) == 2
    assert [type(r) for r in commits[1]] == [ScopeCreated, ScheduleFired]
    assert c._deferred is None
    await trio.sleep(0)


async def test_a_group_commit_is_bounded_by_bytes(autojump_clock, ers, monkeypatch):
    """Fires whose tasks carry large inputs: a new group (journal entry) once the
    estimate passes GROUP_BYTES, so an entry stays far below the journal's and a
    replication message's bound."""
    monkeypatch.setattr(schedule_mod, "GROUP_BYTES", 100_000)
    c = coord(ers)
    await ers.mailboxes.ensure("jobs")
    ids = []
    for i in range(5):
        s = await ers.schedules.create(f"big{i}", cron="* * * * *", overlap="allow_all", mailbox="jobs",
                                       input={"blob": "x" * 40_000})
        ids.append(s.info.id)
    t = c.schedules.next_due[ids[0]][0]
    commits = capture_commits(ers)
    await sleep_to(ms_to_datetime(t), ers)
    await until(lambda: len(fires_at(c, t)) == 5)
    groups = [n for n in (sum(type(r) is ScheduleFired for r in recs) for recs in commits) if n]
    assert groups == [3, 2]  # 3 x ~40.5 KB passes 100,000 bytes: the 4th starts a new entry
    assert fires_at(c, t) == {i: 1 for i in ids}


async def test_one_schedule_catching_up_many_times_spreads_over_bounded_groups(
        tmp_path, autojump_clock, monkeypatch):
    """Down for 27 s with two 1-second schedules: their 54 catch-up fires go in entries
    of at most STEP_FIRES commits -- a schedule that starts in a group part-full stops
    there too and takes the rest of its times in its next step, at once --, each time
    fired once."""
    import rallypoint
    from rallypoint.clock import Clock

    from test_durability_restart import controlled_time
    from test_schedules import actions_of

    monkeypatch.setattr(schedule_mod, "STEP_FIRES", STEP)
    d = str(tmp_path / "data")
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            s = await rs.schedules.create("sec", every=1, catchup_window=3600, overlap="allow_all")
            await rs.schedules.create("sec2", every=1, catchup_window=3600, overlap="allow_all")
            first = s.info.next_fires[0]
            await tc.advance((first - ms_to_datetime(coord(rs).now_ms())).total_seconds() + 0.01)
            assert [len(actions_of(rs, n)) for n in ("sec", "sec2")] == [1, 1]
        await tc.advance(27)
        from rallypoint.persistence.journal import Journal
        from rallypoint.records import decode_commit

        commits: list = []
        orig = Journal.append

        def append(self, payload):  # from recovery on: the catch-up fires at once
            commits.append(decode_commit(payload))
            return orig(self, payload)

        monkeypatch.setattr(Journal, "append", append)
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            await until(lambda: min(len(actions_of(rs, n)) for n in ("sec", "sec2")) >= 28, timeout=5)
            total = 0
            for n in ("sec", "sec2"):
                times = [a.scheduled_ms for a in actions_of(rs, n)]
                assert len(times) == len(set(times))  # none twice
                assert times == list(range(times[0], times[-1] + 1, 1000))  # none missed
                total += len(times) - 1
            groups = [n for n in (sum(type(r) is ScheduleFired for r in recs) for recs in commits) if n]
            assert sum(groups) == total and max(groups) <= STEP and len(groups) >= 5
