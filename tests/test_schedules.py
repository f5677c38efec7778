"""Schedules (issue 45): recurring actions fired by the server, exactly once per
scheduled time. Embedded under trio's MockClock (autojump): minutes pass in
milliseconds, and every wait is on a simulated instant or a condition, never the wall
clock. Restarts use a data dir and one Clock shared by the node before and after."""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
import trio

import rallypoint
from rallypoint.actors.schedule import jitter_ms_of, spec_times
from rallypoint.clock import Clock, ms_to_datetime
from rallypoint.errors import ConflictError, LimitError, NotFoundError, ValidationError
from rallypoint.records import ScheduleConfig, ScheduleFired, ScopeCreated, TaskSubmitted, decode_commit

from test_durability_restart import controlled_time

UTC = timezone.utc


def coord(rs):
    return rs.node.coordinator


def now(rs) -> datetime:
    return ms_to_datetime(coord(rs).now_ms())


async def sleep_to(when: datetime, rs, extra: float = 0.001) -> None:
    """Sleep (simulated time) until the wall instant ``when`` plus ``extra`` seconds."""
    ms = int(round(when.timestamp() * 1000))
    await trio.sleep_until(coord(rs).clock.trio_time_at(ms) + extra)


async def until(pred, timeout: float = 600.0, step: float = 0.05) -> None:
    """Wait (simulated time) until ``pred()`` is true; fail after ``timeout`` s."""
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(step)


def actions_of(rs, name: str):
    k = coord(rs).schedules
    sid = k.by_name[("default", name)]
    return sorted((a for a in k.actions.values() if a.schedule_id == sid), key=lambda a: a.scheduled_ms)


def fired_times(rs, name: str) -> list[int]:
    return [a.scheduled_ms for a in actions_of(rs, name)]


async def work_all(rs, mb, outcome="ok", fail=False) -> int:
    """Complete (or reject) every queued task of ``mb`` in every run; returns how many."""
    n = 0
    for a in list(coord(rs).schedules.actions.values()):
        if a.state != "RUNNING" or a.task_id is None:
            continue
        d = await mb.receive(scope=rs.scope(a.run_id), wait=0)
        if d is None:
            continue
        if fail:
            await d.reject("boom")
        else:
            await d.complete(outcome)
        n += 1
    return n


# ------------------------------------------------------------------------ spec forms

def capture_commits(rs) -> list:
    """Record every journal entry the coordinator appends from now on (decoded)."""
    j = coord(rs).journal
    seen: list = []
    orig = j.append

    def append(payload):
        seen.append(decode_commit(payload))
        return orig(payload)

    j.append = append
    return seen


async def test_interval_with_offset_fires_each_time_once_with_its_run_and_task_in_one_commit(autojump_clock, ers):
    mb = await ers.mailboxes.ensure("jobs")
    commits = capture_commits(ers)
    s = await ers.schedules.create("tick", every=60, offset=15, mailbox="jobs", input={"n": 1},
                                   run_name="{schedule} at {time}", metadata={"team": "a"}, overlap="allow_all")
    nxt = s.info.next_fires
    assert len(nxt) == 5
    assert all(f.second == 15 and f.microsecond == 0 for f in nxt)  # every minute, 15 s past it
    assert [(b - a).total_seconds() for a, b in zip(nxt, nxt[1:])] == [60.0] * 4
    await sleep_to(nxt[2], ers)
    acts = actions_of(ers, "tick")
    assert [ms_to_datetime(a.scheduled_ms) for a in acts] == nxt[:3]
    for a in acts:  # each action: a root run named by the template, a task in it
        run = await ers.scope(a.run_id).status()
        assert run.parent_id is None and run.name == "tick at " + ms_to_datetime(a.scheduled_ms).strftime(
            "%Y-%m-%dT%H:%M:%S") + ".000Z"
        assert run.tasks == {"QUEUED": 1} and a.task_id is not None
    # ... the three records of each fire in ONE journal entry, keyed by the scheduled time
    fires = [recs for recs in commits if any(type(r) is ScheduleFired for r in recs)]
    assert len(fires) == 3
    for recs, a in zip(fires, acts):
        assert [type(r) for r in recs] == [ScopeCreated, TaskSubmitted, ScheduleFired]
        assert recs[0].id == recs[1].scope_id == recs[2].run_id == a.run_id and recs[2].scheduled_ms == a.scheduled_ms
    d = await s.describe(next_n=2, recent=3)
    assert d.actions == 3 and d.metadata == {"team": "a"} and len(d.next_fires) == 2
    assert [a.scheduled_at for a in d.recent] == list(reversed(nxt[:3]))  # newest first
    assert all(a.origin == "scheduled" and a.state == "RUNNING" for a in d.recent)
    task = await mb.receive(scope=ers.scope(acts[0].run_id), wait=0)
    assert task.input == {"n": 1}


