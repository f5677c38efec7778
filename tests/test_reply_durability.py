"""Every reply that depends on state -- success OR error -- waits until the journal is
durable past what it observed (issue 12.2): a client is never told BARRIER_RELEASED,
SCOPE_CANCELLED or CONFLICT because of another client's change that a crash could still
take back. Over TCP, with a journal whose durability the test releases by hand."""

from __future__ import annotations

import msgspec
import trio
import trio.testing

from rallypoint import protocol as p
from rallypoint import wire
from rallypoint.actors import Coordinator
from rallypoint.actors.common import MemoryJournal
from rallypoint.service import Service
from rallypoint.transport.testing import RawClient, running_server


class HeldJournal(MemoryJournal):
    """LSNs as usual, but durable only up to what :meth:`release` allowed."""

    def __init__(self) -> None:
        super().__init__()
        self.released = 0
        self._changed = trio.Event()
        self._listeners = []

    @property
    def durable_lsn(self) -> int:
        return min(self.released, self.last_lsn)

    def add_durable_listener(self, fn) -> None:
        self._listeners.append(fn)

    def remove_durable_listener(self, fn) -> None:
        self._listeners.remove(fn)

    def release(self) -> None:
        self.released = self.last_lsn
        self._changed.set()
        self._changed = trio.Event()
        for fn in self._listeners:  # as the real journal reports durable progress
            fn(self.durable_lsn, None)

    async def wait_durable(self, lsn: int) -> None:
        while self.durable_lsn < lsn:
            await self._changed.wait()


_seen: dict[int, dict[int, object]] = {}  # client -> frames read while waiting for another id


async def _answer(c: RawClient, rid: int, timeout: float):
    """The frame answering ``rid`` within ``timeout`` seconds, or None (answers come in
    any order: frames for other ids are kept for their own call)."""
    kept = _seen.setdefault(id(c), {})
    if rid in kept:
        return kept.pop(rid)
    with trio.move_on_after(timeout):
        while True:
            f = await c.recv(timeout=timeout + 1)
            fid = getattr(f, "id", None)
            if fid == rid:
                return f
            kept[fid] = f
    return None


async def test_error_replies_caused_by_a_change_not_yet_durable_wait_for_it():
    coord = Coordinator()
    journal = coord.journal = HeldJournal()
    async with trio.open_nursery() as n:
        await n.start(coord.run)
        async with running_server(Service(coord)) as srv:
            a = await RawClient.connect(srv.port)
            b = await RawClient.connect(srv.port)
            enc = msgspec.msgpack.encode

            def body(op):
                return msgspec.msgpack.decode(p.encoder.encode(op))

            # setup, made durable
            await a.request(1, body(p.ScopeCreate(name="r")))
            await trio.testing.wait_all_tasks_blocked()  # decided; its reply waits for durability
            assert journal.last_lsn > journal.released
            journal.release()
            run_id = msgspec.msgpack.decode((await _answer(a, 1, 5)).body)["id"]
            await a.request(2, body(p.BarrierCreate(scope_id=run_id, target=1)))
            await a.request(3, body(p.MailboxEnsure(name="m")))
            await trio.testing.wait_all_tasks_blocked()
            journal.release()
            bar = await _answer(a, 2, 5)
            bar_id = msgspec.msgpack.decode(bar.body)["id"]
            assert await _answer(a, 3, 5) is not None

            # A releases the barrier: not durable yet, so A hears nothing ...
            await a.request(10, body(p.BarrierArrive(barrier_id=bar_id, key="a")))
            assert await _answer(a, 10, 0.3) is None
            # ... and B must not be told BARRIER_RELEASED (a crash could take it back)
            await b.request(11, body(p.BarrierArrive(barrier_id=bar_id, key="b")))
            assert await _answer(b, 11, 0.3) is None
            journal.release()  # the arrival is durable: both answers go
            ok = await _answer(a, 10, 5)
            err = await _answer(b, 11, 5)
            assert isinstance(ok, wire.Ok)
            assert isinstance(err, wire.Err) and err.code == "BARRIER_RELEASED"

            # the same for SCOPE_CANCELLED: A's cancel is not durable, B's submit waits
            await a.request(20, body(p.ScopeCancel(scope_id=run_id)))
            await b.request(21, body(p.TaskSubmit(mailbox="m", scope_id=run_id, input=msgspec.Raw(enc(1)))))
            assert await _answer(b, 21, 0.3) is None
            journal.release()
            err = await _answer(b, 21, 5)
            assert isinstance(err, wire.Err) and err.code == "SCOPE_CANCELLED"
            assert isinstance(await _answer(a, 20, 5), wire.Ok)

            # a validation error depends on no state: it is answered at once
            await b.request(30, body(p.ScopeCreate(name="bad\nname")))
            early = await _answer(b, 30, 2)
            assert isinstance(early, wire.Err) and early.code == "VALIDATION_FAILED"
            await a.aclose()
            await b.aclose()
        n.cancel_scope.cancel()
