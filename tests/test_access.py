"""Access control (SPEC §10): API keys, spaces, permissions, open mode."""

from __future__ import annotations

import subprocess
import sys
import typing

import msgspec
import pytest

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors import Coordinator
from rallypoint.actors.api import ANY_KEY, LOCAL, NODE, OPS, PERMISSIONS
from rallypoint.errors import ForbiddenError, NotFoundError, RallypointError, UnauthenticatedError
from rallypoint.service import CallSink, Service, Session
from rallypoint.wire import PROTOCOL_VERSION, Hello

from conftest import Daemon


def _dummy(tp):
    origin = typing.get_origin(tp)
    if tp is str:
        return "x"
    if tp is int:
        return 1
    if tp is bool:
        return False
    if tp is msgspec.Raw:
        return p.NIL
    if origin is list:
        (inner,) = typing.get_args(tp)
        return [_dummy(inner)]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return build_op(tp)  # its required fields filled in too
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return _dummy(next(a for a in typing.get_args(tp) if a is not type(None)))
    raise TypeError(f"no dummy for {tp!r}")


def build_op(op_type):
    """An instance of any op with dummy values for its required fields."""
    hints = typing.get_type_hints(op_type)
    kwargs = {}
    for f in msgspec.structs.fields(op_type):
        if f.required:
            kwargs[f.name] = _dummy(hints[f.name])
    return op_type(**kwargs)


def submit_now(service: Service, session, op):
    """Submit ``op`` and return what was answered at once -- a refusal before anything
    is queued (decode, permission, routing) -- or None when it went to an actor's inbox."""
    sink = CallSink()
    service.submit(session, p.encoder.encode(op), sink, 1)
    return sink.replies.get(1)


@pytest.mark.parametrize("op_type", sorted(p.ALL_OPS, key=lambda t: t.__struct_config__.tag),
                         ids=lambda t: t.__struct_config__.tag)
async def test_permission_matrix(op_type):
    # Generated from the op table (each handler's @op mark: tests/test_op_table.py checks
    # every op has exactly one, with a permission): a key without it is FORBIDDEN
    # naming it; a key with it passes the check (the op may then fail on its dummy
    # arguments, but never with FORBIDDEN).
    coord = Coordinator()
    service = Service(coord)
    needed = OPS[op_type].permission
    if needed == LOCAL:  # no client's, whatever its key holds: the node's own step only
        for perm in PERMISSIONS[:4]:
            _, secret = coord.keys.create_key("s1", [perm])
            s_key, _ = service.hello(Hello(PROTOCOL_VERSION, secret), "t")
            refused = submit_now(service, s_key, build_op(op_type))
            assert isinstance(refused, ForbiddenError) and "not a client's" in refused.message, refused
        assert isinstance(submit_now(service, Session(space="s1", peer="embedded"), build_op(op_type)), ForbiddenError)
        assert not isinstance(submit_now(service, Session(space="s1", local=True), build_op(op_type)), ForbiddenError)
        return
    if needed == NODE:  # another node's call between shards: no client's, no local step either
        for perm in PERMISSIONS[:4]:
            _, secret = coord.keys.create_key("s1", [perm])
            s_key, _ = service.hello(Hello(PROTOCOL_VERSION, secret), "t")
            refused = submit_now(service, s_key, build_op(op_type))
            assert isinstance(refused, ForbiddenError) and "made only by its nodes" in refused.message, refused
        for session in (Session(space="s1", peer="embedded"), Session(space="s1", local=True),
                        Session(space="s1", permissions=frozenset({"operator"}))):
            assert isinstance(submit_now(service, session, build_op(op_type)), ForbiddenError)
        assert not isinstance(submit_now(service, Session(space="s1", node=True), build_op(op_type)), ForbiddenError)
        return
    if needed == ANY_KEY:  # any live key passes, whatever it holds
        for perm in PERMISSIONS[:3]:
            _, secret = coord.keys.create_key("s1", [perm])
            s_any, _ = service.hello(Hello(PROTOCOL_VERSION, secret), "t")
            answer = submit_now(service, s_any, build_op(op_type))
            assert not isinstance(answer, ForbiddenError), answer
        return
    _, with_perm = coord.keys.create_key("s1", [needed])
    others = [x for x in PERMISSIONS if x not in (needed, "admin", "operator")]
    _, without = coord.keys.create_key("s1", others)
    op = build_op(op_type)

    s_without, _ = service.hello(Hello(PROTOCOL_VERSION, without), "t")
    refused = submit_now(service, s_without, op)
    assert isinstance(refused, ForbiddenError), refused
    assert needed in refused.message

    s_with, _ = service.hello(Hello(PROTOCOL_VERSION, with_perm), "t")
    answer = submit_now(service, s_with, op)  # None: it passed the check and was queued
    assert not isinstance(answer, ForbiddenError), answer
    assert answer is None or isinstance(answer, RallypointError)


