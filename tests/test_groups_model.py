"""Task groups against a reference model of the SPEC §4 decision table (Hypothesis).

The coordinator is driven directly (sans-I/O: op handlers and commits are synchronous)
with a hand-driven clock and timer heap, so a whole random history runs in
microseconds and a failing one replays exactly. The model below is written from the
SPEC table, not from ``evaluate_group``:

- SUCCESS: FIRST_ACCEPTED on an accept; N_ACCEPTED at ``threshold`` accepts, open or
  sealed; ALL_TERMINAL once sealed and no member can still be accepted (every member's
  task finished, and every SUCCEEDED one judged) with >= 1 accepted and none rejected.
- FAILURE: N_ACCEPTED sealed with accepted + could-still-be-accepted < threshold;
  ALL_TERMINAL sealed, all finished otherwise; any condition once the deadline passes
  (``deadline``) or the gate / its parent is cancelled (``cancelled``).
- "Could still be accepted": the task is unfinished, or SUCCEEDED and not judged.

Random histories mix submits (some repeated), joins of outside tasks, deliveries,
completions, failures, task cancels, verdicts (repeated, opposite, racing pairs),
close, the deadline passing (with its timer firing at once or later) and run cancels.
"""

from __future__ import annotations

import heapq

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rallypoint import protocol as p
from rallypoint.actors import Coordinator
from rallypoint.clock import to_iso
from rallypoint.errors import (
    ConflictError,
    DeadlineExceededError,
    LimitError,
    ScopeCancelledError,
)
from rallypoint.service import Session

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"}
DEADLINE_S = 60
LEASE_MS = 600_000  # longer than any history: leases never expire here


class HandClock:
    """Wall-clock ms that only move when the test says so."""

    def __init__(self) -> None:
        self.ms = 1_767_225_600_000  # 2026-01-01

    def now_ms(self) -> int:
        return self.ms

    def now(self) -> float:
        return self.ms / 1000

    def trio_time_at(self, at_ms: int) -> float:
        return at_ms / 1000

    # server time is wall time here
    def mono_ms(self) -> int:
        return self.ms

    def trio_time_at_mono(self, mono_ms: int) -> float:
        return mono_ms / 1000

    def mono_to_wall(self, mono_ms: int) -> int:
        return mono_ms


def fire_due(coord: Coordinator) -> None:
    heap = coord.heap._heap
    fns = coord.heap._fns
    while heap and heap[0][0] <= coord.clock.ms / 1000:
        _, _, _, fn, arg = heapq.heappop(heap)
        (fns[fn] if isinstance(fn, int) else fn)(arg)


def raw(x) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(x))


class M:
    """A member in the model."""

    def __init__(self, tid: str, key: str | None, state: str, in_gate: bool) -> None:
        self.tid, self.key, self.state, self.in_gate = tid, key, state, in_gate
        self.verdict: str | None = None
        self.late = False
        self.token = 0