async def test_cron_in_a_time_zone_fires_at_local_wall_time(autojump_clock, ers):
    s = await ers.schedules.create("ny9", cron="0 9 * * *", timezone="America/New_York", run_name="{local}",
                                   overlap="allow_all")
    ny = ZoneInfo("America/New_York")
    nxt = s.info.next_fires
    assert all(f.astimezone(ny).hour == 9 and f.astimezone(ny).minute == 0 for f in nxt)
    await sleep_to(nxt[1], ers)
    acts = actions_of(ers, "ny9")
    assert [ms_to_datetime(a.scheduled_ms) for a in acts] == nxt[:2]
    run = await ers.scope(acts[0].run_id).status()
    assert run.name.startswith(nxt[0].astimezone(ny).strftime("%Y-%m-%dT09:00:00"))


async def test_six_field_cron_and_a_union_with_an_interval(autojump_clock, ers):
    s = await ers.schedules.create("mix", cron=["*/20 * * * * *"], every=30, overlap="allow_all")
    t0 = s.info.next_fires[0]
    secs = [(f - t0).total_seconds() for f in s.info.next_fires]
    # the union of every 20 s and every 30 s, a time both name counted once
    assert all(f.second % 20 == 0 or f.second % 30 == 0 for f in s.info.next_fires)
    assert len(set(secs)) == len(secs)
    end = s.info.next_fires[-1]
    await sleep_to(end, ers)
    assert [ms_to_datetime(t) for t in fired_times(ers, "mix")] == s.info.next_fires


async def test_start_and_end_bound_the_times(autojump_clock, ers):
    n0 = now(ers)
    base = n0.replace(second=0, microsecond=0) + timedelta(minutes=2)  # on the 10 s grid
    s = await ers.schedules.create("bounded", every=10, start=base, end=base + timedelta(seconds=30),
                                   overlap="allow_all")
    assert s.info.next_fires[0] >= base
    await sleep_to(base + timedelta(minutes=5), ers)
    times = [ms_to_datetime(t) for t in fired_times(ers, "bounded")]
    assert times and times[0] >= base and times[-1] <= base + timedelta(seconds=30)
    assert len(times) == 4  # base, +10, +20, +30 s: both bounds inclusive
    d = await s.describe()
    assert d.next_fires == []  # past its end: nothing more


async def test_jitter_is_deterministic_per_schedule_and_time(autojump_clock, ers):
    s = await ers.schedules.create("jit", every=60, jitter=20, overlap="allow_all")
    sid = s.info.id
    k = coord(ers).schedules
    st = k.table[sid]
    times = list(__import__("itertools").islice(spec_times(st.config, st.cursor_ms), 5))
    expect = [t + jitter_ms_of(sid, t, 20_000) for t in times]
    assert [ms_to_datetime(x) for x in expect] == s.info.next_fires
    assert len({e - t for e, t in zip(expect, times)}) > 1  # not one constant delay
    assert all(0 <= e - t < 20_000 for e, t in zip(expect, times))
    await sleep_to(ms_to_datetime(expect[2]), ers)
    acts = actions_of(ers, "jit")
    assert [a.scheduled_ms for a in acts] == times[:3]  # keyed by the scheduled time ...
    assert [a.fired_at_ms for a in acts] == expect[:3]  # ... fired at time + its jitter
    assert jitter_ms_of(sid, times[0], 20_000) == jitter_ms_of(sid, times[0], 20_000)


