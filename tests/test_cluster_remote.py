"""Runs that use their space's home shard, over two in-process shards (no etcd, no
sockets): the home shard links a run of the other shard before its first claim, pool,
quota or budget request (``run.link`` there, a remote run here), and the run's end
comes back through the run shard's outbox, delivered at least once and applied once.

The calls between the shards go straight to the other node's Service with a node
session (what a connection authenticated by the node secret gets); the loopback tests
with etcd are in tests/test_cluster_remote_etcd.py."""

from __future__ import annotations

import msgspec
import pytest
import trio

from rallypoint import protocol as p
from rallypoint.actors.sharding import Sharding, home_slot
from rallypoint.cluster.peers import OutboxSender, RemoteRuns, Reserver
from rallypoint.cluster.peerauth import TokenVerifier, make_token
from rallypoint.errors import ForbiddenError, RallypointError, ScopeCancelledError, UnauthenticatedError, UnavailableError
from rallypoint.ids import slot_of
from rallypoint.node import open_node
from rallypoint.records import RemoteRunEnded
from rallypoint.service import Session
from rallypoint.wire import PROTOCOL_VERSION, Hello

SLOTS = 4
SECRET = "node-secret-for-tests"


def owners_with_home_on_0(space="default"):
    h = home_slot(space, SLOTS)
    return [0 if x == h else 1 for x in range(SLOTS)]


class LoopPeers:
    """Peers whose calls go to the other in-process node with a node session;
    ``down`` shards answer UNAVAILABLE (a shard whose leader is unreachable)."""

    def __init__(self, services):
        self.services = services
        self.down: set[int] = set()
        self.calls: list[tuple[int, str]] = []

    async def call(self, shard, op):
        self.calls.append((shard, op.__struct_config__.tag))
        if shard in self.down:
            raise UnavailableError(f"shard {shard} is down")
        return await self.services[shard].call(Session(node=True), op)


class Two:
    def __init__(self, nodes, peers, sender, nursery):
        self.nodes = nodes
        self.peers = peers
        self.sender = sender
        self.nursery = nursery
        self.user = Session()

    def coord(self, shard):
        return self.nodes[shard].coordinator

    async def call(self, shard, op, type_=None):
        raw = await self.nodes[shard].service.call(self.user, op)
        return msgspec.msgpack.decode(raw, type=type_) if type_ is not None else raw


async def open_two(nursery, stack):
    owners = owners_with_home_on_0()
    nodes = {}
    for s in (0, 1):
        node = await stack.enter_async_context(open_node(None))
        journal = node.coordinator.journal
        journal.payloads = []  # every entry, for the replay test

        def append(payload, _orig=journal.append, _keep=journal.payloads):
            _keep.append(bytes(payload))
            return _orig(payload)

        journal.append = append
        node.coordinator.sharding = Sharding(s, owners, version=1)
        node.service.node_secret = SECRET
        node.service.node_tokens = TokenVerifier(SECRET, "c")
        node.service.shard = s
        nodes[s] = node
    peers = LoopPeers({s: n.service for s, n in nodes.items()})
    nodes[0].service.remote_runs = RemoteRuns(nodes[0].service, peers, nursery)
    sender = OutboxSender(nodes[1].service, peers, 1, retry_s=0.05)
    await nursery.start(sender.run)
    two = Two(nodes, peers, sender, nursery)
    two.reserver = Reserver(nodes[1].service, peers, retry_s=0.05)
    await nursery.start(two.reserver.run)
    return two


async def wait_for(pred, what="", timeout=10):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.005)


@pytest.fixture
async def two(nursery):
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        yield await open_two(nursery, stack)
        nursery.cancel_scope.cancel()


async def new_run(two, shard=1):
    v = await two.call(shard, p.ScopeCreate(), p.ScopeView)
    assert two.coord(0).sharding.owners[slot_of(v.id)] == shard
    return v.id


