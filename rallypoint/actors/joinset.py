"""Join sets: structured concurrency over a run's children (SPEC §5, after Obelisk).

A join set holds child *tasks* (submitted to a work queue) and durable *delays*. Every
child that finishes appends one completion record to the set, in the order children
finish on the server (the order of apply, which is the journal order, so replay
reproduces it). Consuming is positional: the k-th consume of a set returns the set's
k-th record; asking for index k < consumed re-reads the same record.

Steps: every answer of ``join_next`` / ``join_next_try`` is the next step of the set's
log and journaled before it is sent -- a record consumed (``JoinSetConsumed`` with its
step), a probe's ``pending``, JOIN_SET_EXHAUSTED, the record a close hands to a waiting
await (``JoinSetAnswered``), a typed op's FUNCTION_MISMATCH (a consume). A request with
``step < steps`` is a replay: it gets the logged answer if it is the same operation
(await or probe, same ``mailbox``), else NONDETERMINISM_DETECTED naming the step and
both answers. So a client that restarts and re-runs its calls gets identical answers,
"pending" included. A wait that runs out is no step.

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

A task child may own a run (``delivery.run()``): its completion record is written only
when it is terminal, which for a completed task is after its own run's sets closed
(:mod:`rallypoint.actors.queue`), so a record never arrives while anything under that
child is pending. A set of a completing task's run that becomes CLOSED asks the work
queues kind to re-check that task (its ``TaskRunCompleted`` reaction).
"""

from __future__ import annotations

import bisect
import re

import msgspec

from ..clock import to_iso
from ..errors import (
    ConflictError,
    FunctionMismatchError,
    JoinSetExhaustedError,
    LimitError,
    NondeterminismError,
    NotFoundError,
    ValidationError,
)
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
    JoinSetAnswered,
    JoinSetClosed,
    JoinSetConsumed,
    JoinSetCreated,
    JoinSetDelayFired,
    JoinSetDelaySubmitted,
    TaskSubmitted,
)
from ..events import emits, ev
from ..records import JoinSetChildDone, JoinSetClosing, JoinSetDone
from .common import applies, check_range, clamp_wait, data, parse_instant, short
from .kind import Kind
from .opmark import ALWAYS, NEVER, R, W, asked, by, by_op, by_run, in_slot, keyed, op, resend_if, waits_if
from ..opdecl import at_explicit_index_or_step
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


