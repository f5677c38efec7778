"""Shard leadership in etcd (rallypoint/cluster/leader.py) against a real etcd.

Leases run on etcd's clock, so these use real time with etcd's minimum TTL (2 s); waits
are for conditions (an Event, a watched key, every task parked), never fixed sleeps.
"""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest
import trio
import trio.testing

from _etcd import TcpProxy
from rallypoint.cluster.etcd import EtcdClient, EtcdLeaseNotFoundError
from rallypoint.cluster.leader import (
    LeaderInfo,
    LeadershipLostError,
    Replicas,
    ShardElection,
)
from rallypoint.errors import ValidationError


def node(name: str) -> LeaderInfo:
    return LeaderInfo(name, f"{name}.host:7400", f"{name}.host:7401", f"{name}.host:7480")

# etcd's TTLs are real seconds; a test that hangs is a failure, quickly
pytestmark = pytest.mark.timeout(120)  # as test_cluster_etcd.py: not sooner than etcd under load


@pytest.fixture
def cluster_name(request):
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


class ResendingClient(EtcdClient):
    """A client whose every transaction reaches etcd twice, as when a try times out after
    etcd applied it and the call tries again: the caller sees the second answer."""

    async def txn(self, *args, **kw):
        await super().txn(*args, **kw)
        return await super().txn(*args, **kw)


class FreezableClient(EtcdClient):
    """A client whose keepalives can be stopped, as if its process were paused: a frozen
    keepalive never reaches etcd and never returns."""

    frozen = False

    async def lease_keepalive(self, lease_id, *, timeout_s=None):
        if self.frozen:
            await trio.sleep_forever()
        return await super().lease_keepalive(lease_id, timeout_s=timeout_s)


async def settle():
    """Every task of the test is parked (on a watch, a sleep or a socket) for 0.2 s."""
    await trio.testing.wait_all_tasks_blocked(cushion=0.2)


