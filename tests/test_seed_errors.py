"""Seed conformance of the error classes (issue 34 item 8): every error class the seeds
(``/work/shared/seeds/``) promise for an outcome is the class raised -- embedded and over
TCP -- and ``except <the seed's class>`` catches it. The seed's barrier ``wait()``
"throws ConflictError with BARRIER_CANCELLED": BarrierCancelledError (and, the same
case for timers, TimerCancelledError) keep their own class and code under ConflictError."""

from __future__ import annotations

import pytest

from rallypoint.errors import (
    BarrierCancelledError,
    BarrierError,
    BarrierReleasedError,
    ConflictError,
    JoinSetExhaustedError,
    LimitError,
    NotFoundError,
    ScopeCancelledError,
    TimerCancelledError,
    ValidationError,
    error_from_wire,
)


def test_cancelled_barrier_and_timer_errors_are_conflict_errors_with_their_own_codes():
    for cls, code in ((BarrierCancelledError, "BARRIER_CANCELLED"), (TimerCancelledError, "TIMER_CANCELLED")):
        e = error_from_wire(code, "m")
        assert type(e) is cls and e.code == code
        assert isinstance(e, ConflictError)
    assert isinstance(error_from_wire("BARRIER_CANCELLED", "m"), BarrierError)  # SPEC §1: a BarrierError too
    assert not isinstance(error_from_wire("BARRIER_RELEASED", "m"), ConflictError)  # the seed promises no more


async def _raises(cls, coro, code: str | None = None):
    """``except cls`` catches what ``coro`` raises (and the code is ``code``)."""
    try:
        await coro
    except cls as e:
        if code is not None:
            assert e.code == code, e
        return e
    raise AssertionError(f"no {cls.__name__} raised")


async def test_the_seeds_error_classes(rs):
    mbx = await rs.mailboxes.ensure("seed-errors")
    run = await rs.scopes.create()
    # "The queue named in mailbox must exist before you create the group (NotFoundError otherwise)."
    await _raises(NotFoundError, run.groups.create("seed-errors-missing", "FIRST_ACCEPTED"))
    # "After the group is closed, submitting a new member fails with ConflictError."
    g = await run.groups.create(mbx, "N_ACCEPTED", threshold=2)
    await g.close()
    await _raises(ConflictError, g.submit({"late": 1}), "CONFLICT")
    # expected_members below threshold; "A group holds at most 100 members" (SPEC §1: LimitError)
    await _raises(ValidationError, run.groups.create(mbx, "N_ACCEPTED", threshold=3, expected_members=2))
    big = await run.groups.create(mbx, "ALL_TERMINAL")
    for i in range(100):
        await big.submit(i)
    await _raises(LimitError, big.submit(100))
    # "cancelling a completed run returns a conflict"
    done = await rs.scopes.create()
    await done.complete()
    await _raises(ConflictError, done.cancel())
    # cancelled run: new work is refused with SCOPE_CANCELLED (ScopeCancelledError);
    # a barrier's wait "throws ConflictError with BARRIER_CANCELLED"; a timer's likewise
    gone = await rs.scopes.create()
    bar = await gone.barriers.create(target=2)
    tmr = await gone.timers.create(after_seconds=3600)
    await gone.cancel()
    await _raises(ScopeCancelledError, mbx.submit(1, scope=gone))
    e = await _raises(ConflictError, bar.wait(timeout=5), "BARRIER_CANCELLED")
    assert isinstance(e, BarrierCancelledError)
    e = await _raises(ConflictError, tmr.wait(timeout=5), "TIMER_CANCELLED")
    assert isinstance(e, TimerCancelledError)
    # "Arriving after release returns BARRIER_RELEASED."
    live = await rs.scopes.create()
    once = await live.barriers.create(target=1)
    await once.arrive("a")
    await _raises(BarrierReleasedError, once.arrive("b"), "BARRIER_RELEASED")
    # "Awaiting more times than there are submissions throws JoinSetExhaustedError."
    js = await live.join_sets.create()
    await _raises(JoinSetExhaustedError, js.join_next(timeout=5))


@pytest.mark.parametrize("which", ["barrier", "timer"])
async def test_except_conflict_error_catches_a_cancelled_wait_with_the_blocking_client(daemon, which):
    import trio

    import rallypoint.sync as rps

    def blocking() -> str:
        with rps.connect(daemon.url) as rs:
            run = rs.scopes.create()
            h = run.barriers.create(target=2) if which == "barrier" else run.timers.create(after_seconds=3600)
            run.cancel()
            try:
                h.wait(timeout=5)
            except ConflictError as e:
                return e.code
            return "not raised"

    assert await trio.to_thread.run_sync(blocking) == f"{which.upper()}_CANCELLED"
