"""The operation table built from the ``@op`` marks beside the handlers (issue 28, item 1):
the same wire contract as the hand-kept tables it replaced, one process-wide table that
needs no coordinator, and a coordinator that refuses to start when an op has no
handler, two handlers, or a mark without a route, permission or re-send rule."""

from __future__ import annotations

import json
import os

import msgspec
import pytest

from rallypoint import protocol as p
from rallypoint.actors import coordinator as coordinator_mod
from rallypoint.actors.api import OPS, REPLY_TYPES, TABLE, op_decoder
from rallypoint.actors.coordinator import KIND_CLASSES, Coordinator
from rallypoint.actors.opmark import ALWAYS, NEVER, R, SPACE, asked, by, build_table, keyed, op
from rallypoint.actors.pool import Pools
from rallypoint.errors import RallypointError
from rallypoint.service import Session

from _wire_snapshot import snapshot, struct_sample
from test_access import build_op

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ no wire change

def test_every_op_and_reply_encodes_as_before_the_marks():
    # tests/data/wire_ops.json was taken from main before the table was built from the
    # marks (and matched it entry for entry when the marks came in): per op, its tag, its
    # request and reply Structs, their fields in order, defaults, encoding options and the
    # bytes of a sample of each. What the marks decide must not have moved: every op of
    # the snapshot is still there with the same request and reply Struct. What the
    # Structs decide may only have grown: no field gone, the same options, and the same
    # bytes while the fields are the same (a field added since, e.g. ServerStatusView's
    # `cluster`, is an addition, not a change; so is an op added since).
    with open(os.path.join(HERE, "data", "wire_ops.json")) as f:
        before = json.load(f)
    now = snapshot(p.ALL_OPS, REPLY_TYPES)
    assert len(before) == 98 and set(before) <= set(now)
    for tag, entry in before.items():
        for part in ("request", "reply"):
            old, new = entry[part], now[tag][part]
            assert new["name"] == old["name"], (tag, part)
            for k in ("omit_defaults", "forbid_unknown_fields", "tag_field"):
                assert new[k] == old[k], (tag, part, k)
            assert set(old["fields"]) <= set(new["fields"]), (tag, part, "a field is gone")
            if new["fields"] == old["fields"]:
                # a nested view may have grown a field (TaskView.holder inside a reply's
                # list): the old sample's keys and values are all still in the new one
                assert {k: v for k, v in new.items() if k != "bytes"} == {k: v for k, v in old.items()
                                                                         if k != "bytes"}, (tag, part)
                assert _grown_from(msgspec.msgpack.decode(bytes.fromhex(old["bytes"])),
                                   msgspec.msgpack.decode(bytes.fromhex(new["bytes"]))), (tag, part)


def _grown_from(old, new) -> bool:
    """``new`` holds every key and value of ``old`` (maps may have more keys, at any depth)."""
    if isinstance(old, dict):
        return isinstance(new, dict) and all(k in new and _grown_from(v, new[k]) for k, v in old.items())
    if isinstance(old, list):
        return isinstance(new, list) and len(new) == len(old) and all(map(_grown_from, old, new))
    return type(old) is type(new) and old == new


def test_the_additive_comparison_refuses_a_change_and_accepts_a_new_key():
    assert _grown_from({"a": [{"b": 1}]}, {"a": [{"b": 1, "c": None}]})
    assert not _grown_from({"a": [{"b": 1}]}, {"a": [{"b": 2}]})
    assert not _grown_from({"a": [{"b": 1}]}, {"a": [{"c": 1}]})
    assert not _grown_from({"a": [1]}, {"a": [1, 1]})


def test_the_built_union_decodes_every_request_and_only_requests():
    for t in p.ALL_OPS:
        sample = struct_sample(t)
        assert op_decoder.decode(p.encoder.encode(sample)) == sample, t
    with pytest.raises(msgspec.ValidationError):
        op_decoder.decode(msgspec.msgpack.encode({"op": "no.such.op"}))


# ------------------------------------------------------------------ one table

