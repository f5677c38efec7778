"""Claims, pools, admission and work limits through the blocking client
(``rallypoint.sync``): the same calls without ``await``, and the SDK's async context
managers (``hold``, ``keep_alive``) as ``with`` blocks whose lease is renewed by the
client's loop thread while the body runs."""

from __future__ import annotations

import time

import pytest

import rallypoint
from rallypoint.errors import CapacityUnavailableError, ClaimHeldError, LeaseLostError, LimitError


def test_claims_through_the_blocking_client(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create(name="sync-claims")
        lease = run.claims.acquire("sync/k", lease_seconds=5, holder="thread-1")
        assert lease.generation == 1 and lease.token > 0
        with pytest.raises(ClaimHeldError):
            run.claims.acquire("sync/k")
        assert lease.renew() is not None
        with lease.keep_alive():  # renewed by the loop thread while this thread sleeps
            time.sleep(6)
        assert rs.claims.status("sync/k").state == "HELD" and not lease.lost
        assert lease.release("done").state == "FREE"
        with run.claims.hold("sync/held", lease_seconds=5) as held:
            assert rs.claims.status("sync/held").state == "HELD"
        assert rs.claims.status("sync/held").state == "FREE" and held.released
        other = rs.scopes.create()
        lost = other.claims.acquire("sync/lost", lease_seconds=5)
        with pytest.raises(LeaseLostError):  # a thread cannot be cancelled: raised at the end
            with lost.keep_alive():
                other.cancel()
                time.sleep(3)
        assert lost.lost


def test_pools_admission_and_work_limits_through_the_blocking_client(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create(name="sync-pools")
        pool = rs.pools.ensure("sync-gpu", 2)
        with pool.hold(2, scope=run, lease_seconds=5) as g:
            assert g.units == 2
            with pytest.raises(CapacityUnavailableError):
                run.pools.acquire("sync-gpu", 1)
        assert pool.status().units_used == 0
        mbx = rs.mailboxes.ensure("sync-adm")
        run.work_limits.ensure("sync-wl", 1)
        mbx.submit("x", scope=run, requirements={"pools": {"sync-gpu": 2}}, work_limit="sync-wl")
        with pytest.raises(LimitError):
            mbx.submit("y", scope=run, work_limit="sync-wl")
        d = mbx.admit(run)
        assert [(x.pool, x.units) for x in d.grants] == [("sync-gpu", 2)] and pool.status().units_used == 2
        d.complete("ok")
        assert pool.status().units_used == 0


def test_blocking_consume_serves_renews_leases_and_retries(daemon):
    # Issue 31 item 8: rallypoint.sync.consume is a blocking worker loop with the async
    # one's semantics. Given a 5 s lease, a handler that holds its delivery until it has
    # seen the lease renewed (by the client's loop; the handler does nothing for it)
    # succeeds on attempt 1; a handler error is a retry (attempt 2 succeeds); the handler
    # gets a blocking delivery; consume returns once the run is cancelled, with stats.
    import threading

    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create(name="sync-consume")
        jobs = rs.mailboxes.ensure("sync-consume-jobs", max_attempts=3)
        slow = jobs.submit({"kind": "slow"}, scope=run)
        flaky = jobs.submit({"kind": "flaky"}, scope=run)
        renewed = {}

        def handler(d):
            if d.input["kind"] == "flaky" and d.attempt == 1:
                raise RuntimeError("first try fails")
            if d.input["kind"] == "slow":
                first = d.lease_expires_at
                deadline = time.monotonic() + 30
                while d.lease_expires_at == first:  # the condition: a renewal's new expiry
                    assert time.monotonic() < deadline, "the lease was never renewed"
                    time.sleep(0.05)
                renewed["to"] = d.lease_expires_at - first
            return {"done": d.input["kind"], "attempt": d.attempt}

        out = {}
        worker = threading.Thread(target=lambda: out.setdefault(
            "stats", rallypoint.sync.consume(rs, jobs, run, handler, concurrency=2, lease_seconds=5)))
        worker.start()
        assert slow.result(timeout=60).outcome == {"done": "slow", "attempt": 1}
        assert flaky.result(timeout=60).outcome == {"done": "flaky", "attempt": 2}
        run.cancel()
        worker.join(30)
        assert not worker.is_alive()
    stats = out["stats"]
    assert renewed["to"].total_seconds() > 0
    assert (stats.received, stats.completed, stats.retried, stats.lost) == (3, 2, 1, 0), stats
    assert stats.stop_reason == "SCOPE_CANCELLED"


def test_blocking_consume_refuses_an_async_handler(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create(name="sync-consume-async")

        async def handler(d):
            return 1

        with pytest.raises(rallypoint.ValidationError, match="async"):
            rallypoint.sync.consume(rs, "x", run, handler)
