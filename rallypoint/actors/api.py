"""The operation table: for every protocol operation, where it runs, what handles it,
and the permission it needs.

One table, so that routing, access control (SPEC §10) and the tests that cover every
operation are generated from it: an operation without an entry here fails
``tests/test_api_table.py``.

- ``kind`` / ``handler``: the kind object (an attribute of the coordinator) and its
  ``op_*`` method that decides the command.
- ``route``: which actor the command runs on, from the session and the op. It raises
  NOT_FOUND (before anything is queued) for an id of another space or no entity; a run's
  commands run on the run's actor, a task's on its run's, a group's, barrier's, timer's
  or join set's on its own actor, space-level ones on the space's actor.

Permissions: ``resource_config`` (create and configure work queues, groups, barriers...),
``coordination_write`` (submit, receive, settle, cancel, verdicts...),
``coordination_read`` (status, wait, list), ``admin`` (keys of its own space),
``operator`` (keys of every space; granted offline only).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from .. import protocol as p

__all__ = ["OpSpec", "OPS", "PERMISSIONS", "ANY_KEY"]

PERMISSIONS = ("resource_config", "coordination_write", "coordination_read", "admin", "operator")

#: Not a permission: any live key may make the op (the HTTP layer's idempotency
#: bookkeeping, which every request with an Idempotency-Key goes through, whatever the
#: request's own permission; the request itself is checked as usual).
ANY_KEY = "any_key"


class OpSpec(NamedTuple):
    kind: str  # attribute of the Coordinator holding the kind
    handler: str  # name of the kind's op_* method
    route: Callable[[Any, Any, Any], str]  # (coordinator, session, op) -> actor id
    permission: str


R, W, C, A = "coordination_read", "coordination_write", "resource_config", "admin"


def _space(c, s, op) -> str:
    return "spc:" + s.space


def _run(field: str):
    def route(c, s, op) -> str:
        return c.runs.route(s, getattr(op, field))

    return route


def _parent_or_space(c, s, op) -> str:
    return c.runs.route(s, op.parent_id) if op.parent_id is not None else "spc:" + s.space


def _task(c, s, op) -> str:
    return c.queues.route_task(s, op.task_id)


def _tasks(c, s, op) -> str:
    return c.queues.route_tasks(s, op.task_ids)


def _complete_many(c, s, op) -> str:
    return c.queues.route_complete_many(s, op.items)


def _queue(c, s, op) -> str:
    return c.queues.route_queue(s, op.name)


def _group(c, s, op) -> str:
    return c.groups.route(s, op.group_id)


def _barrier(c, s, op) -> str:
    return c.barriers.route(s, op.barrier_id)


def _timer(c, s, op) -> str:
    return c.timers.route(s, op.timer_id)


def _joinset(c, s, op) -> str:
    return c.joinsets.route(s, op.joinset_id)


def _joinset_get(c, s, op) -> str:
    return c.joinsets.route_get(s, op)


def _quota(c, s, op) -> str:
    return c.quotas.route(s, op.quota)


def _quota_waiter(c, s, op) -> str:
    return c.quotas.route_waiter(s, op.waiter_id)


def _budget(c, s, op) -> str:
    return c.budgets.route(s, op.budget)


def _reservation(c, s, op) -> str:
    return c.budgets.route_reservation(s, op.reservation_id)


def _message(c, s, op) -> str:
    return c.inboxes.route_message(s, op.message_id)
def _claim(c, s, op) -> str:
    return c.claims.route(s, op.key)


def _pool(field: str):
    def route(c, s, op) -> str:
        return c.pools.route(s, getattr(op, field))

    return route


def _grant(c, s, op) -> str:
    return c.pools.route_grant(s, op.grant_id)


def _run_or_space(c, s, op) -> str:
    return c.runs.route(s, op.scope_id) if op.scope_id is not None else "spc:" + s.space


def _scope_list(c, s, op) -> str:
    return c.runs.route(s, op.parent_id) if op.parent_id is not None else "spc:" + s.space


OPS: dict[type, OpSpec] = {
    p.ServerStatus: OpSpec("spaces", "op_server_status", _space, R),
    p.ScopeCreate: OpSpec("runs", "op_scope_create", _parent_or_space, W),
    p.ScopeStatus: OpSpec("runs", "op_scope_status", _run("scope_id"), R),
    p.ScopeCancel: OpSpec("runs", "op_scope_cancel", _run("scope_id"), W),
    p.ScopeComplete: OpSpec("runs", "op_scope_complete", _run("scope_id"), W),
    p.ScopeList: OpSpec("runs", "op_scope_list", _scope_list, R),
    p.MailboxEnsure: OpSpec("queues", "op_mailbox_ensure", _space, C),
    p.MailboxGet: OpSpec("queues", "op_mailbox_get", _queue, R),
    p.MailboxList: OpSpec("queues", "op_mailbox_list", _space, R),
    p.TaskSubmit: OpSpec("queues", "op_task_submit", _run("scope_id"), W),
    p.TaskSubmitMany: OpSpec("queues", "op_task_submit_many", _run("scope_id"), W),
    p.TaskStatus: OpSpec("queues", "op_task_status", _task, R),
    p.TaskResult: OpSpec("queues", "op_task_result", _task, R),
    p.TaskResults: OpSpec("queues", "op_task_results", _tasks, R),
    p.TaskCancel: OpSpec("queues", "op_task_cancel", _task, W),
    p.Receive: OpSpec("queues", "op_receive", _run("scope_id"), W),
    p.DeliveryRenew: OpSpec("queues", "op_delivery_renew", _task, W),
    p.DeliveryComplete: OpSpec("queues", "op_delivery_complete", _task, W),
    p.DeliveryCompleteMany: OpSpec("queues", "op_delivery_complete_many", _complete_many, W),
    p.DeliveryRetry: OpSpec("queues", "op_delivery_retry", _task, W),
    p.DeliveryReject: OpSpec("queues", "op_delivery_reject", _task, W),
    p.DeliveryRun: OpSpec("queues", "op_delivery_run", _task, W),
    p.GroupCreate: OpSpec("groups", "op_group_create", _run("scope_id"), C),
    p.GroupSubmit: OpSpec("groups", "op_group_submit", _group, W),
    p.GroupJoinTask: OpSpec("groups", "op_group_join_task", _group, W),
    p.GroupVerdictOp: OpSpec("groups", "op_group_verdict", _group, W),
    p.GroupClose: OpSpec("groups", "op_group_close", _group, W),
    p.GroupStatus: OpSpec("groups", "op_group_status", _group, R),
    p.GroupWait: OpSpec("groups", "op_group_wait", _group, R),
    p.BarrierCreate: OpSpec("barriers", "op_barrier_create", _run("scope_id"), C),
    p.BarrierArrive: OpSpec("barriers", "op_barrier_arrive", _barrier, W),
    p.BarrierStatus: OpSpec("barriers", "op_barrier_status", _barrier, R),
    p.BarrierWait: OpSpec("barriers", "op_barrier_wait", _barrier, R),
    p.BarrierNextEpochOp: OpSpec("barriers", "op_barrier_next_epoch", _barrier, W),
    p.TimerCreate: OpSpec("timers", "op_timer_create", _run("scope_id"), W),
    p.TimerStatus: OpSpec("timers", "op_timer_status", _timer, R),
    p.TimerWait: OpSpec("timers", "op_timer_wait", _timer, W),
    p.TimerCancel: OpSpec("timers", "op_timer_cancel", _timer, W),
    p.JoinSetCreate: OpSpec("joinsets", "op_joinset_create", _run("scope_id"), W),
    p.JoinSetGet: OpSpec("joinsets", "op_joinset_get", _joinset_get, R),
    p.JoinSetSubmit: OpSpec("joinsets", "op_joinset_submit", _joinset, W),
    p.JoinSetSubmitDelay: OpSpec("joinsets", "op_joinset_submit_delay", _joinset, W),
    p.JoinNext: OpSpec("joinsets", "op_joinset_join_next", _joinset, W),
    p.JoinSetClose: OpSpec("joinsets", "op_joinset_close", _joinset, W),
    p.KeyCreate: OpSpec("keys", "op_key_create", _space, A),
    p.KeyList: OpSpec("keys", "op_key_list", _space, A),
    p.KeyRevoke: OpSpec("keys", "op_key_revoke", _space, A),
    p.EventsList: OpSpec("spaces", "op_events_list", _space, R),
    p.EventsWatch: OpSpec("spaces", "op_events_watch", _space, R),
    p.OpsOverview: OpSpec("spaces", "op_ops_overview", _space, R),
    # messages: on the message's run (like tasks)
    p.MessageSend: OpSpec("inboxes", "op_message_send", _run("scope_id"), W),
    p.MessageStatus: OpSpec("inboxes", "op_message_status", _message, R),
    # quotas: on the quota's actor (space level); ensure/list on the space's
    p.QuotaEnsure: OpSpec("quotas", "op_quota_ensure", _space, C),
    p.QuotaGet: OpSpec("quotas", "op_quota_get", _quota, R),
    p.QuotaList: OpSpec("quotas", "op_quota_list", _space, R),
    p.QuotaTake: OpSpec("quotas", "op_quota_take", _quota, W),
    p.QuotaCooldown: OpSpec("quotas", "op_quota_cooldown", _quota, W),
    p.QuotaWaiterWait: OpSpec("quotas", "op_quota_waiter_wait", _quota_waiter, R),
    p.QuotaWaiterCancel: OpSpec("quotas", "op_quota_waiter_cancel", _quota_waiter, W),
    # budgets: on the budget's actor (space level); ensure/list on the space's
    p.BudgetEnsure: OpSpec("budgets", "op_budget_ensure", _space, C),
    p.BudgetGet: OpSpec("budgets", "op_budget_get", _budget, R),
    p.BudgetList: OpSpec("budgets", "op_budget_list", _space, R),
    p.BudgetReserve: OpSpec("budgets", "op_budget_reserve", _budget, W),
    p.BudgetSettle: OpSpec("budgets", "op_budget_settle", _reservation, W),
    p.BudgetVoid: OpSpec("budgets", "op_budget_void", _reservation, W),
    p.ReservationGet: OpSpec("budgets", "op_reservation_get", _reservation, R),
    # named runs, timers and barriers (runstate's PUT .../by-name/{name})
    p.ScopeEnsureNamed: OpSpec("runs", "op_scope_ensure_named", _space, W),
    p.TimerAck: OpSpec("timers", "op_timer_ack", _timer, W),
    p.TimerPoll: OpSpec("timers", "op_timer_poll", _run("scope_id"), R),
    p.MailboxMessages: OpSpec("queues", "op_mailbox_messages", _queue, R),
    # once: on the run's actor (a once belongs to its run; a get waits there)
    p.OnceAcquire: OpSpec("onces", "op_once_acquire", _run("scope_id"), W),
    p.OnceGet: OpSpec("onces", "op_once_get", _run("scope_id"), R),
    p.OnceRenew: OpSpec("onces", "op_once_renew", _run("scope_id"), W),
    p.OnceComplete: OpSpec("onces", "op_once_complete", _run("scope_id"), W),
    p.OnceFail: OpSpec("onces", "op_once_fail", _run("scope_id"), W),
    # HTTP idempotency keys: on the space's actor (the HTTP layer's own bookkeeping; any
    # key may record the answers of the requests it is allowed to make)
    p.IdempotencyLookup: OpSpec("idempotency", "op_idempotency_lookup", _space, ANY_KEY),
    p.IdempotencyRecord: OpSpec("idempotency", "op_idempotency_record", _space, ANY_KEY),
    p.TaskSubscribe: OpSpec("queues", "op_task_subscribe", _task, W),
    p.TaskDetach: OpSpec("queues", "op_task_detach", _task, W),
    # diagnostics (read-only)
    p.OpsRun: OpSpec("diagnostics", "op_ops_run", _run("scope_id"), R),
    p.OpsWaits: OpSpec("diagnostics", "op_ops_waits", _space, R),
    # claims: an acquire runs (and waits) on the acquiring run's actor; the holder's
    # calls on the claim's actor (in its owning run's nursery)
    p.ClaimAcquire: OpSpec("claims", "op_claim_acquire", _run("scope_id"), W),
    p.ClaimRenew: OpSpec("claims", "op_claim_renew", _claim, W),
    p.ClaimRelease: OpSpec("claims", "op_claim_release", _claim, W),
    p.ClaimComplete: OpSpec("claims", "op_claim_complete", _claim, W),
    p.ClaimCancelWait: OpSpec("claims", "op_claim_cancel_wait", _claim, W),
    p.ClaimStatus: OpSpec("claims", "op_claim_status", _claim, R),
    p.ClaimList: OpSpec("claims", "op_claim_list", _space, R),
    # pools: space-level; every pool and grant command runs on the pool's actor
    p.PoolEnsure: OpSpec("pools", "op_pool_ensure", _space, C),
    p.PoolGet: OpSpec("pools", "op_pool_get", _pool("name"), R),
    p.PoolList: OpSpec("pools", "op_pool_list", _space, R),
    p.PoolAcquire: OpSpec("pools", "op_pool_acquire", _pool("pool"), W),
    p.PoolCancelWait: OpSpec("pools", "op_pool_cancel_wait", _pool("pool"), W),
    p.GrantRenew: OpSpec("pools", "op_grant_renew", _grant, W),
    p.GrantRelease: OpSpec("pools", "op_grant_release", _grant, W),
    p.GrantStatus: OpSpec("pools", "op_grant_status", _grant, R),
    # work limits: a run's
    p.WorkLimitEnsure: OpSpec("admission", "op_work_limit_ensure", _run("scope_id"), C),
    p.WorkLimitList: OpSpec("admission", "op_work_limit_list", _run_or_space, R),
}
