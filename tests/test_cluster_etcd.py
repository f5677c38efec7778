"""The Trio etcd client (rallypoint/cluster/etcd.py) against a real etcd.

etcd's lease TTLs run on its own clock, so the lease tests use real time (a 2 s TTL, the
minimum with etcd's default election timeout); everything else waits for a condition.
"""

from __future__ import annotations

import uuid

import pytest
import trio

from _etcd import TcpProxy, free_ports, member_status
from rallypoint.cluster.etcd import (
    Compare,
    Delete,
    EtcdClient,
    EtcdCompactedError,
    EtcdError,
    EtcdLeaseNotFoundError,
    EtcdUnavailableError,
    Put,
    Range,
    prefix_end,
)
from rallypoint.errors import CursorExpiredError, NotFoundError, UnavailableError, ValidationError

# etcd's TTLs are real seconds; a test that hangs is a failure, quickly -- but not
# sooner than a member restarted under load takes to be ready (wait_ready allows 30 s
# itself), and a time-out inside a Trio run leaves the worker's Trio state broken for
# the tests after it
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def prefix(request):
    return f"/t/{request.node.name}/{uuid.uuid4().hex[:8]}/"


async def collect(watch, send_channel):
    async with watch:
        async for ev in watch:
            await send_channel.send(ev)


def test_prefix_end():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_put_range_delete_hide_base64_and_int64(etcd, prefix):
    async with EtcdClient(etcd.endpoints) as client:
        p1 = await client.put(prefix + "b", b"\xff\x00binary")
        p2 = await client.put((prefix + "a").encode(), "text")
        assert p2.revision == p1.revision + 1
        r = await client.range(prefix, prefix=True)
        assert [kv.key for kv in r.kvs] == [(prefix + "a").encode(), (prefix + "b").encode()]
        assert [kv.value for kv in r.kvs] == [b"text", b"\xff\x00binary"]
        assert r.count == 2 and r.revision >= p2.revision
        a = r.kvs[0]
        assert (a.create_revision, a.mod_revision, a.version, a.lease) == (p2.revision, p2.revision, 1, 0)
        again = await client.put(prefix + "a", "text2", prev_kv=True)
        assert again.prev_kv is not None and again.prev_kv.value == b"text"
        kv = await client.get(prefix + "a")
        assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (b"text2", p2.revision, again.revision, 2)
        assert await client.get(prefix + "missing") is None
        d = await client.delete(prefix, prefix=True, prev_kv=True)
        assert d.deleted == 2 and sorted(kv.value for kv in d.prev_kvs) == [b"text2", b"\xff\x00binary"]
        assert (await client.range(prefix, prefix=True)).kvs == []


def test_endpoints_are_required_and_read_as_http():
    with pytest.raises(ValidationError):
        EtcdClient([" ", ""])
    client = EtcdClient("etcd://127.0.0.1:2379, 127.0.0.1:2380,http://h:1/")
    assert client.endpoints == ["http://127.0.0.1:2379", "http://127.0.0.1:2380", "http://h:1"]


async def test_etcd_refusal_is_raised_at_once_not_retried(etcd):
    async with EtcdClient(etcd.endpoints, timeout_s=5.0) as client:
        started = trio.current_time()
        with pytest.raises(EtcdError) as info:
            await client.put(b"", b"x")
        assert trio.current_time() - started < 1.0
        assert info.value.code == "INTERNAL" and "key is not provided" in info.value.message
        assert not isinstance(info.value, EtcdUnavailableError)


async def test_lease_keepalive_extends_it_and_expiry_deletes_the_key_for_the_watch(etcd, prefix):
    key = prefix + "leased"
    async with EtcdClient(etcd.endpoints) as client:
        granted_at = trio.current_time()
        grant = await client.lease_grant(2)
        assert grant.ttl_s == 2 and grant.lease_id > 0
        put = await client.put(key, "held", lease=grant.lease_id)
        ttl = await client.lease_time_to_live(grant.lease_id, keys=True)
        assert ttl.granted_ttl_s == 2 and 0 <= ttl.ttl_s <= 2 and ttl.keys == [key.encode()]
        # renewed every 0.5 s, the lease outlives its TTL
        last_sent = granted_at
        while trio.current_time() < granted_at + 2.5:
            await trio.sleep_until(last_sent + 0.5)
            last_sent = trio.current_time()
            assert await client.lease_keepalive(grant.lease_id) == 2
        assert (await client.get(key)).lease == grant.lease_id
        # no more renewals: etcd deletes the key, and a watch sees the DELETE
        async with client.watch(key, start_revision=put.revision + 1, prev_kv=True) as events:
            ev = await events.__anext__()
        assert ev.type == "DELETE" and ev.kv.key == key.encode()
        assert ev.prev_kv is not None and ev.prev_kv.value == b"held"
        assert trio.current_time() - last_sent >= 1.95  # not before TTL after the last renewal
        assert await client.get(key) is None
        for call in (client.lease_keepalive, client.lease_time_to_live, client.lease_revoke):
            with pytest.raises(EtcdLeaseNotFoundError) as info:
                await call(grant.lease_id)
            assert isinstance(info.value, NotFoundError) and info.value.lease_id == grant.lease_id
            assert "expired or was revoked" in info.value.message