async def test_bad_input_is_refused_with_clear_codes(autojump_clock, ers):
    cases = [
        (dict(cron="61 * * * *"), "cron[0]"),
        (dict(cron="not a cron"), "cron[0]"),
        (dict(every=60, timezone="Mars/Olympus"), "timezone"),
        (dict(every=60, start="2030-01-02T00:00:00Z", end="2030-01-01T00:00:00Z"), "end"),
        (dict(every=0.5), "interval_ms"),
        (dict(), "cron"),
        (dict(every=60, overlap="sometimes"), "overlap"),
        (dict(every=60, offset=60), "offset_ms"),
        (dict(every=60, run_name="{nope}"), "run_name"),
        (dict(every=60, catchup_window=0.1), "catchup_window_ms"),
    ]
    for kw, field in cases:
        with pytest.raises(ValidationError) as ei:
            await ers.schedules.create("bad", **kw)
        assert ei.value.code == "VALIDATION_FAILED" and ei.value.details["field"] == field, (kw, ei.value)
    with pytest.raises(NotFoundError):
        await ers.schedules.create("bad", every=60, mailbox="nowhere")
    with pytest.raises(NotFoundError):
        await ers.schedules.get("nope")
    await ers.schedules.create("ok", every=60)
    assert (await ers.schedules.create("ok", every=60)).info.name == "ok"  # same settings: the same schedule
    with pytest.raises(ConflictError):
        await ers.schedules.create("ok", every=120)
    s = ers.schedules
    sch = await s.get("ok")
    past = now(ers)
    with pytest.raises(ValidationError):
        await sch.backfill(past, past + timedelta(hours=1))  # the end is in the future


# ------------------------------------------------------------------------ overlap policies

async def _overlap_case(rs, policy: str, minutes: int = 3):
    mb = await rs.mailboxes.ensure("w")
    s = await rs.schedules.create("ov-" + policy, every=60, mailbox="w", overlap=policy)
    nxt = s.info.next_fires
    await sleep_to(nxt[minutes - 1], rs)  # nobody works the tasks: the first action keeps running
    return mb, s, nxt


async def test_overlap_skip_records_the_time_skipped(autojump_clock, ers):
    mb, s, nxt = await _overlap_case(ers, "skip")
    d = await s.describe()
    assert d.actions == 1 and d.skipped == 2 and len(d.running) == 1
    await work_all(ers, mb)
    await until(lambda: not coord(ers).schedules.table[d.id].running)
    await sleep_to(nxt[3], ers)
    assert fired_times(ers, "ov-skip") == [int(nxt[0].timestamp() * 1000), int(nxt[3].timestamp() * 1000)]


async def test_overlap_buffer_one_keeps_one_and_fires_it_when_the_run_ends(autojump_clock, ers):
    mb, s, nxt = await _overlap_case(ers, "buffer_one")
    d = await s.describe()
    assert d.actions == 1 and d.buffered == [nxt[1]] and d.skipped == 1  # the third: buffer full
    await work_all(ers, mb)
    # the buffered time fires in the commit that ended the first action
    d = await s.describe()
    assert d.actions == 2 and d.buffered == [] and d.recent[0].origin == "buffered"
    assert d.recent[0].scheduled_at == nxt[1] and d.recent[1].outcome == "succeeded"


