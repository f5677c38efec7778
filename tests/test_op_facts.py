"""Every per-op fact of the cluster in the op's own declaration (issue 43): how a fan-out
op's answers merge, which ops only a node (or only the node itself) may make, and the
checks ``build_table`` makes so that a new op cannot be declared without them."""

from __future__ import annotations

import pytest

from rallypoint import protocol as p
from rallypoint.actors.api import TABLE
from rallypoint.actors.opmark import (ALL, ALWAYS, LOCAL, NODE, PEER, R, RECONCILE_RULES, SPACE, W, Resend,
                                      build_table, fans_out, fenced, in_slot, op)
from rallypoint.client import reconnect, router


def test_every_declared_merge_has_its_merge_in_the_router_and_none_is_unused():
    declared = {d.merge for d in TABLE.decls.values() if d.merge}
    assert declared - set(router.MERGES) == set(), "a fan-out op names a merge the router lacks"
    assert set(router.MERGES) - declared == set(), "a merge of the router no op declares"


def test_every_op_answered_by_every_shard_declares_a_merge_and_no_other_does():
    for t, d in TABLE.decls.items():
        assert bool(d.merge) == fans_out(d.shard), (d.tag, d.shard, d.merge)


def test_every_reconcile_rule_is_implemented_by_the_client_and_used_by_an_op():
    declared = {d.resend.reconcile for d in TABLE.decls.values() if d.resend.reconcile}
    assert set(reconnect.RECONCILERS) == set(RECONCILE_RULES), "a rule without its implementation, or the reverse"
    assert declared == set(RECONCILE_RULES), "a reconcile rule no op declares"
    fenced_ops = {d.tag: d.resend.reconcile for d in TABLE.decls.values() if d.resend.fenced}
    assert fenced_ops == {"delivery.complete": "task_settled", "delivery.complete_many": "tasks_settled",
                          "delivery.complete_next": "task_settled_next",
                          "delivery.retry": "task_requeued", "delivery.release": "task_requeued",
                          "scope.complete": "run_completed"}, fenced_ops


def test_a_fenced_op_without_a_reconcile_rule_cannot_be_declared():
    """issue 43: how a re-sent op is reconciled is the op's declared fact; a fenced op
    (its second sending refused when the first applied) that names no rule, or one the
    client does not implement, is refused at build time (it was a type switch in the
    client: a new fenced op silently got its first sending's refusal)."""
    with pytest.raises(RuntimeError, match=r"re-sent fenced but names no reconcile rule"):
        _table_with("op_x", op(p.ServerStatus, route=SPACE, permission=W, resend=Resend("fenced", True, fenced=True),
                               reply=p.ServerStatusView))
    with pytest.raises(ValueError, match=r"no reconcile rule 'nope'"):
        fenced("nope")
    with pytest.raises(RuntimeError, match=r"names no reconcile rule \('nope'\)"):
        _table_with("op_x", op(p.ServerStatus, route=SPACE, permission=W,
                               resend=Resend("fenced", True, fenced=True, reconcile="nope"), reply=p.ServerStatusView))


def test_the_calls_between_shards_are_no_clients():
    # PEER ops (sent point to point between shards) are made by a node (NODE) or by
    # the node itself (LOCAL): never by a client's key, operator or not. They used to be
    # declared shard=ALL with the "operator" permission: a client could fan them out
    # (and failed on "cannot be merged"), an operator key could forge an outbox delivery.
    peer = {d.tag: d.permission for d in TABLE.decls.values() if d.shard.kind == "peer"}
    assert peer == {"run.adopt_remote": LOCAL, "outbox.deliver": NODE, "admission.reserve": NODE,
                    "admission.hold": LOCAL, "outbox.ack": LOCAL, "key.adopt": LOCAL}, peer
    node_ops = {d.tag for d in TABLE.decls.values() if d.permission == NODE}
    assert node_ops == {"run.link", "outbox.deliver", "admission.reserve"}, node_ops


def _table_with(fn_name: str, mark, request=p.ServerStatus) -> None:
    kind = type("Kind", (), {fn_name: mark(lambda self, actor, session, op: None)})
    build_table((kind,), (request,))  # (a class of its own: never a cached table)


def test_a_fan_out_op_without_a_merge_cannot_be_declared():
    with pytest.raises(RuntimeError, match=r"'server\.status' .* is answered by every shard .* declares no merge"):
        _table_with("op_x", op(p.ServerStatus, route=SPACE, permission=R, resend=ALWAYS, shard=ALL,
                               reply=p.ServerStatusView))
    with pytest.raises(RuntimeError, match=r"declares no merge"):  # a field that may be None: every shard too
        _table_with("op_x", op(p.OpsItems, route=SPACE, permission=R, resend=ALWAYS,
                               shard=in_slot("scope_id", "all"), reply=p.OpsItemsView), p.OpsItems)
    with pytest.raises(RuntimeError, match=r"declares merge='x' but one shard answers it"):
        _table_with("op_x", op(p.ServerStatus, route=SPACE, permission=R, resend=ALWAYS, merge="x",
                               reply=p.ServerStatusView))


def test_a_call_between_shards_cannot_be_declared_for_clients():
    with pytest.raises(RuntimeError, match=r"declared PEER .* but a client may make it"):
        _table_with("op_x", op(p.ServerStatus, route=SPACE, permission=W, resend=ALWAYS, shard=PEER,
                               reply=p.ServerStatusView))
    with pytest.raises(RuntimeError, match=r"is a node's call .* but is declared Shard\(all\)"):
        _table_with("op_x", op(p.ServerStatus, route=SPACE, permission=NODE, resend=ALWAYS, shard=ALL,
                               merge="any", reply=p.ServerStatusView))


def test_the_consoles_lists_of_a_whole_space_merge_over_shards():
    # ops.items without a run (the console's tasks, groups and queues pages) is answered
    # by every shard: it was declared so with no merge, and failed on a cluster of
    # several shards ("cannot be merged over shards")
    import msgspec

    def row(i: str, mailbox: str = "q") -> p.OpsTaskRow:
        return p.OpsTaskRow(id=i, mailbox=mailbox, scope_id="scp_x", state="QUEUED", attempt=0, key=None,
                            created_at="2026-12-07T00:00:00.000Z", finished_at=None, group_id=None, outcome_reason=None, completing=False)

    def queue(queued: int, oldest) -> p.OpsQueueView:
        return p.OpsQueueView(id="mbx_q", name="q", mode="queue", queued=queued, running=1, done=2,
                              oldest_ready_at=oldest, backlog_limit=None)

    a = p.OpsItemsView(tasks=[row("tsk_3"), row("tsk_1")], queues=[queue(2, "2026-12-07T00:00:50.000Z")])
    b = p.OpsItemsView(tasks=[row("tsk_4"), row("tsk_2")], queues=[queue(3, "2026-12-07T00:00:20.000Z")])
    op_ = p.OpsItems(kinds=["tasks", "queues"], limit=3)
    raw = router.MERGES[TABLE.merges[p.OpsItems]](op_, [p.encoder.encode(a), p.encoder.encode(b)])
    v = msgspec.msgpack.decode(raw, type=p.OpsItemsView)
    assert [t.id for t in v.tasks] == ["tsk_4", "tsk_3", "tsk_2"]  # newest first over both, at most limit
    (q,) = v.queues
    assert (q.queued, q.running, q.done, q.oldest_ready_at) == (5, 2, 4, "2026-12-07T00:00:20.000Z")