class GroupMachine(RuleBasedStateMachine):
    # ------------------------------------------------------------------ model
    def could_be_accepted(self, m: M) -> bool:
        return m.state not in TERMINAL or (m.state == "SUCCEEDED" and m.verdict is None)

    def table(self):
        judged = [m for m in self.members if not m.late]
        acc = sum(m.verdict == "ACCEPTED" for m in judged)
        rej = sum(m.verdict == "REJECTED" for m in judged)
        could = sum(self.could_be_accepted(m) for m in judged)
        sealed = self.state == "SEALED"
        if self.condition == "FIRST_ACCEPTED":
            return ("SUCCESS", "first_accepted") if acc >= 1 else None
        if self.condition == "N_ACCEPTED":
            if acc >= self.threshold:
                return ("SUCCESS", "threshold_reached")
            if sealed and acc + could < self.threshold:
                return ("FAILURE", "threshold_unreachable")
            return None
        if sealed and could == 0:
            return ("SUCCESS" if acc >= 1 and rej == 0 else "FAILURE", "all_terminal")
        return None

    def finalize(self, outcome: str, reason: str) -> None:
        assert self.state != "FINALIZED"
        self.state, self.outcome, self.reason = "FINALIZED", outcome, reason
        self.model_finalizations += 1
        for m in self.members:
            if m.state not in TERMINAL:
                m.state = "CANCELLED"

    def touched(self) -> None:
        """After a committed change to the group or one of its members."""
        if self.state == "FINALIZED":
            return
        if self.deadline_passed:
            self.finalize("FAILURE", "deadline")
            return
        d = self.table()
        if d is not None:
            self.finalize(*d)

    # ------------------------------------------------------------------ plumbing
    def call(self, op):
        res = self.coord.decide(self.session, op)
        assert isinstance(res, msgspec.Struct), f"{type(op).__name__} did not answer at once"
        return res

    def expect_error(self, exc_type, op):
        with pytest.raises(exc_type):
            self.call(op)

    def gate_inactive_error(self):
        if self.state == "FINALIZED" or self.cancelled:
            return ScopeCancelledError
        if self.deadline_passed:
            return DeadlineExceededError
        return None

    @initialize(
        condition=st.sampled_from(["FIRST_ACCEPTED", "N_ACCEPTED", "ALL_TERMINAL"]),
        threshold=st.integers(1, 4),
        expected=st.none() | st.integers(1, 6),
        with_deadline=st.booleans(),
        cancel_after=st.integers(0, 60),
        deadline_after=st.integers(0, 40),
    )
    def create(self, condition, threshold, expected, with_deadline, cancel_after, deadline_after):
        self.clock = HandClock()
        self.coord = Coordinator(clock=self.clock)
        self.session = Session()
        self.finalize_calls = 0
        real_finalize = self.coord.groups.finalize

        def counting_finalize(g, *a):
            self.finalize_calls += 1
            return real_finalize(g, *a)

        self.coord.groups.finalize = counting_finalize
        self.call(p.MailboxEnsure(name="work"))
        self.parent = self.call(p.ScopeCreate()).id
        self.condition = condition
        self.threshold = threshold if condition == "N_ACCEPTED" else None
        if condition == "N_ACCEPTED" and expected is not None and expected < threshold:
            expected = threshold
        self.expected = expected
        self.deadline_ms = self.clock.ms + DEADLINE_S * 1000 if with_deadline else None
        g = self.call(
            p.GroupCreate(
                scope_id=self.parent,
                mailbox="work",
                condition=condition,
                threshold=self.threshold,
                expected_members=expected,
                deadline=to_iso(self.deadline_ms),
            )
        )
        self.gid, self.gate = g.id, g.scope_id
        self.members: list[M] = []
        self.state, self.outcome, self.reason = "OPEN", None, None
        self.first_outcome = None
        self.model_finalizations = 0
        self.deadline_passed = False
        self.deadline_fired = False
        self.cancelled = False
        self.n = 0
        # run cancels and the deadline are enabled only after some steps, so that most
        # histories have a long stretch of ordinary work before them
        self.steps = 0
        self.cancel_after, self.deadline_after = cancel_after, deadline_after

    def pick(self, data, pred=lambda m: True) -> M | None:
        cands = [m for m in self.members if pred(m)]
        return data.draw(st.sampled_from(cands)) if cands else None

    # ------------------------------------------------------------------ membership
    def _joined(self, m: M) -> None:
        self.members.append(m)
        if self.expected is not None and len(self.members) >= self.expected:
            self.state = "SEALED"
        self.touched()

    @rule()
    def submit(self):
        self.n += 1
        key = f"k{self.n}"
        op = p.GroupSubmit(group_id=self.gid, input=raw(self.n), key=key)
        if self.deadline_passed and (self.state == "OPEN" or self.reason == "deadline"):
            # past its deadline a group refuses members with DEADLINE_EXCEEDED, whether
            # or not the deadline's activity already finalized it
            return self.expect_error(DeadlineExceededError, op)
        if self.state != "OPEN":
            return self.expect_error(ConflictError, op)
        if len(self.members) >= 100:
            return self.expect_error(LimitError, op)
        if self.deadline_passed:
            return self.expect_error(DeadlineExceededError, op)
        r = self.call(op)
        m = M(r.task.id, key, "QUEUED", in_gate=True)
        self._joined(m)  # the submit that seals may finalize (and so cancel) at once
        assert r.task.scope_id == self.gate and r.task.state == m.state
        assert r.group_state == self.state

    @rule(data=st.data(), same_input=st.booleans())
    def resubmit(self, data, same_input):
        m = self.pick(data, lambda m: m.key is not None)
        if m is None:
            return
        n = int(m.key[1:])
        op = p.GroupSubmit(group_id=self.gid, input=raw(n if same_input else -n), key=m.key)
        if not same_input:
            return self.expect_error(ConflictError, op)
        assert self.call(op).task.id == m.tid  # open or not, the existing member

    @rule(start=st.sampled_from(["QUEUED", "SUCCEEDED", "FAILED"]))
    def join_outside_task(self, start):
        run = self.call(p.ScopeCreate()).id  # a run of its own: FIFO cannot pick another
        t = self.call(p.TaskSubmit(mailbox="work", scope_id=run, input=raw("outside")))
        if start != "QUEUED":
            d = self.call(p.Receive(mailbox="work", scope_id=run, lease_ms=LEASE_MS)).deliveries[0]
            if start == "SUCCEEDED":
                self.call(p.DeliveryComplete(task_id=t.id, token=d.token, outcome=raw("ok")))
            else:
                self.call(p.DeliveryReject(task_id=t.id, token=d.token))
        op = p.GroupJoinTask(group_id=self.gid, task_id=t.id)
        if self.deadline_passed and (self.state == "OPEN" or self.reason == "deadline"):
            return self.expect_error(DeadlineExceededError, op)
        if self.state != "OPEN":
            return self.expect_error(ConflictError, op)
        if len(self.members) >= 100:
            return self.expect_error(LimitError, op)
        if self.deadline_passed:
            return self.expect_error(DeadlineExceededError, op)
        assert self.call(op).task.id == t.id
        self._joined(M(t.id, None, start, in_gate=False))

    # ------------------------------------------------------------------ work
    @rule(n=st.integers(1, 3))
    def deliver(self, n):
        op = p.Receive(mailbox="work", scope_id=self.gate, lease_ms=LEASE_MS, max_messages=n)
        err = self.gate_inactive_error()
        if err is not None:
            return self.expect_error(err, op)
        got = self.call(op).deliveries
        queued = [m for m in self.members if m.in_gate and m.state == "QUEUED"][:n]  # FIFO
        assert [d.task_id for d in got] == [m.tid for m in queued]
        for m, d in zip(queued, got):
            m.state, m.token = "RUNNING", d.token
        if got:
            self.touched()

    @rule(data=st.data())
    def complete(self, data):
        m = self.pick(data, lambda m: m.state == "RUNNING")
        if m is None:
            return
        op = p.DeliveryComplete(task_id=m.tid, token=m.token, outcome=raw({"score": 1}))
        err = self.gate_inactive_error()
        if err is not None:
            return self.expect_error(err, op)
        assert self.call(op).state == "SUCCEEDED"
        m.state = "SUCCEEDED"
        self.touched()

    @rule(data=st.data())
    def fail(self, data):
        m = self.pick(data, lambda m: m.state == "RUNNING")
        if m is None:
            return
        r = self.call(p.DeliveryReject(task_id=m.tid, token=m.token))
        if self.gate_inactive_error() is not None:
            assert r.state == "RUNNING"  # answered, nothing changes on an inactive run
            return
        assert r.state == "FAILED"
        m.state = "FAILED"
        self.touched()

    @rule(data=st.data())
    def cancel_task(self, data):
        m = self.pick(data, lambda m: m.state not in TERMINAL)
        if m is None:
            return
        assert self.call(p.TaskCancel(task_id=m.tid)).state == "CANCELLED"
        m.state = "CANCELLED"
        self.touched()

    # ------------------------------------------------------------------ verdicts
    def _verdict(self, m: M, verdict: str) -> None:
        op = p.GroupVerdictOp(group_id=self.gid, task_id=m.tid, verdict=verdict)
        if m.verdict is not None and m.verdict != verdict:
            return self.expect_error(ConflictError, op)
        if m.verdict is None:
            if verdict == "ACCEPTED" and m.state != "SUCCEEDED":
                return self.expect_error(ConflictError, op)
            if verdict == "REJECTED" and m.state not in TERMINAL:
                return self.expect_error(ConflictError, op)
        r = self.call(op)
        if m.verdict is None:
            m.verdict = verdict
            m.late = self.state == "FINALIZED" or self.deadline_passed
            self.touched()
        assert (r.task_id, r.verdict, r.late) == (m.tid, m.verdict, m.late)
        assert (r.group_state, r.outcome, r.outcome_reason) == (self.state, self.outcome, self.reason)

    @rule(data=st.data(), verdict=st.sampled_from(["ACCEPTED", "REJECTED"]))
    def verdict(self, data, verdict):
        m = self.pick(data)
        if m is not None:
            self._verdict(m, verdict)

    @rule(data=st.data(), first=st.sampled_from(["ACCEPTED", "REJECTED"]), second=st.sampled_from(["ACCEPTED", "REJECTED"]))
    def racing_verdicts(self, data, first, second):
        """Two reviewers judge the same member at once: whichever lands first wins."""
        m = self.pick(data, lambda m: m.state in TERMINAL)
        if m is not None:
            self._verdict(m, first)
            self._verdict(m, second)

    @rule()
    def close(self):
        r = self.call(p.GroupClose(group_id=self.gid))
        if self.state == "OPEN":
            self.state = "SEALED"
            self.touched()
        assert (r.state, r.outcome, r.outcome_reason) == (self.state, self.outcome, self.reason)

    # ------------------------------------------------------------------ time, cancel
    @precondition(
        lambda self: self.deadline_ms is not None and not self.deadline_passed and self.steps >= self.deadline_after
    )
    @rule()
    def deadline_passes(self):
        """The clock passes the deadline; its timer fires only in a later step, so other
        requests can land in between (refusals start at the instant, SPEC §2)."""
        self.clock.ms = self.deadline_ms + 1
        self.deadline_passed = True

    @precondition(lambda self: self.deadline_passed and not self.deadline_fired)
    @rule()
    def fire_timers(self):
        fire_due(self.coord)
        self.deadline_fired = True
        if self.state != "FINALIZED":
            self.finalize("FAILURE", "deadline")

    @precondition(lambda self: self.steps >= self.cancel_after)
    @rule(which=st.sampled_from(["gate", "parent"]))
    def cancel_run(self, which):
        self.call(p.ScopeCancel(scope_id=self.gate if which == "gate" else self.parent))
        self.cancelled = True
        if self.state != "FINALIZED":
            self.finalize("FAILURE", "deadline" if self.deadline_passed else "cancelled")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def count_steps(self):
        self.steps += 1

    @invariant()
    def agrees_with_the_model(self):
        g = self.call(p.GroupStatus(group_id=self.gid))
        assert (g.state, g.outcome, g.outcome_reason) == (self.state, self.outcome, self.reason)
        assert [(x.task_id, x.task_state, x.verdict, x.late) for x in g.members] == [
            (m.tid, m.state, m.verdict, m.late) for m in self.members
        ]

    @invariant()
    def finalizes_at_most_once_and_the_outcome_never_changes(self):
        assert self.finalize_calls == self.model_finalizations <= 1
        if self.outcome is not None:
            if self.first_outcome is None:
                self.first_outcome = (self.outcome, self.reason)
            assert (self.outcome, self.reason) == self.first_outcome

    @invariant()
    def finalized_means_gate_inactive_and_no_member_deliverable(self):
        if self.state != "FINALIZED":
            return
        gate = self.coord.runs.table[self.gate]
        assert gate.state != "ACTIVE" and self.coord.runs.inactive_error(self.gate) is not None
        for m in self.members:
            t = self.coord.queues.tasks[m.tid]
            assert t.state not in ("QUEUED", "RUNNING")
            assert t.id not in self.coord.queues.ready_set


GroupMachine.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=40,
    derandomize=True,  # a failure replays exactly
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
test_group_decision_model = GroupMachine.TestCase
