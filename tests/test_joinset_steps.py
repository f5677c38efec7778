"""Issue 13, item 3 and typed await-next: every answer of ``join_next`` /
``join_next_try`` is a journaled *step* of its set (found, pending, exhausted, a typed
mismatch, a record handed to a waiter by a close), and a replaying client that asks step
``s`` gets what the journal holds there -- or NONDETERMINISM_DETECTED naming the step and
both answers when it asks for another operation. Typed ``join_next(mailbox=, type=)``
(reference obelisk-join-sets.md §3.7): a record of another mailbox or a delay is still
consumed and answered FUNCTION_MISMATCH naming both."""

from __future__ import annotations

import msgspec
import pytest
import trio

import rallypoint.sync
from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.client.reconnect import reissue_safe
from rallypoint.errors import (
    FunctionMismatchError,
    JoinSetExhaustedError,
    NondeterminismError,
    NotFoundError,
    ValidationError,
)

from _joinset_util import child_error, take, uniq, until
from conftest import Daemon


class Page(msgspec.Struct):
    url: str
    size: int


# ---------------------------------------------------------------- probes are steps


async def test_every_probe_answer_is_a_journaled_step_and_replays_as_it_was(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("steps"))
    js = await run.join_sets.create("probe")
    a = await js.submit(mbx, "a")
    assert (await js.status()).steps == 0
    assert await js.join_next_try() is None  # step 0: pending
    assert js.next_step == 1
    (d,) = await take(mbx, run, 1)
    await d.complete("A")
    assert await js.join_next_try() == (a, "A")  # step 1: found
    with pytest.raises(JoinSetExhaustedError) as ei:
        await js.join_next_try()  # step 2: exhausted
    assert ei.value.details["step"] == 2
    st = await js.status()
    assert (st.steps, st.consumed) == (3, 1)
    # a client replaying its first execution: the same answers at the same steps,
    # although record 0 exists now (step 0 stays "pending")
    again = await run.join_sets.by_name("probe", replay=True)
    assert await again.join_next_try() is None
    assert await again.join_next_try() == (a, "A")
    with pytest.raises(JoinSetExhaustedError):
        await again.join_next_try()
    assert (await js.status()).steps == 3  # replayed answers add nothing
    with pytest.raises(JoinSetExhaustedError):
        await again.join_next_try()  # step 3: past the log, a live probe
    assert (await js.status()).steps == 4


async def test_the_raw_reply_carries_the_step_and_whether_it_was_replayed(rs):
    run = await rs.scopes.create()
    js = await run.join_sets.create()
    await js.submit_delay(3600)
    live = await rs._call(p.JoinNext(joinset_id=js.id, try_only=True), t._JoinNextReply)
    assert (live.status, live.step, live.replayed) == ("pending", 0, False)
    again = await rs._call(p.JoinNext(joinset_id=js.id, try_only=True, step=0), t._JoinNextReply)
    assert (again.status, again.step, again.replayed) == ("pending", 0, True)
    waited = await rs._call(p.JoinNext(joinset_id=js.id, wait_ms=10), t._JoinNextReply)
    assert (waited.status, waited.step) == ("pending", None)  # a wait that ran out is no step
    assert (await js.status()).steps == 1


async def test_a_replay_that_asks_another_operation_is_a_determinism_error(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("steps"))
    js = await run.join_sets.create()
    a = await js.submit(mbx, "a")
    assert await js.join_next_try() is None  # step 0: the probe answered pending
    (d,) = await take(mbx, run, 1)
    await d.complete("A")
    with pytest.raises(NondeterminismError) as ei:
        await js.join_next(step=0)  # the replay awaits where the first execution probed
    e = ei.value
    assert e.code == "NONDETERMINISM_DETECTED"
    assert e.details["step"] == 0 and e.details["joinset_id"] == js.id
    assert e.details["logged"] == {"op": "join_next_try", "outcome": "pending", "index": 0}
    assert e.details["asked"]["op"] == "join_next"
    assert e.details["asked"]["now"] == {"outcome": "record", "index": 0, "child_id": a, "ok": True}
    for word in ("step 0", "join_next_try", "pending", "join_next", a):
        assert word in e.message
    assert (await js.status()).consumed == 0  # the refused replay consumed nothing
    assert await js.join_next(step=1, timeout=5) == (a, "A")  # step 1 is live: consumes


