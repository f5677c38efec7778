"""Embedded mode: the coordinator inside the caller's Trio program (SPEC §12)."""

import pytest

import rallypoint
from rallypoint.errors import NotFoundError, ValidationError


async def test_caller_exception_leaves_unwrapped():
    # Given an embedded coordinator, when the caller's block raises, then the caller
    # catches its own exception, not an ExceptionGroup from the background nursery.
    with pytest.raises(KeyError):
        async with rallypoint.open_embedded():
            raise KeyError("mine")
    with pytest.raises(NotFoundError):
        async with rallypoint.open_embedded() as rs:
            await rs.scope("scp_00000000000000000000000000").status()


async def test_state_survives_reopen_of_a_data_dir(tmp_path):
    async with rallypoint.open_embedded(str(tmp_path)) as rs:
        run = await rs.scopes.create(name="kept")
        mbx = await rs.mailboxes.ensure("jobs", max_attempts=3)
        ticket = await mbx.submit({"n": 1}, scope=run, key="k")
    async with rallypoint.open_embedded(str(tmp_path)) as rs:
        assert (await rs.scope(run.id).status()).name == "kept"
        assert (await rs.mailboxes.get("jobs")).info.max_attempts == 3
        info = await rs.task(ticket.id).status()
        assert (info.state, info.input, info.key) == ("QUEUED", {"n": 1}, "k")
        assert rs.node.recovery_info["replayed"] == 0  # the clean exit wrote a snapshot


async def test_unknown_durability_is_refused(tmp_path):
    with pytest.raises(ValidationError):
        async with rallypoint.open_embedded(str(tmp_path), durability="sometimes"):
            pass
    with pytest.raises(ValidationError):
        async with rallypoint.open_embedded(None, durability="fsync"):
            pass


async def test_handles_after_close_raise_unavailable(tmp_path):
    from rallypoint.errors import UnavailableError

    async with rallypoint.open_embedded(str(tmp_path)) as rs:
        run = await rs.scopes.create()
    with pytest.raises(UnavailableError):
        await run.status()
    with pytest.raises(UnavailableError):
        await run.child()


async def test_embedded_batch_waits_for_durability_once(tmp_path):
    # Given 50 leased deliveries on an fsync node, completing them in one batch makes the
    # journal sync a handful of times (group commit), not once per complete.
    from rallypoint import protocol as p

    async with rallypoint.open_embedded(str(tmp_path), durability="fsync") as rs:
        run = await rs.scopes.create()
        mbx = await rs.mailboxes.ensure("batch")
        await mbx.submit_many(range(50), scope=run)
        ds = await mbx.receive(run, wait=0, max_messages=50)
        journal = rs.node.coordinator.journal
        before = journal.stats()["fsyncs"]
        out = await rs._transport.call_many(
            [p.DeliveryComplete(task_id=d.task_id, token=d.token, outcome=p.NIL) for d in ds]
        )
        assert not any(isinstance(o, Exception) for o in out)
        assert journal.stats()["fsyncs"] - before <= 5
        states = [(await rs.task(d.task_id).status()).state for d in ds]
        assert states == ["SUCCEEDED"] * 50