async def test_overlap_buffer_all_keeps_every_time_in_order(autojump_clock, ers):
    mb, s, nxt = await _overlap_case(ers, "buffer_all", minutes=4)
    d = await s.describe()
    assert d.actions == 1 and d.buffered == nxt[1:4] and d.skipped == 0
    for i in range(3):
        await work_all(ers, mb)
    d = await s.describe(recent=10)
    assert d.actions == 4 and d.buffered == []
    assert [a.scheduled_at for a in reversed(d.recent)] == nxt[:4]


async def test_overlap_cancel_other_cancels_the_previous_run_in_the_fire_commit(autojump_clock, ers):
    mb, s, nxt = await _overlap_case(ers, "cancel_other")
    acts = actions_of(ers, "ov-cancel_other")
    assert len(acts) == 3
    assert [a.outcome for a in acts] == ["cancelled", "cancelled", None]
    for a in acts[:2]:
        st = await ers.scope(a.run_id).status()
        assert st.stored_state == "CANCELLED"
    assert (await s.describe()).running == [acts[2].id]


async def test_overlap_allow_all_fires_every_time(autojump_clock, ers):
    mb, s, nxt = await _overlap_case(ers, "allow_all")
    d = await s.describe()
    assert d.actions == 3 and len(d.running) == 3 and d.skipped == 0


# ------------------------------------------------------------------------ outcomes and policies

async def test_pause_on_failure_pauses_after_a_failed_action(autojump_clock, ers):
    mb = await ers.mailboxes.ensure("f", max_attempts=1)
    s = await ers.schedules.create("pf", every=60, mailbox="f", pause_on_failure=True)
    nxt = s.info.next_fires
    await sleep_to(nxt[0], ers)
    await work_all(ers, mb, fail=True)
    d = await s.describe()
    assert d.paused and "failed" in d.note and d.recent[0].outcome == "failed" and d.next_fires == []
    run = await ers.scope(d.recent[0].run_id).status()
    assert run.stored_state == "CANCELLED"  # the task's end ended the run
    await sleep_to(nxt[3], ers)
    assert (await s.describe()).actions == 1  # nothing fired while paused
    # without pause_on_failure a failure does not pause
    s2 = await ers.schedules.create("nopf", every=60, mailbox="f")
    await sleep_to((await s2.describe()).next_fires[0], ers)
    await work_all(ers, mb, fail=True)
    assert not (await s2.describe()).paused


async def test_remaining_actions_stop_the_schedule(autojump_clock, ers):
    s = await ers.schedules.create("three", every=60, remaining_actions=2, overlap="allow_all")
    nxt = s.info.next_fires
    assert len(nxt) == 5
    await sleep_to(nxt[4], ers)
    d = await s.describe()
    assert d.actions == 2 and d.remaining_actions == 0 and d.next_fires == []
    with pytest.raises(ConflictError):
        await s.trigger()
    await s.update(remaining_actions=1)
    await s.trigger()
    assert (await s.describe()).actions == 3
    d = await s.update(remaining_actions=1)  # the same value again: the count starts again
    assert d.remaining_actions == 1
    await s.trigger()
    assert (await s.describe()).remaining_actions == 0


async def test_pause_and_unpause_with_a_note_skips_what_fell_due_meanwhile(autojump_clock, ers):
    s = await ers.schedules.create("pz", every=60, overlap="allow_all")
    nxt = s.info.next_fires
    await sleep_to(nxt[0], ers)
    d = await s.pause("maintenance")
    assert d.paused and d.note == "maintenance" and d.next_fires == []
    await sleep_to(nxt[3], ers)
    d = await s.unpause()
    assert not d.paused and d.actions == 1
    await sleep_to(nxt[4], ers)
    d = await s.describe()
    assert d.actions == 2 and d.skipped == 3  # the three times while paused: skipped, not fired late
    assert fired_times(ers, "pz") == [int(nxt[0].timestamp() * 1000), int(nxt[4].timestamp() * 1000)]
    page = await ers.events.list(types="schedule.*", limit=100)
    kinds = [(e.type, (e.data or {}).get("reason")) for e in page.events]
    assert ("schedule.paused", None) in kinds and ("schedule.unpaused", None) in kinds
    assert ("schedule.skipped", "paused") in kinds