async def test_typed_and_untyped_at_one_step_are_different_operations(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("steps"))
    js = await run.join_sets.create()
    a = await js.submit(mbx, {"url": "/", "size": 1})
    (d,) = await take(mbx, run, 1)
    await d.complete({"url": "/", "size": 1})
    assert await js.join_next(timeout=5, mailbox=mbx) == (a, {"url": "/", "size": 1})
    with pytest.raises(NondeterminismError) as ei:
        await js.join_next(step=0)
    assert ei.value.details["logged"]["mailbox"] == mbx.name
    assert await js.join_next(step=0, mailbox=mbx.name, type=Page) == (a, Page("/", 1))


async def test_steps_never_skip_ahead_and_exclude_index(rs):
    run = await rs.scopes.create()
    js = await run.join_sets.create()
    await js.submit_delay(3600)
    with pytest.raises(ValidationError) as ei:
        await js.join_next_try(step=1)
    assert "step" in ei.value.message
    with pytest.raises(ValidationError):
        await js.join_next(step=-1)
    with pytest.raises(ValidationError):
        await rs._call(p.JoinNext(joinset_id=js.id, step=0, index=0), t._JoinNextReply)
    assert (await js.status()).steps == 0


async def test_an_exhausted_await_is_a_step_and_replays_exhausted(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("steps"))
    js = await run.join_sets.create()
    with pytest.raises(JoinSetExhaustedError) as ei:
        await js.join_next()  # step 0: nothing submitted yet
    assert ei.value.details["step"] == 0
    a = await js.submit(mbx, "a")
    (d,) = await take(mbx, run, 1)
    await d.complete("A")
    replay = run.join_sets.by_id(js.id, replay=True)
    with pytest.raises(JoinSetExhaustedError):
        await replay.join_next()  # the log says exhausted at step 0, whatever exists now
    assert await replay.join_next(timeout=5) == (a, "A")  # step 1: live
    assert (await js.status()).steps == 2


async def test_rereads_by_index_are_not_steps(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("steps"))
    js = await run.join_sets.create()
    a = await js.submit(mbx, "a")
    (d,) = await take(mbx, run, 1)
    await d.complete("A")
    assert await js.join_next(timeout=5) == (a, "A")
    for _ in range(3):
        assert await js.join_next(index=0) == (a, "A")
    assert (await js.status()).steps == 1


async def test_the_record_a_close_hands_to_a_parked_consumer_is_its_step(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("steps"))
    js = await run.join_sets.create()
    a = await js.submit(mbx, "a")
    got = []
    before = (await rs.status()).actors.get("joinsets", {}).get("waiters", 0)
    async with trio.open_nursery() as n:

        async def consumer():
            got.append(await child_error(js.join_next(timeout=30)))

        n.start_soon(consumer)

        async def parked():
            return (await rs.status()).actors.get("joinsets", {}).get("waiters", 0) > before

        await until(parked, "parked")
        await run.cancel()
    assert got[0].child_id == a and got[0].details["step"] == 0
    assert (await js.status()).steps == 1
    e = await child_error(run.join_sets.by_id(js.id, replay=True).join_next())
    assert (e.child_id, e.failure_kind, e.details["closing"]) == (a, "cancelled", True)


def test_a_probe_reissued_after_a_dropped_connection_is_positional():
    assert reissue_safe(p.JoinNext(joinset_id="j", try_only=True, step=4))
    assert reissue_safe(p.JoinNext(joinset_id="j", step=0))
    assert not reissue_safe(p.JoinNext(joinset_id="j", try_only=True))


def test_sigkill_between_two_probes(tmp_path):
    """Probe (pending), the child finishes, SIGKILL; after the restart a replaying client
    gets "pending" at step 0 -- as in its first execution -- and the record at step 1."""
    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        with rallypoint.sync.connect(d.url) as rs:
            run = rs.scopes.create()
            mbx = rs.mailboxes.ensure("probe-restart")
            js = run.join_sets.create("p")
            a = js.submit(mbx, "a")
            assert js.join_next_try() is None
            mbx.receive(run, wait=5).complete("A")
            run_id = run.id
        d.kill()
        d = Daemon(data, "fsync").start()
        with rallypoint.sync.connect(d.url) as rs:
            js = rs.scope(run_id).join_sets.by_name("p", replay=True)
            assert js.status().steps == 1
            assert js.join_next_try() is None  # replayed: what the first execution saw
            assert js.join_next_try() == (a, "A")  # live
            with pytest.raises(NondeterminismError):
                js.join_next(step=0)
        d.kill()
        d = Daemon(data, "fsync").start()
        with rallypoint.sync.connect(d.url) as rs:
            js = rs.scope(run_id).join_sets.by_name("p", replay=True)
            assert js.join_next_try() is None
            assert js.join_next_try() == (a, "A")
            with pytest.raises(JoinSetExhaustedError):
                js.join_next()
            assert js.status().steps == 3
    finally:
        d.kill()