async def test_a_claim_of_a_run_of_another_shard_links_it_and_its_end_answers_the_waiter(two):
    r1 = await new_run(two)
    r2 = await new_run(two)
    lease = await two.call(0, p.ClaimAcquire(scope_id=r1, key="deploy"), p.ClaimLeaseView)
    assert lease.status == "ACQUIRED" and lease.claim.scope_id == r1
    # the run's shard journaled the link, the home shard holds a remote run (no tree)
    assert two.coord(1).runs.table[r1].links == (0,)
    stub = two.coord(0).runs.table[r1]
    assert stub.remote_shard == 1 and stub.state == "ACTIVE"
    assert two.coord(0).runs.counts.get("default", {}).get("ACTIVE", 0) == 0  # not counted as a run here
    listed = await two.call(0, p.ScopeList(), p.ScopeListView)
    assert r1 not in [s.id for s in listed.scopes]

    async def waiter():
        with pytest.raises(ScopeCancelledError):
            await two.call(0, p.ClaimAcquire(scope_id=r2, key="deploy", wait_ms=60_000, request_id="w2"))
        done.set()

    done = trio.Event()
    two.nursery.start_soon(waiter)
    await wait_for(lambda: len(two.coord(0).claims.line(two.coord(0).claims.get("default", "deploy"))) == 1)
    await two.call(1, p.ScopeCancel(scope_id=r2))  # on the run's shard
    with trio.fail_after(10):
        await done.wait()  # the home shard's parked acquire answered with the run's code
    assert len(two.coord(0).claims.line(two.coord(0).claims.get("default", "deploy"))) == 0
    assert two.coord(0).runs.table[r2].state == "CANCELLED"
    await wait_for(lambda: not two.coord(1).outbox.pending())  # acknowledged, out of the outbox
    assert two.coord(1).outbox.acked(0) == 1 and two.coord(0).outbox.received(1) == 1


async def test_a_pool_waiter_of_a_cancelled_remote_run_is_answered_and_its_grant_is_refused_renewal(two):
    await two.call(0, p.PoolEnsure(name="gpu", units_total=1))
    r1 = await new_run(two)
    r2 = await new_run(two)
    local = (await two.call(0, p.ScopeCreate(), p.ScopeView)).id  # a run of the home shard itself
    got = await two.call(0, p.PoolAcquire(pool="gpu", scope_id=r1), p.PoolAcquireView)
    assert got.status == "ACQUIRED"
    grant = got.grant
    answers = {}

    async def acquire(name, run):
        try:
            answers[name] = await two.call(0, p.PoolAcquire(pool="gpu", scope_id=run, wait_ms=60_000,
                                                            request_id=name), p.PoolAcquireView)
        except RallypointError as e:
            answers[name] = e

    two.nursery.start_soon(acquire, "r2", r2)
    pool = two.coord(0).pools.get("default", "gpu")
    await wait_for(lambda: len(two.coord(0).pools.line(pool)) == 1)
    two.nursery.start_soon(acquire, "local", local)
    await wait_for(lambda: len(two.coord(0).pools.line(pool)) == 2)
    await two.call(1, p.ScopeCancel(scope_id=r2))
    await wait_for(lambda: "r2" in answers)
    assert isinstance(answers["r2"], ScopeCancelledError)  # the waiter parked on the home shard
    assert [w.request_id for w in two.coord(0).pools.line(pool)] == ["local"]
    await two.call(1, p.ScopeCancel(scope_id=r1))
    await wait_for(lambda: two.coord(0).runs.table[r1].state == "CANCELLED")
    with pytest.raises(ScopeCancelledError):  # as on one node: the ended run's grant is not renewed
        await two.call(0, p.GrantRenew(grant_id=grant.id, token=grant.token))
    await two.call(0, p.GrantRelease(grant_id=grant.id, token=grant.token))  # release stays allowed
    await wait_for(lambda: "local" in answers)
    assert answers["local"].status == "ACQUIRED"  # the units went to the next in line