async def test_trigger_fires_now_once_per_call(autojump_clock, ers):
    s = await ers.schedules.create("tr", every=3600, overlap="allow_all", paused=True)
    d = await s.trigger()
    assert d.actions == 1 and d.recent[0].origin == "trigger"
    d = await s.trigger()
    assert d.actions == 2 and len({a.scheduled_at for a in d.recent}) == 2
    d = await s.trigger(overlap="skip")  # two still run: skipped
    assert d.actions == 2 and d.skipped == 1


async def test_backfill_fires_each_past_time_once_even_when_sent_again(autojump_clock, ers):
    s = await ers.schedules.create("bf", every=600, overlap="allow_all")
    t_end = now(ers)
    t_start = t_end - timedelta(hours=1)
    d = await s.backfill(t_start, t_end)
    times = fired_times(ers, "bf")
    assert 6 <= len(times) <= 7 and all(t % 600_000 == 0 for t in times)
    assert {a.origin for a in d.recent} == {"backfill"}
    d = await s.backfill(t_start, t_end)  # again: nothing more
    assert fired_times(ers, "bf") == times
    await s.backfill(t_start, t_end + timedelta(seconds=30))  # an end a little ahead (a client's clock): cut at now
    assert fired_times(ers, "bf") == times
    with pytest.raises(ValidationError):
        await s.backfill(t_end, t_start)


async def test_update_and_delete(autojump_clock, ers):
    s = await ers.schedules.create("up", every=60)
    d = await s.update(every=0, cron="0 * * * *")
    assert d.interval_ms is None and d.cron == ["0 * * * *"]
    assert all(f.minute == 0 for f in d.next_fires)
    lst = await ers.schedules.list()
    assert [x.name for x in lst] == ["up"]
    await s.delete()
    assert await ers.schedules.list() == []
    with pytest.raises(NotFoundError):
        await s.describe()


async def test_the_space_schedules_limit(autojump_clock):
    async with rallypoint.open_embedded() as rs:
        coord(rs).limits.configure({"schedules": 2})
        await rs.schedules.create("a", every=60)
        await rs.schedules.create("b", every=60)
        with pytest.raises(LimitError) as ei:
            await rs.schedules.create("c", every=60)
        assert ei.value.details["limit"] == "schedules"
        await (await rs.schedules.get("a")).delete()
        await rs.schedules.create("c", every=60)


async def test_events_fired_and_skipped(autojump_clock, ers):
    s = await ers.schedules.create("ev", every=60, overlap="skip")
    nxt = s.info.next_fires
    await sleep_to(nxt[1], ers)
    page = await ers.events.list(types="schedule.*", limit=100)
    evs = [e for e in page.events if e.type in ("schedule.fired", "schedule.skipped")]
    assert [e.type for e in evs] == ["schedule.fired", "schedule.skipped"]
    fired, skipped = evs
    assert fired.data["scheduled_at"] == nxt[0].strftime("%Y-%m-%dT%H:%M:%S.000Z") and fired.data["origin"] == "scheduled"
    assert fired.run == actions_of(ers, "ev")[0].run_id
    assert skipped.data["reason"] == "overlap" and skipped.data["count"] == 1


# ------------------------------------------------------------------------ DST

def _cfg(**kw) -> ScheduleConfig:
    return ScheduleConfig(**kw)


def _local(ms_list, tz):
    return [datetime.fromtimestamp(t / 1000, tz).strftime("%H:%M%z") for t in ms_list]


