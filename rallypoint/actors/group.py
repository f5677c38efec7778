"""Task groups: decide once, under races, whether a set of tasks is done (SPEC §4).

A group owns a *gate* run (a child of its parent run) and delivers its members through
one mailbox. OPEN -> SEALED (``close()``, or the submit that adds the
``expected_members``-th member) -> FINALIZED; finalizing can happen from OPEN too.

The decision is evaluated after every commit that touches the group (a verdict, a
member's state change, a seal) as a *reaction* inside the same commit, so the verdict
and the finalization it causes are one journal entry. Finalizing is ONE record,
``GroupFinalized``, whose apply records the outcome, cancels the gate run (its subtree
goes inactive: receives refused, ``consume`` loops stop) and cancels every unfinished
member, with no ``await`` in between: no client can observe a FINALIZED group whose gate
is still ACTIVE, nor a member deliverable after it.

Decision table (outcome, outcome_reason)::

    FIRST_ACCEPTED  SUCCESS first member accepted (first_accepted)
                    FAILURE deadline (deadline)
    N_ACCEPTED      SUCCESS threshold accepted, open or sealed (threshold_reached)
                    FAILURE sealed and accepted + still-acceptable < threshold
                            (threshold_unreachable); deadline (deadline)
    ALL_TERMINAL    SUCCESS sealed, all finished, >= 1 accepted, none rejected (all_terminal)
                    FAILURE sealed, all finished otherwise (all_terminal); deadline
    any             FAILURE gate or an ancestor cancelled/completed (cancelled), an
                            ancestor's deadline (deadline)

A member "could still be accepted" while its task is unfinished, or SUCCEEDED and not yet
judged; a member is *finished* for the group when it can no longer be accepted or
rejected by a pending verdict, i.e. its task is terminal and, if it SUCCEEDED, it has a
verdict. (So ALL_TERMINAL waits for verdicts on the members that succeeded: without
that, the last member to finish would decide the group before anyone could accept it.)
The group's deadline is its gate run's deadline. Once a deadline of the gate or an
ancestor has passed (its timer may not have fired yet: refusals start at the instant,
SPEC §2), the only outcome left is FAILURE ``deadline``: the next commit that touches
the group records it, a verdict is ``late``, and a cancel keeps the reason ``deadline``.
"""

from __future__ import annotations

import msgspec
import trio

from ..clock import to_iso
from ..errors import ConflictError, LimitError, NotFoundError, ValidationError
from ..protocol import (
    GroupClose,
    GroupCreate,
    GroupDecisionView,
    GroupJoinTask,
    GroupMemberAddedView,
    GroupMemberView,
    GroupStatus,
    GroupSubmit,
    GroupVerdictOp,
    GroupView,
    GroupWait,
    VerdictView,
)
from ..records import (
    GroupCreated,
    GroupFinalized,
    GroupMemberJoined,
    GroupSealed,
    GroupVerdict,
    TaskSubmitted,
)
from .mailbox import TERMINAL, TaskState
from .scope import ScopeState
from .system import short, applies, check_payload, check_range, clamp_wait, parse_instant

__all__ = ["GroupState", "Member", "GroupKind", "MAX_MEMBERS", "CONDITIONS"]

MAX_MEMBERS = 100
CONDITIONS = ("FIRST_ACCEPTED", "N_ACCEPTED", "ALL_TERMINAL")


class Member(msgspec.Struct, gc=False, array_like=True):
    task_id: str
    verdict: str | None = None  # ACCEPTED | REJECTED
    late: bool = False


class GroupState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    parent_scope_id: str
    gate_scope_id: str
    mailbox_id: str
    condition: str
    created_at_ms: int
    threshold: int | None = None
    expected_members: int | None = None
    deadline_ms: int | None = None
    state: str = "OPEN"  # OPEN | SEALED | FINALIZED
    outcome: str | None = None
    outcome_reason: str | None = None
    finalized_at_ms: int | None = None
    members: list[Member] = msgspec.field(default_factory=list)