# ---------------------------------------------------------------- typed await-next


async def test_typed_join_next_decodes_a_homogeneous_set(rs):
    run = await rs.scopes.create()
    pages = await rs.mailboxes.ensure(uniq("pages"))
    js = await run.join_sets.create()
    ids = [await js.submit(pages, {"url": f"/{i}", "size": i}) for i in range(3)]
    for d in reversed(await take(pages, run, 3)):
        await d.complete({"url": d.input["url"], "size": d.input["size"]})
    got = [await js.join_next(timeout=5, mailbox=pages, type=Page) for _ in range(3)]
    assert got == [(ids[2], Page("/2", 2)), (ids[1], Page("/1", 1)), (ids[0], Page("/0", 0))]
    assert all(isinstance(v, Page) for _, v in got)


async def test_typed_join_next_consumes_a_delay_and_answers_function_mismatch(rs):
    run = await rs.scopes.create()
    pages = await rs.mailboxes.ensure(uniq("pages"))
    js = await run.join_sets.create()
    dly = await js.submit_delay(0)
    a = await js.submit(pages, {"url": "/", "size": 3})
    with pytest.raises(FunctionMismatchError) as ei:
        await js.join_next(timeout=5, mailbox=pages, type=Page)
    e = ei.value
    assert e.code == "FUNCTION_MISMATCH"
    assert e.details["expected"] == pages.name and e.details["actual"] is None
    assert (e.details["actual_kind"], e.details["child_id"], e.details["index"]) == ("delay", dly, 0)
    assert pages.name in e.message and dly in e.message and "delay" in e.message
    assert (await js.status()).consumed == 1  # still consumed
    (d,) = await take(pages, run, 1)
    await d.complete({"url": "/", "size": 3})
    assert await js.join_next(timeout=5, mailbox=pages, type=Page) == (a, Page("/", 3))
    with pytest.raises(FunctionMismatchError):  # a re-read answers the same
        await js.join_next(index=0, mailbox=pages)


async def test_typed_join_next_names_both_mailboxes(rs):
    run = await rs.scopes.create()
    pages = await rs.mailboxes.ensure(uniq("pages"))
    images = await rs.mailboxes.ensure(uniq("images"))
    js = await run.join_sets.create()
    img = await js.submit(images, "i")
    (d,) = await take(images, run, 1)
    await d.complete("I")
    with pytest.raises(FunctionMismatchError) as ei:
        await js.join_next_try(mailbox=pages)
    e = ei.value
    assert (e.details["expected"], e.details["actual"], e.details["child_id"]) == (pages.name, images.name, img)
    assert pages.name in e.message and images.name in e.message
    replay = run.join_sets.by_id(js.id, replay=True)
    with pytest.raises(FunctionMismatchError):
        await replay.join_next_try(mailbox=pages.name)  # the mismatch replays too
    with pytest.raises(JoinSetExhaustedError):
        await js.join_next()


async def test_typed_join_next_of_a_failed_child_raises_child_error(rs):
    run = await rs.scopes.create()
    pages = await rs.mailboxes.ensure(uniq("pages"))
    js = await run.join_sets.create()
    a = await js.submit(pages, 1)
    (d,) = await take(pages, run, 1)
    await d.reject("404")
    e = await child_error(js.join_next(timeout=5, mailbox=pages, type=Page))
    assert (e.child_id, e.value, e.failure_kind) == (a, "404", "failed")


async def test_typed_join_next_with_an_unknown_mailbox_consumes_nothing(rs):
    run = await rs.scopes.create()
    pages = await rs.mailboxes.ensure(uniq("pages"))
    js = await run.join_sets.create()
    await js.submit(pages, 1)
    with pytest.raises(NotFoundError):
        await js.join_next_try(mailbox=uniq("no-such"))
    assert (await js.status()).steps == 0


async def test_a_result_that_does_not_decode_into_the_type_is_consumed_and_says_so(rs):
    run = await rs.scopes.create()
    pages = await rs.mailboxes.ensure(uniq("pages"))
    js = await run.join_sets.create()
    a = await js.submit(pages, 1)
    (d,) = await take(pages, run, 1)
    await d.complete({"url": 5})
    with pytest.raises(ValidationError) as ei:
        await js.join_next(timeout=5, mailbox=pages, type=Page)
    assert ei.value.details["child_id"] == a and ei.value.details["index"] == 0
    assert "Page" in ei.value.message and "consumed" in ei.value.message
    assert await js.join_next(index=0) == (a, {"url": 5})