async def test_quotas_and_budgets_take_a_remote_run_and_refuse_it_once_it_ended(two):
    await two.call(0, p.QuotaEnsure(name="api", units_limit=5, window_ms=60_000))
    await two.call(0, p.BudgetEnsure(name="spend", limit_minor=1000))
    r1 = await new_run(two)
    take = await two.call(0, p.QuotaTake(quota="api", scope_id=r1, units=2), p.QuotaTakeView)
    assert take.state == "GRANTED" and take.scope_id == r1
    res = await two.call(0, p.BudgetReserve(budget="spend", scope_id=r1, amount_minor=100), p.ReservationView)
    assert res.state == "ACTIVE"
    assert [tag for _s, tag in two.peers.calls].count("run.link") == 1  # linked once
    await two.call(1, p.ScopeCancel(scope_id=r1))
    await wait_for(lambda: two.coord(0).runs.table[r1].state == "CANCELLED")
    with pytest.raises(ScopeCancelledError):
        await two.call(0, p.QuotaTake(quota="api", scope_id=r1))
    with pytest.raises(ScopeCancelledError):
        await two.call(0, p.BudgetReserve(budget="spend", scope_id=r1, amount_minor=1))
    # settling stays possible after the run's end, as on one node
    await two.call(0, p.BudgetSettle(reservation_id=res.id, amount_minor=40, usage_key="u1"))


async def test_an_ended_run_is_never_linked_and_a_child_ends_with_its_ancestor(two):
    r1 = await new_run(two)
    await two.call(1, p.ScopeCancel(scope_id=r1))
    with pytest.raises(ScopeCancelledError):
        await two.call(0, p.ClaimAcquire(scope_id=r1, key="k"))
    assert r1 not in two.coord(0).runs.table and two.coord(1).runs.table[r1].links == ()
    root = await new_run(two)
    child = (await two.call(1, p.ScopeCreate(parent_id=root), p.ScopeView)).id
    await two.call(0, p.ClaimAcquire(scope_id=child, key="k2"))
    await two.call(1, p.ScopeCancel(scope_id=root))  # the child ends in its ancestor's step
    await wait_for(lambda: two.coord(0).runs.table[child].state == "CANCELLED")
    assert two.coord(1).runs.table[child].links == ()  # told once


async def test_the_outbox_is_delivered_again_after_a_failure_and_applied_once(two):
    r1 = await new_run(two)
    r2 = await new_run(two)
    for r in (r1, r2):
        await two.call(0, p.ClaimAcquire(scope_id=r, key="k-" + r))
    two.peers.down.add(0)  # the home shard's leader cannot be reached
    await two.call(1, p.ScopeCancel(scope_id=r1))
    await wait_for(lambda: two.sender.failures >= 2)
    assert two.coord(1).outbox.pending() and two.coord(0).runs.table[r1].state == "ACTIVE"
    two.peers.down.clear()
    await wait_for(lambda: two.coord(0).runs.table[r1].state == "CANCELLED")
    await wait_for(lambda: not two.coord(1).outbox.pending())
    # a delivery repeated (an answer lost on the way back, a new leader sending again):
    # nothing is applied twice
    applied = []
    coord0 = two.coord(0)
    orig = coord0._apply[RemoteRunEnded]
    coord0._apply[RemoteRunEnded] = lambda r: (applied.append(r.seq), orig(r))
    item = p.OutboxItem(seq=1, run_id=r1, space="default", reason="cancelled", at_ms=0)
    again = await two.nodes[0].service.call(Session(node=True), p.OutboxDeliver(source=1, items=[item]))
    assert msgspec.msgpack.decode(again, type=p.OutboxDeliverView).received == 1 and applied == []
    await two.call(1, p.ScopeCancel(scope_id=r2))
    await wait_for(lambda: coord0.runs.table[r2].state == "CANCELLED")
    assert applied == [2]


