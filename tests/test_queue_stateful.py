"""A Hypothesis state machine drives the coordinator's work-queue ops directly against a
small reference model: random interleavings of submit, receive, renew, complete, retry,
reject, lease expiry (time moves), task cancel and run cancel.

Deterministic: the coordinator's clock runs on trio's MockClock (jumped by whole seconds,
activities fired with ``coordinator.heap.fire_due()``), and Hypothesis is derandomized.

Invariants after every step: the coordinator agrees with the model (state, attempt,
token, eligibility order); no task has two outcomes; no task is both in the ready index
and leased; tokens only grow; every acknowledged complete is the recorded outcome.
"""

from collections import Counter

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from rallypoint import protocol as p
from rallypoint.actors import Coordinator
from rallypoint.clock import Clock
from rallypoint.errors import LeaseLostError, ScopeCancelledError, ScopeInactiveError
from rallypoint.service import Session
from conftest import direct

MAX_ATTEMPTS = 3
LEASES_MS = (5_000, 7_500, 10_000)
DELAYS_MS = (0, 0, 2_500, 10_000)
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"}
enc = msgspec.msgpack.encode


class RecordingCoordinator(Coordinator):
    """Counts every transition into a terminal state (an outcome)."""

    def __init__(self, **kw) -> None:
        self.finishes: list[tuple[str, str]] = []
        super().__init__(**kw)
        real_finish = self.queues.finish

        def finish(t, state, at_ms, reason):
            self.finishes.append((t.id, state))
            real_finish(t, state, at_ms, reason)

        self.queues.finish = finish


class MTask:
    __slots__ = ("id", "scope", "state", "attempt", "token", "lease_exp", "avail", "outcome")

    def __init__(self, tid: str, scope: str) -> None:
        self.id, self.scope = tid, scope
        self.state, self.attempt, self.token = "QUEUED", 1, 0
        self.lease_exp = self.avail = 0
        self.outcome = None


