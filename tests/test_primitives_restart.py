"""Claims, pools and admission across a SIGKILL of a real daemon (fsync data dir): leases,
durable waiters and grants survive; the clients' parked acquires are re-sent on the new
connection and keep their place in line; nothing is granted twice, no pool is ever
over-granted, and FIFO order holds across the restart."""

from __future__ import annotations

import signal
import socket

import trio

import rallypoint
from rallypoint.errors import LeaseLostError

from conftest import Daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(pred, what: str, timeout: float = 20) -> None:
    with trio.fail_after(timeout):
        while not await pred():
            await trio.sleep(0.02)


async def test_sigkill_in_the_middle_of_claims_pools_and_admission(tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    args = (data, "fsync", ["--listen", f"127.0.0.1:{port}"])
    daemons = [Daemon(*args).start()]
    try:
        async with rallypoint.connect(daemons[0].url, reconnect=rallypoint.Reconnect(timeout=30)) as rs:
            run = await rs.scopes.create(name="restart-primitives")
            a = await run.claims.acquire("report", lease_seconds=30, holder="A")
            pool = await rs.pools.ensure("gpu", 3)
            g2 = await pool.acquire(2, scope=run, lease_seconds=30, holder="explicit")
            mbx = await rs.mailboxes.ensure("gpu-jobs")
            t1 = await mbx.submit("t1", scope=run, requirements={"pools": {"gpu": 1}}, key="t1")
            t2 = await mbx.submit("t2", scope=run, requirements={"pools": {"gpu": 1}}, key="t2")
            d1 = await mbx.admit(run, lease_seconds=30)
            assert d1.task_id == t1.id and (await pool.status()).units_used == 3  # full
            got: dict[str, object] = {}
            over: list[object] = []
            watching = True

            async def claim_waiter():
                got["B"] = await run.claims.acquire("report", lease_seconds=30, wait=120, holder="B")

            async def pool_waiter(name, units):
                got[name] = await pool.acquire(units, scope=run, lease_seconds=30, wait=120, holder=name)

            async def watcher():  # the pool never reports more units granted than it has
                while watching:
                    try:
                        st = await pool.status()
                        if st.units_used > st.units_total:
                            over.append(st)
                    except rallypoint.UnavailableError:
                        pass
                    await trio.sleep(0.01)

            async with trio.open_nursery() as n:
                n.start_soon(watcher)
                n.start_soon(claim_waiter)
                await _until(lambda: _claim_waiters(rs, "report", 1), "claim waiter")
                n.start_soon(pool_waiter, "big", 3)
                await _until(lambda: _pool_waiters(pool, [3]), "big")
                n.start_soon(pool_waiter, "small", 1)
                await _until(lambda: _pool_waiters(pool, [3, 1]), "small")

                rc = await trio.to_thread.run_sync(daemons[0].stop, signal.SIGKILL)
                assert rc == -signal.SIGKILL
                daemons.append(await trio.to_thread.run_sync(Daemon(*args).start))

                # everything is back: the lease, the grants, both queues in order
                st = await rs.claims.status("report")
                assert (st.state, st.generation, [w.holder for w in st.waiters]) == ("HELD", 1, ["B"])
                ps = await pool.status()
                assert (ps.units_used, [w.units for w in ps.waiters]) == (3, [3, 1])
                await a.renew()  # the holders kept their leases (same tokens)
                await g2.renew()
                await d1.renew()

                await g2.release()  # 2 free: big (3) waits, small (1) must not pass it
                await trio.sleep(0.2)
                ps = await pool.status()
                assert (ps.units_used, [w.units for w in ps.waiters]) == (1, [3, 1]) and "big" not in got
                assert await mbx.admit(run) is None  # admission does not barge either
                await d1.complete("done")  # its unit comes back: 3 free, big is served
                await _until(lambda: _has(got, "big"), "big granted")
                assert "small" not in got and (await pool.status()).units_used == 3

                await a.release("A finished the first half")  # B is next, at once
                await _until(lambda: _has(got, "B"), "B")
                await got["big"].release()  # small is next, then t2 is admitted
                await _until(lambda: _has(got, "small"), "small")
                d2 = await mbx.admit(run, wait=5)
                assert d2.task_id == t2.id
                await d2.complete("done")
                await got["small"].release()
                watching = False

            b = got["B"]
            assert b.generation == 2 and b.observation == "A finished the first half"
            try:
                await a.renew()
            except LeaseLostError:
                pass
            else:
                raise AssertionError("A's token must be stale after B took over")
            assert over == []
            ps = await pool.status()
            assert ps.units_used == 0 and ps.waiting == 0
            grant_ids = [got["big"].id, got["small"].id, g2.id, *(g.id for g in d1.grants), *(g.id for g in d2.grants)]
            assert len(set(grant_ids)) == len(grant_ids)  # each request was granted once
            await b.complete({"report": "ok"})
            assert rs._transport.reconnects >= 1
    finally:
        for d in daemons:
            d.kill()


async def _claim_waiters(rs, key: str, n: int) -> bool:
    try:
        return len((await rs.claims.status(key)).waiters) == n
    except rallypoint.NotFoundError:
        return False


async def _pool_waiters(pool, units: list[int]) -> bool:
    return [w.units for w in (await pool.status()).waiters] == units


async def _has(d: dict, k: str) -> bool:
    return k in d
