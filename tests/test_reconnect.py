"""The reconnecting client (issue 12, item 5), in process: a real TCP Server over an
embedded coordinator that is "killed" (every connection dropped, no replies) and
started again on the same port while the coordinator keeps its state; and, under
MockClock, the backoff schedule with a fake connection opener.

What is re-sent after a drop and what surfaces as UNAVAILABLE is documented in
rallypoint/client/reconnect.py; each rule has a test here.
"""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import trio
import trio.testing

import rallypoint
from rallypoint import protocol as p
from rallypoint.client.reconnect import Reconnect, ReconnectingTransport, reissue_safe
from rallypoint.client import reconnect as reconnect_mod
from rallypoint.errors import NotFoundError, UnauthenticatedError, UnavailableError, ValidationError
from rallypoint.actors.api import op_decoder
from rallypoint.transport.server import Server


class _SwallowSink:
    """The sink of a swallowed request: the actor's answer is dropped (a reply lost in
    a crash), and ``applied`` is set when it comes."""

    def __init__(self, inner, applied: trio.Event) -> None:
        self.inner = inner
        self.applied = applied

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def deliver(self, rid, reply, lsn) -> None:
        self.applied.set()

    def track(self, rid, waiter) -> None:
        self.inner.track(rid, waiter)

    def untrack(self, rid) -> None:
        self.inner.untrack(rid)

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name):  # the rest of the ReplySink interface (note_op, streams...)
        return getattr(self.inner, name)


class Swallow:
    """Wraps a Service: the first request of one of ``op_types`` is applied, then its
    reply is held back forever (``applied`` is set): a reply lost in a crash."""

    def __init__(self, service, *op_types) -> None:
        self.service = service
        self.op_types = op_types
        self.applied = trio.Event()
        self.armed = bool(op_types)
        self.durable_gate: trio.Event | None = None  # set: replies wait until it is set

    # Replies are held through wait_durable (the gate): the server then uses a
    # durability task per connection, not the service's durability report.
    add_durable_listener = None

    async def wait_durable(self, lsn):
        if self.durable_gate is not None:
            await self.durable_gate.wait()
        return await self.service.wait_durable(lsn)

    def durable_lsn(self) -> int:
        if self.durable_gate is not None and not self.durable_gate.is_set():
            return -1  # every reply waits for the gate (see wait_durable)
        return self.service.durable_lsn()

    def __getattr__(self, name):
        return getattr(self.service, name)

    def submit(self, session, body, sink, rid):
        if self.armed and isinstance(op_decoder.decode(body), self.op_types):
            self.armed = False
            sink = _SwallowSink(sink, self.applied)
        self.service.submit(session, body, sink, rid)


class Restartable:
    """A Server on a fixed port that can be killed (connections cut, nothing answered)
    and started again; the coordinator behind it lives on."""

    def __init__(self, nursery: trio.Nursery, dispatcher) -> None:
        self.nursery = nursery
        self.dispatcher = dispatcher
        self.port = 0
        self.scope: trio.CancelScope | None = None
        self.stopped: trio.Event | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def start(self) -> "Restartable":
        server = self.server = Server(self.dispatcher, idle_ping_interval=None, drain_wait_grace=0.05)
        scope, stopped = trio.CancelScope(), trio.Event()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            try:
                with scope:
                    await server.serve(None, "127.0.0.1", self.port, task_status=task_status)
            finally:
                stopped.set()

        await self.nursery.start(run)
        self.port, self.scope, self.stopped = server.port, scope, stopped
        return self

    async def kill(self) -> None:
        self.scope.cancel()
        await self.stopped.wait()


@pytest.fixture
async def node():
    async with rallypoint.open_embedded() as ers:
        yield ers


async def serve(nursery, node, *swallow_ops) -> tuple[Restartable, Swallow]:
    sw = Swallow(node.node.service, *swallow_ops)
    return await Restartable(nursery, sw).start(), sw


class Later:
    """A call run in the background: ``await later.get()`` returns its result or raises."""

    def __init__(self, nursery: trio.Nursery, fn) -> None:
        self.done = trio.Event()
        self.value = self.error = None
        nursery.start_soon(self._run, fn)

    async def _run(self, fn) -> None:
        try:
            self.value = await fn()
        except Exception as e:
            self.error = e
        self.done.set()

    async def get(self, timeout: float = 5):
        with trio.fail_after(timeout):
            await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


