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

The group's actor lives in its parent run's nursery (beside its gate run's actor);
``wait`` parks there. The gate run is created and ended by the runs kind's own functions
(``Runs.add``, ``Runs.end``), inside the group's records.
"""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, DeadlineExceededError, LimitError, NotFoundError, ValidationError
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
from ..events import emits, ev
from .common import applies, check_key, check_payload, check_range, clamp_wait, data, parse_instant, short
from .kind import Kind
from .opmark import ALWAYS, C, NEVER, R, W, asked, by, by_run, keyed, op
from .queue import TERMINAL, TaskState
from .run import ScopeState
from .runtime import Park

__all__ = ["GroupState", "Member", "Groups", "MAX_MEMBERS", "CONDITIONS"]

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


class Groups(Kind):
    """Task groups: op handlers, apply functions, the decision reaction."""

    prefix = "grp"
    name = "groups"
    noun = "task group"
    id_field = "group_id"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, GroupState] = {}
        self.member_index: dict[str, dict[str, Member]] = {}
        self.touched: set[str] = set()

    def entity_tables(self):
        return {"grp": (self.table, GroupState)}

    def parent_actor_id(self, group_id: str) -> str | None:
        return self.table[group_id].parent_scope_id


    # ================================================================ create
    @op(GroupCreate, route=by_run(), permission=C, resend=NEVER)
    def op_group_create(self, actor, session, op: GroupCreate) -> GroupView:
        """A group and its gate run (a child of ``parent_scope_id``, default the run the
        call is made on), in one record. Runs on the calling run's actor. Both the calling
        run and the parent must be active (SCOPE_CANCELLED / DEADLINE_EXCEEDED); the gate
        run counts against the space's ``runs`` limit (LIMIT_EXCEEDED)."""
        coord = self.coord
        runs = coord.runs
        space = session.space
        origin = runs.get(space, op.scope_id)
        parent = runs.get(space, op.parent_scope_id) if op.parent_scope_id else origin
        q = coord.queues.get_queue(space, op.mailbox)
        if q.mode != "WORK":
            raise ConflictError(f"mailbox {q.name!r} is an {q.mode} mailbox (messages); a group needs a WORK mailbox",
                                details={"field": "mailbox", "mode": q.mode})
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
        now = coord.now_ms()
        deadline_ms = parse_instant("deadline", op.deadline)
        if deadline_ms is not None and deadline_ms <= now:
            raise ValidationError(f"deadline {op.deadline} is in the past", details={"field": "deadline"})
        runs.require_active(origin.id)
        if parent.id != origin.id:
            runs.require_active(parent.id)
            if coord.sharding is not None and runs.root_of(parent.id) != runs.root_of(origin.id):
                raise ValidationError(
                    f"the group's parent run {parent.id} is in another run tree than run {origin.id}: a sharded "
                    "cluster keeps a group, its gate and its members in one tree", details={"cross_tree": True})
        runs.check_child_limit(parent, "; the group's gate run would exceed it")
        coord.limits.check_runs(space)  # its gate run (the space's runs limit)
        rec = GroupCreated(
            id=coord.new_id("grp", under=origin.id),
            space=space,
            parent_scope_id=parent.id,
            gate_scope_id=coord.new_id("scp", under=parent.id),
            mailbox_id=q.id,
            condition=op.condition,
            at_ms=now,
            threshold=op.threshold,
            expected_members=op.expected_members,
            deadline_ms=deadline_ms,
        )
        coord.commit([rec])
        return self.view(self.table[rec.id])

    @applies(GroupCreated)
    def _apply_created(self, r: GroupCreated) -> None:
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
        self.table[g.id] = g
        self.member_index[g.id] = {}
        runs = self.coord.runs
        runs.add(
            ScopeState(
                id=r.gate_scope_id,
                space=r.space,
                parent_id=r.parent_scope_id,
                name=f"group:{r.id}",
                deadline_ms=r.deadline_ms,
                child_limit=1000,
                created_at_ms=r.at_ms,
                group_id=r.id,
            )
        )
        runs.own(r.gate_scope_id, g.id)
        self.coord.touch(g.id)

    # ================================================================ members
    def _member_added(self, g: GroupState, t: TaskState) -> GroupMemberAddedView:
        return GroupMemberAddedView(task=self.coord.queues.task_view(t), group_state=g.state)

    @op(GroupSubmit, route=by("group_id"), permission=W,
        resend=keyed("key", "give the member a `key` to make it safe to retry"))
    def op_group_submit(self, actor, session, op: GroupSubmit) -> GroupMemberAddedView:
        """A new member task in the gate run. Idempotent by ``key`` (the same key and
        input return that member, open or not); CONFLICT when the group is no longer
        OPEN, when the key was used with another input, or when it names a task of the
        gate run that is not a member. ``requirements``: the member's own (as a
        submit's: VALIDATION_FAILED / NOT_FOUND), else its mailbox's default ones."""
        coord = self.coord
        queues = coord.queues
        g = self.get(session.space, op.group_id)
        q = queues.table[g.mailbox_id]
        check_key("key", op.key)
        if op.key is not None:
            t = queues.task_by_key(g.gate_scope_id, q.id, op.key)
            if t is not None:
                if t.group_id != g.id:
                    raise ConflictError(
                        f"key {op.key!r} names task {t.id} of the gate run, which is not a member of group {g.id}",
                        details={"field": "key", "task_id": t.id},
                    )
                if t.input != check_payload("input", op.input):
                    raise ConflictError(
                        f"key {op.key!r} is already a member of group {g.id} with a different input",
                        details={"field": "key", "task_id": t.id},
                    )
                return self._member_added(g, t)
        self._require_open(g)
        rec = queues.prepare_submit(session.space, q, g.gate_scope_id, op.input, op.key, op.deadline, group_id=g.id,
                                    requirements=op.requirements)
        assert isinstance(rec, TaskSubmitted)
        seals = g.expected_members is not None and len(g.members) + 1 >= g.expected_members
        coord.commit([rec, GroupMemberJoined(group_id=g.id, task_id=rec.id, at_ms=rec.at_ms, seals=seals)])
        return self._member_added(g, queues.tasks[rec.id])

    def _require_open(self, g: GroupState) -> None:
        if g.state == "FINALIZED" and g.outcome_reason == "deadline":
            # the same answer whether or not the deadline's activity ran before this
            raise DeadlineExceededError(
                f"group {g.id} passed its deadline {to_iso(g.deadline_ms)}; it takes no new members",
                details={"scope_id": g.gate_scope_id, "reason": "deadline"},
            )
        if g.state != "OPEN":
            raise ConflictError(
                f"group {g.id} is {g.state}; it takes no new members", details={"group_id": g.id, "state": g.state}
            )
        if len(g.members) >= MAX_MEMBERS:
            raise LimitError(f"group {g.id} already has {MAX_MEMBERS} members, the limit")

    @op(GroupJoinTask, route=by("group_id"), permission=W, resend=ALWAYS)
    def op_group_join_task(self, actor, session, op: GroupJoinTask) -> GroupMemberAddedView:
        """An existing task joins while the group is OPEN (idempotent); CONFLICT when it
        is another group's member."""
        coord = self.coord
        g = self.get(session.space, op.group_id)
        sh = coord.sharding
        if sh is not None and op.task_id not in coord.queues.tasks:
            sh.cross_shard(op.task_id, "task")
        t = coord.queues.get_task(session.space, op.task_id)
        if t.group_id == g.id:
            return self._member_added(g, t)
        if sh is not None and coord.runs.root_of(t.scope_id) != coord.runs.root_of(g.gate_scope_id):
            raise ValidationError(
                f"task {t.id} is in another run tree than group {g.id}: a sharded cluster decides a group in one "
                "step of its own tree, so it takes members of that tree only", details={"cross_tree": True})
        if t.group_id is not None:
            raise ConflictError(f"task {t.id} is already a member of group {t.group_id}")
        self._require_open(g)
        coord.runs.require_active(g.gate_scope_id)  # like submit: no new members past the deadline
        seals = g.expected_members is not None and len(g.members) + 1 >= g.expected_members
        coord.commit([GroupMemberJoined(group_id=g.id, task_id=t.id, at_ms=coord.now_ms(), seals=seals)])
        return self._member_added(g, t)

    @applies(GroupMemberJoined)
    def _apply_member_joined(self, r: GroupMemberJoined) -> None:
        g = self.table[r.group_id]
        m = Member(task_id=r.task_id)
        g.members.append(m)
        self.member_index[g.id][r.task_id] = m
        t = self.coord.queues.tasks[r.task_id]
        if t.group_id != g.id:
            t.group_id = g.id
            self.coord.touch(t.id)
        if r.seals and g.state == "OPEN":
            g.state = "SEALED"
        self.coord.touch(g.id)
        self.member_changed(g.id)

    # ================================================================ verdicts
    @op(GroupVerdictOp, route=by("group_id"), permission=W, resend=ALWAYS)
    def op_group_verdict(self, actor, session, op: GroupVerdictOp) -> VerdictView:
        """ACCEPTED (the member SUCCEEDED) or REJECTED (it finished). Idempotent; CONFLICT
        for the opposite verdict or a member not in that state; ``late`` after the group
        was decided (or past its deadline): it never changes the outcome."""
        coord = self.coord
        g = self.get(session.space, op.group_id)
        verdict = {"ACCEPTED": "ACCEPTED", "ACCEPT": "ACCEPTED", "REJECTED": "REJECTED", "REJECT": "REJECTED"}.get(
            op.verdict
        )
        if verdict is None:
            raise ValidationError(
                f"verdict must be ACCEPTED or REJECTED (got {short(op.verdict)})", details={"field": "verdict"}
            )
        m = self.member_index[g.id].get(op.task_id)
        if m is None:
            raise NotFoundError(
                f"task {short(op.task_id)} is not a member of group {g.id}", details={"task_id": op.task_id}
            )
        if m.verdict == verdict:
            return self._verdict_view(g, m)
        if m.verdict is not None:
            raise ConflictError(
                f"member {m.task_id} was already {m.verdict}; a verdict cannot change",
                details={"task_id": m.task_id, "verdict": m.verdict},
            )
        t = coord.queues.tasks[m.task_id]
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
        coord.commit([
            GroupVerdict(
                group_id=g.id, task_id=t.id, verdict=verdict, at_ms=coord.now_ms(),
                late=g.state == "FINALIZED" or coord.runs.deadline_passed(g.gate_scope_id),
            )
        ])
        return self._verdict_view(g, m)

    def _verdict_view(self, g: GroupState, m: Member) -> VerdictView:
        return VerdictView(
            task_id=m.task_id, verdict=m.verdict or "", late=m.late, group_state=g.state,
            outcome=g.outcome, outcome_reason=g.outcome_reason,
        )

    @applies(GroupVerdict)
    def _apply_verdict(self, r: GroupVerdict) -> None:
        m = self.member_index[r.group_id][r.task_id]
        m.verdict = r.verdict
        m.late = r.late
        self.coord.touch(r.group_id)
        self.member_changed(r.group_id)

    # ================================================================ close, status, wait
    @op(GroupClose, route=by("group_id"), permission=W, resend=ALWAYS)
    def op_group_close(self, actor, session, op: GroupClose) -> GroupDecisionView:
        """Seal (no new members) and evaluate at once; repeatable."""
        g = self.get(session.space, op.group_id)
        if g.state == "OPEN":
            self.coord.commit([GroupSealed(group_id=g.id, at_ms=self.coord.now_ms())])
        return GroupDecisionView(state=g.state, outcome=g.outcome, outcome_reason=g.outcome_reason)

    @applies(GroupSealed)
    def _apply_sealed(self, r: GroupSealed) -> None:
        g = self.table[r.group_id]
        if g.state == "OPEN":
            g.state = "SEALED"
        self.coord.touch(g.id)
        self.member_changed(g.id)

    @op(GroupStatus, route=by("group_id"), permission=R, resend=ALWAYS)
    def op_group_status(self, actor, session, op: GroupStatus) -> GroupView:
        return self.view(self.get(session.space, op.group_id))

    @op(GroupWait, route=by("group_id"), permission=R, resend=ALWAYS, waits=asked("wait_ms"), reply=GroupView)
    def op_group_wait(self, actor, session, op: GroupWait):
        """The group once FINALIZED; parks on the group's actor up to ``wait_ms``."""
        g = self.get(session.space, op.group_id)
        wait_ms = clamp_wait(op.wait_ms)
        if g.state == "FINALIZED" or wait_ms == 0:
            return self.view(g)
        view = self.view
        return Park("final", lambda: view(g) if g.state == "FINALIZED" else None, wait_ms, lambda: view(g))

    def view(self, g: GroupState) -> GroupView:
        tasks = self.coord.queues.tasks
        members = []
        counts: dict[str, int] = {"members": len(g.members), "accepted": 0, "rejected": 0}
        for m in g.members:
            t = tasks[m.task_id]
            members.append(GroupMemberView(task_id=t.id, task_state=t.state, verdict=m.verdict, late=m.late, key=t.key))
            counts[t.state] = counts.get(t.state, 0) + 1
            if m.verdict == "ACCEPTED":
                counts["accepted"] += 1
            elif m.verdict == "REJECTED":
                counts["rejected"] += 1
        return GroupView(
            id=g.id,
            scope_id=g.gate_scope_id,
            parent_scope_id=g.parent_scope_id,
            mailbox=self.coord.queues.table[g.mailbox_id].name,
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
    def member_changed(self, group_id: str) -> None:
        """A member's state or verdict changed, or the group sealed: evaluate the group
        as a reaction of the current commit (not in replay: the outcome is journaled)."""
        if not self.coord.replaying:
            self.touched.add(group_id)

    def react(self) -> list:
        """Follow-up records for the current commit: a ``GroupFinalized`` for every
        touched group whose decision table now decides."""
        if not self.touched:
            return []
        touched, self.touched = self.touched, set()
        more = []
        now = None
        runs = self.coord.runs
        for gid in sorted(touched):
            g = self.table.get(gid)
            if g is None or g.state == "FINALIZED":
                continue
            # past the deadline (its activity may not have fired yet) only the deadline decides
            decision = ("FAILURE", "deadline") if runs.deadline_passed(g.gate_scope_id) else self.evaluate(g)
            if decision is not None:
                if now is None:
                    now = self.coord.now_ms()
                more.append(GroupFinalized(group_id=gid, outcome=decision[0], reason=decision[1], at_ms=now))
        return more

    def evaluate(self, g: GroupState) -> tuple[str, str] | None:
        """The decision table (pure). None while undecided."""
        accepted = rejected = still = 0
        all_finished = True
        tasks = self.coord.queues.tasks
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
    def _apply_finalized(self, r: GroupFinalized) -> None:
        self.finalize(self.table[r.group_id], r.outcome, r.reason, r.at_ms)

    def finalize(self, g: GroupState, outcome: str, reason: str, at_ms: int) -> None:
        """The one atomic step: outcome recorded, gate run cancelled (its subtree goes
        inactive and its nursery is cancelled), unfinished members CANCELLED, waiters
        answered."""
        coord = self.coord
        g.state = "FINALIZED"
        g.outcome = outcome
        g.outcome_reason = reason
        g.finalized_at_ms = at_ms
        coord.touch(g.id)
        runs = coord.runs
        gate = runs.table[g.gate_scope_id]
        if gate.state == "ACTIVE":
            runs.end(gate, "CANCELLED", at_ms, "group_finalized", implied=True)
        queues = coord.queues
        for m in g.members:
            t = queues.tasks[m.task_id]
            if t.state not in TERMINAL:
                queues.cancel_implied(t, at_ms, "group_finalized")
        coord.notify(g.id, "final")

    def on_run_inactive(self, group_id: str, at_ms: int, reason: str) -> None:
        """The gate run (or an ancestor) ended: FAILURE ``cancelled`` (``deadline`` when a
        deadline passed first: a later cancel does not rewrite the reason)."""
        g = self.table.get(group_id)
        if g is not None and g.state != "FINALIZED":
            past = reason == "deadline" or self.coord.runs.deadline_passed(g.gate_scope_id, at_ms)
            why = "deadline" if past else "cancelled"
            self.coord.implied(GroupFinalized(group_id=g.id, outcome="FAILURE", reason=why, at_ms=at_ms))
            self.finalize(g, "FAILURE", why, at_ms)

    # ================================================================ retention
    def purge_run(self, run_id: str) -> int:
        """The groups gated at ``run_id``, with every member task (finished: finalizing
        cancelled the rest), members of other runs included."""
        n = 0
        queues = self.coord.queues
        for gid in self.coord.runs.owned.get(run_id, ()):
            if not gid.startswith("grp"):
                continue
            g = self.table.pop(gid, None)
            if g is None:
                continue
            self.member_index.pop(gid, None)
            for m in g.members:
                t = queues.tasks.get(m.task_id)
                if t is not None:
                    n += queues.purge_task(t)
            self.coord.touch(gid)
            n += 1
        return n

    # ================================================================ events
    @emits(GroupCreated)
    def _ev_created(self, r: GroupCreated):
        return (
            ev(r.space, "group.created", "group", r.id, r.gate_scope_id, r.at_ms,
               data(condition=r.condition, threshold=r.threshold, expected_members=r.expected_members,
                    mailbox=self.coord.queues.table[r.mailbox_id].name, gate=r.gate_scope_id,
                    deadline=to_iso(r.deadline_ms))),
            ev(r.space, "scope.created", "scope", r.gate_scope_id, r.gate_scope_id, r.at_ms,
               data(parent=r.parent_scope_id, name=f"group:{r.id}", group=r.id, deadline=to_iso(r.deadline_ms))),
        )

    @emits(GroupMemberJoined)
    def _ev_member_joined(self, r: GroupMemberJoined):
        g = self.table[r.group_id]
        out = [ev(g.space, "group.member_joined", "group", g.id, g.gate_scope_id, r.at_ms, {"task": r.task_id})]
        if r.seals and g.state == "SEALED":
            out.append(ev(g.space, "group.sealed", "group", g.id, g.gate_scope_id, r.at_ms, None))
        return out

    @emits(GroupSealed)
    def _ev_sealed(self, r: GroupSealed):
        g = self.table[r.group_id]
        if g.state != "SEALED":
            return None  # already finalized: nothing changed
        return ev(g.space, "group.sealed", "group", g.id, g.gate_scope_id, r.at_ms, None)

    @emits(GroupVerdict)
    def _ev_verdict(self, r: GroupVerdict):
        g = self.table[r.group_id]
        return ev(g.space, "group.verdict", "group", g.id, g.gate_scope_id, r.at_ms,
                  data(task=r.task_id, verdict=r.verdict, late=r.late or None))

    @emits(GroupFinalized)
    def _ev_finalized(self, r: GroupFinalized):
        g = self.table[r.group_id]
        return ev(g.space, "group.finalized", "group", g.id, g.gate_scope_id, r.at_ms,
                  {"outcome": r.outcome, "reason": r.reason})

    # ================================================================ recovery
    def rebuild_indexes(self) -> None:
        self.member_index = {g.id: {m.task_id: m for m in g.members} for g in self.table.values()}
        runs = self.coord.runs
        for g in self.table.values():
            runs.own(g.gate_scope_id, g.id)
