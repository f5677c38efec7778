"""The operation table: for every protocol operation, its handler and its permission.

One table, so that access control (SPEC §10) and the tests that cover every operation
are generated from it: an operation without an entry here fails
``tests/test_api_table.py``.

Permissions: ``resource_config`` (create and configure mailboxes, groups, barriers...),
``coordination_write`` (submit, receive, settle, cancel, verdicts...),
``coordination_read`` (status, wait, list), ``admin`` (server-wide).
"""

from __future__ import annotations

from typing import NamedTuple

from .. import protocol as p

__all__ = ["OpSpec", "OPS", "PERMISSIONS"]

PERMISSIONS = ("resource_config", "coordination_write", "coordination_read", "admin")


class OpSpec(NamedTuple):
    handler: str  # name of the Coordinator method
    permission: str


R, W, C, A = "coordination_read", "coordination_write", "resource_config", "admin"

OPS: dict[type, OpSpec] = {
    p.ServerStatus: OpSpec("op_server_status", R),
    p.ScopeCreate: OpSpec("op_scope_create", W),
    p.ScopeStatus: OpSpec("op_scope_status", R),
    p.ScopeCancel: OpSpec("op_scope_cancel", W),
    p.ScopeComplete: OpSpec("op_scope_complete", W),
    p.ScopeList: OpSpec("op_scope_list", R),
    p.MailboxEnsure: OpSpec("op_mailbox_ensure", C),
    p.MailboxGet: OpSpec("op_mailbox_get", R),
    p.MailboxList: OpSpec("op_mailbox_list", R),
    p.TaskSubmit: OpSpec("op_task_submit", W),
    p.TaskSubmitMany: OpSpec("op_task_submit_many", W),
    p.TaskStatus: OpSpec("op_task_status", R),
    p.TaskResult: OpSpec("op_task_result", R),
    p.TaskCancel: OpSpec("op_task_cancel", W),
    p.Receive: OpSpec("op_receive", W),
    p.DeliveryRenew: OpSpec("op_delivery_renew", W),
    p.DeliveryComplete: OpSpec("op_delivery_complete", W),
    p.DeliveryRetry: OpSpec("op_delivery_retry", W),
    p.DeliveryReject: OpSpec("op_delivery_reject", W),
    p.GroupCreate: OpSpec("op_group_create", C),
    p.GroupSubmit: OpSpec("op_group_submit", W),
    p.GroupJoinTask: OpSpec("op_group_join_task", W),
    p.GroupVerdictOp: OpSpec("op_group_verdict", W),
    p.GroupClose: OpSpec("op_group_close", W),
    p.GroupStatus: OpSpec("op_group_status", R),
    p.GroupWait: OpSpec("op_group_wait", R),
    p.BarrierCreate: OpSpec("op_barrier_create", C),
    p.BarrierArrive: OpSpec("op_barrier_arrive", W),
    p.BarrierStatus: OpSpec("op_barrier_status", R),
    p.BarrierWait: OpSpec("op_barrier_wait", R),
    p.BarrierNextEpochOp: OpSpec("op_barrier_next_epoch", W),
    p.TimerCreate: OpSpec("op_timer_create", W),
    p.TimerStatus: OpSpec("op_timer_status", R),
    p.TimerWait: OpSpec("op_timer_wait", W),
    p.TimerCancel: OpSpec("op_timer_cancel", W),
    p.JoinSetCreate: OpSpec("op_joinset_create", W),
    p.JoinSetGet: OpSpec("op_joinset_get", R),
    p.JoinSetSubmit: OpSpec("op_joinset_submit", W),
    p.JoinSetSubmitDelay: OpSpec("op_joinset_submit_delay", W),
    p.JoinNext: OpSpec("op_joinset_join_next", W),
    p.JoinSetClose: OpSpec("op_joinset_close", W),
    p.KeyCreate: OpSpec("op_key_create", A),
    p.KeyList: OpSpec("op_key_list", A),
    p.KeyRevoke: OpSpec("op_key_revoke", A),
}