async def test_an_end_that_arrives_before_the_link_leaves_the_remote_run_ended(two):
    # the run ended between its link and the home shard's adoption: the outbox entry
    # makes the remote run, ended; the adoption then changes nothing
    r1 = await new_run(two)
    await two.nodes[1].service.call(Session(node=True), p.RunLink(scope_id=r1, space="default", shard=0))
    await two.call(1, p.ScopeCancel(scope_id=r1))
    await wait_for(lambda: r1 in two.coord(0).runs.table)
    assert two.coord(0).runs.table[r1].state == "CANCELLED"
    await two.nodes[0].service.call(Session(local=True), p.RemoteRunAdopt(scope_id=r1, space="default", shard=1))
    with pytest.raises(ScopeCancelledError):
        await two.call(0, p.ClaimAcquire(scope_id=r1, key="late"))


async def test_the_calls_between_shards_need_a_node_token_of_the_node_secret(two):
    r1 = await new_run(two)
    for shard, op in ((1, p.RunLink(scope_id=r1, space="default", shard=0)),
                      (0, p.OutboxDeliver(source=1, items=[])),
                      (0, p.RemoteRunAdopt(scope_id=r1, space="default", shard=1)),
                      (1, p.OutboxAck(shard=0, seq=1))):
        with pytest.raises(ForbiddenError):  # an open-mode session holds every permission, yet not these
            await two.call(shard, op)
    service = two.nodes[0].service
    token = make_token(SECRET, purpose="session", cluster="c", node="n1", target=str(service.shard))
    session, _ok = service.hello(Hello(PROTOCOL_VERSION, token), "peer")
    assert session.node
    session, _ok = service.hello(Hello(PROTOCOL_VERSION, SECRET), "peer")
    assert not session.node  # the secret itself is never a credential (open mode: an ordinary session)
    with pytest.raises(UnauthenticatedError):  # a token of another secret
        service.hello(Hello(PROTOCOL_VERSION, make_token(SECRET + "x", purpose="session", cluster="c", node="n1",
                                                          target=str(service.shard))), "peer")
    with pytest.raises(ForbiddenError):  # the in-process steps are not taken from a node either
        await service.call(Session(node=True), p.RemoteRunAdopt(scope_id=r1, space="default", shard=1))
    with pytest.raises(ForbiddenError):  # and a node session makes nothing but those calls
        await service.call(Session(node=True), p.ScopeCreate())


async def test_a_link_to_an_unreachable_run_shard_answers_unavailable(two):
    r1 = await new_run(two)
    two.peers.down.add(1)
    with pytest.raises(UnavailableError):
        await two.call(0, p.ClaimAcquire(scope_id=r1, key="k"))
    assert r1 not in two.coord(0).runs.table


async def test_the_outbox_links_and_remote_runs_are_the_same_after_a_replay(two):
    # what a standby or a restarted node has: the same outbox, links and remote runs
    from rallypoint.actors.coordinator import Coordinator

    await jobs_on_both(two)
    await two.call(0, p.PoolEnsure(name="gpu", units_total=1))
    r0 = await new_run(two)
    await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r0, requirements=p.Requirements(pools={"gpu": 1})))
    (d,) = (await two.call(1, p.Receive(mailbox="jobs", scope_id=r0, wait_ms=10_000), p.ReceiveView)).deliveries
    await wait_for(lambda: two.coord(0).outbox.holds["adm:" + d.task_id].confirmed)
    r1 = await new_run(two)
    await two.call(0, p.ClaimAcquire(scope_id=r1, key="k"))
    two.peers.down.add(0)
    await two.call(1, p.ScopeCancel(scope_id=r1))
    await wait_for(lambda: two.sender.failures >= 1)
    assert two.coord(0).outbox.inbox and two.coord(1).outbox.reserved and two.coord(1).outbox.table
    for shard in (0, 1):
        coord = two.coord(shard)
        fresh = Coordinator()
        for payload in coord.journal.payloads:
            fresh.replay(payload)
        for table in ("table", "inbox", "holds", "reserved"):
            assert {k: msgspec.to_builtins(v) for k, v in getattr(fresh.outbox, table).items()} == \
                   {k: msgspec.to_builtins(v) for k, v in getattr(coord.outbox, table).items()}, (shard, table)
        assert msgspec.to_builtins(fresh.runs.table[r1]) == msgspec.to_builtins(coord.runs.table[r1])


