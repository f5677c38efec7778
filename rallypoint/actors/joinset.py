"""Join sets: structured concurrency over a run's children (SPEC §5, after Obelisk).

A join set holds child *tasks* (submitted to a mailbox) and durable *delays*. Every child
that finishes appends one completion record to the set, in the order children finish on
the server (the order of apply, which is the journal order, so replay reproduces it).
Consuming is positional: the k-th consume of a set returns the set's k-th record; each
consume is journaled with its index (``JoinSetConsumed``), and asking again for index
k < consumed re-reads the same record, so a client that restarts and re-attaches gets
identical answers.

Close (``JoinSetClosed``, one record): no more submissions; unconsumed delays and
cancellable tasks are cancelled in reverse submission order; non-cancellable tasks are
awaited; every record not yet consumed is consumed as a *closing* consume as it arrives;
the set is CLOSED once every child has finished. Failures seen while closing never
raise. A run's ``complete()`` first closes its open sets, newest first, and completes
only after the last child finished; cancelling the run cancels every child of every set
at once (tasks via the run's task cascade, delays here).

Failure kinds: ``failed`` (retries exhausted or rejected), ``timed_out`` (its last lease
expired with no attempts left), ``cancelled``, ``expired`` (task deadline).
"""

from __future__ import annotations

import re

import msgspec
import trio

from ..clock import to_iso
from ..errors import ConflictError, JoinSetExhaustedError, NotFoundError, ValidationError
from ..protocol import (
    NIL,
    JoinNext,
    JoinNextView,
    JoinSetChildAdded,
    JoinSetChildView,
    JoinSetClose,
    JoinSetCreate,
    JoinSetGet,
    JoinSetSubmit,
    JoinSetSubmitDelay,
    JoinSetView,
)
from ..records import (
    JoinSetClosed,
    JoinSetConsumed,
    JoinSetCreated,
    JoinSetDelayFired,
    JoinSetDelaySubmitted,
    TaskSubmitted,
)
from .system import short, applies, check_range, clamp_wait, parse_instant

__all__ = ["JoinSetState", "JoinSetKind"]

_NAME_RE = re.compile(r"^[A-Za-z0-9\-/]{1,128}$")
MAX_CHILDREN = 10_000
MAX_DELAY_MS = 10 * 365 * 24 * 3600 * 1000


class JsChild(msgspec.Struct, gc=False, array_like=True):
    child_id: str
    kind: str  # "task" | "delay"
    cancellable: bool = True
    fire_at_ms: int | None = None
    done: bool = False


class Completion(msgspec.Struct, gc=False, array_like=True):
    child_id: str
    kind: str
    ok: bool
    value: bytes | None = None
    failure_kind: str | None = None


class JoinSetState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    scope_id: str
    created_at_ms: int
    name: str | None = None
    state: str = "OPEN"  # OPEN | CLOSING | CLOSED
    children: list[JsChild] = msgspec.field(default_factory=list)
    completions: list[Completion] = msgspec.field(default_factory=list)
    consumed: int = 0
    closing_from: int | None = None  # consumes from this index on were closing consumes
    closed_at_ms: int | None = None


def _failure_kind(state: str, reason: str | None) -> str:
    if state == "CANCELLED":
        return "cancelled"
    if state == "EXPIRED":
        return "expired"
    if reason == "lease_expired":
        return "timed_out"
    return "failed"