FAST = Reconnect(timeout=10, initial_delay=0.01, max_delay=0.05)


# --- what may be re-sent --------------------------------------------------------------


def test_reissue_safe_reads_the_resend_rule_of_each_ops_mark():
    # ALWAYS: reads, waits, fenced or idempotent writes; NEVER: creating, arriving,
    # key administration, once.acquire/fail, timer.ack; keyed / predicates: below.
    assert reissue_safe(p.TaskStatus(task_id="t")) and reissue_safe(p.Receive(mailbox="m", scope_id="s"))
    assert reissue_safe(p.DeliveryComplete(task_id="t", token=1)) and reissue_safe(p.ScopeCancel(scope_id="s"))
    for op in (p.ScopeCreate(), p.BarrierArrive(barrier_id="b", key="k"), p.KeyCreate(space="s", permissions=[]),
               p.OnceAcquire(scope_id="s", key="k"), p.OnceFail(scope_id="s", key="k", token=1),
               p.TimerAck(timer_id="t"), p.TimerCreate(scope_id="s", after_ms=1)):
        assert not reissue_safe(op), op
    assert not reissue_safe(p.TaskSubmit(mailbox="m", scope_id="s"))
    assert reissue_safe(p.TaskSubmit(mailbox="m", scope_id="s", key="k"))
    items = [p.SubmitItem(key="a"), p.SubmitItem(key=None)]
    assert not reissue_safe(p.TaskSubmitMany(mailbox="m", scope_id="s", items=items))
    assert reissue_safe(p.TaskSubmitMany(mailbox="m", scope_id="s", items=items[:1]))
    assert not reissue_safe(p.JoinNext(joinset_id="j")) and reissue_safe(p.JoinNext(joinset_id="j", index=3))
    assert reissue_safe(p.JoinNext(joinset_id="j", step=2))
    for t in (p.MessageSend, p.QuotaTake, p.BudgetReserve):
        assert not reissue_safe(msgspec.convert(_minimal(t), t)), t
        assert reissue_safe(msgspec.convert({**_minimal(t), "key": "k"}, t)), t
    assert not reissue_safe(p.ClaimAcquire(scope_id="s", key="k"))
    assert reissue_safe(p.ClaimAcquire(scope_id="s", key="k", request_id="r1"))
    assert not reissue_safe(p.PoolAcquire(pool="p", scope_id="s"))
    assert reissue_safe(p.PoolAcquire(pool="p", scope_id="s", request_id="r1"))
    assert not reissue_safe(b"\x80")  # pre-encoded bodies: unknown, never
    # a named timer or barrier is one per (run, name): its create is safe to re-send
    assert reissue_safe(p.TimerCreate(scope_id="s", after_ms=1, name="n"))
    assert reissue_safe(p.BarrierCreate(scope_id="s", target=2, name="n"))
    assert not reissue_safe(p.BarrierCreate(scope_id="s", target=2))


