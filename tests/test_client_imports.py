"""The client imports no server module (issue 43): the facts it needs of each op -- its
shard, how a fan-out op's answers merge, its re-send rule -- travel in
``rallypoint.opfacts`` (generated from the ``@op`` marks, with the names of the shared
``rallypoint.opdecl``), and the routing arithmetic in ``rallypoint.slots``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import rallypoint
from rallypoint import opfacts
from rallypoint.actors.api import TABLE, render_opfacts
from rallypoint.opdecl import resend_if

SERVER_PACKAGES = ("rallypoint.actors", "rallypoint.cluster", "rallypoint.replication", "rallypoint.persistence",
                   "rallypoint.service", "rallypoint.node")


def test_the_client_routes_and_re_sends_without_importing_a_server_module():
    # in a fresh interpreter: route a fan-out and a split list through the SDK's router,
    # decide re-sends and reconcile rules as the reconnecting transport does
    code = textwrap.dedent('''
        import sys, trio, msgspec
        import rallypoint
        from rallypoint import protocol as p
        from rallypoint.client import api, consume, follow, shardevents, types  # noqa: F401
        from rallypoint.client import reconnect
        from rallypoint.client.router import ShardedTransport
        from rallypoint.ids import IdGenerator

        class Shard:
            def __init__(self, n):
                self.n, self.calls = n, []
            async def call(self, op):
                self.calls.append(op)
                if isinstance(op, p.ServerStatus):
                    return p.encoder.encode(p.ServerStatusView(
                        version="t", protocol_version=1, uptime_s=1.0, connections=1, durability="fsync",
                        runs={"ACTIVE": 1}, tasks={}, entities=10, last_lsn=1, durable_lsn=1))
                return p.encoder.encode(p.TaskListView(ids=[], outcomes=[
                    p.TaskOutcomeView(id=t, state="SUCCEEDED", attempt=1, outcome=msgspec.Raw(b"\\xc0"),
                                      outcome_reason=None, error=msgspec.Raw(b"\\xc0")) for t in op.task_ids]))

        async def main():
            st = ShardedTransport(["tcp://x:1"], None, None, "default")
            st.map = p.ClusterMapView(cluster="c", version=1, owners=[0, 1],
                                      shards=[p.ShardView(shard=0), p.ShardView(shard=1)])
            st.shards = {0: Shard(0), 1: Shard(1)}
            v = msgspec.msgpack.decode(await st.call(p.ServerStatus()), type=p.ServerStatusView)
            assert v.entities == 20, v
            g = IdGenerator()
            ids = [g.new("tsk", s) for s in (1, 0)]
            await st.call(p.TaskResults(task_ids=ids, brief=True))
            assert [len(s.calls[-1].task_ids) for s in st.shards.values()] == [1, 1]
            assert st.event_shards(p.EventsList()) == [0, 1]
        trio.run(main)
        assert reconnect.reissue_safe(p.ServerStatus())
        assert not reconnect.reissue_safe(p.TaskSubmit(mailbox="m", scope_id="scp_x"))
        assert reconnect.reissue_safe(p.TaskSubmit(mailbox="m", scope_id="scp_x", key="k"))
        assert reconnect._op_table().reconcile_rule(p.DeliveryComplete(task_id="tsk_x", token=1)) == "task_settled"
        print("\\n".join(sorted(m for m in sys.modules if m.startswith("rallypoint"))))
    ''')
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rallypoint.__file__))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "rallypoint.client.router" in loaded and "rallypoint.opfacts" in loaded
    server = [m for m in loaded if m.startswith(SERVER_PACKAGES)]
    assert server == [], f"the client imported server modules: {server}"


def test_the_clients_op_facts_are_the_marks_own():
    # a mark changed without `python -m rallypoint.actors.api --write-opfacts` fails here
    with open(opfacts.__file__) as f:
        assert f.read() == render_opfacts(), \
            "rallypoint/opfacts.py is stale: run python -m rallypoint.actors.api --write-opfacts"
    assert list(opfacts.TABLE.facts) == list(TABLE.decls)
    for t, d in TABLE.decls.items():
        f = opfacts.TABLE.facts[t]
        assert (f.shard.expr, f.merge, f.resend.expr) == (d.shard.expr, d.merge, d.resend.expr), t.__name__
        assert (f.resend.advice, f.resend.reconcile, f.resend.fenced) == \
            (d.resend.advice, d.resend.reconcile, d.resend.fenced), t.__name__


def test_a_re_send_rule_the_client_cannot_have_is_refused_where_it_is_declared():
    with pytest.raises(ValueError, match="named function of rallypoint.opdecl"):
        resend_if(lambda op: True, "always, by a lambda")