async def test_admin_implies_every_permission():
    coord = Coordinator()
    service = Service(coord)
    _, admin = coord.keys.create_key("s1", ["admin"])
    session, ok = service.hello(Hello(PROTOCOL_VERSION, admin), "t")
    assert ok.space == "s1"
    assert submit_now(service, session, p.ScopeCreate(name="by-admin")) is None  # queued, not refused


async def test_a_hello_names_its_space_in_open_mode_only():
    # (a sharded cluster's HTTP router opens open-mode connections in the request's space)
    coord = Coordinator()
    service = Service(coord)
    session, ok = service.hello(Hello(PROTOCOL_VERSION, None, "", "dev"), "t")
    assert session.space == ok.space == "dev" and session.permissions is None
    _, secret = coord.keys.create_key("s1", ["admin"])
    session, ok = service.hello(Hello(PROTOCOL_VERSION, secret, "", "dev"), "t")
    assert session.space == ok.space == "s1"  # a key's own space wins


async def test_open_mode_until_a_key_exists_then_keys_required():
    coord = Coordinator()
    service = Service(coord)
    session, ok = service.hello(Hello(PROTOCOL_VERSION, None), "t")
    assert session.permissions is None and ok.space == "default"
    # open mode authenticates no one: any key is accepted, as over HTTP
    session, ok = service.hello(Hello(PROTOCOL_VERSION, "rpk_anything"), "t")
    assert session.permissions is None and session.key_id is None and ok.space == "default"
    key, secret = coord.keys.create_key("default", ["coordination_read"])
    with pytest.raises(UnauthenticatedError):
        service.hello(Hello(PROTOCOL_VERSION, None), "t")
    with pytest.raises(UnauthenticatedError):
        service.hello(Hello(PROTOCOL_VERSION, "rpk_wrong"), "t")
    s, _ = service.hello(Hello(PROTOCOL_VERSION, secret), "t")
    coord.keys.revoke_key(key.id)
    # an open connection loses it at once
    assert isinstance(submit_now(service, s, p.ServerStatus()), UnauthenticatedError)
    # revoking the last key does not turn authentication off
    assert not coord.keys.open_mode
    with pytest.raises(UnauthenticatedError):
        service.hello(Hello(PROTOCOL_VERSION, None), "t")


def _keys(data_dir, *args) -> str:
    out = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "--data-dir", data_dir, *args],
                         capture_output=True, text=True, check=True)
    return out.stdout


async def test_spaces_are_isolated_over_tcp(tmp_path):
    data = str(tmp_path)
    perms = ["--permission", "coordination_read", "--permission", "coordination_write",
             "--permission", "resource_config"]
    secret_a = _keys(data, "create", "--space", "a", *perms).split("secret: ")[1].strip()
    secret_b = _keys(data, "create", "--space", "b", *perms).split("secret: ")[1].strip()
    assert "space=a" in _keys(data, "list")
    d = Daemon(data, "fsync").start()
    try:
        with pytest.raises(UnauthenticatedError):
            async with rallypoint.connect(d.url) as rs:
                await rs.status()
        async with rallypoint.connect(d.url, api_key=secret_a) as a, rallypoint.connect(d.url, api_key=secret_b) as b:
            run = await a.scopes.create(name="a-run")
            mbx = await a.mailboxes.ensure("a-jobs")
            ticket = await mbx.submit({"n": 1}, scope=run)
            group = await run.groups.create(mbx, "FIRST_ACCEPTED")
            barrier = await run.barriers.create(2)
            # b sees none of a's ids: NOT_FOUND, never FORBIDDEN, and nothing changes
            for attempt in (
                lambda: b.scope(run.id).status(),
                lambda: b.scope(run.id).cancel(),
                lambda: b.task(ticket.id).cancel(),
                lambda: b.mailboxes.get("a-jobs"),
                lambda: b.group(group.id).close(),
                lambda: b.scope(run.id).barriers.get(barrier.id).arrive("x"),
                lambda: b.mailbox("a-jobs").receive(run, wait=0),
            ):
                with pytest.raises(NotFoundError):
                    await attempt()
            assert (await run.status()).stored_state == "ACTIVE"
            assert (await ticket.status()).state == "QUEUED"
            assert (await b.status()).runs["ACTIVE"] == 0
            assert (await a.status()).runs["ACTIVE"] >= 1
    finally:
        assert d.stop() == 0


