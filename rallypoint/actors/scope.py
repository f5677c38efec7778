"""Runs (scopes): a tree with deadlines whose cancellation stops a whole subtree at once.

SPEC §2. A run's ``stored_state`` is its own (ACTIVE, CANCELLED, COMPLETED); it is
*effectively* INACTIVE when it or any ancestor is not ACTIVE or is past its deadline.
Refusals are computed from the tree at request time, so a deadline refuses work at the
instant it passes; the subtree's queued work is then cancelled by ONE record
(``ScopeEnded`` or ``ScopeDeadlinePassed``) whose apply walks the subtree and runs every
kind's inactivation hook (tasks cancelled, groups finalized, waiters woken) with no
``await`` in between: no request can see a half-cancelled subtree.
"""

from __future__ import annotations

from typing import Callable

import msgspec
import trio

from ..clock import to_iso
from ..errors import ConflictError, DeadlineExceededError, LimitError, ValidationError
from ..protocol import (
    ScopeCancel,
    ScopeComplete,
    ScopeCreate,
    ScopeList,
    ScopeListView,
    ScopeStatus,
    ScopeView,
)
from ..records import ScopeCreated, ScopeDeadlinePassed, ScopeEnded
from .system import applies, check_name, check_range, clamp_wait, parse_instant

__all__ = ["ScopeState", "ScopeKind"]