def test_dst_spring_forward_a_skipped_local_hour_fires_once_at_the_end_of_the_gap():
    berlin = ZoneInfo("Europe/Berlin")
    day_before = int(datetime(2026, 3, 28, 12, 0, tzinfo=berlin).timestamp() * 1000)
    it = spec_times(_cfg(cron=["30 2 * * *"], timezone="Europe/Berlin"), day_before)
    times = [next(it) for _ in range(3)]
    # 28 Mar 02:30 does not come again; 29 Mar 02:30 does not exist: fired once, at 03:00 CEST
    assert _local(times, berlin) == ["03:00+0200", "02:30+0200", "02:30+0200"]
    assert datetime.fromtimestamp(times[0] / 1000, berlin).day == 29
    # a wildcard hour has simply no times in the missing hour
    it = spec_times(_cfg(cron=["*/30 * * * *"], timezone="Europe/Berlin"),
                    int(datetime(2026, 3, 29, 1, 0, tzinfo=berlin).timestamp() * 1000))
    assert _local([next(it) for _ in range(3)], berlin) == ["01:30+0100", "03:00+0200", "03:30+0200"]


def test_dst_fall_back_a_repeated_local_hour():
    berlin = ZoneInfo("Europe/Berlin")
    start = int(datetime(2026, 10, 24, 12, 0, tzinfo=berlin).timestamp() * 1000)
    it = spec_times(_cfg(cron=["30 2 * * *"], timezone="Europe/Berlin"), start)
    times = [next(it) for _ in range(2)]
    # a fixed hour fires ONCE on the day the hour repeats (its first occurrence, summer time)
    assert _local(times, berlin) == ["02:30+0200", "02:30+0100"]
    assert [datetime.fromtimestamp(t / 1000, berlin).day for t in times] == [25, 26]
    # a wildcard hour fires in both occurrences: different instants, each once
    it = spec_times(_cfg(cron=["*/30 * * * *"], timezone="Europe/Berlin"),
                    int(datetime(2026, 10, 25, 1, 45, tzinfo=berlin).timestamp() * 1000))
    got = [next(it) for _ in range(5)]
    assert _local(got, berlin) == ["02:00+0200", "02:30+0200", "02:00+0100", "02:30+0100", "03:00+0100"]
    assert len(set(got)) == 5 and got == sorted(got)


async def test_dst_days_fire_under_the_server_in_new_york(autojump_clock):
    """The whole path on a spring-forward and a fall-back day in America/New_York (the
    server's clock starts the day before each): a 02:30 job fires once at 03:00 EDT on
    14 Mar 2027; a 01:30 job fires once on 7 Nov 2027, when 01:00-02:00 happens twice."""
    ny = ZoneInfo("America/New_York")
    cases = [
        (datetime(2027, 3, 13, 12, 0, tzinfo=ny), "30 2 * * *", ["14 03:00 EDT", "15 02:30 EDT"]),
        (datetime(2027, 11, 6, 12, 0, tzinfo=ny), "30 1 * * *", ["07 01:30 EDT", "08 01:30 EST"]),
    ]
    for start, cron, expect in cases:
        async with rallypoint.open_embedded(clock=Clock(wall_start=start.timestamp())) as rs:
            s = await rs.schedules.create("dst", cron=cron, timezone="America/New_York", overlap="allow_all")
            nxt = s.info.next_fires
            assert [f.astimezone(ny).strftime("%d %H:%M %Z") for f in nxt[:2]] == expect
            await sleep_to(nxt[1], rs)
            acts = actions_of(rs, "dst")
            assert [ms_to_datetime(a.scheduled_ms) for a in acts] == nxt[:2]  # each once, nothing between


# ------------------------------------------------------------------------ restarts

