"""Errors cross the wire and come back as the same class (SPEC §1).

Every code in ``errors.CODES`` maps to its class, survives a real TCP round trip with
its message, retry_after and details, and the coordinator's own refusals arrive as the
same classes embedded and over TCP (the ``rs`` fixture runs both).
"""

from datetime import datetime, timedelta, timezone

import msgspec
import pytest
import trio

import rallypoint
from rallypoint import errors
from rallypoint.errors import (
    CODES,
    ConflictError,
    DeadlineExceededError,
    LeaseLostError,
    LimitError,
    NotFoundError,
    RallypointError,
    ScopeCancelledError,
    ValidationError,
    error_from_wire,
)
from rallypoint.transport.connection import connect_transport
from rallypoint.transport.testing import running_server
from rallypoint import wire

# SPEC §1's table, written out independently of errors._BY_CODE.
SPEC_TABLE = {
    "VALIDATION_FAILED": errors.ValidationError,
    "NOT_FOUND": errors.NotFoundError,
    "CONFLICT": errors.ConflictError,
    "SCOPE_CANCELLED": errors.ScopeCancelledError,
    "DEADLINE_EXCEEDED": errors.DeadlineExceededError,
    "STALE_CLAIM": errors.LeaseLostError,
    "BARRIER_RELEASED": errors.BarrierReleasedError,
    "BARRIER_CANCELLED": errors.BarrierCancelledError,
    "JOIN_SET_EXHAUSTED": errors.JoinSetExhaustedError,
    "CHILD_FAILED": errors.ChildError,
    "CAPACITY_UNAVAILABLE": errors.CapacityUnavailableError,
    "ALLOWANCE_EXHAUSTED": errors.AllowanceExhaustedError,
    "INSUFFICIENT_BUDGET": errors.InsufficientBudgetError,
    "CLAIM_HELD": errors.ClaimHeldError,
    "LIMIT_EXCEEDED": errors.LimitError,
    "TIMEOUT": errors.WaitTimeout,
    "UNAUTHENTICATED": errors.UnauthenticatedError,
    "FORBIDDEN": errors.ForbiddenError,
    "UNAVAILABLE": errors.UnavailableError,
}


def test_every_code_maps_to_its_class():
    assert set(SPEC_TABLE) <= set(CODES)
    for code in CODES:
        e = error_from_wire(code, "what to do", 1.5, {"field": "x"})
        assert isinstance(e, RallypointError)
        assert e.code == code and type(e).code == code, code
        assert (e.message, e.retry_after, e.details) == ("what to do", 1.5, {"field": "x"})
        if code in SPEC_TABLE:
            assert type(e) is SPEC_TABLE[code], code
        # exported at the top level, so `except rallypoint.XError` works
        assert getattr(rallypoint, type(e).__name__) is type(e)
    # families the SPEC names
    assert isinstance(error_from_wire("BARRIER_CANCELLED", ""), errors.BarrierError)
    assert isinstance(error_from_wire("DEADLINE_EXCEEDED", ""), errors.ScopeInactiveError)
    assert isinstance(error_from_wire("FORBIDDEN", ""), errors.AuthError)
    assert isinstance(error_from_wire("CLAIM_HELD", ""), errors.ContentionError)
    assert isinstance(error_from_wire("TIMEOUT", ""), TimeoutError)
    child = error_from_wire("CHILD_FAILED", "m", None, {"value": {"e": 1}, "failure_kind": "failed", "child_id": "c"})
    assert (child.value, child.failure_kind, child.child_id) == ({"e": 1}, "failed", "c")


def test_unknown_code_stays_a_rallypoint_error_with_that_code():
    e = error_from_wire("SOMETHING_NEW", "later version", 2.0)
    assert type(e) is RallypointError and e.code == "SOMETHING_NEW" and e.retry_after == 2.0


class _RaiseByCode:
    """A dispatcher whose request body is an error code; it raises that error."""

    def hello(self, hello, peer):
        return None, wire.HelloOk(wire.PROTOCOL_VERSION, "test", "default")

    def submit(self, session, body, sink, rid):
        code = msgspec.msgpack.decode(bytes(body))
        sink.deliver(rid, error_from_wire(code, f"message of {code}", 0.25, {"code": code, "n": [1, 2]}), 0)

    def durable_lsn(self):
        return 0

    async def wait_durable(self, lsn):
        return None


async def test_every_code_round_trips_over_tcp_as_its_class():
    async with running_server(_RaiseByCode()) as srv:
        async with connect_transport(f"tcp://127.0.0.1:{srv.port}") as conn:
            for code in CODES:
                if code == "INTERNAL":
                    continue  # the server answers INTERNAL itself (tested below)
                with pytest.raises(RallypointError) as ei:
                    await conn.call(msgspec.msgpack.encode(code))
                e = ei.value
                assert type(e) is type(error_from_wire(code, "")), code
                assert e.code == code
                assert e.message == f"message of {code}"
                assert e.retry_after == 0.25
                assert e.details == {"code": code, "n": [1, 2]}
            # and in one batch frame
            results = await conn.call_many([msgspec.msgpack.encode(c) for c in CODES])
            assert [type(r) for r in results] == [type(error_from_wire(c, "")) for c in CODES]


