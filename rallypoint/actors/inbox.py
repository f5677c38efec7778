"""Messages: plain payloads sent into an INBOX-mode mailbox (kernel reference §6.4).

``mailbox.send(payload, scope=run)`` puts a message into an INBOX mailbox
(``rs.mailboxes.ensure(name, mode="INBOX")``); receivers take it with the same
``receive`` as tasks and renew, complete (ACKED), retry or reject it with the same
fencing tokens. A message is not a task: nobody waits for its result, it joins no group
or join set, and a WORK mailbox refuses it (CONFLICT), as an INBOX refuses tasks.

**What is reused.** Everything but the two ops here is the work-queue kind's
(:mod:`rallypoint.actors.queue`): a message is a ``TaskState`` of an INBOX queue with a
``msg_`` id, created by the same ``TaskSubmitted`` record through
``WorkQueues.prepare_submit`` (payload limit, idempotency key per run and mailbox,
deadline, backlog limit, the run's refusal), and then received, leased, renewed,
settled, retried after a lost lease (attempt + 1), failed after ``max_attempts``,
extended by ``LeasesExtended`` after a restart or a stall, and cancelled with its run
by the same code and records. There is no message-specific state or record.

Both ops run on the message's run's actor (a message belongs to its run, like a task).
"""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import NotFoundError
from ..protocol import NIL, MessageSend, MessageStatus, MessageView
from ..records import TaskSubmitted
from .common import short
from .kind import Kind
from .opmark import ALWAYS, R, W, by, by_run, keyed, op
from .queue import TaskState

__all__ = ["Inboxes"]


class Inboxes(Kind):
    """The message ops of INBOX mailboxes (no state of its own: see the module doc)."""

    prefix = ""
    name = "inboxes"

    def get_message(self, space: str, message_id) -> TaskState:
        t = self.coord.queues.tasks.get(message_id) if isinstance(message_id, str) else None
        if t is None or t.space != space or not message_id.startswith("msg_"):
            raise NotFoundError(f"no message {short(message_id)} in this space", details={"message_id": message_id})
        return t

    def route_message(self, session, message_id) -> str:
        """The actor of a command about a message: its run's."""
        return self.get_message(session.space, message_id).scope_id

    @op(MessageSend, route=by_run(), permission=W,
        resend=keyed("key", "give the message a `key` to make it safe to retry"))
    def op_message_send(self, actor, session, op: MessageSend) -> MessageView:
        """Send ``payload`` (any msgpack value, at most 64 KiB) into the INBOX mailbox,
        bound to run ``scope_id``; returns the message (QUEUED). With ``key``,
        idempotent within the run and mailbox (same payload: the existing message;
        another payload: CONFLICT).

        Errors: NOT_FOUND (mailbox, run), CONFLICT (a WORK mailbox; a key reused),
        VALIDATION_FAILED (payload, key, deadline), SCOPE_CANCELLED /
        DEADLINE_EXCEEDED (the run is inactive), LIMIT_EXCEEDED (backlog full)."""
        coord = self.coord
        queues = coord.queues
        q = queues.get_queue(session.space, op.mailbox)
        run = coord.runs.get(session.space, op.scope_id)
        rec = queues.prepare_submit(session.space, q, run.id, op.payload, op.key, op.deadline, mode="INBOX")
        if isinstance(rec, TaskSubmitted):
            coord.commit([rec])
            rec = queues.tasks[rec.id]
        return self.view(rec)

    @op(MessageStatus, route=by("message_id", "route_message"), permission=R, resend=ALWAYS)
    def op_message_status(self, actor, session, op: MessageStatus) -> MessageView:
        """The message now; readable forever, whatever its run's state."""
        return self.view(self.get_message(session.space, op.message_id))

    def view(self, t: TaskState) -> MessageView:
        return MessageView(
            id=t.id,
            mailbox=self.coord.queues.table[t.mailbox_id].name,
            scope_id=t.scope_id,
            state=t.state,
            attempt=t.attempt,
            key=t.key,
            payload=msgspec.Raw(t.input),
            result=msgspec.Raw(t.outcome) if t.outcome is not None else NIL,
            error=msgspec.Raw(t.error) if t.error is not None else NIL,
            outcome_reason=t.outcome_reason,
            created_at=to_iso(t.created_at_ms),
            finished_at=to_iso(t.finished_at_ms),
            deadline=to_iso(t.deadline_ms),
        )
