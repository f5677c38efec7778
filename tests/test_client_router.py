"""The SDK's router over fake shard transports (no servers): fan-out and split calls
merge answers, and a shard that fails mid-call gives its error as itself."""

from __future__ import annotations

import msgspec
import pytest

from rallypoint import protocol as p
from rallypoint.client.router import ShardedTransport
from rallypoint.errors import UnavailableError
from rallypoint.ids import IdGenerator


class FakeShard:
    def __init__(self, n, fail=False):
        self.n = n
        self.fail = fail
        self.calls = []

    async def call(self, op):
        self.calls.append(op)
        if self.fail:
            raise UnavailableError(f"shard {self.n} is down")
        if isinstance(op, p.ServerStatus):
            return p.encoder.encode(p.ServerStatusView(
                version="t", protocol_version=1, uptime_s=1.0, connections=1, durability="fsync",
                runs={"ACTIVE": self.n + 1}, tasks={}, entities=10, last_lsn=1, durable_lsn=1))
        if isinstance(op, p.TaskResults):
            return p.encoder.encode(p.TaskListView(ids=[], outcomes=[
                p.TaskOutcomeView(id=t, state="SUCCEEDED", attempt=1, outcome=msgspec.Raw(b"\xc0"),
                                  outcome_reason=None, error=msgspec.Raw(b"\xc0")) for t in op.task_ids]))
        raise AssertionError(op)


def router(shards):
    st = ShardedTransport(["tcp://x:1"], None, None, "default")
    st.map = p.ClusterMapView(cluster="c", version=1, owners=[0, 1], shards=[p.ShardView(shard=0), p.ShardView(shard=1)])
    st.shards = shards
    return st


async def test_a_fan_out_sums_every_shards_part():
    st = router({0: FakeShard(0), 1: FakeShard(1)})
    v = msgspec.msgpack.decode(await st.call(p.ServerStatus()), type=p.ServerStatusView)
    assert v.runs == {"ACTIVE": 3} and v.entities == 20


async def test_a_split_list_comes_back_in_the_requests_order():
    g = IdGenerator()
    ids = [g.new("tsk", slot) for slot in (1, 0, 1, 0)]
    shards = {0: FakeShard(0), 1: FakeShard(1)}
    st = router(shards)
    v = msgspec.msgpack.decode(await st.call(p.TaskResults(task_ids=ids, brief=True)), type=p.TaskListView)
    assert [o.id for o in v.outcomes] == ids
    assert [len(s.calls[0].task_ids) for s in shards.values()] == [2, 2]


async def test_a_shard_failing_mid_fan_out_raises_its_error_not_a_group():
    st = router({0: FakeShard(0), 1: FakeShard(1, fail=True)})
    with pytest.raises(UnavailableError, match="shard 1 is down"):
        await st.call(p.ServerStatus())


class QueueShard:
    """A shard holding ``queued`` / ``running`` tasks of queue ``jobs`` (or not knowing it)."""

    def __init__(self, queued, running, known=True, backlog_limit=5):
        self.view = p.MailboxView(id="mbx_1", name="jobs", mode="fifo", max_attempts=3, backlog_limit=backlog_limit,
                                  created_at="2026-01-01T00:00:00Z", queued=queued, running=running)
        self.known = known

    async def call(self, op):
        from rallypoint.errors import NotFoundError

        if not self.known:
            raise NotFoundError("no mailbox jobs")
        if isinstance(op, p.MailboxGet):
            return p.encoder.encode(self.view)
        if isinstance(op, p.MailboxList):
            return p.encoder.encode(p.MailboxListView(mailboxes=[self.view]))
        raise AssertionError(op)


async def test_a_queues_counts_are_summed_over_the_shards_and_its_definition_is_the_home_shards():
    # each shard counts only the tasks of its own runs (a queue's status once said 0 for
    # tasks of runs on other shards); the home shard of "default" (2 slots) is shard 1
    from rallypoint.actors.sharding import home_slot
    from rallypoint.errors import NotFoundError

    assert home_slot("default", 2) == 1
    st = router({0: QueueShard(2, 1, backlog_limit=99), 1: QueueShard(3, 4)})
    v = msgspec.msgpack.decode(await st.call(p.MailboxGet(name="jobs")), type=p.MailboxView)
    assert (v.queued, v.running, v.backlog_limit) == (5, 5, 5)
    lv = msgspec.msgpack.decode(await st.call(p.MailboxList()), type=p.MailboxListView)
    assert [(q.name, q.queued, q.running) for q in lv.mailboxes] == [("jobs", 5, 5)]
    # a shard that never adopted the queue has none of its tasks; the home shard's NOT_FOUND is the answer
    st = router({0: QueueShard(0, 0, known=False), 1: QueueShard(3, 4)})
    assert msgspec.msgpack.decode(await st.call(p.MailboxGet(name="jobs")), type=p.MailboxView).queued == 3
    st = router({0: QueueShard(2, 1), 1: QueueShard(0, 0, known=False)})
    with pytest.raises(NotFoundError):
        await st.call(p.MailboxGet(name="jobs"))