class GroupKind:
    """Task groups: op handlers, apply functions, the decision reaction."""

    def _init_tables(self) -> None:
        super()._init_tables()
        self.groups: dict[str, GroupState] = {}
        self.group_member_index: dict[str, dict[str, Member]] = {}
        self.inactive_hooks.append(self._groups_on_scope_inactive)

    def entity_tables(self):
        t = super().entity_tables()
        t["grp"] = (self.groups, GroupState)
        return t

    def get_group(self, space: str, group_id: str) -> GroupState:
        g = self.groups.get(group_id) if isinstance(group_id, str) else None
        if g is None or g.space != space:
            raise NotFoundError(f"no task group {short(group_id)} in this space", details={"group_id": group_id})
        return g

    # ================================================================ create
    def op_group_create(self, session, op: GroupCreate) -> GroupView:
        space = session.space
        origin = self.get_scope(space, op.scope_id)
        parent = self.get_scope(space, op.parent_scope_id) if op.parent_scope_id else origin
        mbx = self.get_mailbox(space, op.mailbox)
        if op.condition not in CONDITIONS:
            raise ValidationError(
                f"condition must be one of {', '.join(CONDITIONS)} (got {short(op.condition)})",
                details={"field": "condition"},
            )
        if op.condition == "N_ACCEPTED":
            if op.threshold is None:
                raise ValidationError("threshold is required for N_ACCEPTED", details={"field": "threshold"})
            check_range("threshold", op.threshold, 1, MAX_MEMBERS)
        elif op.threshold is not None:
            raise ValidationError(
                f"threshold applies only to N_ACCEPTED, not {op.condition}", details={"field": "threshold"}
            )
        if op.expected_members is not None:
            check_range("expected_members", op.expected_members, 1, MAX_MEMBERS)
            if op.threshold is not None and op.expected_members < op.threshold:
                raise ValidationError(
                    f"expected_members ({op.expected_members}) is lower than threshold ({op.threshold})",
                    details={"field": "expected_members"},
                )
        now = self.now_ms()
        deadline_ms = parse_instant("deadline", op.deadline)
        if deadline_ms is not None and deadline_ms <= now:
            raise ValidationError(f"deadline {op.deadline} is in the past", details={"field": "deadline"})
        self.require_active(parent.id)
        if parent.children >= parent.child_limit:
            raise LimitError(
                f"run {parent.id} already has {parent.children} children, its child_limit; "
                "the group's gate run would exceed it",
                details={"field": "child_limit", "limit": parent.child_limit},
            )
        gid = self.ids.new("grp")
        rec = GroupCreated(
            id=gid,
            space=space,
            parent_scope_id=parent.id,
            gate_scope_id=self.ids.new("scp"),
            mailbox_id=mbx.id,
            condition=op.condition,
            at_ms=now,
            threshold=op.threshold,
            expected_members=op.expected_members,
            deadline_ms=deadline_ms,
        )
        self.commit([rec])
        return self.group_view(self.groups[gid])

    @applies(GroupCreated)
    def _apply_group_created(self, r: GroupCreated) -> None:
        g = GroupState(
            id=r.id,
            space=r.space,
            parent_scope_id=r.parent_scope_id,
            gate_scope_id=r.gate_scope_id,
            mailbox_id=r.mailbox_id,
            condition=r.condition,
            created_at_ms=r.at_ms,
            threshold=r.threshold,
            expected_members=r.expected_members,
            deadline_ms=r.deadline_ms,
        )
        self.groups[g.id] = g
        self.group_member_index[g.id] = {}
        gate = ScopeState(
            id=r.gate_scope_id,
            space=r.space,
            parent_id=r.parent_scope_id,
            name=f"group:{r.id}",
            deadline_ms=r.deadline_ms,
            child_limit=1000,
            created_at_ms=r.at_ms,
            group_id=r.id,
        )
        self._index_scope(gate)
        self.scopes[r.parent_scope_id].children += 1
        self.touch(r.parent_scope_id)
        self.touch(gate.id)
        self.touch(g.id)

    # ================================================================ members
    def _member_view_for(self, g: GroupState, t: TaskState) -> GroupMemberAddedView:
        return GroupMemberAddedView(task=self.task_view(t), group_state=g.state)

    def op_group_submit(self, session, op: GroupSubmit) -> GroupMemberAddedView:
        g = self.get_group(session.space, op.group_id)
        mbx = self.mailboxes[g.mailbox_id]
        self._check_key(op.key)
        if op.key is not None:
            tid = self.task_keys.get((g.gate_scope_id, mbx.id, op.key))
            if tid is not None:
                t = self.tasks[tid]
                if t.input != check_payload("input", op.input):
                    raise ConflictError(
                        f"key {op.key!r} is already a member of group {g.id} with a different input",
                        details={"field": "key", "task_id": t.id},
                    )
                return self._member_view_for(g, t)
        self._require_open(g)
        rec = self.prepare_submit(
            session.space, mbx, g.gate_scope_id, op.input, op.key, op.deadline, group_id=g.id
        )
        assert isinstance(rec, TaskSubmitted)
        seals = g.expected_members is not None and len(g.members) + 1 >= g.expected_members
        self.commit([rec, GroupMemberJoined(group_id=g.id, task_id=rec.id, at_ms=rec.at_ms, seals=seals)])
        return self._member_view_for(g, self.tasks[rec.id])

    def _require_open(self, g: GroupState) -> None:
        if g.state != "OPEN":
            raise ConflictError(
                f"group {g.id} is {g.state}; it takes no new members",
                details={"group_id": g.id, "state": g.state},
            )
        if len(g.members) >= MAX_MEMBERS:
            raise LimitError(f"group {g.id} already has {MAX_MEMBERS} members, the limit")

    def op_group_join_task(self, session, op: GroupJoinTask) -> GroupMemberAddedView:
        g = self.get_group(session.space, op.group_id)
        t = self.get_task(session.space, op.task_id)
        if t.group_id == g.id:
            return self._member_view_for(g, t)
        if t.group_id is not None:
            raise ConflictError(f"task {t.id} is already a member of group {t.group_id}")
        self._require_open(g)
        self.require_active(g.gate_scope_id)  # like submit: no new members past the deadline
        seals = g.expected_members is not None and len(g.members) + 1 >= g.expected_members
        self.commit([GroupMemberJoined(group_id=g.id, task_id=t.id, at_ms=self.now_ms(), seals=seals)])
        return self._member_view_for(g, t)

    @applies(GroupMemberJoined)
    def _apply_member_joined(self, r: GroupMemberJoined) -> None:
        g = self.groups[r.group_id]
        m = Member(task_id=r.task_id)
        g.members.append(m)
        self.group_member_index[g.id][r.task_id] = m
        t = self.tasks[r.task_id]
        if t.group_id != g.id:
            t.group_id = g.id
            self.touch(t.id)
        if r.seals and g.state == "OPEN":
            g.state = "SEALED"
        self.touch(g.id)
        self._touch_group(g.id)

    # ================================================================ verdicts
    def op_group_verdict(self, session, op: GroupVerdictOp) -> VerdictView:
        g = self.get_group(session.space, op.group_id)
        verdict = {"ACCEPTED": "ACCEPTED", "ACCEPT": "ACCEPTED", "REJECTED": "REJECTED", "REJECT": "REJECTED"}.get(
            op.verdict
        )
        if verdict is None:
            raise ValidationError(f"verdict must be ACCEPTED or REJECTED (got {short(op.verdict)})", details={"field": "verdict"})
        m = self.group_member_index[g.id].get(op.task_id)
        if m is None:
            raise NotFoundError(f"task {short(op.task_id)} is not a member of group {g.id}", details={"task_id": op.task_id})
        if m.verdict == verdict:
            return self._verdict_view(g, m)  # idempotent
        if m.verdict is not None:
            raise ConflictError(
                f"member {m.task_id} was already {m.verdict}; a verdict cannot change",
                details={"task_id": m.task_id, "verdict": m.verdict},
            )
        t = self.tasks[m.task_id]
        if verdict == "ACCEPTED" and t.state != "SUCCEEDED":
            raise ConflictError(
                f"member {t.id} is {t.state}; only a SUCCEEDED member can be accepted",
                details={"task_id": t.id, "task_state": t.state},
            )
        if verdict == "REJECTED" and t.state not in TERMINAL:
            raise ConflictError(
                f"member {t.id} is {t.state}; only a finished member can be rejected",
                details={"task_id": t.id, "task_state": t.state},
            )
        self.commit([
            GroupVerdict(
                group_id=g.id, task_id=t.id, verdict=verdict, at_ms=self.now_ms(),
                late=g.state == "FINALIZED" or self._deadline_passed(g),
            )
        ])
        return self._verdict_view(g, m)

    def _verdict_view(self, g: GroupState, m: Member) -> VerdictView:
        return VerdictView(
            task_id=m.task_id,
            verdict=m.verdict or "",
            late=m.late,
            group_state=g.state,
            outcome=g.outcome,
            outcome_reason=g.outcome_reason,
        )

    @applies(GroupVerdict)
    def _apply_verdict(self, r: GroupVerdict) -> None:
        m = self.group_member_index[r.group_id][r.task_id]
        m.verdict = r.verdict
        m.late = r.late
        self.touch(r.group_id)
        self._touch_group(r.group_id)

    # ================================================================ close, status, wait
    def op_group_close(self, session, op: GroupClose) -> GroupDecisionView:
        g = self.get_group(session.space, op.group_id)
        if g.state == "OPEN":
            self.commit([GroupSealed(group_id=g.id, at_ms=self.now_ms())])
        return GroupDecisionView(state=g.state, outcome=g.outcome, outcome_reason=g.outcome_reason)

    @applies(GroupSealed)
    def _apply_sealed(self, r: GroupSealed) -> None:
        g = self.groups[r.group_id]
        if g.state == "OPEN":
            g.state = "SEALED"
        self.touch(g.id)
        self._touch_group(g.id)

    def op_group_status(self, session, op: GroupStatus) -> GroupView:
        return self.group_view(self.get_group(session.space, op.group_id))

    def op_group_wait(self, session, op: GroupWait):
        g = self.get_group(session.space, op.group_id)
        wait_ms = clamp_wait(op.wait_ms)
        if g.state == "FINALIZED" or wait_ms == 0:
            return self.group_view(g)
        return self._group_wait(g, wait_ms)

    async def _group_wait(self, g: GroupState, wait_ms: int) -> GroupView:
        with trio.move_on_after(wait_ms / 1000):
            while g.state != "FINALIZED":
                await self.notifier.event(g.id).wait()
        return self.group_view(g)

    def group_view(self, g: GroupState) -> GroupView:
        members = []
        counts: dict[str, int] = {"members": len(g.members), "accepted": 0, "rejected": 0}
        for m in g.members:
            t = self.tasks[m.task_id]
            members.append(
                GroupMemberView(task_id=t.id, task_state=t.state, verdict=m.verdict, late=m.late, key=t.key)
            )
            counts[t.state] = counts.get(t.state, 0) + 1
            if m.verdict == "ACCEPTED":
                counts["accepted"] += 1
            elif m.verdict == "REJECTED":
                counts["rejected"] += 1
        return GroupView(
            id=g.id,
            scope_id=g.gate_scope_id,
            parent_scope_id=g.parent_scope_id,
            mailbox=self.mailboxes[g.mailbox_id].name,
            condition=g.condition,
            threshold=g.threshold,
            expected_members=g.expected_members,
            deadline=to_iso(g.deadline_ms),
            state=g.state,
            outcome=g.outcome,
            outcome_reason=g.outcome_reason,
            created_at=to_iso(g.created_at_ms),
            finalized_at=to_iso(g.finalized_at_ms),
            counts=counts,
            members=members,
        )

    # ================================================================ the decision
    def _touch_group(self, gid: str) -> None:
        if not self._replaying:
            self._touched_groups.add(gid)

    def _react(self) -> list:
        more = super()._react()
        if self._touched_groups:
            touched, self._touched_groups = self._touched_groups, set()
            now = None
            for gid in sorted(touched):
                g = self.groups.get(gid)
                if g is None or g.state == "FINALIZED":
                    continue
                # past the deadline (its timer may not have fired yet) only the deadline decides
                decision = ("FAILURE", "deadline") if self._deadline_passed(g) else self.evaluate_group(g)
                if decision is not None:
                    if now is None:
                        now = self.now_ms()
                    more.append(GroupFinalized(group_id=gid, outcome=decision[0], reason=decision[1], at_ms=now))
        return more

    def _deadline_passed(self, g: GroupState, at_ms: int | None = None) -> bool:
        """The gate (or an ancestor) is past its deadline at ``at_ms`` (default: now),
        whether or not the deadline's timer has fired: the group's outcome can only be
        FAILURE ``deadline`` from then on. Deterministic given ``at_ms`` (used in apply)."""
        if at_ms is None:
            at_ms = self.now_ms()
        scopes = self.scopes
        s = scopes.get(g.gate_scope_id)
        while s is not None:
            if s.deadline_ms is not None and (s.deadline_fired or s.deadline_ms <= at_ms):
                return True
            s = scopes.get(s.parent_id) if s.parent_id else None
        return False

    def evaluate_group(self, g: GroupState) -> tuple[str, str] | None:
        """The decision table (pure). None while undecided."""
        accepted = rejected = still = 0
        all_finished = True
        tasks = self.tasks
        for m in g.members:
            if m.late:
                continue
            if m.verdict == "ACCEPTED":
                accepted += 1
            elif m.verdict == "REJECTED":
                rejected += 1
            else:
                st = tasks[m.task_id].state
                if st not in TERMINAL or st == "SUCCEEDED":
                    still += 1
                    all_finished = False
        sealed = g.state == "SEALED"
        if g.condition == "FIRST_ACCEPTED":
            if accepted >= 1:
                return ("SUCCESS", "first_accepted")
        elif g.condition == "N_ACCEPTED":
            if accepted >= g.threshold:
                return ("SUCCESS", "threshold_reached")
            if sealed and accepted + still < g.threshold:
                return ("FAILURE", "threshold_unreachable")
        else:  # ALL_TERMINAL
            if sealed and all_finished:
                ok = accepted >= 1 and rejected == 0
                return ("SUCCESS" if ok else "FAILURE", "all_terminal")
        return None

    @applies(GroupFinalized)
    def _apply_group_finalized(self, r: GroupFinalized) -> None:
        self._finalize(self.groups[r.group_id], r.outcome, r.reason, r.at_ms)

    def _finalize(self, g: GroupState, outcome: str, reason: str, at_ms: int) -> None:
        """The one atomic step: outcome, gate cancelled (subtree inactive), unfinished
        members CANCELLED, waiters woken."""
        g.state = "FINALIZED"
        g.outcome = outcome
        g.outcome_reason = reason
        g.finalized_at_ms = at_ms
        self.touch(g.id)
        gate = self.scopes[g.gate_scope_id]
        if gate.state == "ACTIVE":
            self.count_run(gate.space, "ACTIVE", "CANCELLED")
            gate.state = "CANCELLED"
            gate.ended_at_ms = at_ms
            gate.end_reason = "group_finalized"
            self.touch(gate.id)
            self._inactivate_subtree(gate.id, at_ms, "cancelled")
        for m in g.members:
            t = self.tasks[m.task_id]
            if t.state not in TERMINAL:
                self._finish(t, "CANCELLED", at_ms, "group_finalized")
        self.notifier.notify(g.id)

    def _groups_on_scope_inactive(self, scope_id: str, at_ms: int, reason: str) -> None:
        s = self.scopes[scope_id]
        if s.group_id is None:
            return
        g = self.groups.get(s.group_id)
        if g is not None and g.state != "FINALIZED":
            # a cancel that lands after the deadline passed (before its timer fired) does
            # not rewrite the reason: the deadline decided first
            past = reason == "deadline" or self._deadline_passed(g, at_ms)
            self._finalize(g, "FAILURE", "deadline" if past else "cancelled", at_ms)

    # ================================================================ recovery
    def rebuild_indexes(self) -> None:
        super().rebuild_indexes()
        self.group_member_index = {g.id: {m.task_id: m for m in g.members} for g in self.groups.values()}
