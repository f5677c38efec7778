"""Join sets: structured concurrency over a run's children (SPEC §5, after Obelisk).

A join set holds child *tasks* (submitted to a work queue) and durable *delays*. Every
child that finishes appends one completion record to the set, in the order children
finish on the server (the order of apply, which is the journal order, so replay
reproduces it). Consuming is positional: the k-th consume of a set returns the set's
k-th record; each consume is journaled with its index (``JoinSetConsumed``), and asking
again for index k < consumed re-reads the same record, so a client that restarts and
re-attaches gets identical answers.

Close (``JoinSetClosed``, one record): no more submissions; unconsumed delays and
cancellable tasks are cancelled in reverse submission order; non-cancellable tasks are
awaited; every record not yet consumed is consumed as a *closing* consume as it
arrives; the set is CLOSED once every child has finished. Failures seen while closing
never raise.

What ends a run ends its sets the same way, newest set first, so a replay sees the same
sequence whether the run returned, was closed or was cancelled:

- ``complete()`` closes its open sets and completes only after their last child finished
  (a set created while it waits is closed too);
- a cancel or a passed deadline closes every set in the run's ONE cancellation step:
  every unfinished child -- non-cancellable ones too (SPEC §5) -- is cancelled in reverse
  submission order, each writes its completion record, each record is consumed as a
  closing consume, and the set is CLOSED.

A delay given in seconds is due after that much server time; one given with ``at`` at
that wall instant. The join set's actor lives in its run's nursery: ``join_next`` and a
close that waits park there.

Failure kinds: ``failed`` (retries exhausted or rejected), ``timed_out`` (its last lease
expired with no attempts left), ``cancelled``, ``expired`` (task deadline).
"""

from __future__ import annotations

import re

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, JoinSetExhaustedError, LimitError, NotFoundError, ValidationError
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
from .common import applies, check_range, clamp_wait, parse_instant, short
from .kind import Kind
from .queue import TERMINAL
from .runtime import Park

__all__ = ["JoinSetState", "JoinSets"]

_NAME_RE = re.compile(r"^[A-Za-z0-9\-/]{1,128}$")
MAX_CHILDREN = 10_000
MAX_DELAY_MS = 10 * 365 * 24 * 3600 * 1000
_RUN_REASON = {"cancelled": "scope_cancelled", "completed": "scope_completed", "deadline": "deadline"}


class JsChild(msgspec.Struct, gc=False, array_like=True):
    child_id: str
    kind: str  # "task" | "delay"
    cancellable: bool = True
    fire_at_ms: int | None = None  # a delay's wall instant
    done: bool = False
    fire_mono_ms: int | None = None  # a delay given in seconds: server time


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