async def test_revoke_deletes_the_keys_of_the_lease_at_once(etcd, prefix):
    async with EtcdClient(etcd.endpoints) as client:
        grant = await client.lease_grant(30)
        await client.put(prefix + "k", "v", lease=grant.lease_id)
        await client.lease_revoke(grant.lease_id)
        assert await client.get(prefix + "k") is None
        with pytest.raises(EtcdLeaseNotFoundError):
            await client.put(prefix + "k2", "v", lease=grant.lease_id)


async def test_txn_fences_on_create_revision_mod_revision_and_value(etcd, prefix):
    key, other = prefix + "leader", prefix + "other"
    async with EtcdClient(etcd.endpoints) as client:
        absent = await client.txn([Compare.create_revision(key, "==", 0)], [Put(key, "first")], [Range(key)])
        assert absent.succeeded and len(absent.responses) == 1
        first = await client.get(key)
        assert first.create_revision == absent.revision
        await client.delete(key)
        await client.put(key, "second")
        second = await client.get(key)
        assert second.create_revision > first.create_revision
        # a stale fencing token (the first incarnation's create revision) is refused
        stale = await client.txn(
            [Compare.create_revision(key, "==", first.create_revision)],
            [Put(other, "by the stale holder"), Delete(key)],
            [Range(key)],
        )
        assert not stale.succeeded
        assert [kv.value for kv in stale.responses[0].kvs] == [b"second"]
        assert await client.get(other) is None and (await client.get(key)).value == b"second"
        # the current one is accepted, and every success op ran
        ok = await client.txn(
            [Compare.create_revision(key, "==", second.create_revision), Compare.value(key, "==", "second")],
            [Put(other, "by the holder"), Range(key)],
        )
        assert ok.succeeded and ok.responses[1].kvs[0].value == b"second"
        assert (await client.get(other)).mod_revision == ok.revision
        assert not (await client.txn([Compare.value(key, "!=", "second")])).succeeded
        assert not (await client.txn([Compare.mod_revision(other, "<", ok.revision)])).succeeded
        assert (await client.txn([Compare.mod_revision(other, "==", ok.revision), Compare.version(key, ">", 0)])).succeeded


async def test_watch_from_a_compacted_revision_raises_compacted(etcd, prefix):
    key = prefix + "k"
    async with EtcdClient(etcd.endpoints) as client:
        old = await client.put(key, "1")
        new = await client.put(key, "2")
        gone = await client.delete(key)
        await client.compact(gone.revision)
        for start in (old.revision, gone.revision):  # before, and at the compaction point
            with pytest.raises(EtcdCompactedError) as info:
                async with client.watch(key, start_revision=start) as events:
                    await events.__anext__()
            assert isinstance(info.value, CursorExpiredError) and info.value.revision == start
        with pytest.raises(EtcdCompactedError):
            await client.range(key, revision=old.revision)
        # etcd itself refuses a watch from before its compaction point, and says where
        # that is (here the compaction comes after the watch's own check passed)
        first = await client.put(prefix + "other", "x")
        second = await client.put(prefix + "other", "y")
        watch = client.watch(key, start_revision=first.revision)
        check = watch._check_not_compacted

        async def compact_after_check():
            await check()
            await client.compact(second.revision)

        watch._check_not_compacted = compact_after_check
        with pytest.raises(EtcdCompactedError) as info:
            async with watch:
                await watch.__anext__()
        assert info.value.compact_revision == second.revision
        # after the compaction point, it watches
        async with client.watch(key, start_revision=second.revision + 1) as events:
            put = await client.put(key, "3")
            ev = await events.__anext__()
        assert (ev.kv.value, ev.kv.mod_revision) == (b"3", put.revision)