def test_non_loopback_without_keys_is_refused_unless_insecure(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rallypoint", "serve", "--listen", "0.0.0.0:0",
                        "--durability", "memory"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--insecure" in r.stderr
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "rallypoint", "serve", "--listen", "0.0.0.0:0",
                             "--durability", "memory", "--insecure"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY ")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert "WITHOUT authentication" in proc.stderr.read()


# ------------------------------------------------------------------ keys act in their own space (issue 12.1)


async def _answer(service, session, op):
    """``op`` through the service and the actors, the answer decoded (or the error)."""
    try:
        raw = await service.call(session, op)
    except RallypointError as e:
        return e
    return msgspec.msgpack.decode(raw)


async def test_an_admin_key_manages_the_keys_of_its_own_space_only():
    async with rallypoint.open_embedded() as rs:
        coord, service = rs.node.coordinator, rs.node.service
        _, admin_a = coord.keys.create_key("space-a", ["admin"])
        a_reader, _ = coord.keys.create_key("space-a", ["coordination_read"])
        _, admin_b = coord.keys.create_key("space-b", ["admin"])
        sb, _ = service.hello(Hello(PROTOCOL_VERSION, admin_b), "t")
        # B's admin sees B's keys only, and cannot name another space
        listed = await _answer(service, sb, p.KeyList())
        assert {k["space"] for k in listed["keys"]} == {"space-b"}
        assert isinstance(await _answer(service, sb, p.KeyList(space="space-a")), ForbiddenError)
        # it cannot mint itself a key for A (read A's data) ...
        refused = await _answer(service, sb, p.KeyCreate(space="space-a", permissions=["admin"]))
        assert isinstance(refused, ForbiddenError) and "space-b" in refused.message
        # ... nor lock A out: A's keys answer NOT_FOUND, and stay live
        assert isinstance(await _answer(service, sb, p.KeyRevoke(key_id=a_reader.id)), NotFoundError)
        assert not coord.keys.is_revoked(a_reader.id)
        # in its own space it works
        made = await _answer(service, sb, p.KeyCreate(space="space-b", permissions=["coordination_read"]))
        assert made["space"] == "space-b" and made["secret"].startswith("rpk_")
        # and A's admin is unaffected
        sa, _ = service.hello(Hello(PROTOCOL_VERSION, admin_a), "t")
        assert {k["space"] for k in (await _answer(service, sa, p.KeyList()))["keys"]} == {"space-a"}


async def test_the_operator_permission_is_granted_offline_only_and_spans_spaces(tmp_path):
    d = str(tmp_path / "data")
    async with rallypoint.open_embedded(d, durability="fsync") as rs:
        coord, service = rs.node.coordinator, rs.node.service
        _, admin = coord.keys.create_key("space-a", ["admin"])
        sa, _ = service.hello(Hello(PROTOCOL_VERSION, admin), "t")
        over_the_wire = await _answer(service, sa, p.KeyCreate(space="space-a", permissions=["operator"]))
        assert isinstance(over_the_wire, ForbiddenError) and "offline" in over_the_wire.message
    # offline, on the stopped daemon's data dir (the CLI's path), it is granted
    secret = _keys(d, "create", "--space", "ops", "--permission", "operator", "--secret-only").strip()
    async with rallypoint.open_embedded(d, durability="fsync") as rs:
        service = rs.node.service
        so, ok = service.hello(Hello(PROTOCOL_VERSION, secret), "t")
        assert ok.space == "ops"
        made = await _answer(service, so, p.KeyCreate(space="space-z", permissions=["coordination_read"]))
        assert made["space"] == "space-z"
        spaces = {k["space"] for k in (await _answer(service, so, p.KeyList()))["keys"]}
        assert {"space-a", "ops", "space-z"} <= spaces
