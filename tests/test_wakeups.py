"""No lost wake-ups: a server-side wait dispatched just before the event it waits for
(in the same batch frame) must see it, not sleep for its whole wait."""

import trio

from rallypoint import protocol as p

from conftest import parked_waits, wait_parked_at_most, wait_parked_remote


async def test_join_next_sees_a_record_written_right_after_it_was_dispatched(daemon):
    import rallypoint

    async with rallypoint.connect(daemon.url) as rs:
        run = await rs.scopes.create()
        mbx = await rs.mailboxes.ensure("wakeup-js")
        js = await run.join_sets.create()
        await js.submit(mbx, {"n": 1})
        d = await mbx.receive(run, wait=0)
        with trio.fail_after(5):  # the wait below is 20 s: a lost wake-up would time out
            join, done = await rs._transport.call_many([
                p.JoinNext(joinset_id=js.id, wait_ms=20_000),
                p.DeliveryComplete(task_id=d.task_id, token=d.token, outcome=p.NIL),
            ])
        assert not isinstance(join, Exception) and not isinstance(done, Exception)
        import msgspec

        assert msgspec.msgpack.decode(join)["status"] == "record"


async def test_receive_sees_a_task_submitted_right_after_it_was_dispatched(daemon):
    import rallypoint

    async with rallypoint.connect(daemon.url) as rs:
        run = await rs.scopes.create()
        await rs.mailboxes.ensure("wakeup-q")
        with trio.fail_after(5):
            got, _ = await rs._transport.call_many([
                p.Receive(mailbox="wakeup-q", scope_id=run.id, wait_ms=20_000),
                p.TaskSubmit(mailbox="wakeup-q", scope_id=run.id),
            ])
        import msgspec

        assert len(msgspec.msgpack.decode(got)["deliveries"]) == 1


async def test_an_abandoned_receive_leases_nothing(daemon):
    # Given a receive with a long server-side wait that the client abandons, when a task
    # arrives afterwards, then the next receive gets it: the Cancel frame ended the old
    # wait, so the task was not leased to a request nobody listens to.
    import rallypoint

    async with rallypoint.connect(daemon.url) as rs:
        run = await rs.scopes.create()
        mbx = await rs.mailboxes.ensure("abandoned")
        base = await parked_waits(rs)
        async with trio.open_nursery() as n:
            async def receive():
                await mbx.receive(run, wait=20)
                raise AssertionError("the receive should still be waiting")

            n.start_soon(receive)
            await wait_parked_remote(rs, 1, base=base)  # parked on the server ...
            n.cancel_scope.cancel()  # ... and abandoned
        # the Cancel frame ends the wait (long before its 20 s)
        await wait_parked_at_most(rs, base, timeout=10)
        ticket = await mbx.submit({"n": 1}, scope=run)
        d = await mbx.receive(run, wait=2)
        assert d is not None and d.task_id == ticket.id and d.token == 1