async def test_watch_resumes_from_its_revision_after_the_connection_is_cut(etcd, prefix):
    key = prefix + "k"
    async with EtcdClient(etcd.endpoints) as direct, TcpProxy(int(etcd.endpoints[0].rsplit(":", 1)[1])) as proxy:
        async with EtcdClient([proxy.url], timeout_s=1.0) as via_proxy, trio.open_nursery() as nursery:
            send, receive = trio.open_memory_channel(100)
            # from a known revision: a watch from "now" made after the marker's put
            # would never see it (the watch connects in the background)
            start = await direct.put(key + "/start", "s")
            watch = via_proxy.watch(key, prefix=True, start_revision=start.revision + 1)
            nursery.start_soon(collect, watch, send)
            await direct.put(key, "v1")
            await direct.put(key + "/x", "marker")
            seen = []
            with trio.fail_after(20):
                while not seen or seen[-1].kv.value != b"marker":
                    seen.append(await receive.receive())
            proxy.cut()
            # written while the watch cannot reach etcd: a watch that resumed from "now"
            # would never see them
            r2 = await direct.put(key, "v2")
            r3 = await direct.delete(key)
            proxy.restore()
            with trio.fail_after(5):
                after = [await receive.receive(), await receive.receive()]
            assert [(e.type, e.kv.value, e.kv.mod_revision) for e in after] == [
                ("PUT", b"v2", r2.revision),
                ("DELETE", b"", r3.revision),
            ]
            assert watch.statistics().connects >= 2
            await direct.put(key, "v4")
            assert (await receive.receive()).kv.value == b"v4"
            with pytest.raises(trio.WouldBlock):
                receive.receive_nowait()  # nothing twice
            nursery.cancel_scope.cancel()


async def test_watch_resumes_after_etcd_restarts(etcd_private, prefix):
    key = prefix + "k"
    member = etcd_private.members[0]
    async with EtcdClient(etcd_private.endpoints, timeout_s=5.0) as client, trio.open_nursery() as nursery:
        first = await client.put(key, "v1")
        send, receive = trio.open_memory_channel(100)
        watch = client.watch(key, start_revision=first.revision)
        nursery.start_soon(collect, watch, send)
        assert (await receive.receive()).kv.value == b"v1"
        await trio.to_thread.run_sync(member.stop)
        await trio.to_thread.run_sync(member.start)
        await trio.to_thread.run_sync(etcd_private.wait_ready)
        r2 = await client.put(key, "v2")
        r3 = await client.put(key, "v3")
        with trio.fail_after(5):
            got = [await receive.receive(), await receive.receive()]
        assert [(e.kv.value, e.kv.mod_revision) for e in got] == [(b"v2", r2.revision), (b"v3", r3.revision)]
        assert watch.statistics().connects >= 2
        nursery.cancel_scope.cancel()


async def test_client_fails_over_past_dead_and_silent_endpoints(etcd, prefix):
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    etcd_port = int(etcd.endpoints[0].rsplit(":", 1)[1])
    async with TcpProxy(etcd_port) as silent:
        silent.blackhole()
        async with EtcdClient([dead, silent.url, etcd.endpoints[0]], timeout_s=1.5) as client:
            started = trio.current_time()
            await client.put(prefix + "k", "v")
            # the silent endpoint had its share of the time (1.5 s / 2 left), not all of it
            assert 0.7 <= trio.current_time() - started < 1.4
            started = trio.current_time()
            assert (await client.get(prefix + "k")).value == b"v"
            assert trio.current_time() - started < 0.5  # the live endpoint is now tried first
        async with EtcdClient(f"{dead},{silent.url}", timeout_s=0.6) as client:
            started = trio.current_time()
            with pytest.raises(EtcdUnavailableError) as info:
                await client.get(prefix + "k")
            assert 0.6 <= trio.current_time() - started < 1.0
            assert isinstance(info.value, UnavailableError) and info.value.code == "UNAVAILABLE"
            assert dead in info.value.message and silent.url in info.value.message
            assert "within 0.6 s" in info.value.message


async def test_three_members_the_client_and_its_watch_survive_the_loss_of_the_member_in_use(etcd3, prefix):
    key = prefix + "k"
    first = etcd3.members[0]
    async with EtcdClient(etcd3.endpoints, timeout_s=5.0) as client, trio.open_nursery() as nursery:
        r1 = await client.put(key, "v1")
        in_use = (await client.status()).member_id
        assert in_use == int(member_status(first.client_url)["header"]["member_id"])
        send, receive = trio.open_memory_channel(100)
        # from v1's revision on: a watch from "now" that connected after v2's put would
        # never see it (the full suite's timing: a hang until the time-out)
        watch = client.watch(key, start_revision=r1.revision + 1)
        nursery.start_soon(collect, watch, send)
        await client.put(key, "v2")
        with trio.fail_after(20):
            while (await receive.receive()).kv.value != b"v2":
                pass
        try:
            await trio.to_thread.run_sync(first.stop)
            r3 = await client.put(key, "v3")
            assert (await client.get(key)).mod_revision == r3.revision
            with trio.fail_after(5):
                ev = await receive.receive()
            assert (ev.kv.value, ev.kv.mod_revision) == (b"v3", r3.revision)
            assert watch.statistics().connects >= 2
        finally:
            await trio.to_thread.run_sync(first.start)
            await trio.to_thread.run_sync(etcd3.wait_ready)
        nursery.cancel_scope.cancel()