# --- the coordinator's own refusals, embedded and over TCP ----------------------------


def _in(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


async def test_validation_error_arrives_as_validation_error(rs):
    with pytest.raises(ValidationError) as ei:
        await rs.scopes.create(name="no\tcontrol characters allowed")
    assert type(ei.value) is ValidationError and "name" in ei.value.message
    with pytest.raises(ValidationError) as ei:
        await rs.scopes.create(child_limit=-1)
    assert type(ei.value) is ValidationError and "child_limit" in ei.value.message


@pytest.mark.parametrize("name", ["invoice\u202egpj.exe", "a\u2066b\u2069", "c1\x85control", "lrm\u200e"])
async def test_a_name_with_bidirectional_or_c1_control_characters_is_refused(rs, name):
    # issue 41, item 10: bidi-override characters were allowed in names (a run that
    # reads "invoiceexe.jpg" in the console and the CLI)
    with pytest.raises(ValidationError, match="bidirectional formatting"):
        await rs.scopes.create(name=name)
    run = await rs.scopes.create(name="fine")
    jobs = await rs.mailboxes.ensure("bidi-names")
    await jobs.submit({}, scope=run)
    with pytest.raises(ValidationError, match="holder"):
        await jobs.receive(run, wait=0, holder=name)


async def test_not_found_arrives_as_not_found(rs):
    with pytest.raises(NotFoundError) as ei:
        await rs.scope("scp_doesnotexist").status()
    assert type(ei.value) is NotFoundError and "scp_doesnotexist" in ei.value.message


async def test_conflict_arrives_as_conflict(rs):
    run = await rs.scopes.create()
    await run.complete()
    with pytest.raises(ConflictError) as ei:
        await run.cancel()
    assert type(ei.value) is ConflictError and "COMPLETED" in ei.value.message


async def test_scope_cancelled_arrives_as_scope_cancelled(rs):
    run = await rs.scopes.create()
    await run.cancel()
    with pytest.raises(ScopeCancelledError) as ei:
        await run.child()
    assert type(ei.value) is ScopeCancelledError
    assert ei.value.details == {"scope_id": run.id, "reason": "cancelled"}
    mbx = await rs.mailboxes.ensure("spine-err-cancelled")
    with pytest.raises(ScopeCancelledError):
        await mbx.submit(1, scope=run)


async def test_limit_arrives_as_limit(rs):
    run = await rs.scopes.create(child_limit=1)
    await run.child()
    with pytest.raises(LimitError) as ei:
        await run.child()
    assert type(ei.value) is LimitError and ei.value.details["limit"] == 1


async def test_deadline_exceeded_arrives_as_deadline_exceeded(rs):
    run = await rs.scopes.create(deadline=_in(0.25))
    await trio.sleep(0.3)
    with pytest.raises(DeadlineExceededError) as ei:
        await run.child()
    assert type(ei.value) is DeadlineExceededError


async def test_stale_claim_arrives_as_lease_lost(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure("spine-err-stale")
    await mbx.submit({"n": 1}, scope=run)
    d = await mbx.receive(run, lease_seconds=30, wait=1)
    await d.complete("done")
    with pytest.raises(LeaseLostError) as ei:
        await d.complete("again")
    assert type(ei.value) is LeaseLostError and d.lost


async def test_idempotency_record_and_lookup_from_a_client_are_forbidden(rs):
    # issue 41 item 2: the HTTP front end's idempotency ops are the node's own steps
    # (LOCAL): a client -- embedded or over TCP, open mode's every permission included --
    # cannot store (forge, squat) or read an answer; the node's own step can, and a key
    # reused for another request is IDEMPOTENCY_CONFLICT, a ConflictError whose code is
    # one of CODES (the protocol fuzzer found it outside them).
    from rallypoint import protocol as p
    from rallypoint.actors.api import REPLY_TYPES
    from rallypoint.service import Session

    record = p.IdempotencyRecord(key="spine-k", fingerprint="a", status=200, body=b"{}")
    lookup = p.IdempotencyLookup(key="spine-k", fingerprint="b")
    for op in (record, lookup):
        with pytest.raises(errors.ForbiddenError) as ei:
            await rs._call(op, REPLY_TYPES[type(op)])
        assert "not a client's" in ei.value.message and ei.value.details == {"op": type(op).__struct_config__.tag}
    node = getattr(rs, "node", None)
    if node is None:  # (over TCP: nothing more a client can reach)
        return
    local = Session(local=True)
    await node.service.call(local, record)
    with pytest.raises(errors.IdempotencyConflictError) as ei:
        await node.service.call(local, lookup)
    e = ei.value
    assert isinstance(e, ConflictError) and e.code == "IDEMPOTENCY_CONFLICT" and e.code in CODES
    assert e.details == {"key": "spine-k"}