class ScopeState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a run."""

    id: str
    space: str
    parent_id: str | None
    name: str | None
    deadline_ms: int | None
    child_limit: int
    created_at_ms: int
    state: str = "ACTIVE"  # ACTIVE | CANCELLED | COMPLETED
    ended_at_ms: int | None = None
    end_reason: str | None = None
    deadline_fired: bool = False
    children: int = 0
    group_id: str | None = None


class ScopeKind:
    """Runs: op handlers, apply functions, the subtree-inactivation walk."""

    scopes: dict[str, ScopeState]

    def _init_tables(self) -> None:
        super()._init_tables()
        self.scopes = {}
        self.scope_children: dict[str, list[str]] = {}
        self.run_counts: dict[str, dict[str, int]] = {}  # space -> stored_state -> runs
        # hooks(scope_id, at_ms, reason) run for every run of an inactivated subtree
        self.inactive_hooks: list[Callable[[str, int, str], None]] = []

    def entity_tables(self):
        t = super().entity_tables()
        t["scp"] = (self.scopes, ScopeState)
        return t

    # ---------------------------------------------------------------- decide (ops)
    def op_scope_create(self, session, op: ScopeCreate) -> ScopeView:
        space = session.space
        if op.parent_id is not None:
            parent = self.get_scope(space, op.parent_id)
            self.require_active(parent.id)
            if parent.children >= parent.child_limit:
                raise LimitError(
                    f"run {parent.id} already has {parent.children} children, its child_limit",
                    details={"field": "child_limit", "limit": parent.child_limit},
                )
        if op.name is not None:
            check_name("name", op.name)
        check_range("child_limit", op.child_limit, 0, 1_000_000)
        now = self.now_ms()
        deadline_ms = parse_instant("deadline", op.deadline)
        if deadline_ms is not None and deadline_ms <= now:
            raise ValidationError(
                f"deadline {op.deadline} is in the past (now {to_iso(now)})",
                details={"field": "deadline"},
            )
        rec = ScopeCreated(
            id=self.ids.new("scp"),
            space=space,
            parent_id=op.parent_id,
            name=op.name,
            deadline_ms=deadline_ms,
            child_limit=op.child_limit,
            at_ms=now,
        )
        self.commit([rec])
        return self.scope_view(self.scopes[rec.id])

    def op_scope_status(self, session, op: ScopeStatus) -> ScopeView:
        return self.scope_view(self.get_scope(session.space, op.scope_id))

    def op_scope_cancel(self, session, op: ScopeCancel) -> ScopeView:
        s = self.get_scope(session.space, op.scope_id)
        if s.state == "CANCELLED":
            return self.scope_view(s)  # idempotent
        if s.state == "COMPLETED":
            raise ConflictError(f"run {s.id} is already COMPLETED; a finished run cannot be cancelled")
        if op.reason is not None and len(op.reason) > 1024:
            raise ValidationError("reason is longer than 1024 characters", details={"field": "reason"})
        self.commit([ScopeEnded(id=s.id, state="CANCELLED", at_ms=self.now_ms(), reason=op.reason)])
        return self.scope_view(s)

    def op_scope_complete(self, session, op: ScopeComplete):
        """Complete the run: first close its open join sets (newest first); the run is
        COMPLETED only once every child of those sets finished. Until then the reply is
        the run still ACTIVE (the SDK re-issues the request)."""
        s = self.get_scope(session.space, op.scope_id)
        if s.state != "ACTIVE":
            raise ConflictError(f"run {s.id} is already {s.state}; a finished run cannot be completed")
        wait_ms = clamp_wait(op.wait_ms)
        closes = self.close_records_for_complete(s.id, self.now_ms())
        if closes:
            self.commit(closes)
        if self.complete_blockers(s.id) == 0:
            self.commit([ScopeEnded(id=s.id, state="COMPLETED", at_ms=self.now_ms())])
            return self.scope_view(s)
        if wait_ms == 0:
            return self.scope_view(s)
        return self._complete_later(s, wait_ms)

    async def _complete_later(self, s: ScopeState, wait_ms: int) -> ScopeView:
        with trio.move_on_after(wait_ms / 1000):
            await self.wait_complete_blockers(s.id)
        if s.state == "ACTIVE" and self.complete_blockers(s.id) == 0:
            self.commit([ScopeEnded(id=s.id, state="COMPLETED", at_ms=self.now_ms())])
        return self.scope_view(s)

    def op_scope_list(self, session, op: ScopeList) -> ScopeListView:
        check_range("limit", op.limit, 1, 10_000)
        if op.order not in ("asc", "desc"):
            raise ValidationError("order must be 'asc' or 'desc'", details={"field": "order"})
        desc = op.order == "desc"
        if op.parent_id is not None:
            parent = self.get_scope(session.space, op.parent_id)
            ids = self.scope_children.get(parent.id, [])
            source = (self.scopes[i] for i in (reversed(ids) if desc else ids))
        else:
            source = reversed(self.scopes.values()) if desc else iter(self.scopes.values())
        out = []
        for s in source:
            if s.space != session.space:
                continue
            if op.roots_only and s.parent_id is not None:
                continue
            if op.after is not None and s.id <= op.after:
                continue
            if op.before is not None and s.id >= op.before:
                continue
            if op.state is not None and s.state != op.state:
                continue
            out.append(self.scope_view(s))
            if len(out) >= op.limit:
                break
        return ScopeListView(scopes=out)

    # ---------------------------------------------------------------- views
    def scope_view(self, s: ScopeState) -> ScopeView:
        err = self.scope_inactive_error(s.id)
        reason = None
        if err is not None:
            owner = (err.details or {}).get("scope_id")
            if isinstance(err, DeadlineExceededError):
                reason = "deadline"
            else:
                reason = (self.scopes[owner].state.lower() if owner in self.scopes else "cancelled")
            if owner != s.id:
                reason = "ancestor_" + reason
        return ScopeView(
            id=s.id,
            name=s.name,
            parent_id=s.parent_id,
            stored_state=s.state,
            effective="ACTIVE" if err is None else "INACTIVE",
            inactive_reason=reason,
            deadline=to_iso(s.deadline_ms),
            created_at=to_iso(s.created_at_ms),
            ended_at=to_iso(s.ended_at_ms),
            child_limit=s.child_limit,
            children=s.children,
            tasks=dict(self.scope_task_counts.get(s.id, {})),
            group_id=s.group_id,
        )

    # ---------------------------------------------------------------- apply
    @applies(ScopeCreated)
    def _apply_scope_created(self, r: ScopeCreated) -> None:
        s = ScopeState(
            id=r.id,
            space=r.space,
            parent_id=r.parent_id,
            name=r.name,
            deadline_ms=r.deadline_ms,
            child_limit=r.child_limit,
            created_at_ms=r.at_ms,
            group_id=r.group_id,
        )
        self._index_scope(s)
        if r.parent_id is not None:
            self.scopes[r.parent_id].children += 1
            self.touch(r.parent_id)
        self.touch(r.id)

    def count_run(self, space: str, old: str | None, new: str) -> None:
        """Keep the per-space runs-by-state counters (server status) in O(1)."""
        c = self.run_counts.get(space)
        if c is None:
            c = self.run_counts[space] = {"ACTIVE": 0, "CANCELLED": 0, "COMPLETED": 0}
        if old is not None:
            c[old] -= 1
        c[new] = c.get(new, 0) + 1

    def _index_scope(self, s: ScopeState) -> None:
        self.count_run(s.space, None, s.state)
        self.scopes[s.id] = s
        if s.parent_id is not None:
            self.scope_children.setdefault(s.parent_id, []).append(s.id)
        if s.deadline_ms is not None and not s.deadline_fired and s.state == "ACTIVE":
            self.arm(s.deadline_ms, "scope_deadline", s.id, s.deadline_ms)

    @applies(ScopeEnded)
    def _apply_scope_ended(self, r: ScopeEnded) -> None:
        s = self.scopes[r.id]
        self.count_run(s.space, s.state, r.state)
        s.state = r.state
        s.ended_at_ms = r.at_ms
        s.end_reason = r.reason
        self.touch(s.id)
        self._inactivate_subtree(s.id, r.at_ms, "cancelled" if r.state == "CANCELLED" else "completed")

    @applies(ScopeDeadlinePassed)
    def _apply_scope_deadline(self, r: ScopeDeadlinePassed) -> None:
        s = self.scopes[r.id]
        s.deadline_fired = True
        self.touch(s.id)
        self._inactivate_subtree(s.id, r.at_ms, "deadline")

    def _inactivate_subtree(self, root_id: str, at_ms: int, reason: str) -> None:
        """Run every kind's inactivation hook over the subtree, synchronously."""
        stack = [root_id]
        children = self.scope_children
        hooks = self.inactive_hooks
        while stack:
            sid = stack.pop()
            for hook in hooks:
                hook(sid, at_ms, reason)
            stack.extend(children.get(sid, ()))

    # ---------------------------------------------------------------- activities
    def _on_scope_deadline(self, scope_id: str, deadline_ms: int, _due_ms: int) -> None:
        s = self.scopes.get(scope_id)
        if s is None or s.deadline_fired or s.deadline_ms != deadline_ms:
            return
        self.commit([ScopeDeadlinePassed(id=scope_id, at_ms=deadline_ms)])

    def rearm_all(self) -> None:
        super().rearm_all()
        now = self.now_ms()
        for s in self.scopes.values():
            if s.deadline_ms is not None and not s.deadline_fired:
                self.timers.arm(max(s.deadline_ms, now), "scope_deadline", s.id, s.deadline_ms)

    def rebuild_indexes(self) -> None:
        super().rebuild_indexes()
        self.scope_children.clear()
        self.run_counts = {}
        for s in self.scopes.values():
            self.count_run(s.space, None, s.state)
            if s.parent_id is not None:
                self.scope_children.setdefault(s.parent_id, []).append(s.id)