def test_the_coordinator_builds_the_same_table_the_client_reads():
    coord = Coordinator()
    assert [type(k) for k in coord.kinds] == list(KIND_CLASSES)
    assert coord.op_table is TABLE  # built once per set of kind classes
    assert list(coord.ops) == list(p.ALL_OPS) == list(OPS)
    for t, b in coord.ops.items():
        d = OPS[t]
        assert b.handler.__self__ is next(k for k in coord.kinds if type(k) is d.kind)
        assert b.handler.__func__ is getattr(d.kind, d.handler)
        assert b.tag == t.__struct_config__.tag and b.permission == d.permission


def test_every_route_names_an_actor_or_refuses_with_a_code():
    # Each op's route, bound to a coordinator, called with placeholder ids: an actor id
    # (a space's, a run's...) or NOT_FOUND / VALIDATION_FAILED -- never another exception.
    coord = Coordinator()
    session = Session()
    for t, b in coord.ops.items():
        try:
            actor_id = b.route(coord, session, build_op(t))
        except RallypointError as e:
            assert e.code in ("NOT_FOUND", "VALIDATION_FAILED"), (t, e)
        else:
            assert actor_id == "spc:default", (t, actor_id)


def test_a_wait_the_client_asked_for_is_declared_by_the_mark():
    w = TABLE.asked_wait
    assert w(p.TaskResults(task_ids=["t"], wait_ms=5000)) and not w(p.TaskResults(task_ids=["t"]))
    assert w(p.ClaimAcquire(scope_id="s", key="k", wait_ms=1)) and not w(p.ClaimAcquire(scope_id="s", key="k"))
    assert w(p.PoolAcquire(pool="p", scope_id="s", wait_ms=1))
    assert w(p.Receive(mailbox="m", scope_id="s", wait_ms=1))
    assert w(p.JoinNext(joinset_id="j", wait_ms=1)) and not w(p.JoinNext(joinset_id="j", wait_ms=1, try_only=True))
    assert w(p.QuotaTake(quota="q", scope_id="s", wait_ms=1))
    # names that only look like waits are not (the old rule matched op-name suffixes)
    assert not w(p.DeliveryComplete(task_id="t", token=1)) and not w(p.GroupClose(group_id="g"))
    assert not w(p.ClaimComplete(key="k", token=1)) and not w(b"\x80")


# ------------------------------------------------------------------ fail fast

def _coordinator_with(monkeypatch, pools_cls):
    monkeypatch.setattr(coordinator_mod, "Pools", pools_cls)
    return Coordinator()


def test_an_op_without_a_handler_stops_the_coordinator(monkeypatch):
    class Unmarked(Pools):
        def op_pool_get(self, actor, session, op: p.PoolGet) -> p.PoolView:  # the mark is gone
            return super().op_pool_get(actor, session, op)

    with pytest.raises(RuntimeError, match=r"ops without a handler: 'pool\.get' \(PoolGet\)"):
        _coordinator_with(monkeypatch, Unmarked)


def test_an_op_with_two_handlers_stops_the_coordinator(monkeypatch):
    class Twice(Pools):
        @op(p.PoolGet, route=by("name"), permission=R, resend=ALWAYS)
        def op_pool_get_too(self, actor, session, op: p.PoolGet) -> p.PoolView:
            return self.op_pool_get(actor, session, op)

    with pytest.raises(RuntimeError, match=r"op 'pool\.get' has two handlers: Twice\.op_pool_get and "
                                           r"Twice\.op_pool_get_too"):
        _coordinator_with(monkeypatch, Twice)


def test_an_op_without_a_route_stops_the_coordinator(monkeypatch):
    class NoRoute(Pools):
        @op(p.PoolGet, permission=R, resend=ALWAYS)
        def op_pool_get(self, actor, session, op: p.PoolGet) -> p.PoolView:
            return super().op_pool_get(actor, session, op)

    with pytest.raises(RuntimeError, match=r"op 'pool\.get' \(NoRoute\.op_pool_get\) has no route"):
        _coordinator_with(monkeypatch, NoRoute)