class JoinSetKind:
    def _init_tables(self) -> None:
        super()._init_tables()
        self.joinsets: dict[str, JoinSetState] = {}
        self._init_js_indexes()
        self.inactive_hooks.append(self._joinsets_on_scope_inactive)

    def _init_js_indexes(self) -> None:
        self.joinset_names: dict[tuple[str, str], str] = {}
        self.scope_joinsets: dict[str, list[str]] = {}
        self.js_child_pos: dict[str, tuple[str, int]] = {}  # child id -> (set id, position)

    def entity_tables(self):
        t = super().entity_tables()
        t["jst"] = (self.joinsets, JoinSetState)
        return t

    def get_joinset(self, space: str, js_id: str) -> JoinSetState:
        js = self.joinsets.get(js_id) if isinstance(js_id, str) else None
        if js is None or js.space != space:
            raise NotFoundError(f"no join set {short(js_id)} in this space", details={"joinset_id": js_id})
        return js

    def joinset_view(self, js: JoinSetState) -> JoinSetView:
        return JoinSetView(
            id=js.id,
            scope_id=js.scope_id,
            name=js.name,
            state=js.state,
            submitted=len(js.children),
            finished=len(js.completions),
            consumed=js.consumed,
            created_at=to_iso(js.created_at_ms),
            children=[JoinSetChildView(child_id=c.child_id, kind=c.kind, cancellable=c.cancellable, finished=c.done)
                      for c in js.children],
        )

    # ================================================================ create, get
    def op_joinset_create(self, session, op: JoinSetCreate) -> JoinSetView:
        scope = self.get_scope(session.space, op.scope_id)
        if op.name is not None:
            if not isinstance(op.name, str) or not _NAME_RE.match(op.name):
                raise ValidationError(
                    f"join set name must be 1 to 128 letters, digits, - and / (got {short(op.name)})",
                    details={"field": "name"},
                )
            existing = self.joinset_names.get((scope.id, op.name))
            if existing is not None:
                raise ConflictError(
                    f"run {scope.id} already used the join set name {short(op.name)} (a name is used once per run)",
                    details={"field": "name", "joinset_id": existing},
                )
        self.require_active(scope.id)
        rec = JoinSetCreated(id=self.ids.new("jst"), space=session.space, scope_id=scope.id,
                             at_ms=self.now_ms(), name=op.name)
        self.commit([rec])
        return self.joinset_view(self.joinsets[rec.id])

    @applies(JoinSetCreated)
    def _apply_joinset_created(self, r: JoinSetCreated) -> None:
        js = JoinSetState(id=r.id, space=r.space, scope_id=r.scope_id, created_at_ms=r.at_ms, name=r.name)
        self.joinsets[js.id] = js
        self._index_joinset(js)
        self.touch(js.id)

    def _index_joinset(self, js: JoinSetState) -> None:
        if js.name is not None:
            self.joinset_names[(js.scope_id, js.name)] = js.id
        self.scope_joinsets.setdefault(js.scope_id, []).append(js.id)
        for i, c in enumerate(js.children):
            self.js_child_pos[c.child_id] = (js.id, i)

    def op_joinset_get(self, session, op: JoinSetGet) -> JoinSetView:
        if op.joinset_id is not None:
            return self.joinset_view(self.get_joinset(session.space, op.joinset_id))
        if op.scope_id is None or op.name is None:
            raise ValidationError("give joinset_id, or scope_id and name", details={"field": "joinset_id"})
        scope = self.get_scope(session.space, op.scope_id)
        jid = self.joinset_names.get((scope.id, op.name))
        if jid is None:
            raise NotFoundError(f"run {scope.id} has no join set named {short(op.name)}", details={"name": op.name})
        return self.joinset_view(self.joinsets[jid])

    # ================================================================ submissions
    def _require_submittable(self, js: JoinSetState) -> None:
        if js.state != "OPEN":
            raise ConflictError(f"join set {js.id} is {js.state}; it takes no new children")
        if len(js.children) >= MAX_CHILDREN:
            from ..errors import LimitError

            raise LimitError(f"join set {js.id} already has {MAX_CHILDREN} children, the limit")

    def op_joinset_submit(self, session, op: JoinSetSubmit) -> JoinSetChildAdded:
        js = self.get_joinset(session.space, op.joinset_id)
        self._require_submittable(js)
        mbx = self.get_mailbox(session.space, op.mailbox)
        rec = self.prepare_submit(
            session.space, mbx, js.scope_id, op.input, op.key, op.deadline,
            joinset_id=js.id, cancellable=bool(op.cancellable),
        )
        if not isinstance(rec, TaskSubmitted):  # idempotent resubmission by key
            if rec.joinset_id != js.id:
                raise ConflictError(
                    f"key {op.key!r} names task {rec.id}, which is not a child of join set {js.id}",
                    details={"field": "key"},
                )
            return JoinSetChildAdded(child_id=rec.id, kind="task")
        self.commit([rec])
        return JoinSetChildAdded(child_id=rec.id, kind="task")

    def _on_task_created(self, t) -> None:
        super()._on_task_created(t)
        if t.joinset_id is not None:
            js = self.joinsets[t.joinset_id]
            self.js_child_pos[t.id] = (js.id, len(js.children))
            js.children.append(JsChild(child_id=t.id, kind="task", cancellable=t.cancellable))
            self.touch(js.id)

    def _on_task_terminal(self, t) -> None:
        super()._on_task_terminal(t)
        if t.joinset_id is not None:
            ok = t.state == "SUCCEEDED"
            self._js_complete(
                self.joinsets[t.joinset_id], t.id, "task", ok,
                t.outcome if ok else t.error,
                None if ok else _failure_kind(t.state, t.outcome_reason),
            )

    def op_joinset_submit_delay(self, session, op: JoinSetSubmitDelay) -> JoinSetChildAdded:
        js = self.get_joinset(session.space, op.joinset_id)
        if (op.at is None) == (op.after_ms is None):
            raise ValidationError("give exactly one of seconds and at", details={"field": "at"})
        now = self.now_ms()
        if op.after_ms is not None:
            check_range("after_ms", op.after_ms, 0, MAX_DELAY_MS, " ms")
            fire_at = now + op.after_ms
        else:
            fire_at = parse_instant("at", op.at)
        self._require_submittable(js)
        self.require_active(js.scope_id)
        rec = JoinSetDelaySubmitted(joinset_id=js.id, child_id=self.ids.new("chd"), fire_at_ms=fire_at, at_ms=now)
        self.commit([rec])
        return JoinSetChildAdded(child_id=rec.child_id, kind="delay", fire_at=to_iso(fire_at))

    @applies(JoinSetDelaySubmitted)
    def _apply_js_delay(self, r: JoinSetDelaySubmitted) -> None:
        js = self.joinsets[r.joinset_id]
        self.js_child_pos[r.child_id] = (js.id, len(js.children))
        js.children.append(JsChild(child_id=r.child_id, kind="delay", fire_at_ms=r.fire_at_ms))
        self.touch(js.id)
        self.arm(r.fire_at_ms, "js_delay", r.child_id, r.fire_at_ms)

    def _on_js_delay(self, child_id: str, fire_at: int, _due: int) -> None:
        pos = self.js_child_pos.get(child_id)
        if pos is None:
            return
        js = self.joinsets[pos[0]]
        if js.children[pos[1]].done:
            return
        self.commit([JoinSetDelayFired(joinset_id=js.id, child_id=child_id, at_ms=max(fire_at, self.now_ms()))])

    @applies(JoinSetDelayFired)
    def _apply_js_delay_fired(self, r: JoinSetDelayFired) -> None:
        self._js_complete(self.joinsets[r.joinset_id], r.child_id, "delay", True, None, None)

    # ================================================================ completion records
    def _js_complete(self, js: JoinSetState, child_id: str, kind: str, ok: bool, value, failure_kind) -> None:
        _, i = self.js_child_pos[child_id]
        child = js.children[i]
        if child.done:
            return
        child.done = True
        js.completions.append(Completion(child_id=child_id, kind=kind, ok=ok, value=value, failure_kind=failure_kind))
        if js.state == "CLOSING":
            self._js_advance_close(js)
        self.touch(js.id)
        self.notifier.notify(js.id)

    def _js_advance_close(self, js: JoinSetState) -> None:
        js.consumed = len(js.completions)  # closing consumes take every record that arrived
        if js.consumed == len(js.children):
            js.state = "CLOSED"
            self.notifier.notify(js.id)
            self.notifier.notify(("js_scope", js.scope_id))

    # ================================================================ consume
    def _record_view(self, js: JoinSetState, index: int) -> JoinNextView:
        c = js.completions[index]
        return JoinNextView(
            status="record",
            index=index,
            child_id=c.child_id,
            kind=c.kind,
            ok=c.ok,
            value=msgspec.Raw(c.value) if c.value is not None else NIL,
            failure_kind=c.failure_kind,
            closing=js.closing_from is not None and index >= js.closing_from,
        )

    def op_joinset_join_next(self, session, op: JoinNext):
        js = self.get_joinset(session.space, op.joinset_id)
        wait_ms = clamp_wait(op.wait_ms)
        if op.index is not None and op.index < 0:
            raise ValidationError("index must be >= 0", details={"field": "index"})
        res = self._try_consume(js, op.index)
        if res is not None or op.try_only or wait_ms == 0:
            return res if res is not None else JoinNextView(status="pending", index=js.consumed)
        return self._join_wait(js, op.index, wait_ms)

    def _try_consume(self, js: JoinSetState, index: int | None) -> JoinNextView | None:
        """The record at ``index`` (default: the next), consuming it if it is the next
        one; None while it has not arrived. Raises JOIN_SET_EXHAUSTED past the children."""
        idx = js.consumed if index is None else index
        if idx < js.consumed:
            return self._record_view(js, idx)  # positional re-read
        if idx > js.consumed:
            raise ValidationError(
                f"index {idx} is ahead of join set {js.id}'s next unconsumed record ({js.consumed}); "
                "consumes never skip ahead",
                details={"field": "index"},
            )
        if idx >= len(js.children):
            raise JoinSetExhaustedError(
                f"join set {js.id} has {len(js.children)} children and all were consumed",
                details={"joinset_id": js.id, "submitted": len(js.children)},
            )
        if idx < len(js.completions):
            self.commit([JoinSetConsumed(joinset_id=js.id, index=idx, at_ms=self.now_ms())])
            return self._record_view(js, idx)
        return None

    async def _join_wait(self, js: JoinSetState, index: int | None, wait_ms: int) -> JoinNextView:
        with trio.move_on_after(wait_ms / 1000):
            while True:  # check, then park (a record may have arrived since op_* looked)
                res = self._try_consume(js, index)
                if res is not None:
                    return res
                await self.notifier.event(js.id).wait()
        return JoinNextView(status="pending", index=js.consumed)

    @applies(JoinSetConsumed)
    def _apply_js_consumed(self, r: JoinSetConsumed) -> None:
        js = self.joinsets[r.joinset_id]
        js.consumed = r.index + 1
        self.touch(js.id)

    # ================================================================ close
    def op_joinset_close(self, session, op: JoinSetClose):
        js = self.get_joinset(session.space, op.joinset_id)
        wait_ms = clamp_wait(op.wait_ms)
        if js.state == "OPEN":
            self.commit([JoinSetClosed(joinset_id=js.id, at_ms=self.now_ms())])
        if js.state == "CLOSED" or wait_ms == 0:
            return self.joinset_view(js)
        return self._close_wait(js, wait_ms)

    async def _close_wait(self, js: JoinSetState, wait_ms: int) -> JoinSetView:
        with trio.move_on_after(wait_ms / 1000):
            while js.state != "CLOSED":
                await self.notifier.event(js.id).wait()
        return self.joinset_view(js)

    @applies(JoinSetClosed)
    def _apply_js_closed(self, r: JoinSetClosed) -> None:
        js = self.joinsets[r.joinset_id]
        if js.state != "OPEN":
            return
        js.state = "CLOSING"
        js.closed_at_ms = r.at_ms
        js.closing_from = js.consumed
        self.touch(js.id)
        # cancel in reverse submission order: delays and cancellable tasks
        for c in reversed(js.children):
            if c.done:
                continue
            if c.kind == "delay":
                self._js_complete(js, c.child_id, "delay", False, None, "cancelled")
            elif c.cancellable:
                t = self.tasks[c.child_id]
                if t.state not in ("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"):
                    self._finish(t, "CANCELLED", r.at_ms, "joinset_closed")  # appends its record
        self._js_advance_close(js)
        self.notifier.notify(js.id)

    def _joinsets_on_scope_inactive(self, scope_id: str, at_ms: int, reason: str) -> None:
        for jid in self.scope_joinsets.get(scope_id, ()):
            js = self.joinsets[jid]
            for c in js.children:
                if not c.done and c.kind == "delay":
                    self._js_complete(js, c.child_id, "delay", False, None, "cancelled")

    # ================================================================ run completion
    def open_joinsets(self, scope_id: str) -> list[JoinSetState]:
        return [self.joinsets[j] for j in self.scope_joinsets.get(scope_id, ()) if self.joinsets[j].state != "CLOSED"]

    def close_records_for_complete(self, scope_id: str, at_ms: int) -> list:
        """``complete()`` closes the run's open sets, newest first."""
        recs = super().close_records_for_complete(scope_id, at_ms)
        for jid in reversed(self.scope_joinsets.get(scope_id, ())):
            if self.joinsets[jid].state == "OPEN":
                recs.append(JoinSetClosed(joinset_id=jid, at_ms=at_ms))
        return recs

    def complete_blockers(self, scope_id: str) -> int:
        return super().complete_blockers(scope_id) + len(self.open_joinsets(scope_id))

    async def wait_complete_blockers(self, scope_id: str) -> None:
        await super().wait_complete_blockers(scope_id)
        while self.open_joinsets(scope_id):
            await self.notifier.event(("js_scope", scope_id)).wait()

    # ================================================================ recovery
    def rebuild_indexes(self) -> None:
        super().rebuild_indexes()
        self._init_js_indexes()
        for js in self.joinsets.values():
            self._index_joinset(js)

    def rearm_all(self) -> None:
        super().rearm_all()
        for js in self.joinsets.values():
            for c in js.children:
                if c.kind == "delay" and not c.done:
                    self.timers.arm(c.fire_at_ms, "js_delay", c.child_id, c.fire_at_ms)