async def test_campaign_timing_is_checked(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        for kw in ({"margin_s": 2.0}, {"keepalive_interval_s": 1.9}, {"margin_s": -1}):
            with pytest.raises(ValidationError):
                async with election.campaign(node("a"), **kw):
                    pass


async def test_one_of_two_contenders_leads_the_other_after_it_with_higher_epochs(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client, trio.open_nursery() as nursery:
        election = ShardElection(client, cluster_name, 3)
        assert await election.bootstrap(["a", "b"]) is True
        assert await election.bootstrap(["x"]) is False  # exists: unchanged
        assert (await election.read_replicas()).replicas == Replicas(members=["a", "b"], isr=["a", "b"])
        terms: list[tuple[str, int]] = []
        release = {"a": trio.Event(), "b": trio.Event()}
        elected = trio.Event()

        async def contender(name):
            async with election.campaign(node(name)) as leadership:
                assert leadership.is_leader_now()
                terms.append((name, leadership.epoch))
                elected.set()
                await release[name].wait()

        nursery.start_soon(contender, "a")
        nursery.start_soon(contender, "b")
        await elected.wait()
        await settle()  # the other one had every chance to win too
        assert len(terms) == 1
        first, first_epoch = terms[0]
        second = "b" if first == "a" else "a"
        rec = await election.read_leader()
        assert (rec.info, rec.epoch) == (node(first), first_epoch)
        release[first].set()  # leaving the block revokes the lease: the other takes over at once
        with trio.fail_after(1.5):  # well under the 2 s TTL: not by expiry
            while len(terms) < 2:
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.01)
        assert terms[1][0] == second and terms[1][1] > first_epoch
        release[second].set()
        await trio.testing.wait_all_tasks_blocked()
        async with election.campaign(node(first)) as again:
            assert again.epoch > terms[1][1]
        assert await election.read_leader() is None


async def test_a_holder_that_stops_renewing_fences_itself_before_etcd_expires_it_and_the_standby_takes_over(
    etcd, cluster_name
):
    async with (
        FreezableClient(etcd.endpoints) as frozen_client,
        EtcdClient(etcd.endpoints) as client,
        trio.open_nursery() as nursery,
    ):
        shard_a = ShardElection(frozen_client, cluster_name, 0)
        shard_b = ShardElection(client, cluster_name, 0)
        await shard_b.bootstrap(["a", "b"])
        b_elected = trio.Event()
        b_epoch = []
        events = []

        async def standby():
            async with shard_b.campaign(node("b")) as lb:
                b_epoch.append(lb.epoch)
                events.append("b elected")
                b_elected.set()
                await trio.sleep_forever()

        async with shard_a.campaign(node("a"), cancel_on_loss=False) as la:
            nursery.start_soon(standby)
            with trio.fail_after(2):
                while la.statistics().keepalives_ok < 2:  # renewals work
                    await trio.sleep(0.05)
            deadline_before = la.fence_deadline
            frozen_client.frozen = True  # the keepalive task stops, as in a SIGSTOP
            await la.lost.wait()
            events.append("a lost")
            lost_at = trio.current_time()
            # a fences itself while etcd still holds its lease and key
            still = await shard_b.read_leader()
            assert still is not None and still.epoch == la.epoch
            assert (await client.lease_time_to_live(la.lease_id)).ttl_s >= 0
            assert not la.is_leader_now()
            assert "self-fence" in la.lost_reason
            assert lost_at >= deadline_before and la.statistics().keepalive_failures >= 1
            with pytest.raises(LeadershipLostError):
                la.check()
            with pytest.raises(LeadershipLostError):
                await la.update_isr(["a"])
            await b_elected.wait()
            assert events == ["a lost", "b elected"]
            assert b_epoch[0] > la.epoch
            assert trio.current_time() - lost_at >= la.margin_s * 0.8  # etcd expired it later
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("fault", ["blackhole", "cut"])
async def test_a_leader_cut_off_from_etcd_stops_leading_before_its_lease_expires(etcd, cluster_name, fault):
    etcd_port = int(etcd.endpoints[0].rsplit(":", 1)[1])
    async with TcpProxy(etcd_port) as proxy, EtcdClient(etcd.endpoints) as client:
        async with EtcdClient([proxy.url], timeout_s=1.0) as cut_client:
            shard_a = ShardElection(cut_client, cluster_name, 0)
            shard_b = ShardElection(client, cluster_name, 0)
            await shard_b.bootstrap(["a", "b"])
            observed = {}
            with pytest.raises(LeadershipLostError) as info, trio.fail_after(5):
                async with shard_a.campaign(node("a")) as la:
                    observed["epoch"] = la.epoch
                    getattr(proxy, fault)()
                    try:
                        await trio.sleep_forever()  # cancelled when leadership is lost
                    finally:
                        observed["lost_at"] = trio.current_time()
                        observed["is_leader_now"] = la.is_leader_now()
                        # etcd still has a's key: a stopped before its lease could expire
                        with trio.CancelScope(shield=True):
                            observed["leader_then"] = await shard_b.read_leader()
            assert info.value.code == "STALE_CLAIM" and "self-fence" in info.value.reason
            assert info.value.epoch == observed["epoch"]
            assert observed["is_leader_now"] is False
            assert observed["leader_then"] is not None and observed["leader_then"].epoch == observed["epoch"]
            async with shard_b.campaign(node("b")) as lb:
                assert lb.epoch > observed["epoch"]
                assert trio.current_time() > observed["lost_at"]


async def test_a_process_stalled_past_its_deadline_is_not_leader_the_moment_it_runs_again(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        await election.bootstrap(["a"])
        with pytest.raises(LeadershipLostError), trio.fail_after(5):
            async with election.campaign(node("a")) as la:
                assert la.is_leader_now()
                # the whole process stalls (a SIGSTOP, a VM pause): no task runs, not even
                # the fence task; the monotonic clock keeps counting
                time.sleep(la.fence_deadline - trio.current_time() + 0.05)
                # no checkpoint since: only the clock can tell
                assert la.lost_reason is None
                assert not la.is_leader_now()
                with pytest.raises(LeadershipLostError):
                    la.check()
                await trio.sleep_forever()  # then the fence task ends the block


async def test_losing_the_leader_key_cancels_the_block_promptly(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        await election.bootstrap(["a"])
        with pytest.raises(LeadershipLostError) as info, trio.fail_after(2):
            async with election.campaign(node("a")) as la:
                # (taken before: the watch may end the block while the revoke still waits for its answer)
                revoked_at = trio.current_time()
                await client.lease_revoke(la.lease_id)  # an operator, or etcd expiring it
                await trio.sleep_forever()
        assert trio.current_time() - revoked_at < 0.5  # the watch saw it, not the fence deadline
        assert "leader key was deleted" in info.value.reason or "lease expired" in info.value.reason


async def test_without_cancel_on_loss_the_block_runs_on_and_sees_the_event(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        await election.bootstrap(["a"])
        async with election.campaign(node("a"), cancel_on_loss=False) as la:
            await client.delete(election.leader_key)
            await la.lost.wait()
            assert not la.is_leader_now() and "leader key was deleted" in la.lost_reason
        # no error on leaving: the holder was told through the event


async def test_resign_deletes_the_key_at_once_and_ends_the_block_quietly(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        await election.bootstrap(["a"])
        async with election.campaign(node("a")) as la:
            await la.resign()
            assert await election.read_leader() is None
            assert la.lost.is_set() and la.lost_reason == "resigned" and not la.is_leader_now()
            await la.resign()  # idempotent


async def test_an_error_in_the_block_comes_out_as_itself_and_the_lease_is_revoked(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        await election.bootstrap(["a"])
        with pytest.raises(KeyError):  # not wrapped in an ExceptionGroup
            async with election.campaign(node("a")) as la:
                raise KeyError("the body failed")
        assert await election.read_leader() is None
        with pytest.raises(EtcdLeaseNotFoundError):
            await client.lease_time_to_live(la.lease_id)


async def test_a_deposed_leaders_isr_update_is_refused_by_etcd(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        await election.bootstrap(["a", "b"])
        async with election.campaign(node("a"), cancel_on_loss=False) as la:
            shrunk = await la.update_isr(["a"])
            assert shrunk.replicas == Replicas(members=["a", "b"], isr=["a"])
            grown = await la.update_isr(["a", "b"])
            assert grown.mod_revision > shrunk.mod_revision
            with pytest.raises(ValidationError):
                await la.update_isr(["b"])  # the leader must stay in sync
            with pytest.raises(ValidationError):
                await la.update_isr(["a", "c"])  # not a member
            old_epoch = la.epoch
            await client.lease_revoke(la.lease_id)  # a's lease expires at etcd
            async with election.campaign(node("b")) as lb:
                # the fence is etcd's compare, whatever a believes locally
                with pytest.raises(LeadershipLostError) as info:
                    await election.update_replicas_fenced(old_epoch, ["a"], leader_node="a")
                assert f"epoch {lb.epoch}" in info.value.reason
                assert (await election.read_replicas()).replicas.isr == ["a", "b"]
                with pytest.raises(LeadershipLostError):
                    await la.update_isr(["a"])
                assert not la.is_leader_now()
                after = await lb.update_isr(["b"])  # the new leader drops a
                assert after.replicas.isr == ["b"]


async def test_campaign_and_isr_updates_survive_a_transaction_applied_twice(etcd, cluster_name):
    async with ResendingClient(etcd.endpoints) as resending, EtcdClient(etcd.endpoints) as client:
        election = ShardElection(resending, cluster_name, 0)
        await election.bootstrap(["a", "b"])
        with trio.fail_after(2):
            async with election.campaign(node("a")) as la:
                # the re-sent campaign found its own key: still the leader, same epoch
                rec = await ShardElection(client, cluster_name, 0).read_leader()
                assert (rec.epoch, rec.lease_id) == (la.epoch, la.lease_id)
                shrunk = await la.update_isr(["a"])
                assert shrunk.replicas.isr == ["a"]
                assert (await client.get(election.replicas_key)).mod_revision == shrunk.mod_revision


async def test_a_campaign_whose_new_lease_expired_before_its_transaction_tries_again(etcd, cluster_name):
    class FirstLeaseGone(EtcdClient):
        """The first lease granted is gone before it is used (a stall past its TTL)."""

        grants = 0

        async def lease_grant(self, ttl_s, **kw):
            grant = await super().lease_grant(ttl_s, **kw)
            self.grants += 1
            if self.grants == 1:
                await self.lease_revoke(grant.lease_id)
            return grant

    async with FirstLeaseGone(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        await election.bootstrap(["a"])
        with trio.fail_after(2):
            async with election.campaign(node("a")) as la:
                assert client.grants == 2 and (await election.read_leader()).lease_id == la.lease_id


async def test_a_node_out_of_the_isr_waits_and_wins_once_put_back(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client, trio.open_nursery() as nursery:
        election = ShardElection(client, cluster_name, 0)
        await election.bootstrap(["a", "b"], isr=["a"])
        won = trio.Event()

        async def b():
            async with election.campaign(node("b")) as lb:
                won.set()
                await trio.sleep_forever()

        nursery.start_soon(b)
        await settle()
        assert not won.is_set() and await election.read_leader() is None
        await client.put(election.replicas_key, msgspec.json.encode(Replicas(["a", "b"], ["a", "b"])))
        await won.wait()
        assert (await election.read_leader()).info.node == "b"
        nursery.cancel_scope.cancel()


async def test_watch_leader_reports_the_leader_its_loss_and_its_successor(etcd, cluster_name):
    etcd_port = int(etcd.endpoints[0].rsplit(":", 1)[1])
    async with (
        EtcdClient(etcd.endpoints) as client,
        TcpProxy(etcd_port) as proxy,
        EtcdClient([proxy.url], timeout_s=1.0) as watch_client,
        trio.open_nursery() as nursery,
    ):
        election = ShardElection(client, cluster_name, 0)
        watched = ShardElection(watch_client, cluster_name, 0)
        await election.bootstrap(["a", "b"])
        send, receive = trio.open_memory_channel(100)

        async def watcher():
            async with watched.watch_leader() as leaders:
                async for rec in leaders:
                    await send.send(rec)

        nursery.start_soon(watcher)
        with trio.fail_after(10):
            assert await receive.receive() is None  # no leader yet
            async with election.campaign(node("a")) as la:
                rec = await receive.receive()
                assert (rec.info, rec.epoch, rec.lease_id) == (node("a"), la.epoch, la.lease_id)
                assert rec.info.http_address == "a.host:7480"
                # the watch loses its stream while etcd compacts past where it was: it
                # reads the key again, finds the same leader, and says nothing
                proxy.cut()
                await client.put(election.prefix + "unrelated", "x")
                await client.compact((await client.status()).revision)
                proxy.restore()
                await settle()  # the watcher is back on a stream
                with pytest.raises(trio.WouldBlock):
                    receive.receive_nowait()
            assert await receive.receive() is None  # a stepped down: the key is gone
            async with election.campaign(node("b")) as lb:
                rec = await receive.receive()
                assert (rec.info.node, rec.epoch) == ("b", lb.epoch) and lb.epoch > la.epoch
                # compacted while cut, again, but now the leader changed meanwhile
                proxy.cut()
                await lb.resign()
                await client.compact((await client.status()).revision)
                proxy.restore()
            assert await receive.receive() is None
            async with election.campaign(node("a")) as la2:
                rec = await receive.receive()
                assert (rec.info.node, rec.epoch) == ("a", la2.epoch)
        assert await receive.receive() is None
        with pytest.raises(trio.WouldBlock):
            receive.receive_nowait()  # one value per change, none twice
        nursery.cancel_scope.cancel()