class _Probe:
    """A stand-in kind with one marked handler (for the checks of a single mark)."""

    def route_other(self, session, value):  # pragma: no cover - never called
        return "spc:" + session.space


def _one(mark) -> tuple:
    """(kind classes, requests) where ``_Probe.op_x`` carries ``mark`` for ServerStatus."""
    cls = type("Probe", (_Probe,), {"op_x": mark(lambda self, actor, session, op: p.ServerStatusView)})
    return (cls,), (p.ServerStatus,)


@pytest.mark.parametrize("mark, message", [
    (op(p.ServerStatus, route=SPACE, resend=ALWAYS, reply=p.ServerStatusView), "has no permission"),
    (op(p.ServerStatus, route=SPACE, permission="root", resend=ALWAYS, reply=p.ServerStatusView),
     "unknown permission 'root'"),
    (op(p.ServerStatus, route=SPACE, permission=R, reply=p.ServerStatusView), "has no re-send rule"),
    (op(p.ServerStatus, route=SPACE, permission=R, resend=ALWAYS), "has no reply type"),
    (op(p.ServerStatus, route=by("name", "route_nowhere"), permission=R, resend=ALWAYS, reply=p.ServerStatusView),
     "its route calls Probe.route_nowhere, which does not exist"),
    (op(p.ServerStatus, route=by("name", "route_other"), permission=R, resend=ALWAYS, reply=p.ServerStatusView),
     "its route reads the field 'name', which ServerStatus does not have"),
    (op(p.ServerStatus, route=SPACE, permission=R, resend=keyed("key"), reply=p.ServerStatusView),
     "its re-send rule reads the field 'key'"),
    (op(p.ServerStatus, route=SPACE, permission=R, resend=NEVER, waits=asked("wait_ms"), reply=p.ServerStatusView),
     "its wait rule reads the field 'wait_ms'"),
], ids=["permission", "unknown-permission", "resend", "reply", "route-method", "route-field", "resend-field",
        "wait-field"])
def test_an_incomplete_mark_is_refused_naming_what_to_add(mark, message):
    kinds, requests = _one(mark)
    with pytest.raises(RuntimeError, match="op 'server.status' .*" + message.replace("(", r"\(").replace(")", r"\)")):
        build_table(kinds, requests)


def test_a_mark_for_a_struct_that_is_not_an_op_is_refused():
    kinds, _ = _one(op(p.ServerStatusView, route=SPACE, permission=R, resend=ALWAYS, reply=p.ServerStatusView))
    with pytest.raises(RuntimeError, match=r"not an op of the protocol: Probe\.op_x \(@op\(ServerStatusView\)\)"):
        build_table(kinds, (p.ServerStatus,))


def test_a_handler_annotated_with_another_request_is_refused():
    class Wrong(_Probe):
        @op(p.ServerStatus, route=SPACE, permission=R, resend=ALWAYS)
        def op_x(self, actor, session, op: p.OpsWaits) -> p.ServerStatusView:  # pragma: no cover
            raise AssertionError

    with pytest.raises(RuntimeError, match="annotated OpsWaits, not ServerStatus"):
        build_table((Wrong,), (p.ServerStatus,))


def test_the_reply_type_comes_from_the_return_annotation_or_the_mark():
    class Annotated(_Probe):
        @op(p.ServerStatus, route=SPACE, permission=R, resend=ALWAYS)
        def op_x(self, actor, session, op: p.ServerStatus) -> p.ServerStatusView:  # pragma: no cover
            raise AssertionError

        @op(p.OpsWaits, route=SPACE, permission=R, resend=ALWAYS, reply=p.OpsWaitsView)
        def op_y(self, actor, session, op: p.OpsWaits):  # pragma: no cover
            raise AssertionError

    table = build_table((Annotated,), (p.ServerStatus, p.OpsWaits))
    assert table.reply_types == {p.ServerStatus: p.ServerStatusView, p.OpsWaits: p.OpsWaitsView}
