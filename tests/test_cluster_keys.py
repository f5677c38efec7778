"""A cluster's API keys in etcd (rallypoint/cluster/keystore.py): made and revoked there
(``rallypoint keys create|list|revoke --cluster``), taken by every shard's leader
(``key.adopt``), so a key authenticates on every shard, open mode ends cluster-wide
with the first one, a revocation is refused on every shard within one watch round trip,
and a standby that takes over has the keys through the journal."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.cluster import keystore
from rallypoint.cluster.etcd import EtcdClient
from rallypoint.cluster.shardmap import init_cluster
from rallypoint.errors import (ConflictError, ForbiddenError, NotFoundError, UnauthenticatedError,
                               ValidationError)
from rallypoint.ids import slot_of

from test_cluster_shards import cluster_name, leader, start_cluster, urls, wait_until  # noqa: F401

pytestmark = pytest.mark.timeout(300)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "rallypoint", *args], capture_output=True, text=True, timeout=120)


async def try_status(address: str, key: str | None):
    """The leader at ``address`` answers a request with ``key`` (True), or the error it
    answers."""
    try:
        async with rallypoint.connect(f"tcp://{address}", api_key=key, reconnect=False) as rs:
            await rs.scopes.list(limit=1)
        return True
    except (UnauthenticatedError, ForbiddenError) as e:
        return e


def leaders_of(members) -> dict[int, str]:
    return {s: f"127.0.0.1:{leader(ms).client_port}" for s, ms in members.items()}


async def test_the_key_store_in_etcd(etcd, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        await init_cluster(client, cluster_name, slots=64, shards=2)
        rec, secret = await keystore.create_key(client, cluster_name, "team-a", ["admin", "admin"], "ops")
        assert secret.startswith("rpk_") and rec.permissions == ["admin"] and rec.revoked_at_ms is None
        from rallypoint.actors.keys import hash_secret
        from rallypoint.actors.sharding import home_slot

        assert rec.secret_sha256 == hash_secret(secret)
        raw = (await client.get(keystore.keys_prefix(cluster_name) + rec.id)).value
        assert secret.encode() not in raw  # only the hash is stored
        assert slot_of(rec.id) == home_slot("team-a", 64)  # the space's home slot, as a shard would make it
        other, _ = await keystore.create_key(client, cluster_name, "team-b", ["coordination_read"])
        assert [k.id for k in await keystore.list_keys(client, cluster_name, "team-a")] == [rec.id]
        assert {k.id for k in await keystore.list_keys(client, cluster_name)} == {rec.id, other.id}
        revoked = await keystore.revoke_key(client, cluster_name, rec.id)
        assert revoked.revoked_at_ms is not None
        assert (await keystore.revoke_key(client, cluster_name, rec.id)).revoked_at_ms == revoked.revoked_at_ms
        with pytest.raises(NotFoundError):
            await keystore.revoke_key(client, cluster_name, "key_" + "0" * 26)
        with pytest.raises(ValidationError):
            await keystore.create_key(client, cluster_name, "team-a", ["root"])
        # the watch: every record, then each change
        async with trio.open_nursery() as n:
            seen: list = []

            async def watch():
                async for recs, deleted in keystore.watch_keys(client, cluster_name):
                    seen.append(([r.id for r in recs], deleted))

            n.start_soon(watch)
            await wait_until(lambda: len(seen) == 1)
            assert set(seen[0][0]) == {rec.id, other.id}
            await keystore.revoke_key(client, cluster_name, other.id)
            await wait_until(lambda: len(seen) == 2)
            assert seen[1] == ([other.id], [])
            n.cancel_scope.cancel()


async def test_key_adopt_is_the_nodes_own_step_and_idempotent(tmp_path):
    from rallypoint.node import open_node
    from rallypoint.service import Service, Session

    async with open_node(None, "memory") as node:
        svc = Service(node.coordinator)
        local = Session(local=True)
        from rallypoint.actors.keys import hash_secret

        op = p.KeyAdopt(id="key_01jzzzzzzzzzzzzzzzzzzzzzzz", space="team-a", permissions=["admin"],
                        secret_sha256=hash_secret("rpk_x"), created_at_ms=1_700_000_000_000, name="ops")
        with pytest.raises(ForbiddenError):  # not over the wire (open mode: every permission, not local)
            await svc.call(Session(), op)
        v = msgspec.msgpack.decode(await svc.call(local, op), type=p.KeyView)
        assert v.id == op.id and v.revoked_at is None
        keys = node.coordinator.keys
        assert not keys.open_mode and keys.authenticate("rpk_x").id == op.id
        lsn = node.coordinator.journal.last_lsn
        await svc.call(local, op)  # again: nothing journaled
        assert node.coordinator.journal.last_lsn == lsn
        await svc.call(local, msgspec.structs.replace(op, revoked_at_ms=1_700_000_001_000))
        with pytest.raises(UnauthenticatedError):
            keys.authenticate("rpk_x")
        with pytest.raises(ConflictError):
            await svc.call(local, msgspec.structs.replace(op, secret_sha256=hash_secret("rpk_y")))
        with pytest.raises(ValidationError):
            await svc.call(local, msgspec.structs.replace(op, id="key_x"))
        # a node of a cluster makes no key over the wire, and says where they are made
        keys.store = ("etcd://127.0.0.1:2379", "c1")
        admin = Session(space="team-a", permissions=frozenset(["admin"]), key_id=op.id)
        keys.table[op.id].revoked_at_ms = None  # (a live admin key for the check below)
        with pytest.raises(ForbiddenError) as e:
            await svc.call(admin, p.KeyCreate(space="team-a", permissions=["coordination_read"]))
        assert "rallypoint keys create --cluster etcd://127.0.0.1:2379 --cluster-name c1" in e.value.message
        with pytest.raises(ForbiddenError) as e:
            await svc.call(admin, p.KeyRevoke(key_id=op.id))
        assert "rallypoint keys revoke --cluster" in e.value.message


async def test_a_key_made_in_etcd_works_on_every_shard_and_its_revocation_everywhere(etcd, tmp_path, cluster_name):
    base = ["--cluster", etcd.endpoints[0], "--cluster-name", cluster_name]
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n)
        addrs = leaders_of(members)
        assert all([await try_status(a, None) for a in addrs.values()])  # open mode

        # the first key of a running cluster ends open mode: refused without --force
        out = await trio.to_thread.run_sync(lambda: cli("keys", "create", *base, "--space", "default",
                                                        "--permission", "admin", "--secret-only"))
        assert out.returncode == 2 and "open mode" in out.stderr
        out = await trio.to_thread.run_sync(lambda: cli("keys", "create", *base, "--space", "default",
                                                        "--permission", "admin", "--name", "ops", "--force",
                                                        "--json"))
        assert out.returncode == 0, out.stderr
        made = msgspec.json.decode(out.stdout)
        secret, kid = made["secret"], made["id"]
        # every shard's leader takes it before long: open mode is over on every shard
        await wait_until(lambda: all(kid in leader(ms).node.coordinator.keys.table for ms in members.values()),
                         timeout=30, what=lambda: {s: leader(ms).keys_adopted for s, ms in members.items()})
        for s, a in addrs.items():
            assert isinstance(await try_status(a, None), UnauthenticatedError), s
            assert await try_status(a, secret) is True, s
        out = await trio.to_thread.run_sync(lambda: cli("keys", "list", *base))
        assert out.returncode == 0 and kid in out.stdout and "live" in out.stdout

        async with rallypoint.connect(urls(members), api_key=secret) as rs:
            runs = [await rs.scopes.create() for _ in range(3)]  # one on every shard
            # keys are made in etcd, not over the wire: refused naming the command
            with pytest.raises(ForbiddenError) as e:
                await rs._transport.call(p.KeyCreate(space="default", permissions=["coordination_read"]))
            assert f"rallypoint keys create --cluster" in e.value.message

            # revoked in etcd: refused on every shard within a bounded wait (one watch
            # round trip), by a new connection and by this open one alike; a receive the
            # key had parked on a run's shard ends UNAUTHENTICATED (issue 41 item 3: the
            # shard's key.adopt applies the revocation, and that apply ends its waits)
            await rs._call(p.MailboxEnsure(name="jobs"), p.MailboxView)
            parked: list = []

            async def receive():
                try:
                    await rs._call(p.Receive(mailbox="jobs", scope_id=runs[0].id, wait_ms=60_000), p.ReceiveView)
                except Exception as e:
                    parked.append(e)

            def waits() -> int:
                return sum(leader(ms).node.coordinator.runtime.n_waiters for ms in members.values())

            async with trio.open_nursery() as pn:
                pn.start_soon(receive)
                await wait_until(lambda: waits() == 1, timeout=10)
                out = await trio.to_thread.run_sync(lambda: cli("keys", "revoke", *base, kid))
                assert out.returncode == 0, out.stderr
                with trio.fail_after(10):
                    while not all([isinstance(await try_status(a, secret), UnauthenticatedError)
                                   for a in addrs.values()]):
                        await trio.sleep(0.05)
                await wait_until(lambda: parked, timeout=10)
            assert isinstance(parked[0], UnauthenticatedError) and parked[0].details["reason"] == "key_revoked", parked
            assert waits() == 0
            for r in runs:
                with pytest.raises(UnauthenticatedError):
                    await r.status()
        out = await trio.to_thread.run_sync(lambda: cli("keys", "list", *base, "--json"))
        assert msgspec.json.decode(out.stdout)[0]["revoked_at"] is not None

        # a standby that takes over has the keys (through the journal, not taken again)
        async with EtcdClient(etcd.endpoints) as client:
            rec, secret2 = await keystore.create_key(client, cluster_name, "default", ["coordination_read"])
        await wait_until(lambda: all(rec.id in leader(ms).node.coordinator.keys.table for ms in members.values()),
                         timeout=30)
        old = leader(members[1])
        old.stop()
        await wait_until(lambda: any(m.role == "leader" and m is not old for m in members[1]))
        new = leader(members[1])
        assert new.keys_adopted == 0  # nothing to take: it had both from the journal
        assert await try_status(f"127.0.0.1:{new.client_port}", secret2) is True
        assert isinstance(await try_status(f"127.0.0.1:{new.client_port}", secret), UnauthenticatedError)
        n.cancel_scope.cancel()


async def test_a_new_leader_takes_the_keys_before_it_serves(etcd, tmp_path, cluster_name, monkeypatch):
    import test_cluster_shards as tcs
    from rallypoint.cluster.member import MemberConfig, ShardMember
    from rallypoint.nodeconfig import StorageOptions
    from rallypoint.transport.server import Server

    serving_with: dict[int, int] = {}  # shard -> keys its coordinator held when its client port opened

    class Watched(Server):
        async def serve(self, *args, **kw):
            coord = getattr(self.dispatcher, "coordinator", None)
            if coord is not None:
                serving_with[coord.sharding.shard] = len(coord.keys.table)
            return await super().serve(*args, **kw)

    def member(etcd, tmp_path, name, cluster, shard):
        cfg = MemberConfig(etcd=etcd.endpoints, node=name, data_dir=str(tmp_path / name), cluster=cluster,
                           shard=shard, client=("127.0.0.1", 0), replication=("127.0.0.1", 0), isr_timeout_s=0.5,
                           storage=StorageOptions(sync_helper="thread"))
        return ShardMember(cfg, make_server=lambda d: Watched(d))

    monkeypatch.setattr(tcs, "member", member)
    # keys made in etcd before any node starts: no shard ever serves in open mode
    async with EtcdClient(etcd.endpoints) as client:
        rec, secret = await keystore.create_key(client, cluster_name, "default", ["admin"])
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n, shards=2, nodes=1)
        assert serving_with == {0: 1, 1: 1}
        for s, a in leaders_of(members).items():
            assert leader(members[s]).keys_adopted == 1
            assert isinstance(await try_status(a, None), UnauthenticatedError)
            assert await try_status(a, secret) is True
        n.cancel_scope.cancel()