async def test_catch_up_after_downtime_fires_within_the_window_and_skips_the_rest(tmp_path, autojump_clock):
    """Down for 10 minutes with a 1-minute schedule and a 3-minute catch-up window: the
    times more than 3 minutes late are recorded skipped (one record), the rest fire once
    each (origin catchup); nothing is fired twice, before or after a second restart."""
    d = str(tmp_path / "data")
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            s = await rs.schedules.create("cu", every=60, catchup_window=180, overlap="allow_all")
            nxt = s.info.next_fires
            await tc.advance((nxt[1] - now(rs)).total_seconds() + 0.01)
            before = fired_times(rs, "cu")
            assert before == [int(f.timestamp() * 1000) for f in nxt[:2]]
            down_at = now(rs)
        await tc.advance(600)
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            await tc.advance(0.01)
            acts = actions_of(rs, "cu")
            times = [a.scheduled_ms for a in acts]
            assert times[:2] == before and len(times) == len(set(times))
            late = [a for a in acts[2:]]
            t_now = coord(rs).now_ms()
            assert late and all(t_now - a.scheduled_ms <= 180_000 for a in late)
            assert all(a.origin == "catchup" for a in late)
            d1 = await rs.schedules.get("cu")
            info = d1.info
            # every minute while down is either fired or skipped: none missing, none twice
            expect = [t for t in range(times[1] + 60_000, t_now + 1, 60_000)]
            assert sorted(times[2:]) == [t for t in expect if t_now - t <= 180_000]
            assert info.skipped == len(expect) - len(times[2:])
            n = len(times)
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            await tc.advance(0.01)
            assert len(actions_of(rs, "cu")) == n  # a second restart fires nothing again


async def test_a_crash_in_the_minute_of_a_fire_fires_that_time_exactly_once(tmp_path, autojump_clock):
    """A copy of the data dir taken right after a fire (what kill -9 leaves: the journal,
    no snapshot) and one taken right before it: both recover to exactly one action for
    that time."""
    live = tmp_path / "live"
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(str(live), durability="fsync", clock=clock) as rs:
            mb = await rs.mailboxes.ensure("jobs")
            s = await rs.schedules.create("crash", every=60, mailbox="jobs", overlap="allow_all")
            nxt = s.info.next_fires
            await tc.advance((nxt[0] - now(rs)).total_seconds() - 0.5)
            j = coord(rs).journal
            await j.wait_durable(j.last_lsn)
            shutil.copytree(live, tmp_path / "before")
            await tc.advance(0.6)
            assert len(actions_of(rs, "crash")) == 1
            await j.wait_durable(j.last_lsn)
            shutil.copytree(live, tmp_path / "after")
        for which in ("before", "after"):
            async with rallypoint.open_embedded(str(tmp_path / which), durability="fsync", clock=clock) as rs:
                await tc.advance(0.01)
                acts = actions_of(rs, "crash")
                assert [a.scheduled_ms for a in acts] == [int(nxt[0].timestamp() * 1000)], which
                a = acts[0]
                st = await rs.scope(a.run_id).status()
                assert st.tasks == {"QUEUED": 1}  # the run and its task with the record


async def test_a_wall_clock_stepped_back_across_a_restart_fires_no_time_twice(tmp_path, autojump_clock):
    """The node restarts with its wall clock 5 minutes behind (an NTP step back): the
    times already fired are not fired again when the clock passes them a second time;
    the next new time fires once."""
    d = str(tmp_path / "data")
    async with controlled_time() as tc:
        clock = Clock()
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            s = await rs.schedules.create("ntp", every=60, overlap="allow_all")
            nxt = s.info.next_fires
            await tc.advance((nxt[2] - now(rs)).total_seconds() + 0.01)
            first = fired_times(rs, "ntp")
            assert first == [int(f.timestamp() * 1000) for f in nxt[:3]]
            wall = coord(rs).now_ms()
        back = Clock(wall_start=(wall - 300_000) / 1000)  # the wall clock was stepped back 5 minutes
        async with rallypoint.open_embedded(d, durability="fsync", clock=back) as rs:
            assert now(rs) < nxt[0]
            await tc.advance(300 + 60 + 0.5)  # the clock passes the fired times again, then one new time
            times = fired_times(rs, "ntp")
            assert times == first + [int(nxt[3].timestamp() * 1000)]  # each once
            assert (await rs.schedules.get("ntp")).info.skipped == 0
