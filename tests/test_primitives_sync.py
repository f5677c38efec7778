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