# ---------------------------------------------------------------------------- admission


async def jobs_on_both(two):
    home = await two.call(0, p.MailboxEnsure(name="jobs"), p.MailboxView)
    await two.call(1, p.MailboxEnsure(name="jobs", id=home.id))  # as the router adopts it


async def test_a_task_of_another_shard_needing_pool_units_is_reserved_on_home_then_delivered(two):
    await jobs_on_both(two)
    await two.call(0, p.PoolEnsure(name="gpu", units_total=2))
    await two.call(0, p.BudgetEnsure(name="spend", limit_minor=1000))
    r1 = await new_run(two)
    t = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1, requirements=p.Requirements(
        pools={"gpu": 2}, budgets={"spend": 40})), p.TaskView)
    assert two.coord(1).queues.tasks[t.id].requirements.remote.pools == {"gpu": 2}  # kept by name here
    got = await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=10_000), p.ReceiveView)
    (d,) = got.deliveries
    assert d.task_id == t.id and [g.units for g in d.grants] == [2] and len(d.reservations) == 1
    home = two.coord(0)
    pool = home.pools.get("default", "gpu")
    assert home.pools.view(pool).units_used == 2  # the grant lives on the home shard
    assert home.budgets.get("default", "spend").reserved_minor == 40
    await wait_for(lambda: home.outbox.holds["adm:" + t.id].confirmed)  # the delivery was told: no lapse
    await two.call(1, p.DeliveryComplete(task_id=t.id, token=d.token))
    await wait_for(lambda: home.pools.view(pool).units_used == 0)  # the delivery's end, through the outbox
    b = home.budgets.get("default", "spend")
    assert b.reserved_minor == 0 and b.settled_minor == 40  # settled in full: the task succeeded
    assert home.outbox.holds["adm:" + t.id].ended == "delivery_ended"


async def test_a_second_task_waits_for_the_units_and_gets_them_when_the_first_delivery_ends(two):
    await jobs_on_both(two)
    await two.call(0, p.PoolEnsure(name="gpu", units_total=1))
    # no polling: the reserve that did not fit is asked again when this shard's outbox
    # has given the units back (the first delivery's end)
    two.reserver.retry_s = 3600
    r1 = await new_run(two)
    a = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1, requirements=p.Requirements(pools={"gpu": 1})),
                       p.TaskView)
    b = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1, requirements=p.Requirements(pools={"gpu": 1})),
                       p.TaskView)
    (da,) = (await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=10_000), p.ReceiveView)).deliveries
    assert da.task_id == a.id
    nothing = await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=300), p.ReceiveView)
    assert nothing.deliveries == [] and two.reserver.waiting >= 1  # b's reservation does not fit yet
    await two.call(1, p.DeliveryReject(task_id=a.id, token=da.token, error=msgspec.Raw(b"\xc0")))
    (db,) = (await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=10_000), p.ReceiveView)).deliveries
    assert db.task_id == b.id and [g.units for g in db.grants] == [1]