class Step(msgspec.Struct, gc=False, array_like=True):
    """One entry of a set's log of answers (``n`` identical answers in a row: a probe
    loop's ``pending``, repeated exhaustion, stored once)."""

    op: str  # "next" (an await) | "try" (a probe)
    outcome: str  # "record" | "pending" | "exhausted"
    index: int = -1  # the record; for pending/exhausted the next unconsumed record then
    mailbox: str | None = None  # a typed op: the work queue id it asked for
    n: int = 1


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
    steps: list[Step] = msgspec.field(default_factory=list)  # the log of answers, run-length encoded
    nsteps: int = 0  # answers in the log: the next live answer's step


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
        self.step_starts: dict[str, list[int]] = {}  # set id -> first step of each entry of its log

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
            steps=js.nsteps,
        )

    # ================================================================ create, get
    @op(JoinSetCreate, route=by_run(), permission=W, resend=NEVER)
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
        rec = JoinSetCreated(id=coord.new_id("jst", under=run.id), space=session.space, scope_id=run.id,
                             at_ms=coord.now_ms(), name=op.name)
        if coord.runs.completing_task(run.id) is not None:
            # the run's task was completed: its run is closing, like a run whose
            # complete() waits; a set made now is closed at once
            coord.commit([rec, JoinSetClosed(joinset_id=rec.id, at_ms=rec.at_ms)])
        else:
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
        if js.steps:
            starts, n = [], 0
            for e in js.steps:
                starts.append(n)
                n += e.n
            self.step_starts[js.id] = starts

    def route_get(self, session, op: JoinSetGet) -> str:
        if op.joinset_id is not None:
            return self.route(session, op.joinset_id)
        if op.scope_id is None or op.name is None:
            raise ValidationError("give joinset_id, or scope_id and name", details={"field": "joinset_id"})
        return self.coord.runs.route(session, op.scope_id)

    @op(JoinSetGet, route=by_op("route_get"), permission=R, resend=ALWAYS, shard=in_slot("joinset_id", "scope_id"))
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

    @op(JoinSetSubmit, route=by("joinset_id"), permission=W,
        resend=keyed("key", "give the child a `key` to make it safe to retry"))
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
            joinset_id=js.id, cancellable=bool(op.cancellable), requirements=op.requirements,
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
            t.finished_at_ms or 0,
        )

    @op(JoinSetSubmitDelay, route=by("joinset_id"), permission=W, resend=NEVER)
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
        rec = JoinSetDelaySubmitted(joinset_id=js.id, child_id=coord.new_id("chd", under=js.id), fire_at_ms=fire_at, at_ms=now,
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
        self._complete(self.table[r.joinset_id], r.child_id, "delay", True, None, None, r.at_ms)

    # ================================================================ completion records
    def _complete(self, js: JoinSetState, child_id: str, kind: str, ok: bool, value, failure_kind,
                  at_ms: int) -> None:
        _, i = self.child_pos[child_id]
        child = js.children[i]
        if child.done:
            return
        child.done = True
        js.completions.append(Completion(child_id=child_id, kind=kind, ok=ok, value=value, failure_kind=failure_kind))
        self.coord.implied(JoinSetChildDone(joinset_id=js.id, child_id=child_id, child_kind=kind, ok=ok,
                                            at_ms=at_ms, failure_kind=failure_kind))
        if js.state == "CLOSING":
            self._advance_close(js, at_ms)
        self.coord.touch(js.id)
        self.coord.notify(js.id, "j")

    def _advance_close(self, js: JoinSetState, at_ms: int) -> None:
        js.consumed = len(js.completions)  # closing consumes take every record that arrived
        if js.consumed == len(js.children):
            if js.state != "CLOSED":
                self.coord.implied(JoinSetDone(joinset_id=js.id, at_ms=at_ms))
            js.state = "CLOSED"
            self.coord.notify(js.id, "j")
            self.coord.notify(js.scope_id, "complete")
            task = self.coord.runs.completing_task(js.scope_id)
            if task is not None:  # a completing task's run: it may be done now
                self.coord.queues.check_completion(task.id)

    # ================================================================ consume: steps
    def _step_at(self, js: JoinSetState, step: int) -> "Step":
        starts = self.step_starts[js.id]
        return js.steps[bisect.bisect_right(starts, step) - 1]

    def _mailbox_name(self, mailbox_id: str | None) -> str | None:
        if mailbox_id is None:
            return None
        q = self.coord.queues.table.get(mailbox_id)
        return q.name if q is not None else mailbox_id

    def _op_name(self, op: str, mailbox_id: str | None) -> str:
        name = "join_next" if op == "next" else "join_next_try"
        if mailbox_id is not None:
            name += f"(mailbox={self._mailbox_name(mailbox_id)!r})"
        return name

    def _describe(self, js: JoinSetState, outcome: str, index: int) -> str:
        if outcome == "record":
            c = js.completions[index]
            return f"record {index} (child {c.child_id}, {'ok' if c.ok else c.failure_kind})"
        if outcome == "exhausted":
            return "JOIN_SET_EXHAUSTED"
        if outcome == "wait":
            return f"a wait for record {index}"
        return "pending"

    def _now(self, js: JoinSetState, op: str) -> dict:
        """What a live ``op`` would be answered now (nothing is consumed)."""
        idx = js.consumed
        if idx >= len(js.children):
            return {"outcome": "exhausted"}
        if idx < len(js.completions):
            c = js.completions[idx]
            return {"outcome": "record", "index": idx, "child_id": c.child_id, "ok": c.ok}
        return {"outcome": "pending" if op == "try" else "wait", "index": idx}

    def _nondeterminism(self, js: JoinSetState, step: int, e: "Step", op: str, mailbox_id: str | None):
        logged = {"op": "join_next" if e.op == "next" else "join_next_try", "outcome": e.outcome, "index": e.index}
        if e.mailbox is not None:
            logged["mailbox"] = self._mailbox_name(e.mailbox)
        now = self._now(js, op)
        asked = {"op": "join_next" if op == "next" else "join_next_try", "now": now}
        if mailbox_id is not None:
            asked["mailbox"] = self._mailbox_name(mailbox_id)
        return NondeterminismError(
            f"join set {js.id} step {step}: the journal holds {self._op_name(e.op, e.mailbox)} answered "
            f"{self._describe(js, e.outcome, e.index)}, but this replay asks {self._op_name(op, mailbox_id)} "
            f"(answered now it would get {self._describe(js, now['outcome'], now.get('index', -1))}); a replaying "
            "client must repeat its first execution's join_next / join_next_try calls in the same order",
            details={"joinset_id": js.id, "step": step, "logged": logged, "asked": asked},
        )

    def _exhausted(self, js: JoinSetState, step: int | None, replayed: bool = False) -> JoinSetExhaustedError:
        return JoinSetExhaustedError(
            f"join set {js.id} has {len(js.children)} children and all were consumed",
            details={"joinset_id": js.id, "submitted": len(js.children), "step": step, "replayed": replayed},
        )

    def _record_view(self, js: JoinSetState, index: int, step: int | None = None, replayed: bool = False) -> JoinNextView:
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
            step=step,
            replayed=replayed,
        )

    def _answer_record(self, js: JoinSetState, index: int, step: int | None, mailbox_id: str | None,
                       replayed: bool = False) -> JoinNextView:
        """Record ``index`` as the answer; FUNCTION_MISMATCH when a typed op (``mailbox_id``)
        took a child of another kind (it is consumed all the same)."""
        if mailbox_id is not None:
            c = js.completions[index]
            actual = None if c.kind == "delay" else self.coord.queues.tasks[c.child_id].mailbox_id
            if actual != mailbox_id:
                expected, actual_name = self._mailbox_name(mailbox_id), self._mailbox_name(actual)
                what = f"delay {c.child_id}" if actual is None else f"task {c.child_id} of mailbox {actual_name!r}"
                raise FunctionMismatchError(
                    f"join set {js.id} record {index}: expected a child of mailbox {expected!r}, got {what}; "
                    f"the record is consumed (re-read it with join_next(index={index}))",
                    details={"joinset_id": js.id, "index": index, "step": step, "child_id": c.child_id,
                             "expected": expected, "actual": actual_name, "actual_kind": c.kind,
                             "replayed": replayed},
                )
        return self._record_view(js, index, step, replayed)

    def _replay(self, js: JoinSetState, step: int, op: str, mailbox_id: str | None) -> JoinNextView:
        """The answer the log holds at ``step`` (< steps), for the same operation only."""
        e = self._step_at(js, step)
        if e.op != op or e.mailbox != mailbox_id:
            raise self._nondeterminism(js, step, e, op, mailbox_id)
        if e.outcome == "record":
            return self._answer_record(js, e.index, step, mailbox_id, replayed=True)
        if e.outcome == "exhausted":
            raise self._exhausted(js, step, replayed=True)
        return JoinNextView(status="pending", index=e.index, step=step, replayed=True)

    @op(JoinNext, route=by("joinset_id"), permission=W, reply=JoinNextView,
        resend=resend_if(at_explicit_index_or_step, "at an explicit index or step",
                         fields=("index", "step")),
        waits=waits_if(lambda op: op.wait_ms > 0 and not op.try_only, "wait_ms > 0 and not try_only",
                       ("wait_ms", "try_only")))
    def op_joinset_join_next(self, actor, session, op: JoinNext):
        """An await (parks on the set's actor up to ``wait_ms``) or a probe (``try_only``).

        Every answer is the next step of the set's log and journaled: a record consumed
        (``JoinSetConsumed``), a probe's ``pending`` or JOIN_SET_EXHAUSTED
        (``JoinSetAnswered``), FUNCTION_MISMATCH for a typed op. ``step`` replays (see
        :class:`~rallypoint.protocol.JoinNext`); ``index`` re-reads or consumes a record by
        position. VALIDATION_FAILED for a step or index ahead of the log, or both given;
        NONDETERMINISM_DETECTED for a replay of another operation; NOT_FOUND for an
        unknown ``mailbox``."""
        js = self.get(session.space, op.joinset_id)
        wait_ms = clamp_wait(op.wait_ms)
        kind = "try" if op.try_only else "next"
        mailbox_id = None if op.mailbox is None else self.coord.queues.get_queue(session.space, op.mailbox).id
        index, step = op.index, op.step
        if index is not None and step is not None:
            raise ValidationError("give index (a record) or step (a replay position), not both",
                                  details={"field": "step"})
        if index is not None and index < 0:
            raise ValidationError("index must be >= 0", details={"field": "index"})
        if step is not None:
            if step < 0:
                raise ValidationError("step must be >= 0", details={"field": "step"})
            if step > js.nsteps:
                raise ValidationError(
                    f"step {step} is ahead of join set {js.id}'s log ({js.nsteps} steps: the next live answer "
                    f"is step {js.nsteps}); steps never skip ahead",
                    details={"field": "step", "steps": js.nsteps},
                )
        res = self._answer(js, kind, mailbox_id, index, step)
        if res is not None or op.try_only or wait_ms == 0:
            return res if res is not None else JoinNextView(status="pending", index=js.consumed)
        position = js.consumed

        def check():
            # The record this await waits for was taken by a closing consume (a close,
            # or its run ended): it is handed over, marked closing, as this await's step.
            if (index is None and (step is None or step == js.nsteps) and js.closing_from is not None
                    and js.closing_from <= position < js.consumed):
                s = js.nsteps
                self.coord.commit([JoinSetAnswered(joinset_id=js.id, step=s, op=kind, outcome="record",
                                                   at_ms=self.coord.now_ms(), index=position, mailbox=mailbox_id)])
                return self._answer_record(js, position, s, mailbox_id)
            return self._answer(js, kind, mailbox_id, index, step)

        return Park("j", check, wait_ms, lambda: JoinNextView(status="pending", index=js.consumed))

    def _answer(self, js: JoinSetState, op: str, mailbox_id: str | None, index: int | None,
                step: int | None) -> JoinNextView | None:
        """The answer now, journaled as the next step; None while an await must wait.
        Raises JOIN_SET_EXHAUSTED (a step too) past the last child."""
        if step is not None and step < js.nsteps:
            return self._replay(js, step, op, mailbox_id)
        if index is not None:
            if index < js.consumed:
                return self._answer_record(js, index, None, mailbox_id)  # positional re-read: no step
            if index > js.consumed:
                raise ValidationError(
                    f"index {index} is ahead of join set {js.id}'s next unconsumed record ({js.consumed}); "
                    "consumes never skip ahead",
                    details={"field": "index"},
                )
        coord = self.coord
        idx, s = js.consumed, js.nsteps
        if idx >= len(js.children):
            coord.commit([JoinSetAnswered(joinset_id=js.id, step=s, op=op, outcome="exhausted", at_ms=coord.now_ms(),
                                          index=idx, mailbox=mailbox_id)])
            raise self._exhausted(js, s)
        if idx < len(js.completions):
            coord.commit([JoinSetConsumed(joinset_id=js.id, index=idx, at_ms=coord.now_ms(), step=s, op=op,
                                          mailbox=mailbox_id)])
            return self._answer_record(js, idx, s, mailbox_id)
        if op == "try":
            coord.commit([JoinSetAnswered(joinset_id=js.id, step=s, op=op, outcome="pending", at_ms=coord.now_ms(),
                                          index=idx, mailbox=mailbox_id)])
            return JoinNextView(status="pending", index=idx, step=s)
        return None

    def _add_step(self, js: JoinSetState, step: int, op: str, outcome: str, index: int, mailbox: str | None) -> None:
        if step != js.nsteps:
            raise RuntimeError(f"join set {js.id}: step {step} applied where the log has {js.nsteps} steps")
        last = js.steps[-1] if js.steps else None
        if (last is not None and outcome != "record" and last.outcome == outcome and last.op == op
                and last.index == index and last.mailbox == mailbox):
            last.n += 1  # the same answer again (a probe loop): one entry
        else:
            js.steps.append(Step(op=op, outcome=outcome, index=index, mailbox=mailbox))
            self.step_starts.setdefault(js.id, []).append(step)
        js.nsteps += 1

    @applies(JoinSetConsumed)
    def _apply_consumed(self, r: JoinSetConsumed) -> None:
        js = self.table[r.joinset_id]
        js.consumed = r.index + 1
        if r.step is not None:
            self._add_step(js, r.step, r.op, "record", r.index, r.mailbox)
        self.coord.touch(js.id)

    @applies(JoinSetAnswered)
    def _apply_answered(self, r: JoinSetAnswered) -> None:
        js = self.table[r.joinset_id]
        self._add_step(js, r.step, r.op, r.outcome, r.index, r.mailbox)
        self.coord.touch(js.id)

    # ================================================================ close
    @op(JoinSetClose, route=by("joinset_id"), permission=W, resend=ALWAYS, waits=asked("wait_ms"), reply=JoinSetView)
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
            self.coord.implied(JoinSetClosing(joinset_id=js.id, at_ms=at_ms))
        self.coord.touch(js.id)
        queues = self.coord.queues
        for c in reversed(js.children):
            if c.done:
                continue
            if c.kind == "delay":
                self._complete(js, c.child_id, "delay", False, None, "cancelled", at_ms)
            elif c.cancellable or everything:
                t = queues.tasks[c.child_id]
                if t.state not in TERMINAL:
                    queues.cancel_implied(t, at_ms, task_reason)  # writes its completion record
        self._advance_close(js, at_ms)
        self.coord.notify(js.id, "j")

    def on_run_inactive(self, js_id: str, at_ms: int, reason: str) -> None:
        """The run ended (cancel, deadline): the set closes in the same step, every
        unfinished child cancelled in reverse submission order."""
        js = self.table[js_id]
        if js.state != "CLOSED":
            self._close(js, at_ms, _RUN_REASON.get(reason, reason), everything=True)

    # ================================================================ retention
    def purge_run(self, run_id: str) -> int:
        """The run's join sets (their task children go with the run's tasks)."""
        n = 0
        for jid in self.by_run.pop(run_id, ()):
            js = self.table.pop(jid, None)
            if js is None:
                continue
            if js.name is not None:
                self.names.pop((js.scope_id, js.name), None)
            for c in js.children:
                self.child_pos.pop(c.child_id, None)
            self.step_starts.pop(jid, None)
            self.coord.touch(jid)
            n += 1
        return n

    # ================================================================ events
    @emits(JoinSetCreated)
    def _ev_created(self, r: JoinSetCreated):
        return ev(r.space, "joinset.created", "joinset", r.id, r.scope_id, r.at_ms, data(name=r.name))

    @emits(JoinSetDelaySubmitted)
    def _ev_delay(self, r: JoinSetDelaySubmitted):
        js = self.table[r.joinset_id]
        return ev(js.space, "joinset.delay_submitted", "joinset", js.id, js.scope_id, r.at_ms,
                  {"child": r.child_id, "fire_at": to_iso(r.fire_at_ms)})

    @emits(JoinSetDelayFired, JoinSetClosed)
    def _ev_described_by_facts(self, r):
        """A delay firing and a close are described by the facts their apply implies
        (JoinSetChildDone, JoinSetClosing, JoinSetDone): the same transitions happen
        when a run's end closes a set."""
        return None

    @emits(JoinSetConsumed)
    def _ev_consumed(self, r: JoinSetConsumed):
        js = self.table[r.joinset_id]
        return ev(js.space, "joinset.consumed", "joinset", js.id, js.scope_id, r.at_ms,
                  data(index=r.index, step=r.step))

    @emits(JoinSetChildDone)
    def _ev_child_done(self, r: JoinSetChildDone):
        js = self.table[r.joinset_id]
        return ev(js.space, "joinset.child_done", "joinset", js.id, js.scope_id, r.at_ms,
                  data(child=r.child_id, child_kind=r.child_kind, ok=r.ok, failure_kind=r.failure_kind))

    @emits(JoinSetClosing)
    def _ev_closing(self, r: JoinSetClosing):
        js = self.table[r.joinset_id]
        return ev(js.space, "joinset.closing", "joinset", js.id, js.scope_id, r.at_ms, None)

    @emits(JoinSetDone)
    def _ev_done(self, r: JoinSetDone):
        js = self.table[r.joinset_id]
        return ev(js.space, "joinset.closed", "joinset", js.id, js.scope_id, r.at_ms, None)

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