class RootShard:
    def __init__(self, n):
        self.n = n
        self.created = 0

    async def call(self, op):
        assert isinstance(op, p.ScopeCreate)
        self.created += 1
        return b""


async def test_clients_that_each_make_one_root_run_spread_it_over_the_shards():
    # issue 42, item 6: every new client put its first root run on shard 0
    shards = {0: RootShard(0), 1: RootShard(1)}
    for _ in range(40):
        st = router(shards)  # a new client each time
        await st.call(p.ScopeCreate())
    assert shards[0].created + shards[1].created == 40
    assert shards[0].created >= 5 and shards[1].created >= 5  # (binomial(40, 1/2): fails with p < 1e-6)
    # and one client goes round the shards in turn
    one = router(shards)
    before = [s.created for s in shards.values()]
    for _ in range(10):
        await one.call(p.ScopeCreate())
    assert [s.created - b for s, b in zip(shards.values(), before)] == [5, 5]


def test_the_overview_sums_a_queues_ready_backlog_over_the_shards_and_recuts_its_largest_keys():
    """Issue 44 (``rallypoint top`` on a sharded cluster): per priority and per key the
    shards' ready tasks add up; the largest keys are cut again to three."""
    from rallypoint.client.router import _merge_overview

    def part(q: p.OverviewQueue) -> bytes:
        return p.encoder.encode(p.OverviewView(runs=[], runs_active=0, queues=[q], groups=[], groups_open=0,
                                               waits={}, events={}, entities=0, tasks={}, retention={}))

    a = p.OverviewQueue(name="jobs", queued=5, running=1, done=2, ready_by_priority={"1": 1, "3": 4}, ready_keys=3,
                        ready_top_keys={"a": 3, "b": 1, "c": 1})
    b = p.OverviewQueue(name="jobs", queued=6, running=0, done=1, ready_by_priority={"3": 6}, ready_keys=2,
                        ready_top_keys={"d": 4, "b": 2})
    v = msgspec.msgpack.decode(_merge_overview(p.OpsOverview(), [part(a), part(b)]), type=p.OverviewView)
    (q,) = v.queues
    assert (q.queued, q.running, q.done, q.ready_keys) == (11, 1, 3, 5)
    assert q.ready_by_priority == {"1": 1, "3": 10}
    assert q.ready_top_keys == {"d": 4, "a": 3, "b": 3}


class EnsureShard:
    """A shard answering ``mailbox.ensure`` with the settings it was given (the home
    shard: its own aging, weights and rate limits, whatever the ensure said)."""

    def __init__(self, home: bool):
        self.home = home
        self.calls = []

    async def call(self, op):
        assert isinstance(op, p.MailboxEnsure)
        self.calls.append(op)
        extra = dict(aging_ms=60_000, weights={"a": 3}, rate_limits={"a": 5, "*": 50}) if self.home else {}
        return p.encoder.encode(p.MailboxView(id="mbx_1", name=op.name, mode="WORK", max_attempts=5,
                                              backlog_limit=None, created_at="2026-01-01T00:00:00Z", queued=0,
                                              running=0, **extra))


async def test_an_ensure_gives_every_shard_the_home_shards_aging_weights_and_rate_limits():
    """Issue 44: the router adopts the queue on the other shards with the home shard's
    scheduling settings (a rate limit then counts per shard)."""
    st = router({0: EnsureShard(home=False), 1: EnsureShard(home=True)})  # "default"'s home is shard 1
    await st.call(p.MailboxEnsure(name="jobs"))
    (adopt,) = st.shards[0].calls
    assert (adopt.id, adopt.aging_ms, adopt.weights, adopt.rate_limits) == ("mbx_1", 60_000, {"a": 3},
                                                                              {"a": 5, "*": 50})