class QueueMachine(RuleBasedStateMachine):
    mock_clock = None  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.c = RecordingCoordinator(clock=Clock(wall_start=1_700_000_000))
        self.s = Session()
        self.now = 0  # ms since start, the model's clock
        self.fired_at = 0  # model time of the last timers.fire_due()
        direct(self.c, self.s, p.MailboxEnsure(name="jobs", max_attempts=MAX_ATTEMPTS))
        root = direct(self.c, self.s, p.ScopeCreate()).id
        child = direct(self.c, self.s, p.ScopeCreate(parent_id=root)).id
        self.sid = {"root": root, "child": child}
        self.active = {"root": True, "child": True}
        self.tasks: dict[str, MTask] = {}
        self.deliveries: list[tuple[str, int]] = []  # (task_id, token), every one ever handed out
        self.acked: dict[str, bytes] = {}  # task -> outcome of the acknowledged complete
        self.last_token: dict[str, int] = {}
        self.n = 0

    # ---------------------------------------------------------------- model helpers
    def live(self, m: MTask) -> bool:
        return m.state == "RUNNING" and m.lease_exp > self.now

    def in_scope(self, m: MTask, scope: str) -> bool:
        return scope == "root" or m.scope == "child"

    def eligible(self, scope: str) -> list[MTask]:
        return sorted(
            (m for m in self.tasks.values() if m.state == "QUEUED" and m.avail <= self.fired_at and self.in_scope(m, scope)),
            key=lambda m: m.id,
        )

    def expect_error(self, exc_type, op):
        with pytest.raises(exc_type):
            direct(self.c, self.s, op)

    def pick(self, i: int) -> tuple[str, int]:
        return self.deliveries[i % len(self.deliveries)]

    # ---------------------------------------------------------------- rules
    @rule(scope=st.sampled_from(["root", "child"]), n=st.integers(1, 3))
    def submit(self, scope, n):
        items = []
        for _ in range(n):
            self.n += 1
            items.append(p.SubmitItem(input=msgspec.Raw(enc(self.n))))
        op = p.TaskSubmitMany(mailbox="jobs", scope_id=self.sid[scope], items=items)
        if not self.active[scope]:
            self.expect_error(ScopeCancelledError, op)
            return
        view = direct(self.c, self.s, op)
        for tv in view.tasks:
            assert tv.id not in self.tasks and tv.state == "QUEUED"
            self.tasks[tv.id] = MTask(tv.id, scope)

    @rule(scope=st.sampled_from(["root", "child"]), k=st.integers(1, 3), lease=st.sampled_from(LEASES_MS))
    def receive(self, scope, k, lease):
        op = p.Receive(mailbox="jobs", scope_id=self.sid[scope], lease_ms=lease, wait_ms=0, max_messages=k)
        if not self.active[scope]:
            self.expect_error(ScopeCancelledError, op)
            return
        want = self.eligible(scope)[:k]
        got = direct(self.c, self.s, op).deliveries
        assert [d.task_id for d in got] == [m.id for m in want], "oldest eligible first, in the run's subtree"
        for d, m in zip(got, want):
            assert d.token == m.token + 1 and d.attempt == m.attempt
            m.state, m.token, m.lease_exp = "RUNNING", d.token, self.now + lease
            self.deliveries.append((m.id, d.token))

    @precondition(lambda self: self.deliveries)
    @rule(i=st.integers(0, 10_000), lease=st.sampled_from(LEASES_MS))
    def renew(self, i, lease):
        tid, token = self.pick(i)
        m = self.tasks[tid]
        op = p.DeliveryRenew(task_id=tid, token=token, lease_ms=lease)
        if token != m.token:
            self.expect_error(LeaseLostError, op)
        elif not self.active[m.scope]:
            self.expect_error(ScopeInactiveError, op)
        elif not self.live(m):
            self.expect_error(LeaseLostError, op)
        else:
            direct(self.c, self.s, op)
            m.lease_exp = self.now + lease

    @precondition(lambda self: self.deliveries)
    @rule(i=st.integers(0, 10_000))
    def complete(self, i):
        tid, token = self.pick(i)
        m = self.tasks[tid]
        self.n += 1
        outcome = enc({"by": token, "n": self.n})
        op = p.DeliveryComplete(task_id=tid, token=token, outcome=msgspec.Raw(outcome))
        if token != m.token:
            self.expect_error(LeaseLostError, op)
        elif not self.active[m.scope]:
            self.expect_error(ScopeInactiveError, op)
        elif not self.live(m):
            self.expect_error(LeaseLostError, op)
        else:
            view = direct(self.c, self.s, op)
            assert view.state == "SUCCEEDED"
            m.state, m.outcome = "SUCCEEDED", outcome
            assert tid not in self.acked
            self.acked[tid] = outcome

    @precondition(lambda self: self.deliveries)
    @rule(i=st.integers(0, 10_000), delay=st.sampled_from(DELAYS_MS))
    def retry(self, i, delay):
        tid, token = self.pick(i)
        m = self.tasks[tid]
        op = p.DeliveryRetry(task_id=tid, token=token, delay_ms=delay)
        if token != m.token:
            self.expect_error(LeaseLostError, op)
        elif m.state in TERMINAL or not self.active[m.scope]:
            assert direct(self.c, self.s, op).state == m.state  # answered, no change
        elif not self.live(m):
            self.expect_error(LeaseLostError, op)
        else:
            direct(self.c, self.s, op)
            if m.attempt >= MAX_ATTEMPTS:
                m.state = "FAILED"
            else:
                m.state, m.attempt, m.avail = "QUEUED", m.attempt + 1, (self.now + delay if delay else 0)

    @precondition(lambda self: self.deliveries)
    @rule(i=st.integers(0, 10_000))
    def reject(self, i):
        tid, token = self.pick(i)
        m = self.tasks[tid]
        op = p.DeliveryReject(task_id=tid, token=token)
        if token != m.token:
            self.expect_error(LeaseLostError, op)
        elif m.state in TERMINAL or not self.active[m.scope]:
            assert direct(self.c, self.s, op).state == m.state
        elif not self.live(m):
            self.expect_error(LeaseLostError, op)
        else:
            assert direct(self.c, self.s, op).state == "FAILED"
            m.state = "FAILED"

    @rule(seconds=st.integers(1, 12), fire=st.booleans())
    def advance(self, seconds, fire):
        """Time passes: expired leases requeue (or fail at max_attempts); delays end.
        Without ``fire`` the timer task has not run yet: a lease that ran out is no
        longer live (refused), but the task is not requeued until the timers fire."""
        self.mock_clock.jump(seconds)
        self.now += seconds * 1000
        if not fire:
            return
        self.c.heap.fire_due()
        self.fired_at = self.now
        for m in self.tasks.values():
            if m.state == "RUNNING" and m.lease_exp <= self.now:
                if m.attempt >= MAX_ATTEMPTS:
                    m.state = "FAILED"
                else:
                    m.state, m.attempt, m.avail = "QUEUED", m.attempt + 1, 0

    @precondition(lambda self: self.tasks)
    @rule(i=st.integers(0, 10_000))
    def cancel_task(self, i):
        m = self.tasks[sorted(self.tasks)[i % len(self.tasks)]]
        view = direct(self.c, self.s, p.TaskCancel(task_id=m.id))
        if m.state not in TERMINAL:
            m.state = "CANCELLED"
        assert view.state == m.state

    @rule(scope=st.sampled_from(["root", "child"]), roll=st.integers(0, 3))
    def cancel_run(self, scope, roll):
        if roll:  # cancel rarely, so that runs live long enough to be interesting
            return
        direct(self.c, self.s, p.ScopeCancel(scope_id=self.sid[scope]))
        gone = ["root", "child"] if scope == "root" else ["child"]
        for name in gone:
            self.active[name] = False
        for m in self.tasks.values():
            if m.scope in gone and m.state not in TERMINAL:
                m.state = "CANCELLED"

    # ---------------------------------------------------------------- invariants
    @invariant()
    def agrees_with_model(self):
        for tid, m in self.tasks.items():
            t = self.c.queues.tasks[tid]
            assert (t.state, t.attempt, t.token) == (m.state, m.attempt, m.token), tid

    @invariant()
    def no_task_has_two_outcomes(self):
        counts = Counter(tid for tid, _ in self.c.finishes)
        assert not [tid for tid, n in counts.items() if n > 1]
        for tid, state in self.c.finishes:
            assert self.c.queues.tasks[tid].state == state

    @invariant()
    def never_both_ready_and_leased(self):
        ready = self.c.queues.ready_set
        for t in self.c.queues.tasks.values():
            if t.id in ready:
                assert t.state == "QUEUED"
            m = self.tasks[t.id]
            if m.state == "QUEUED" and m.avail <= self.fired_at:
                assert t.id in ready  # eligible work is findable
        for per_run in self.c.queues.ready_index.entries().values():
            for ids in per_run.values():
                assert len(set(ids)) == len(ids)  # each ready task indexed once
                assert all(tid in ready for tid in ids)

    @invariant()
    def tokens_only_grow(self):
        for tid, t in self.c.queues.tasks.items():
            assert t.token >= self.last_token.get(tid, 0)
            self.last_token[tid] = t.token

    @invariant()
    def acknowledged_completes_are_the_outcome(self):
        for tid, outcome in self.acked.items():
            t = self.c.queues.tasks[tid]
            assert t.state == "SUCCEEDED" and t.outcome == outcome

    @invariant()
    def counts_match(self):
        q = sum(1 for t in self.c.queues.tasks.values() if t.state == "QUEUED")
        r = sum(1 for t in self.c.queues.tasks.values() if t.state == "RUNNING")
        assert list(self.c.queues.queue_counts.get(next(iter(self.c.queues.table)), [0, 0])) == [q, r]


async def test_queue_state_machine(mock_clock):
    QueueMachine.mock_clock = mock_clock
    run_state_machine_as_test(
        QueueMachine,
        settings=settings(
            max_examples=200,
            stateful_step_count=40,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
