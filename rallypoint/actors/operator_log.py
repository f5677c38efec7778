"""The audit trail of what operators did from the web console (issue 46).

An action taken from the console (cancel a run, retry or fail a task, release a lease,
close a join set, pause or unpause a schedule) is the same operation a client sends
over TCP or HTTP, run under the login's key and permission-checked by
``Service.call`` as any other. Once it succeeded, the console records it here with
``console.acted`` -- a node-local op (``LOCAL``: only the node itself makes it, in
process, under ``Session.as_local`` of the acting login, so the key id it records is the
session's, never a field a client could forge) -- as one ``OperatorActionRecorded``
journal record, which emits the event ``console.action`` (``action``, ``key``,
``note``; its aggregate the target, its run the target's run). The record changes no
state: the action's own records did.
"""

from __future__ import annotations

from ..clock import to_iso
from ..errors import ValidationError
from ..events import emits, ev
from ..protocol import OperatorActed, OperatorActedView
from ..records import OperatorActionRecorded
from .common import applies
from .kind import Kind
from .opmark import ALWAYS, HERE, LOCAL, SPACE, op

__all__ = ["OperatorLog", "ACTIONS", "MAX_NOTE"]

#: The console's actions, by name.
ACTIONS = ("cancel-run", "retry-task", "fail-task", "release-lease", "close-joinset", "pause-schedule",
           "unpause-schedule")
#: Longest note, characters.
MAX_NOTE = 1024
#: Longest target id, characters.
MAX_TARGET = 256


class OperatorLog(Kind):
    """The ``console.acted`` op and its record's event; no state of its own."""

    prefix = ""  # (no entities)
    name = "operator_log"

    @op(OperatorActed, route=SPACE, permission=LOCAL, resend=ALWAYS, shard=HERE)
    def op_console_acted(self, actor, session, op: OperatorActed) -> OperatorActedView:
        """Journal the action (VALIDATION_FAILED for an action not in :data:`ACTIONS`, an
        empty or over-long target, a note longer than :data:`MAX_NOTE`)."""
        if op.action not in ACTIONS:
            raise ValidationError(f"action must be one of {', '.join(ACTIONS)}", details={"field": "action"})
        if not op.target or len(op.target) > MAX_TARGET:
            raise ValidationError(f"target must be 1 to {MAX_TARGET} characters", details={"field": "target"})
        if op.note is not None and len(op.note) > MAX_NOTE:
            raise ValidationError(f"note is longer than {MAX_NOTE} characters", details={"field": "note"})
        now = self.coord.now_ms()
        self.coord.commit([OperatorActionRecorded(space=session.space, action=op.action, target=op.target, at_ms=now,
                                                  run=op.run, key_id=session.key_id, note=op.note)])
        return OperatorActedView(at=to_iso(now))

    @applies(OperatorActionRecorded)
    def _apply_acted(self, r: OperatorActionRecorded) -> None:
        """No state changes: the record is the audit line of an action whose own records
        changed what it changed."""

    @emits(OperatorActionRecorded, pure=True)
    def _ev_acted(self, r: OperatorActionRecorded):
        data = {"action": r.action, "key": r.key_id}
        if r.note is not None:
            data["note"] = r.note
        return ev(r.space, "console.action", "console", r.target, r.run, r.at_ms, data)
