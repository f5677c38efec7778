"""Where a node of a sharded cluster runs each op of an HTTP request
(rallypoint.cluster.httproute.decide): its own shard's ops here, another shard's there
(forwarded, or sent natively), every-shard ops fanned out and merged, new root runs
spread (by the Idempotency-Key when there is one, so a retry reaches the same shard)."""

from __future__ import annotations

from rallypoint import protocol as p
from rallypoint.actors.sharding import Sharding, home_slot
from rallypoint.cluster.httproute import FANOUT, LOCAL, decide
from rallypoint.ids import IdGenerator

SLOTS = 12
OWNERS = [s % 3 for s in range(SLOTS)]  # slot i on shard i % 3
_ids = IdGenerator()


def sid(slot: int, prefix: str = "scp") -> str:
    return _ids.new(prefix, slot=slot)


def here(shard: int = 0, owners=OWNERS) -> Sharding:
    return Sharding(shard, owners)


def test_an_op_about_an_id_runs_on_the_shard_of_its_slot():
    h = here(0)
    assert decide(p.ScopeStatus(scope_id=sid(3)), "sp", h) == LOCAL  # slot 3: shard 0
    assert decide(p.ScopeStatus(scope_id=sid(4)), "sp", h) == ("shard", 1)
    assert decide(p.TaskStatus(task_id=sid(5, "tsk")), "sp", h) == ("shard", 2)


def test_a_space_wide_entity_runs_on_the_home_shard():
    home = OWNERS[home_slot("sp", SLOTS)]
    for shard in range(3):
        where = decide(p.PoolGet(name="gpu"), "sp", here(shard))
        assert where == (LOCAL if shard == home else ("shard", home))


def test_every_shard_ops_and_a_queue_definition_fan_out():
    h = here(0)
    assert decide(p.ScopeList(), "sp", h) == FANOUT
    assert decide(p.EventsList(), "sp", h) == FANOUT
    assert decide(p.MailboxEnsure(name="jobs"), "sp", h) == FANOUT  # defined on every shard
    assert decide(p.MailboxList(), "sp", h) == FANOUT  # counts summed over the shards


def test_a_list_of_ids_goes_where_its_ids_are():
    h = here(0)
    assert decide(p.TaskResults(task_ids=[sid(0, "tsk"), sid(3, "tsk")]), "sp", h) == LOCAL
    assert decide(p.TaskResults(task_ids=[sid(1, "tsk"), sid(4, "tsk")]), "sp", h) == ("shard", 1)
    assert decide(p.TaskResults(task_ids=[sid(0, "tsk"), sid(4, "tsk")]), "sp", h) == FANOUT


def test_new_root_runs_are_spread_and_a_keyed_one_always_goes_to_the_same_shard():
    h = here(0)
    spread = [decide(p.ScopeCreate(), "sp", h, turn=i) for i in range(6)]
    assert spread == [LOCAL, ("shard", 1), ("shard", 2)] * 2
    keyed = {decide(p.ScopeCreate(), "sp", h, key="k-1", turn=i) for i in range(6)}
    assert len(keyed) == 1  # the turn does not matter: a retry finds its stored answer there
    assert len({decide(p.ScopeCreate(), "sp", h, key=f"k-{i}") for i in range(30)}) == 3
    # forwarded here by another node: it chose this shard
    assert decide(p.ScopeCreate(), "sp", h, turn=1, routed=True) == LOCAL
    # a child run is its parent's
    assert decide(p.ScopeCreate(parent_id=sid(4)), "sp", h) == ("shard", 1)


def test_a_named_root_run_goes_to_the_slot_its_name_hashes_to():
    from rallypoint.actors.sharding import named_slot

    for name in ("a", "b", "c", "d"):
        owner = OWNERS[named_slot("sp", name, SLOTS)]
        where = decide(p.ScopeEnsureNamed(name=name), "sp", here(0))
        assert where == (LOCAL if owner == 0 else ("shard", owner))


def test_the_idempotency_store_is_the_shard_that_takes_the_request():
    for shard in range(3):
        assert decide(p.IdempotencyLookup(key="k", fingerprint="f"), "sp", here(shard)) == LOCAL
        assert decide(p.IdempotencyRecord(key="k", fingerprint="f", status=200, body=b"{}"), "sp",
                      here(shard)) == LOCAL


def test_a_cluster_of_one_shard_runs_everything_here():
    one = here(0, [0] * SLOTS)
    assert decide(p.ScopeList(), "sp", one) == LOCAL
    assert decide(p.ScopeStatus(scope_id=sid(4)), "sp", one) == LOCAL


def test_a_released_slot_is_not_run_here():
    h = here(0)
    h.release([3])
    h.update([1 if s == 3 else o for s, o in enumerate(OWNERS)], 2)
    assert decide(p.ScopeStatus(scope_id=sid(3)), "sp", h) == ("shard", 1)