async def test_a_reservation_whose_delivery_never_happened_lapses(two):
    await two.call(0, p.PoolEnsure(name="gpu", units_total=1))
    await two.call(0, p.BudgetEnsure(name="spend", limit_minor=100))
    r1 = await new_run(two)
    home = two.coord(0)
    op = p.AdmissionReserve(space="default", scope_id=r1, task_id="tsk_fake", token=1, pools={"gpu": 1},
                            budgets={"spend": 30}, lease_ms=300)
    v = msgspec.msgpack.decode(await two.nodes[0].service.call(Session(node=True), op), type=p.AdmissionReserveView)
    assert v.status == "GRANTED"
    again = msgspec.msgpack.decode(await two.nodes[0].service.call(Session(node=True), op),
                                   type=p.AdmissionReserveView)
    assert [g.id for g in again.grants] == [g.id for g in v.grants]  # idempotent per (task, token)
    pool = home.pools.get("default", "gpu")
    assert home.pools.view(pool).units_used == 1 and home.budgets.get("default", "spend").reserved_minor == 30
    await wait_for(lambda: home.outbox.holds["adm:tsk_fake"].ended == "lapsed")  # nobody confirmed it
    assert home.pools.view(pool).units_used == 0
    b = home.budgets.get("default", "spend")
    assert b.reserved_minor == 0 and b.settled_minor == 0  # voided
    stale = op.__class__(**{**msgspec.structs.asdict(op), "token": 0})
    with pytest.raises(RallypointError) as e:  # fenced: an older token than one that was held
        await two.nodes[0].service.call(Session(node=True), stale)
    assert e.value.code == "STALE_CLAIM"


async def test_requirements_the_home_shard_can_never_grant_cancel_the_task(two):
    await jobs_on_both(two)
    r1 = await new_run(two)
    t = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1, requirements=p.Requirements(
        pools={"no-such-pool": 1})), p.TaskView)
    got = await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=300), p.ReceiveView)
    assert got.deliveries == []
    await wait_for(lambda: two.coord(1).queues.tasks[t.id].state == "CANCELLED")
    assert two.reserver.refused == 1


async def test_an_old_reservation_with_too_little_lease_left_is_let_lapse_and_made_again(two):
    # a reservation made earlier for the same delivery (a reserve whose answer was
    # lost, say) holds 1.5 s: half of what is left is under the reserver's minimum (1 s),
    # so it is not used; it lapses on the home shard, and the next reserve makes a new one
    await jobs_on_both(two)
    await two.call(0, p.PoolEnsure(name="gpu", units_total=1))
    r1 = await new_run(two)
    t = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1, requirements=p.Requirements(pools={"gpu": 1})),
                       p.TaskView)
    home = two.coord(0)
    early = p.AdmissionReserve(space="default", scope_id=r1, task_id=t.id, token=1, pools={"gpu": 1}, lease_ms=1500)
    await two.nodes[0].service.call(Session(node=True), early)
    first = home.outbox.holds["adm:" + t.id]
    got = await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=10_000), p.ReceiveView)
    (d,) = got.deliveries
    assert d.task_id == t.id and first.ended == "lapsed" and two.reserver.waiting >= 1
    second = home.outbox.holds["adm:" + t.id]
    assert second is not first and second.token == 1 and [g.id for g in d.grants] == second.grants
    await wait_for(lambda: home.outbox.holds["adm:" + t.id].confirmed)


async def test_a_budget_reservation_for_a_delivery_of_another_shard_is_refused_clearly(two):
    from rallypoint.errors import ValidationError

    await jobs_on_both(two)
    await two.call(0, p.BudgetEnsure(name="spend", limit_minor=100))
    r1 = await new_run(two)
    t = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1), p.TaskView)
    (d,) = (await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=10_000), p.ReceiveView)).deliveries
    with pytest.raises(ValidationError) as e:
        await two.call(0, p.BudgetReserve(budget="spend", scope_id=r1, amount_minor=5, task_id=t.id, token=d.token))
    assert e.value.details.get("cross_shard")


async def test_a_queues_default_requirements_reach_the_tasks_of_another_shard(two):
    await two.call(0, p.PoolEnsure(name="gpu", units_total=1))
    reqs = p.Requirements(pools={"gpu": 1})
    home = await two.call(0, p.MailboxEnsure(name="jobs", requirements=reqs), p.MailboxView)
    await two.call(1, p.MailboxEnsure(name="jobs", id=home.id, requirements=reqs))  # as the router adopts it
    r1 = await new_run(two)
    t = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1), p.TaskView)  # none of its own
    assert two.coord(1).queues.tasks[t.id].requirements.remote.pools == {"gpu": 1}
    (d,) = (await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=10_000), p.ReceiveView)).deliveries
    assert [g.units for g in d.grants] == [1]
    assert two.coord(0).pools.view(two.coord(0).pools.get("default", "gpu")).units_used == 1


