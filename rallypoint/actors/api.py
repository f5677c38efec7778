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

__all__ = ["OpSpec", "OPS", "PERMISSIONS"]

PERMISSIONS = ("resource_config", "coordination_write", "coordination_read", "admin", "operator")


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
    p.TaskCancel: OpSpec("queues", "op_task_cancel", _task, W),
    p.Receive: OpSpec("queues", "op_receive", _run("scope_id"), W),
    p.DeliveryRenew: OpSpec("queues", "op_delivery_renew", _task, W),
    p.DeliveryComplete: OpSpec("queues", "op_delivery_complete", _task, W),
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
}