def test_the_client_decides_re_sends_without_a_coordinator_or_any_kind_module():
    # `import rallypoint` stays cheap, and a re-send decision reads the op facts the
    # client has (rallypoint.opfacts, generated from the marks): no kind module is
    # imported for it, so no coordinator either (issue 43; tests/test_client_imports.py)
    code = (
        "import sys, rallypoint\n"
        "from rallypoint import protocol as p\n"
        "from rallypoint.client.reconnect import reissue_safe\n"
        "assert reissue_safe(p.TaskSubmit(mailbox='m', scope_id='s', key='k'))\n"
        "assert not reissue_safe(p.TaskSubmit(mailbox='m', scope_id='s'))\n"
        "assert 'rallypoint.opfacts' in sys.modules\n"
        "assert not [m for m in sys.modules if m.startswith('rallypoint.actors')], 'a kind module imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _minimal(t) -> dict:
    """Placeholder values for an op's required fields."""
    out = {}
    for f in msgspec.structs.fields(t):
        if f.required:
            out[f.name] = 1 if f.type is int else ([] if "list" in str(f.type) else "x")
    return out


# --- re-sent or not ---------------------------------------------------------------------


async def test_calls_made_while_disconnected_wait_and_go_through(node):
    async with trio.open_nursery() as n:
        srv, _ = await serve(n, node)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            run = await rs.scopes.create()
            await srv.kill()
            later = Later(n, run.status)  # made while the server is down
            await trio.testing.wait_all_tasks_blocked()
            assert not later.done.is_set()
            await srv.start()
            assert (await later.get()).stored_state == "ACTIVE"
            assert rs._transport.reconnects == 1
        n.cancel_scope.cancel()


@pytest.mark.parametrize("key", [None, "same-key"], ids=["no-key", "key"])
async def test_submit_in_flight_is_resent_only_with_a_key(node, key):
    # Given a submit the server applied but whose reply was lost in a crash: with a key
    # it is sent again and returns the same task; without one it raises UNAVAILABLE
    # (maybe applied) and is NOT sent again: either way exactly one task exists.
    async with trio.open_nursery() as n:
        srv, sw = await serve(n, node, p.TaskSubmit)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-submit")
            run = await rs.scopes.create()
            later = Later(n, lambda: mbx.submit({"n": 1}, key=key, scope=run))
            await sw.applied.wait()
            await srv.kill()
            await srv.start()
            with trio.fail_after(5):
                await later.done.wait()
            assert (await run.status()).tasks.get("QUEUED") == 1  # exactly one task
            if key is None:
                e = later.error
                assert e.details == {"op": "task.submit", "maybe_applied": True}
                assert "may or may not have applied" in e.message and "`key`" in e.message
            else:
                ticket = later.value
                assert ticket.info.key == key and ticket.info.state == "QUEUED"
        n.cancel_scope.cancel()


async def test_complete_applied_but_reply_lost_returns_its_result(node):
    # Given a complete the server applied whose reply was lost, when it is sent again it
    # is refused STALE_CLAIM (the task is SUCCEEDED): the SDK recognises its own outcome
    # and returns the task, so the caller sees success, not a lost lease.
    async with trio.open_nursery() as n:
        srv, sw = await serve(n, node, p.DeliveryComplete)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-complete")
            run = await rs.scopes.create()
            ticket = await mbx.submit("x", scope=run)
            d = await mbx.receive(run, wait=0)
            later = Later(n, lambda: d.complete({"ok": 1}))
            await sw.applied.wait()
            await srv.kill()
            await srv.start()
            info = await later.get()
            assert (info.state, info.outcome) == ("SUCCEEDED", {"ok": 1})
            assert d.lost is False
            assert (await ticket.status()).outcome == {"ok": 1}
        n.cancel_scope.cancel()


async def test_complete_many_applied_but_reply_lost_returns_every_result(node):
    # The batch form: a delivery.complete_many applied whose reply was lost is sent again;
    # its items are refused STALE_CLAIM (the tasks are SUCCEEDED), and the SDK answers
    # each with its task, as the first sending would have been.
    async with trio.open_nursery() as n:
        srv, sw = await serve(n, node, p.DeliveryCompleteMany)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-complete-many")
            run = await rs.scopes.create()
            await mbx.submit_many(["a", "b", "c"], scope=run)
            ds = await mbx.receive(run, wait=0, max_messages=3)
            later = Later(n, lambda: mbx.complete_many([(d, d.input.upper()) for d in ds]))
            await sw.applied.wait()
            await srv.kill()
            await srv.start()
            infos = await later.get()
            assert [(i.state, i.outcome) for i in infos] == [("SUCCEEDED", x) for x in "ABC"]
            assert not any(d.lost for d in ds)
        n.cancel_scope.cancel()


async def test_complete_next_applied_but_reply_lost_is_answered_once(node):
    # Complete-and-next (issue 47) whose reply was lost after both halves ran: the
    # re-sent request's settle is refused STALE_CLAIM (the task SUCCEEDED with this
    # outcome); the SDK answers with the task and a fresh receive. Nothing is completed
    # twice, and the delivery the lost reply carried is not handed out again while its
    # lease runs (it stays RUNNING, attempt 1, with the first sending's token).
    async with trio.open_nursery() as n:
        srv, sw = await serve(n, node, p.DeliveryCompleteNext)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-complete-next")
            run = await rs.scopes.create()
            a, b = await mbx.submit_many(["a", "b"], scope=run)
            d = await mbx.receive(run, wait=0)
            later = Later(n, lambda: d.complete_and_next("A", max_messages=5))
            await sw.applied.wait()
            await srv.kill()
            await srv.start()
            nxt = await later.get()
            assert nxt == [] and (nxt.task.state, nxt.task.outcome) == ("SUCCEEDED", "A") and not d.lost
            st = await b.status()
            assert (st.state, st.attempt) == ("RUNNING", 1)
            assert (await a.result(timeout=0)).outcome == "A"
            tasks = node.node.coordinator.queues.tasks
            assert tasks[b.id].token == 1  # leased once (by the lost reply), never twice
        n.cancel_scope.cancel()


async def test_complete_next_parked_in_its_receive_half_across_a_drop(node):
    # The settle half applied (durable), the receive half parked when the connection
    # drops: the request is sent again, its settle reconciled, its receive parks anew
    # and gets the task submitted after the restart.
    async with trio.open_nursery() as n:
        srv, _ = await serve(n, node)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-complete-next-park")
            run = await rs.scopes.create()
            a = await mbx.submit("a", scope=run)
            d = await mbx.receive(run, wait=0)
            later = Later(n, lambda: d.complete_and_next("A", wait=30))
            await trio.testing.wait_all_tasks_blocked()
            assert (await a.result(timeout=0)).outcome == "A"
            await srv.kill()
            await srv.start()
            nxt_task = await mbx.submit("b", scope=run)
            nxt = await later.get()
            assert [x.task_id for x in nxt] == [nxt_task.id] and nxt[0].attempt == 1
            assert nxt.task.outcome == "A" and not d.lost
            assert (await nxt[0].complete("B")).state == "SUCCEEDED"
        n.cancel_scope.cancel()


async def test_complete_refused_for_another_outcome_stays_refused(node):
    # The reconciliation checks the outcome: a re-sent complete whose task SUCCEEDED
    # with a different outcome (not ours) is still STALE_CLAIM.
    from rallypoint.errors import LeaseLostError

    async with trio.open_nursery() as n:
        srv, _ = await serve(n, node)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-other")
            run = await rs.scopes.create()
            await mbx.submit("x", scope=run)
            d = await mbx.receive(run, wait=0)
            await d.complete("theirs")
            tr = rs._transport
            e = LeaseLostError("lost", details={"state": "SUCCEEDED", "task_id": d.task_id})
            op = p.DeliveryComplete(task_id=d.task_id, token=d.token, outcome=msgspec.Raw(msgspec.msgpack.encode("ours")))
            assert await reconnect_mod._reconcile(tr._conn, op, e) is None
        n.cancel_scope.cancel()


async def test_run_complete_applied_but_reply_lost_returns_completed(node):
    async with trio.open_nursery() as n:
        srv, sw = await serve(n, node, p.ScopeComplete)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            run = await rs.scopes.create()
            later = Later(n, run.complete)
            await sw.applied.wait()
            await srv.kill()
            await srv.start()
            assert (await later.get()).stored_state == "COMPLETED"
        n.cancel_scope.cancel()


async def test_parked_receive_is_reissued_and_a_lease_survives_the_drop(node):
    # Given a held delivery and a receive parked on the server, when the server is
    # killed and restarted, then the receive is re-issued (and gets the task submitted
    # after the restart) and the held delivery renews and completes with its token.
    async with trio.open_nursery() as n:
        srv, _ = await serve(n, node)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-recv")
            run = await rs.scopes.create()
            await mbx.submit("held", scope=run)
            held = await mbx.receive(run, wait=0)
            later = Later(n, lambda: mbx.receive(run, wait=30))
            await trio.testing.wait_all_tasks_blocked()
            await srv.kill()
            await srv.start()
            await held.renew()  # the lease is still ours
            nxt = await mbx.submit("next", scope=run)
            got = await later.get()
            assert got.task_id == nxt.id and got.attempt == 1
            assert (await held.complete("done")).state == "SUCCEEDED"
        n.cancel_scope.cancel()


async def test_a_draining_server_still_answers_what_it_finishes(node):
    # Given a receive parked and a run create waiting for its durable reply when the
    # server drains (SIGTERM): the receive is answered UNAVAILABLE and re-sent later,
    # and the client does not cut the connection on that answer, so the create's reply
    # still arrives (a create is never re-sent: cutting early would turn its success
    # into "maybe applied").
    async with trio.open_nursery() as n:
        srv, sw = await serve(n, node)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-drain")
            run = await rs.scopes.create()
            receive = Later(n, lambda: mbx.receive(run, wait=30))
            await trio.testing.wait_all_tasks_blocked()
            sw.durable_gate = trio.Event()
            create = Later(n, lambda: rs.scopes.create(name="during-drain"))
            await trio.testing.wait_all_tasks_blocked()
            assert srv.server.statistics()["inflight"] == 2
            n.start_soon(srv.server.drain)
            with trio.fail_after(5):  # the drain's grace for long waits (0.05 s) ends the receive
                while srv.server.statistics()["inflight"] != 1:
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()  # the client has read that answer
            assert not create.done.is_set() and not receive.done.is_set()
            sw.durable_gate.set()
            created = await create.get()  # answered, not "maybe applied"
            await srv.stopped.wait()
            await srv.start()
            assert (await created.status()).name == "during-drain"
            ticket = await mbx.submit("after", scope=run)
            assert (await receive.get()).task_id == ticket.id
        n.cancel_scope.cancel()


@pytest.mark.parametrize("handle", ["created", "by_id"])
async def test_join_next_consumed_but_reply_lost(node, handle):
    # Given join_next consumed a record on the server and the reply was lost: a handle
    # that knows which index it expected re-reads that record (nothing is skipped);
    # one that does not (by_id, never read) raises UNAVAILABLE, maybe applied.
    async with trio.open_nursery() as n:
        srv, sw = await serve(n, node, p.JoinNext)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-js")
            run = await rs.scopes.create()
            js = await run.join_sets.create()
            child = await js.submit(mbx, "a")
            js2 = await js.submit(mbx, "b")
            if handle == "by_id":
                js = run.join_sets.by_id(js.id)
            later = Later(n, js.join_next)
            await trio.testing.wait_all_tasks_blocked()
            d = await mbx.receive(run, wait=0)
            assert d.task_id == child
            await d.complete("A")
            await sw.applied.wait()
            await srv.kill()
            await srv.start()
            with trio.fail_after(5):
                await later.done.wait()
            assert (await js.status()).consumed == 1
            if handle == "created":
                assert later.value == (child, "A")
                d2 = await mbx.receive(run, wait=0)
                await d2.complete("B")
                assert await js.join_next(timeout=5) == (js2, "B")  # and the next one is next
            else:
                assert later.error.details == {"op": "joinset.join_next", "maybe_applied": True}
                assert await js.join_next(index=0) == (child, "A")  # re-read it
        n.cancel_scope.cancel()


async def test_consume_keeps_going_across_repeated_drops(node):
    # Three times: two handlers running and one receive parked on the server when the
    # server is killed; the work is finished on the restarted one, every task once.
    async with trio.open_nursery() as n:
        srv, _ = await serve(n, node)
        async with rallypoint.connect(srv.url, reconnect=FAST) as rs:
            mbx = await rs.mailboxes.ensure("rc-consume")
            run = await rs.scopes.create()
            gate = trio.Semaphore(0)

            async def handler(d):
                await gate.acquire()
                return -d.input

            worker = Later(n, lambda: rallypoint.consume(rs, mbx, run, handler, concurrency=3))
            tickets = []
            for wave in range(3):
                tickets += await mbx.submit_many([2 * wave, 2 * wave + 1], scope=run)
                await trio.testing.wait_all_tasks_blocked()
                await srv.kill()
                await srv.start()
                gate.release()
                gate.release()
            with trio.fail_after(10):
                infos = await rs.results(tickets)
            await run.cancel()
            s = await worker.get()
            assert rs._transport.reconnects == 3
        n.cancel_scope.cancel()
    assert [(i.state, i.outcome, i.attempt) for i in infos] == [("SUCCEEDED", -k, 1) for k in range(6)]
    assert (s.received, s.completed, s.lost) == (6, 6, 0)


# --- errors, and giving up ----------------------------------------------------------------


async def test_errors_in_the_block_and_from_calls_are_not_wrapped(node):
    async with trio.open_nursery() as n:
        srv, _ = await serve(n, node)
        with pytest.raises(KeyError):
            async with rallypoint.connect(srv.url):
                raise KeyError("mine")
        with pytest.raises(NotFoundError):
            async with rallypoint.connect(srv.url) as rs:
                await rs.mailboxes.get("no-such-mailbox")
        n.cancel_scope.cancel()


class FakeConn:
    """Just enough of a Connection for the supervisor: drop() closes it."""

    server_info = None

    def __init__(self) -> None:
        self._closed = None
        self._ev = trio.Event()
        self.calls = 0

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def close_reason(self):
        return self._closed

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def wait_closed(self):
        await self._ev.wait()

    def drop(self, reason="dropped") -> None:
        self._closed = reason
        self._ev.set()

    async def aclose(self):
        self.drop("closed by the client")

    async def call(self, op):
        if self.closed:
            raise UnavailableError("closed")
        self.calls += 1
        await trio.lowlevel.checkpoint()
        return msgspec.Raw(b"\xc0")


async def test_backoff_doubles_up_to_the_cap_then_gives_up(autojump_clock):
    first, attempts = FakeConn(), []

    async def opener(timeout):
        attempts.append(trio.current_time())
        raise UnavailableError("refused")

    pol = Reconnect(timeout=10, initial_delay=0.5, max_delay=2, jitter=0)
    async with ReconnectingTransport("tcp://x:1", first, opener, pol) as tr:
        await tr.call(p.ServerStatus())
        t0 = trio.current_time()
        first.drop()
        with pytest.raises(UnavailableError) as ei:
            await tr.call(p.ServerStatus())
        assert trio.current_time() - t0 == pytest.approx(10)
    gaps = [round(b - a, 6) for a, b in zip(attempts, attempts[1:])]
    assert attempts[0] == pytest.approx(t0)  # the first attempt is immediate
    assert gaps[:4] == [0.5, 1.0, 2.0, 2.0]
    # at 0, .5, 1.5, 3.5, 5.5, 7.5, 9.5 and a last one at the deadline (10)
    assert all(g <= 2.0 for g in gaps) and len(attempts) == 8 and attempts[-1] == pytest.approx(t0 + 10)
    assert "could not be re-established within 10 s (8 attempts; last: refused)" in ei.value.message


async def test_jitter_keeps_delays_within_bounds(autojump_clock):
    first, attempts = FakeConn(), []
    second = FakeConn()

    async def opener(timeout):
        attempts.append(trio.current_time())
        if len(attempts) < 6:
            raise UnavailableError("refused")
        return second

    pol = Reconnect(timeout=60, initial_delay=1, max_delay=4, jitter=0.5)
    async with ReconnectingTransport("tcp://x:1", first, opener, pol) as tr:
        first.drop()
        await tr.call(p.ServerStatus())  # waits for the reconnection
        assert second.calls == 1
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    for g, nominal in zip(gaps, [1, 2, 4, 4, 4]):
        assert nominal * 0.5 - 1e-9 <= g <= nominal + 1e-9


async def test_a_refused_reconnection_raises_that_error(autojump_clock):
    first = FakeConn()

    async def opener(timeout):
        raise UnauthenticatedError("unknown API key")

    async with ReconnectingTransport("tcp://x:1", first, opener, Reconnect()) as tr:
        first.drop()
        with pytest.raises(UnauthenticatedError):
            await tr.call(p.ServerStatus())
        with pytest.raises(UnauthenticatedError):  # and later calls, at once
            await tr.call(p.ServerStatus())


def test_reconnect_policy_is_validated():
    with pytest.raises(ValidationError):
        Reconnect(timeout=-1)
    with pytest.raises(ValidationError):
        Reconnect(jitter=2)