async def test_a_task_no_receive_asks_for_any_more_is_not_reserved_again(two):
    await jobs_on_both(two)
    await two.call(0, p.PoolEnsure(name="gpu", units_total=1))
    r1 = await new_run(two)
    holder = (await two.call(0, p.ScopeCreate(), p.ScopeView)).id
    await two.call(0, p.PoolAcquire(pool="gpu", scope_id=holder))  # every unit taken: reserves wait
    t = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1, requirements=p.Requirements(pools={"gpu": 1})),
                       p.TaskView)
    two.reserver.forget_after_ms = 300
    got = await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=100), p.ReceiveView)
    assert got.deliveries == [] and t.id in two.coord(1).outbox.wanted
    # no receive asked for 0.3 s: the reserver forgets it (and asks the home shard nothing)
    await wait_for(lambda: t.id not in two.coord(1).outbox.wanted)
    assert two.reserver.waiting >= 1 and not two.coord(1).outbox.wanted


async def test_retention_purges_an_ended_remote_run_and_its_reservations_and_a_late_request_is_refused(two):
    await jobs_on_both(two)
    await two.call(0, p.PoolEnsure(name="gpu", units_total=1))
    await two.call(0, p.BudgetEnsure(name="spend", limit_minor=100))
    home = two.coord(0)
    home.retention.retain_ms = 0  # (the daemon keeps finished runs 7 days by default)
    r1 = await new_run(two)
    lease = await two.call(0, p.ClaimAcquire(scope_id=r1, key="k"), p.ClaimLeaseView)
    await two.call(0, p.ClaimRelease(key="k", token=lease.token))
    t = await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1, requirements=p.Requirements(
        pools={"gpu": 1}, budgets={"spend": 10})), p.TaskView)
    (d,) = (await two.call(1, p.Receive(mailbox="jobs", scope_id=r1, wait_ms=10_000), p.ReceiveView)).deliveries
    await two.call(1, p.DeliveryComplete(task_id=t.id, token=d.token))
    await wait_for(lambda: home.outbox.holds["adm:" + t.id].ended == "delivery_ended")
    grant_id, res_id = d.grants[0].id, d.reservations[0]
    await two.call(1, p.ScopeCancel(scope_id=r1))
    await wait_for(lambda: r1 in home.runs.table and home.runs.table[r1].state == "CANCELLED")
    home.retention.purge_due(home.now_ms() + 1)
    assert r1 not in home.runs.table  # the remote run went, with what it held here
    assert "adm:" + t.id not in home.outbox.holds
    assert grant_id not in home.pools.grants and res_id not in home.budgets.reservations
    with pytest.raises(ScopeCancelledError):  # linked again: its shard says it ended
        await two.call(0, p.ClaimAcquire(scope_id=r1, key="k2"))
    assert r1 not in home.runs.table


async def test_no_clients_key_makes_a_call_between_shards_not_even_an_operators(two):
    # issue 43: the calls between shards were declared with the "operator" permission, so
    # an operator's key could forge an outbox delivery or a remote run's admission; they
    # are NODE now (a node session only), the node's own steps LOCAL
    r1 = await new_run(two)
    service = two.nodes[0].service
    operator = Session(permissions=frozenset({"operator", "admin"}))
    for op in (p.OutboxDeliver(source=1, items=[]), p.RunLink(scope_id=r1, space="default", shard=0),
               p.AdmissionReserve(space="default", scope_id=r1, task_id="tsk_x", token=1),
               p.OutboxAck(shard=1, seq=1), p.KeyAdopt(id="key_x", space="default", permissions=["admin"],
                                                          secret_sha256="x" * 64, created_at_ms=0)):
        with pytest.raises(ForbiddenError, match="made only by its nodes|a step the node takes itself"):
            await service.call(operator, op)


