"""consume(): what happens to a delivery, and what the statistics say about it.

Issue 12, items 3, 4 and 6: an outcome that cannot be encoded is a retry (not a crash);
consume() raises the documented exception itself (not an ExceptionGroup); handlers
cancelled because the run stopped are counted lost and their deliveries marked lost; a
retry the server ignored is not counted as a retry.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

import rallypoint
from rallypoint import ConsumeStats
from rallypoint.errors import NotFoundError, ValidationError
from rallypoint.wire import MAX_PAYLOAD_BYTES


def check_accounting(stats: ConsumeStats) -> None:
    """Every received delivery ended exactly one way."""
    assert stats.received == stats.completed + stats.retried + stats.released + stats.lost, stats


# --- item 3: an outcome that cannot be encoded -------------------------------------------


@pytest.mark.parametrize(
    "bad, expect",
    [
        (lambda: {"when": object()}, "not msgpack-able"),
        (lambda: "x" * (MAX_PAYLOAD_BYTES + 10), "exceeds 65536 bytes"),
    ],
    ids=["not-encodable", "too-large"],
)
async def test_unencodable_outcome_is_a_retry_with_the_encoding_error(autojump_clock, ers, bad, expect):
    # Given a handler whose result for one task cannot be recorded (not msgpack-able, or
    # over the 64 KiB payload limit), when consume() serves it, then each attempt is a
    # retry carrying the encoding error, the task ends FAILED (max_attempts) with that
    # error, and consume() goes on serving the other tasks.
    m = await ers.mailboxes.ensure("o-bad", max_attempts=2)
    run = await ers.scopes.create()
    poison = await m.submit("poison", scope=run)
    fine = await m.submit("fine", scope=run)

    async def handler(d):
        return bad() if d.input == "poison" else "ok"

    result = {}

    async def worker():
        result["stats"] = await rallypoint.consume(ers, m, run, handler)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        res = await poison.result(timeout=60)
        assert (await fine.result(timeout=60)).outcome == "ok"
        await run.cancel()
    assert (res.state, res.outcome_reason, res.attempt) == ("FAILED", "max_attempts", 2)
    assert isinstance(res.error, str) and "could not be encoded" in res.error and expect in res.error
    s = result["stats"]
    assert (s.received, s.completed, s.retried, s.failed, s.lost) == (3, 1, 2, 1, 0)
    check_accounting(s)


# --- item 4: errors are raised as themselves ---------------------------------------------


async def test_consume_on_a_missing_mailbox_raises_not_found_itself(rs):
    run = await rs.scopes.create()

    async def handler(d):
        return None

    with trio.fail_after(10):
        with pytest.raises(NotFoundError) as ei:
            await rallypoint.consume(rs, "no-such-mailbox-typo", run, handler, wait=1)
    assert type(ei.value) is NotFoundError and "no-such-mailbox-typo" in ei.value.message
    with pytest.raises(NotFoundError):
        await rallypoint.consume(rs, "mbx-x", "scp_00000000000000000000000000", handler, wait=1)
    await run.cancel()


async def test_consume_bad_arguments_are_validation_errors(ers, autojump_clock):
    run = await ers.scopes.create()

    async def handler(d):
        return None

    with pytest.raises(ValidationError):
        await rallypoint.consume(ers, "any", run, handler, concurrency=0)
    with pytest.raises(ValidationError):
        await rallypoint.consume(ers, "any", run, handler, lease_seconds=-1)


# --- item 6: statistics count what actually happened ----------------------------------------


async def test_group_finalizing_counts_cancelled_handlers_as_lost(autojump_clock, ers):
    # Given a FIRST_ACCEPTED group whose three members are being handled at once, when
    # the first finishes and is accepted (the group finalizes, its gate run is
    # cancelled), then consume() cancels the two handlers still running, counts them
    # lost, marks their deliveries lost, and returns.
    m = await ers.mailboxes.ensure("o-group")
    run = await ers.scopes.create()
    group = await run.groups.create(m, "FIRST_ACCEPTED")
    tickets = [await group.submit(i, key=f"k{i}") for i in range(3)]
    await group.close()
    deliveries, cancelled = {}, []

    async def handler(d):
        deliveries[d.input] = d
        if d.input == 0:
            return "first"
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(d.input)
            raise

    result, returned = {}, trio.Event()

    async def worker():
        result["stats"] = await rallypoint.consume(ers, m, group.scope_id, handler, concurrency=3, lease_seconds=60)
        returned.set()

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        assert (await tickets[0].result(timeout=10)).outcome == "first"
        await trio.testing.wait_all_tasks_blocked()
        await group.accept(tickets[0])
        with trio.fail_after(1):  # well within a renewal period (20 s): not found by a renewal
            await returned.wait()
    s = result["stats"]
    assert sorted(cancelled) == [1, 2]
    assert (s.received, s.completed, s.retried, s.lost, s.stop_reason) == (3, 1, 0, 2, "SCOPE_CANCELLED")
    assert [deliveries[i].lost for i in range(3)] == [False, True, True]
    check_accounting(s)


async def test_retry_the_server_ignored_is_lost_not_retried(autojump_clock, ers):
    # Given a handler that fails after its task was cancelled (the server answers the
    # retry without changing anything), then the delivery is counted lost, not retried.
    m = await ers.mailboxes.ensure("o-ignored")
    run = await ers.scopes.create()
    ticket = await m.submit("x", scope=run)
    started, proceed, seen = trio.Event(), trio.Event(), {}

    async def handler(d):
        seen["d"] = d
        started.set()
        with trio.CancelScope(shield=True):  # the renewer must not cancel us first
            await proceed.wait()
        raise RuntimeError("too late")

    result = {}

    async def worker():
        result["stats"] = await rallypoint.consume(ers, m, run, handler, lease_seconds=60)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        await started.wait()
        assert (await ticket.cancel()).state == "CANCELLED"
        proceed.set()
        await trio.testing.wait_all_tasks_blocked()
        await run.cancel()
    s = result["stats"]
    assert (s.received, s.completed, s.retried, s.lost) == (1, 0, 0, 1)
    assert seen["d"].lost is True
    assert (await ticket.status()).error is None  # the retry changed nothing
    check_accounting(s)


async def test_stats_when_the_run_is_cancelled_under_busy_handlers(autojump_clock, ers):
    # Given four handlers busy and tasks still queued, when the run is cancelled, then
    # every received delivery is accounted for exactly once.
    m = await ers.mailboxes.ensure("o-busy")
    run = await ers.scopes.create()
    await m.submit_many(range(10), scope=run)
    done = []

    async def handler(d):
        if d.input < 3:
            done.append(d.input)
            return d.input
        await trio.sleep_forever()

    result = {}

    async def worker():
        result["stats"] = await rallypoint.consume(ers, m, run, handler, concurrency=4, lease_seconds=60)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        await trio.testing.wait_all_tasks_blocked()
        await run.cancel()
    s = result["stats"]
    assert sorted(done) == [0, 1, 2]
    assert (s.received, s.completed, s.lost) == (7, 3, 4)
    check_accounting(s)


# --- issue 31 item 6: a handler that raises is logged --------------------------------------


async def test_each_retried_delivery_logs_one_warning_with_the_error_and_debug_traceback(autojump_clock, ers, caplog):
    # Given a handler that always raises on a task allowed 3 attempts, when consume()
    # serves it, then every handed-back delivery logs exactly one WARNING on
    # rallypoint.consume naming the task, the attempt and "Type: message" (the last one
    # saying the task is FAILED), and the handler's traceback at DEBUG (not in the WARNING).
    import logging

    caplog.set_level(logging.DEBUG, logger="rallypoint.consume")
    m = await ers.mailboxes.ensure("o-log", max_attempts=3)
    run = await ers.scopes.create()
    task = await m.submit("boom", scope=run)

    async def handler(d):
        raise KeyError(f"no such page {d.input}")

    async with trio.open_nursery() as n:
        n.start_soon(rallypoint.consume, ers, m, run, handler)
        assert (await task.result(timeout=60)).state == "FAILED"
        await run.cancel()
    mine = [r for r in caplog.records if r.name == "rallypoint.consume"]
    warnings = [r for r in mine if r.levelno == logging.WARNING]
    assert len(warnings) == 3, [r.getMessage() for r in mine]
    for attempt, r in enumerate(warnings, 1):
        text = r.getMessage()
        assert task.id in text and f"attempt {attempt}" in text and "KeyError: 'no such page boom'" in text, text
        assert r.exc_info is None
    assert "attempt 2 next" in warnings[0].getMessage()
    assert "FAILED" in warnings[2].getMessage() and "last attempt" in warnings[2].getMessage()
    tracebacks = [r for r in mine if r.levelno == logging.DEBUG and r.exc_info]
    assert len(tracebacks) == 3 and all(r.exc_info[0] is KeyError for r in tracebacks)
    assert "raise KeyError" in caplog.text  # the traceback's source line, at DEBUG