class JoinSets(Kind):
    """Join sets: create, submit (tasks, delays), join_next, close; closed with their run."""

    prefix = "jst"
    name = "joinsets"
    noun = "join set"
    id_field = "joinset_id"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, JoinSetState] = {}
        self._init_indexes()

    def _init_indexes(self) -> None:
        self.names: dict[tuple[str, str], str] = {}
        self.by_run: dict[str, list[str]] = {}
        self.child_pos: dict[str, tuple[str, int]] = {}  # child id -> (set id, position)

    def entity_tables(self):
        return {"jst": (self.table, JoinSetState)}

    def parent_actor_id(self, js_id: str) -> str | None:
        return self.table[js_id].scope_id


    def view(self, js: JoinSetState) -> JoinSetView:
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
    def op_joinset_create(self, actor, session, op: JoinSetCreate) -> JoinSetView:
        """A generated or named set in the run (runs on the run's actor). A name is used
        once per run (CONFLICT). SCOPE_CANCELLED / DEADLINE_EXCEEDED on an inactive run."""
        coord = self.coord
        run = coord.runs.get(session.space, op.scope_id)
        if op.name is not None:
            if not isinstance(op.name, str) or not _NAME_RE.match(op.name):
                raise ValidationError(
                    f"join set name must be 1 to 128 letters, digits, - and / (got {short(op.name)})",
                    details={"field": "name"},
                )
            existing = self.names.get((run.id, op.name))
            if existing is not None:
                raise ConflictError(
                    f"run {run.id} already used the join set name {short(op.name)} (a name is used once per run)",
                    details={"field": "name", "joinset_id": existing},
                )
        coord.runs.require_active(run.id)
        rec = JoinSetCreated(id=coord.ids.new("jst"), space=session.space, scope_id=run.id,
                             at_ms=coord.now_ms(), name=op.name)
        coord.commit([rec])
        return self.view(self.table[rec.id])

    @applies(JoinSetCreated)
    def _apply_created(self, r: JoinSetCreated) -> None:
        js = JoinSetState(id=r.id, space=r.space, scope_id=r.scope_id, created_at_ms=r.at_ms, name=r.name)
        self.table[js.id] = js
        self._index(js)
        self.coord.runs.own(js.scope_id, js.id)
        self.coord.touch(js.id)
        self.coord.notify(js.scope_id, "complete")  # a complete() waiting on the run closes it too

    def _index(self, js: JoinSetState) -> None:
        if js.name is not None:
            self.names[(js.scope_id, js.name)] = js.id
        self.by_run.setdefault(js.scope_id, []).append(js.id)
        for i, c in enumerate(js.children):
            self.child_pos[c.child_id] = (js.id, i)

    def route_get(self, session, op: JoinSetGet) -> str:
        if op.joinset_id is not None:
            return self.route(session, op.joinset_id)
        if op.scope_id is None or op.name is None:
            raise ValidationError("give joinset_id, or scope_id and name", details={"field": "joinset_id"})
        return self.coord.runs.route(session, op.scope_id)

    def op_joinset_get(self, actor, session, op: JoinSetGet) -> JoinSetView:
        if op.joinset_id is not None:
            return self.view(self.get(session.space, op.joinset_id))
        run = self.coord.runs.get(session.space, op.scope_id)
        jid = self.names.get((run.id, op.name))
        if jid is None:
            raise NotFoundError(f"run {run.id} has no join set named {short(op.name)}", details={"name": op.name})
        return self.view(self.table[jid])

    # ================================================================ submissions
    def _require_submittable(self, js: JoinSetState) -> None:
        if js.state != "OPEN":
            raise ConflictError(f"join set {js.id} is {js.state}; it takes no new children")
        if len(js.children) >= MAX_CHILDREN:
            raise LimitError(f"join set {js.id} already has {MAX_CHILDREN} children, the limit")

    def op_joinset_submit(self, actor, session, op: JoinSetSubmit) -> JoinSetChildAdded:
        """A child task in ``mailbox``, in the set's run. Idempotent by ``key``; a refused
        submission adds nothing."""
        coord = self.coord
        js = self.get(session.space, op.joinset_id)
        coord.runs.require_active(js.scope_id)  # SPEC §2: an inactive run's code first
        self._require_submittable(js)
        queues = coord.queues
        q = queues.get_queue(session.space, op.mailbox)
        rec = queues.prepare_submit(
            session.space, q, js.scope_id, op.input, op.key, op.deadline,
            joinset_id=js.id, cancellable=bool(op.cancellable),
        )
        if not isinstance(rec, TaskSubmitted):  # idempotent resubmission by key
            if rec.joinset_id != js.id:
                raise ConflictError(
                    f"key {op.key!r} names task {rec.id}, which is not a child of join set {js.id}",
                    details={"field": "key"},
                )
            return JoinSetChildAdded(child_id=rec.id, kind="task")
        coord.commit([rec])
        return JoinSetChildAdded(child_id=rec.id, kind="task")

    def on_task_created(self, t) -> None:
        """A task child was submitted (in the apply of its TaskSubmitted)."""
        js = self.table[t.joinset_id]
        self.child_pos[t.id] = (js.id, len(js.children))
        js.children.append(JsChild(child_id=t.id, kind="task", cancellable=t.cancellable))
        self.coord.touch(js.id)

    def on_task_terminal(self, t) -> None:
        """A task child finished: its completion record (in the apply that finished it)."""
        ok = t.state == "SUCCEEDED"
        self._complete(
            self.table[t.joinset_id], t.id, "task", ok,
            t.outcome if ok else t.error,
            None if ok else _failure_kind(t.state, t.outcome_reason),
        )

    def op_joinset_submit_delay(self, actor, session, op: JoinSetSubmitDelay) -> JoinSetChildAdded:
        """A durable delay child: ``after_ms`` of server time, or until wall instant ``at``."""
        coord = self.coord
        js = self.get(session.space, op.joinset_id)
        if (op.at is None) == (op.after_ms is None):
            raise ValidationError("give exactly one of seconds and at", details={"field": "at"})
        now = coord.now_ms()
        fire_mono = None
        if op.after_ms is not None:
            check_range("after_ms", op.after_ms, 0, MAX_DELAY_MS, " ms")
            fire_at = now + op.after_ms
            fire_mono = coord.mono_ms() + op.after_ms
        else:
            fire_at = parse_instant("at", op.at)
        coord.runs.require_active(js.scope_id)
        self._require_submittable(js)
        rec = JoinSetDelaySubmitted(joinset_id=js.id, child_id=coord.ids.new("chd"), fire_at_ms=fire_at, at_ms=now,
                                    fire_mono_ms=fire_mono)
        coord.commit([rec])
        return JoinSetChildAdded(child_id=rec.child_id, kind="delay", fire_at=to_iso(fire_at))

    @applies(JoinSetDelaySubmitted)
    def _apply_delay(self, r: JoinSetDelaySubmitted) -> None:
        js = self.table[r.joinset_id]
        self.child_pos[r.child_id] = (js.id, len(js.children))
        child = JsChild(child_id=r.child_id, kind="delay", fire_at_ms=r.fire_at_ms, fire_mono_ms=r.fire_mono_ms)
        js.children.append(child)
        self.coord.touch(js.id)
        self._arm(child)

    def _arm(self, c: JsChild) -> None:
        if c.fire_mono_ms is not None:
            self.coord.arm_mono(c.fire_mono_ms, self._on_delay, c.child_id)
        else:
            self.coord.arm_wall(c.fire_at_ms, self._on_delay, c.child_id)

    def _on_delay(self, child_id: str) -> None:
        pos = self.child_pos.get(child_id)
        if pos is None:
            return
        js = self.table[pos[0]]
        c = js.children[pos[1]]
        if c.done:
            return
        coord = self.coord
        due = c.fire_at_ms if c.fire_mono_ms is None else coord.clock.mono_to_wall(c.fire_mono_ms)
        coord.commit([JoinSetDelayFired(joinset_id=js.id, child_id=child_id, at_ms=max(due, coord.now_ms()))])

    @applies(JoinSetDelayFired)
    def _apply_delay_fired(self, r: JoinSetDelayFired) -> None:
        self._complete(self.table[r.joinset_id], r.child_id, "delay", True, None, None)

    # ================================================================ completion records
    def _complete(self, js: JoinSetState, child_id: str, kind: str, ok: bool, value, failure_kind) -> None:
        _, i = self.child_pos[child_id]
        child = js.children[i]
        if child.done:
            return
        child.done = True
        js.completions.append(Completion(child_id=child_id, kind=kind, ok=ok, value=value, failure_kind=failure_kind))
        if js.state == "CLOSING":
            self._advance_close(js)
        self.coord.touch(js.id)
        self.coord.notify(js.id, "j")

    def _advance_close(self, js: JoinSetState) -> None:
        js.consumed = len(js.completions)  # closing consumes take every record that arrived
        if js.consumed == len(js.children):
            js.state = "CLOSED"
            self.coord.notify(js.id, "j")
            self.coord.notify(js.scope_id, "complete")

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

    def op_joinset_join_next(self, actor, session, op: JoinNext):
        """Consume (or re-read) record ``index`` (default: the next); parks on the set's
        actor while it has not arrived. JOIN_SET_EXHAUSTED past the last child."""
        js = self.get(session.space, op.joinset_id)
        wait_ms = clamp_wait(op.wait_ms)
        if op.index is not None and op.index < 0:
            raise ValidationError("index must be >= 0", details={"field": "index"})
        res = self._try_consume(js, op.index)
        if res is not None or op.try_only or wait_ms == 0:
            return res if res is not None else JoinNextView(status="pending", index=js.consumed)
        index = op.index
        position = js.consumed if index is None else index

        def check():
            # The record this waiter waits for was taken by a closing consume (a close,
            # or its run ended): it is answered with that record, marked closing.
            if index is None and js.closing_from is not None and js.closing_from <= position < js.consumed:
                return self._record_view(js, position)
            return self._try_consume(js, index)

        return Park("j", check, wait_ms, lambda: JoinNextView(status="pending", index=js.consumed))

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
            self.coord.commit([JoinSetConsumed(joinset_id=js.id, index=idx, at_ms=self.coord.now_ms())])
            return self._record_view(js, idx)
        return None

    @applies(JoinSetConsumed)
    def _apply_consumed(self, r: JoinSetConsumed) -> None:
        js = self.table[r.joinset_id]
        js.consumed = r.index + 1
        self.coord.touch(js.id)

    # ================================================================ close
    def op_joinset_close(self, actor, session, op: JoinSetClose):
        """Close the set (one record); waits up to ``wait_ms`` for it to be CLOSED."""
        js = self.get(session.space, op.joinset_id)
        wait_ms = clamp_wait(op.wait_ms)
        if js.state == "OPEN":
            self.coord.commit([JoinSetClosed(joinset_id=js.id, at_ms=self.coord.now_ms())])
        if js.state == "CLOSED" or wait_ms == 0:
            return self.view(js)
        view = self.view
        return Park("j", lambda: view(js) if js.state == "CLOSED" else None, wait_ms, lambda: view(js))

    @applies(JoinSetClosed)
    def _apply_closed(self, r: JoinSetClosed) -> None:
        js = self.table[r.joinset_id]
        if js.state != "OPEN":
            return
        self._close(js, r.at_ms, "joinset_closed", everything=False)

    def _close(self, js: JoinSetState, at_ms: int, task_reason: str, *, everything: bool) -> None:
        """CLOSING, then cancel in reverse submission order: delays, cancellable tasks,
        and (``everything``: the run ended) non-cancellable tasks too."""
        if js.state == "OPEN":
            js.state = "CLOSING"
            js.closed_at_ms = at_ms
            js.closing_from = js.consumed
        self.coord.touch(js.id)
        queues = self.coord.queues
        for c in reversed(js.children):
            if c.done:
                continue
            if c.kind == "delay":
                self._complete(js, c.child_id, "delay", False, None, "cancelled")
            elif c.cancellable or everything:
                t = queues.tasks[c.child_id]
                if t.state not in TERMINAL:
                    queues.finish(t, "CANCELLED", at_ms, task_reason)  # writes its completion record
        self._advance_close(js)
        self.coord.notify(js.id, "j")

    def on_run_inactive(self, js_id: str, at_ms: int, reason: str) -> None:
        """The run ended (cancel, deadline): the set closes in the same step, every
        unfinished child cancelled in reverse submission order."""
        js = self.table[js_id]
        if js.state != "CLOSED":
            self._close(js, at_ms, _RUN_REASON.get(reason, reason), everything=True)

    # ================================================================ run completion
    def open_count(self, run_id: str) -> int:
        """How many of the run's sets are not CLOSED (they keep it from completing)."""
        return sum(1 for j in self.by_run.get(run_id, ()) if self.table[j].state != "CLOSED")

    def close_records_for_complete(self, run_id: str, at_ms: int) -> list:
        """``complete()`` closes the run's open sets, newest first."""
        return [
            JoinSetClosed(joinset_id=jid, at_ms=at_ms)
            for jid in reversed(self.by_run.get(run_id, ()))
            if self.table[jid].state == "OPEN"
        ]

    # ================================================================ recovery
    def rebuild_indexes(self) -> None:
        self._init_indexes()
        runs = self.coord.runs
        for js in self.table.values():
            self._index(js)
            runs.own(js.scope_id, js.id)

    def rearm(self) -> None:
        for js in self.table.values():
            for c in js.children:
                if c.kind == "delay" and not c.done:
                    self._arm(c)