class _SpyKind:
    """A requirement kind standing in for another (every call passes through to it),
    with its own limit of names and a switch for ``requirement_fits``: what a new
    requirement type would be to the admission registry."""

    requirement_max_names = 1

    def __init__(self, real):
        self.real = real
        self.calls: list[str] = []
        self.fits = True

    def __getattr__(self, name):
        return getattr(self.real, name)

    def requirement_prepare(self, space, value):
        self.calls.append("prepare")
        return self.real.requirement_prepare(space, value)

    def requirement_fits(self, value, pending, task=None):
        self.calls.append("fits")
        return self.fits and self.real.requirement_fits(value, pending, task)

    def requirement_records(self, task, value, at_ms):
        self.calls.append("records")
        return self.real.requirement_records(task, value, at_ms)


def test_every_requirement_type_has_its_cross_shard_fields():
    # a new requirement type (a line in REQUIREMENT_KINDS) that the cross-shard Structs
    # do not carry could not be admitted for a run of another shard than its space's home
    from rallypoint.actors.admission import REQUIREMENT_KINDS
    from rallypoint.actors.coordinator import Coordinator
    from rallypoint.records import RemoteRequirements, TaskRequirements

    coord = Coordinator()
    for field, attr in REQUIREMENT_KINDS.items():
        for struct in (p.Requirements, TaskRequirements, RemoteRequirements, p.AdmissionReserve):
            assert field in struct.__struct_fields__, (field, struct.__name__)
        assert isinstance(getattr(coord, attr).requirement_max_names, int), field


async def test_cross_shard_admission_decides_through_the_requirement_registry(two, monkeypatch):
    # issue 43: admission.reserve hard-coded pools and budgets and re-declared their
    # limits; every requirement type now goes through the registry local admission uses
    # (its kind's prepare, fits and records on the home shard, its limit of names on the
    # run's shard), so a type swapped in the registry is the one consulted
    from rallypoint.actors.admission import REQUIREMENT_KINDS

    await jobs_on_both(two)
    await two.call(0, p.BudgetEnsure(name="spend", limit_minor=100))
    await two.call(0, p.BudgetEnsure(name="other", limit_minor=100))
    home, run_shard = two.coord(0), two.coord(1)
    spies = {0: _SpyKind(home.budgets), 1: _SpyKind(run_shard.budgets)}
    for shard, spy in spies.items():
        monkeypatch.setattr(two.coord(shard), "spy_budgets", spy, raising=False)
    monkeypatch.setitem(REQUIREMENT_KINDS, "budgets", "spy_budgets")
    r1 = await new_run(two)
    with pytest.raises(RallypointError) as e:  # the spy's limit (1 name), not the budgets' own (2)
        await two.call(1, p.TaskSubmit(mailbox="jobs", scope_id=r1, requirements=p.Requirements(
            budgets={"spend": 1, "other": 1})))
    assert e.value.code == "VALIDATION_FAILED" and "at most 1" in e.value.message

    op = p.AdmissionReserve(space="default", scope_id=r1, task_id="tsk_spy", token=1, budgets={"spend": 30})
    spies[0].fits = False
    v = msgspec.msgpack.decode(await two.nodes[0].service.call(Session(node=True), op), type=p.AdmissionReserveView)
    assert v.status == "WAITING" and spies[0].calls == ["prepare", "fits"]
    assert home.budgets.get("default", "spend").reserved_minor == 0  # nothing taken
    spies[0].fits = True
    spies[0].calls.clear()
    v = msgspec.msgpack.decode(await two.nodes[0].service.call(Session(node=True), op), type=p.AdmissionReserveView)
    assert v.status == "GRANTED" and spies[0].calls == ["prepare", "fits", "records"]
    assert len(v.reservations) == 1 and home.budgets.get("default", "spend").reserved_minor == 30
