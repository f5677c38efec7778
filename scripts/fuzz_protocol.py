#!/usr/bin/env python
"""Protocol fuzzer against a live ``rallypoint serve`` daemon (127.0.0.1 only).

Three families of input, each checked frame by frame:

* ``bytes``: random bytes, either as the body of a well-formed frame or as a raw,
  unframed byte stream (framing may be lost: the server must answer and close);
* ``envelopes``: structurally valid envelopes (Request / Batch) whose body is an op of
  :data:`rallypoint.protocol.ALL_OPS` with random field values (type-correct via
  ``hypothesis.strategies.from_type``, or of any msgpack type, with fields dropped and
  unknown fields added);
* ``ops``: well-typed ops whose ids, names, strings and ints are random or taken from a
  pool of real entities (so the coordinator's handlers run, not just validation).

Invariants (a violation is a bug): the daemon never dies; every frame it sends decodes
as :data:`rallypoint.wire.ServerFrame`; every Err code is in :data:`errors.CODES` and is
never INTERNAL; no message carries internal exception text; an Ok to a valid op
decodes as that op's reply type; a fresh connection works afterwards.

``python scripts/fuzz_protocol.py --seconds 60`` starts a daemon (memory durability),
fuzzes for that long and prints examples tried, replies by code and the INTERNAL count
(exit 1 if any invariant failed). ``--url tcp://127.0.0.1:PORT --api-key K`` fuzzes a
running daemon instead (it must be on loopback; the fuzzer creates entities in it).
The pytest suite (``tests/test_fuzz.py``) imports the strategies and checker from here.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import string
import subprocess
import sys
import threading
import time
from typing import Any, Iterable
from urllib.parse import urlsplit

import msgspec
from hypothesis import strategies as st

from rallypoint import errors, protocol, wire
from rallypoint.actors.api import REPLY_TYPES, op_decoder
from rallypoint.transport.framing import FrameParser

_enc = msgspec.msgpack.encode
_server_decoder = msgspec.msgpack.Decoder(wire.ServerFrame)
_event_decoder = msgspec.msgpack.Decoder(protocol.EventView)
_any_decoder = msgspec.msgpack.Decoder()
_reply_decoders = {op: msgspec.msgpack.Decoder(rt) for op, rt in REPLY_TYPES.items()}
OP_TAGS: dict[str, type] = {cls.__struct_config__.tag: cls for cls in protocol.ALL_OPS}

#: Text that must never reach a client: Python exception names, tracebacks, reprs.
LEAK_MARKERS = (
    "Traceback",
    'File "',
    ".py\", line",
    "KeyError",
    "AttributeError",
    "TypeError",
    "ValueError",
    "IndexError",
    "RuntimeError",
    "AssertionError",
    "ZeroDivisionError",
    "OverflowError",
    "RecursionError",
    "UnicodeDecodeError",
    "UnicodeEncodeError",
    "NameError",
    "UnboundLocalError",
    "NotImplementedError",
    "StopIteration",
    " object at 0x",
    "<class '",
    "<built-in",
    "NoneType",
)

SENTINEL_BASE = 1 << 50  # request ids of the fuzzer's own status probes


# ------------------------------------------------------------------------------ client


class ProtocolViolation(AssertionError):
    pass


class Stats:
    def __init__(self) -> None:
        self.examples = 0
        self.frames_sent = 0
        self.replies: collections.Counter[str] = collections.Counter()
        self.internal = 0
        self.violations: list[str] = []

    def summary(self) -> str:
        codes = ", ".join(f"{k} {v}" for k, v in sorted(self.replies.items(), key=lambda kv: -kv[1]))
        return (
            f"examples {self.examples}, frames sent {self.frames_sent}, replies by code: {codes}; "
            f"INTERNAL {self.internal}; violations {len(self.violations)}"
        )


def check_frame(frame: Any, sent: bytes, ops_by_id: dict[int, type], stats: Stats | None) -> None:
    """Raise ProtocolViolation if a decoded server frame breaks an invariant."""
    if isinstance(frame, wire.Err):
        if stats is not None:
            stats.replies[frame.code] += 1
        if frame.code == "INTERNAL":
            if stats is not None:
                stats.internal += 1
            raise ProtocolViolation(f"INTERNAL reply (a server bug; see the daemon log): {frame!r}")
        if frame.code not in errors.CODES:
            raise ProtocolViolation(f"Err code {frame.code!r} is not in errors.CODES: {frame!r}")
        if not isinstance(frame.message, str) or not frame.message:
            raise ProtocolViolation(f"Err without a message: {frame!r}")
        for marker in LEAK_MARKERS:
            if marker in frame.message and marker.encode() not in sent:
                raise ProtocolViolation(f"Err message leaks internal text {marker!r}: {frame!r}")
        if frame.details is not None and not isinstance(frame.details, dict):
            raise ProtocolViolation(f"Err details is not a map: {frame!r}")
    elif isinstance(frame, wire.Ok):
        if stats is not None:
            stats.replies["OK"] += 1
        op = ops_by_id.get(frame.id)
        try:
            if op is not None:
                _reply_decoders[op].decode(frame.body)
            else:
                _any_decoder.decode(frame.body)
        except msgspec.MsgspecError as exc:
            raise ProtocolViolation(f"Ok body to {op} does not decode: {exc}: {bytes(frame.body)[:300]!r}") from None
    elif isinstance(frame, (wire.Pong, wire.Ping)):
        if stats is not None:
            stats.replies[type(frame).__name__.upper()] += 1
    elif isinstance(frame, wire.Push):  # events for a subscription (events.watch) the fuzzer opened
        if stats is not None:
            stats.replies["PUSH"] += 1
        try:
            for raw in frame.events:
                _event_decoder.decode(raw)
        except msgspec.MsgspecError as exc:
            raise ProtocolViolation(f"a pushed event does not decode as an EventView: {exc}") from None
    else:
        raise ProtocolViolation(f"unexpected frame after the handshake: {frame!r}")


class SyncClient:
    """A blocking frame-level client (no event loop: usable inside Hypothesis tests)."""

    def __init__(self, port: int, api_key: str | None = None, hello: bool = True, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.parser = FrameParser()
        self.pending: collections.deque[Any] = collections.deque()
        self.next_sentinel = SENTINEL_BASE
        # request id -> op types of requests sent on this connection and not answered
        # yet (replies come back in any order, and a wait's may come after later probes)
        self.outstanding: dict[int, list[type | None]] = {}
        self.eof = False
        if hello:
            self.send_frame(_enc(wire.Hello(wire.PROTOCOL_VERSION, api_key, "fuzz")))
            ok = self.recv()
            if not isinstance(ok, wire.HelloOk):
                raise ProtocolViolation(f"handshake refused: {ok!r}")

    def send_frame(self, body: bytes) -> None:
        self.sock.sendall(len(body).to_bytes(4, "big") + body)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> Any:
        """Next decoded frame, None at EOF. A frame that does not decode is a violation."""
        while not self.pending:
            if self.eof:
                return None
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                if self.parser.buffered:
                    raise ProtocolViolation(f"server closed mid-frame ({self.parser.buffered} bytes buffered)")
                return None
            for body in self.parser.feed(data):
                try:
                    self.pending.append(_server_decoder.decode(body))
                except msgspec.MsgspecError as exc:
                    raise ProtocolViolation(f"server sent a frame that is not a ServerFrame: {exc}: {bytes(body)!r}")
            if self.parser.oversize is not None:
                raise ProtocolViolation(f"server sent an oversize frame header {self.parser.oversize}")
        return self.pending.popleft()

    def sync(self, sent: bytes, ops_by_id: dict[int, type], stats: Stats | None) -> bool:
        """Send a status probe and check every frame up to its reply. False if the
        server closed the connection (after answering everything properly).

        Replies come back in any order (each request is answered by its own actor), so
        a reply is checked against the op of the request it answers when that is
        unambiguous: the request ids still outstanding on this connection are kept
        across examples."""
        rid = self.next_sentinel
        self.next_sentinel += 1
        try:
            self.send_frame(_enc(wire.Request(rid, msgspec.Raw(_enc({"op": "server.status"})))))
        except (BrokenPipeError, ConnectionResetError):
            pass
        for r in _request_ids(sent):
            self.outstanding.setdefault(r, []).append(ops_by_id.get(r))
        self.outstanding.setdefault(rid, []).append(protocol.ServerStatus)
        while True:
            f = self.recv()
            if f is None:
                return False
            fid = getattr(f, "id", None)
            cands = self.outstanding.get(fid) if fid is not None else None
            known = {fid: cands[0]} if cands and len(cands) == 1 and cands[0] is not None else {}
            check_frame(f, sent, known, stats)
            if cands:
                # Requests that share an id are answered in the order they were sent,
                # except that one sent while another with its id is in flight is refused
                # at once (VALIDATION_FAILED "already in flight").
                refused_dup = isinstance(f, wire.Err) and "already in flight" in (f.message or "")
                cands.pop() if refused_dup else cands.pop(0)
                if not cands:
                    del self.outstanding[fid]
            if isinstance(f, wire.Ok) and fid == rid:
                return True
            if isinstance(f, wire.Err) and fid == rid:
                raise ProtocolViolation(f"the status probe failed: {f!r}")

    def drain_to_eof(self, sent: bytes, ops_by_id: dict[int, type], stats: Stats | None) -> None:
        while (f := self.recv()) is not None:
            check_frame(f, sent, ops_by_id, stats)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _request_ids(sent: bytes) -> list[int]:
    """The request ids in a stream of frames (requests and batches), best effort."""
    ids: list[int] = []
    parser = FrameParser()
    for body in parser.feed(sent):
        try:
            msg = _client_any.decode(body)
        except (msgspec.MsgspecError, RecursionError):
            continue
        if isinstance(msg, dict):
            if msg.get("t") == "req" and isinstance(msg.get("id"), int):
                ids.append(msg["id"])
            elif msg.get("t") == "batch" and isinstance(msg.get("reqs"), list):
                ids.extend(r["id"] for r in msg["reqs"] if isinstance(r, dict) and isinstance(r.get("id"), int))
    return ids


_client_any = msgspec.msgpack.Decoder()


def call(c: SyncClient, body: dict, rid: int = 1) -> Any:
    """One request/reply on a SyncClient (setup helper): the decoded reply body."""
    c.send_frame(_enc(wire.Request(rid, msgspec.Raw(_enc(body)))))
    while True:
        f = c.recv()
        if f is None:
            raise ProtocolViolation(f"connection closed while waiting for the reply to {body}")
        if getattr(f, "id", None) == rid:
            if isinstance(f, wire.Err):
                raise errors.error_from_wire(f.code, f.message, f.retry_after, f.details)
            return _any_decoder.decode(f.body)


# ------------------------------------------------------------------------------ target


class Target:
    """A live daemon plus a pool of real entity ids for the fuzzer to aim at."""

    def __init__(self, port: int, api_key: str | None, pool: dict[str, list[Any]]) -> None:
        self.port = port
        self.api_key = api_key
        self.pool = pool
        self._conn: SyncClient | None = None
        self._uses = 0

    def conn(self) -> SyncClient:
        # Rotate connections now and then: long server-side waits (wait_ms) a fuzzed op
        # started hold in-flight slots until the connection closes.
        if self._conn is None or self._conn.eof or self._uses >= 40:
            if self._conn is not None:
                self._conn.close()
            self._conn = SyncClient(self.port, self.api_key)
            self._uses = 0
        self._uses += 1
        return self._conn

    def drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def run_framed(self, bodies: list[bytes], ops_by_id: dict[int, type], stats: Stats | None) -> None:
        """Send frames on the shared connection; check every reply up to a status probe."""
        c = self.conn()
        sent = b"".join(len(b).to_bytes(4, "big") + b for b in bodies)
        try:
            c.send_raw(sent)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if stats is not None:
            stats.examples += 1
            stats.frames_sent += len(bodies)
        if not c.sync(sent, ops_by_id, stats):
            # Closed only when framing is lost or the hello is refused, never here.
            raise ProtocolViolation("the server closed a connection whose framing was intact")

    def run_raw(self, data: bytes, stats: Stats | None) -> None:
        """Raw unframed bytes on a fresh connection, then EOF: the server answers what it
        can, closes, and every frame it sent is well-formed."""
        c = SyncClient(self.port, self.api_key, timeout=10.0)
        try:
            try:
                c.send_raw(data)
                c.sock.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass
            if stats is not None:
                stats.examples += 1
            c.drain_to_eof(data, {}, stats)
        finally:
            c.close()

    def alive(self) -> None:
        c = SyncClient(self.port, self.api_key)
        try:
            body = call(c, {"op": "server.status"})
            assert body["protocol_version"] == wire.PROTOCOL_VERSION
        finally:
            c.close()


def build_pool(port: int, api_key: str | None) -> dict[str, list[Any]]:
    """Create one of each entity; their ids seed the ``ops`` strategy."""
    c = SyncClient(port, api_key)
    try:
        rid = iter(range(1, 1000))
        run = call(c, {"op": "scope.create", "name": "fuzz-run"}, next(rid))
        child = call(c, {"op": "scope.create", "parent_id": run["id"]}, next(rid))
        mbx = call(c, {"op": "mailbox.ensure", "name": "fuzz-mbx"}, next(rid))
        t1 = call(c, {"op": "task.submit", "mailbox": "fuzz-mbx", "scope_id": run["id"], "input": 1}, next(rid))
        call(c, {"op": "task.submit", "mailbox": "fuzz-mbx", "scope_id": run["id"], "input": 2}, next(rid))
        dl = call(c, {"op": "delivery.receive", "mailbox": "fuzz-mbx", "scope_id": run["id"]}, next(rid))
        grp = call(c, {"op": "group.create", "scope_id": run["id"], "mailbox": "fuzz-mbx",
                       "condition": "FIRST_ACCEPTED"}, next(rid))
        gm = call(c, {"op": "group.submit", "group_id": grp["id"], "input": 3}, next(rid))
        bar = call(c, {"op": "barrier.create", "scope_id": run["id"], "target": 2}, next(rid))
        tmr = call(c, {"op": "timer.create", "scope_id": run["id"], "after_ms": 3_600_000}, next(rid))
        tmr2 = call(c, {"op": "timer.create", "scope_id": run["id"], "after_ms": 1}, next(rid))
        js = call(c, {"op": "joinset.create", "scope_id": run["id"], "name": "fuzz-js"}, next(rid))
        jc = call(c, {"op": "joinset.submit", "joinset_id": js["id"], "mailbox": "fuzz-mbx"}, next(rid))
        key = call(c, {"op": "key.create", "space": "default", "permissions": ["coordination_read"]}, next(rid))
        inbox = call(c, {"op": "mailbox.ensure", "name": "fuzz-inbox", "mode": "INBOX"}, next(rid))
        msg = call(c, {"op": "message.send", "mailbox": "fuzz-inbox", "scope_id": run["id"], "payload": 1}, next(rid))
        quota = call(c, {"op": "quota.ensure", "name": "fuzz-quota", "units_limit": 3, "window_ms": 60_000}, next(rid))
        take = call(c, {"op": "quota.take", "quota": "fuzz-quota", "scope_id": run["id"], "units": 3,
                        "ttl_ms": 60_000}, next(rid))
        waiter = call(c, {"op": "quota.take", "quota": "fuzz-quota", "scope_id": run["id"], "units": 2,
                          "ttl_ms": 3_600_000}, next(rid))
        budget = call(c, {"op": "budget.ensure", "name": "fuzz-budget", "limit_minor": 10_000}, next(rid))
        rsv = call(c, {"op": "budget.reserve", "budget": "fuzz-budget", "scope_id": run["id"], "amount_minor": 100},
                   next(rid))
        pool = call(c, {"op": "pool.ensure", "name": "fuzz-pool", "units_total": 3}, next(rid))
        grant = call(c, {"op": "pool.acquire", "pool": "fuzz-pool", "scope_id": run["id"], "units": 1,
                         "lease_ms": 600_000}, next(rid))
        claim = call(c, {"op": "claim.acquire", "scope_id": run["id"], "key": "fuzz-claim", "lease_ms": 600_000},
                     next(rid))
        wl = call(c, {"op": "work_limit.ensure", "scope_id": run["id"], "name": "fuzz-wl", "max_outstanding": 5},
                  next(rid))
        ids = [run["id"], child["id"], mbx["id"], t1["id"], grp["id"], grp["scope_id"], gm["task"]["id"],
               bar["id"], tmr["id"], tmr2["id"], js["id"], jc["child_id"], key["id"], inbox["id"], msg["id"],
               quota["id"], take["waiter_id"], waiter["waiter_id"], budget["id"], rsv["id"], pool["id"],
               grant["grant"]["id"], claim["claim"]["id"], wl["id"]]
        ids += [d["id"] for d in dl["deliveries"]] + [d["task_id"] for d in dl["deliveries"]]
        tokens = [d["token"] for d in dl["deliveries"]] + [grant["grant"]["token"], claim["token"]]
        return {"ids": ids, "names": ["fuzz-run", "fuzz-mbx", "fuzz-js", "default", "fuzz-inbox", "fuzz-quota",
                                      "fuzz-budget", "fuzz-pool", "fuzz-claim", "fuzz-wl"], "tokens": tokens}
    finally:
        c.close()


# ------------------------------------------------------------------------------ strategies

_ints = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([0, -1, 1, 4999, 5000, 600_000, 600_001, 60_000, 60_001, 2**31 - 1, 2**31, 2**32,
                     2**53, 2**63 - 1, -(2**63), 2**64 - 1]),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
)
_floats = st.floats(allow_nan=True, allow_infinity=True)
_text = st.text(max_size=40)
_scalars = st.one_of(st.none(), st.booleans(), _ints, _floats, _text, st.binary(max_size=40))
#: any msgpack-able value (what msgspec.msgpack.encode accepts)
msgpack_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(_text, st.integers(-5, 5)), inner, max_size=6),
    ),
    max_leaves=20,
)

st.register_type_strategy(msgspec.Raw, st.builds(lambda v: msgspec.Raw(_enc(v)), msgpack_values))

#: Edge instants: the ends of datetime's range (with offsets and rounding that push
#: them over: a bug found by this fuzzer), impossible dates, not-quite-ISO strings.
EDGE_INSTANTS = [
    "9999-12-31T23:59:59.999999Z", "9999-12-31T23:59:59.9995Z", "9999-12-31T23:59:59-14:00",
    "9999-12-31T23:59:59.999Z", "0001-01-01T00:00:00+14:00", "0001-01-01T00:00:00Z",
    "0001-01-01T00:00:00-14:00", "1970-01-01T00:00:00+00:00", "2000-01-01T00:00:00Z", "2999-12-31T23:59:59Z",
    "2024-02-30T00:00:00Z", "now", "", "T", "2024-01-01", "2024-01-01T00:00:00", "2024-01-01T00:00:00+25:00",
]
_iso = st.one_of(
    st.sampled_from(EDGE_INSTANTS),
    st.datetimes().map(lambda d: d.isoformat() + "Z"),
    st.builds(lambda d, tz: d.isoformat() + tz, st.datetimes(),
              st.sampled_from(["+14:00", "-14:00", "+00:00", "+05:30", ""])),
    _text,
)
_name_chars = string.ascii_letters + string.digits + "-_./:"
_names = st.one_of(st.text(_name_chars, min_size=1, max_size=10), st.text(_name_chars, min_size=127, max_size=130),
                   _text)
_ENUMS = {
    "mode": ["WORK", "INBOX", "BROADCAST", "work"],
    "currency": ["USD", "EUR", "usd", "DOLLARS"],
    "condition": ["FIRST_ACCEPTED", "N_ACCEPTED", "ALL_TERMINAL", "ANY"],
    "verdict": ["ACCEPTED", "REJECTED", "MAYBE"],
    "state": ["ACTIVE", "CANCELLED", "COMPLETED", "DONE"],
    "permissions": ["resource_config", "coordination_write", "coordination_read", "admin", "root"],
    "space": ["default", "other", "fuzz"],
}


def _id_strategy(pool: dict[str, list[Any]]) -> st.SearchStrategy[str]:
    prefixes = ["scp_", "mbx_", "tsk_", "dlv_", "grp_", "bar_", "tmr_", "jst_", "clm_", "key_", "quo_", "qwt_", "bdg_",
                "rsv_", "msg_", "pol_", "grt_", "wlm_"]
    return st.one_of(
        st.sampled_from(pool["ids"]),
        st.builds(lambda p, s: p + s, st.sampled_from(prefixes), st.text(_name_chars, max_size=30)),
        st.sampled_from(pool["ids"]).map(lambda s: s[:-1] + ("0" if s[-1] != "0" else "1")),
        _text,
    )


def _field_strategy(name: str, typ: Any, pool: dict[str, list[Any]]) -> st.SearchStrategy[Any]:
    """A type-correct value for one op field, biased towards interesting values."""
    nullable = False
    args = getattr(typ, "__args__", None)
    if args and type(None) in args:
        nullable = True
        rest = [a for a in args if a is not type(None)]
        typ = rest[0] if len(rest) == 1 else typ
        args = getattr(typ, "__args__", None)  # (the optional type's own: dict[str, str] | None -> str, str)
    if typ is str:
        if name.endswith("_id") or name in ("mailbox", "quota", "budget", "pool"):
            s = st.one_of(_id_strategy(pool), st.sampled_from(pool["names"]), _names)
        elif name in _ENUMS:
            s = st.one_of(st.sampled_from(_ENUMS[name]), _text)
        elif name in ("deadline", "at", "settle_by"):
            s = _iso
        elif name in ("name", "key", "space"):
            s = st.one_of(st.sampled_from(pool["names"]), _names)
        else:
            s = _text
    elif typ is int:
        if name == "token":
            s = st.one_of(st.sampled_from(pool["tokens"] or [1]), _ints)
        elif name.endswith("wait_ms"):
            # Mostly short waits, so replies come back within the example.
            s = st.one_of(st.integers(-5, 50), st.sampled_from([-(2**63), 60_001, 2**64 - 1]))
        else:
            s = _ints
    elif typ is bool:
        s = st.booleans()
    elif typ is msgspec.Raw:
        s = st.builds(lambda v: msgspec.Raw(_enc(v)), msgpack_values)
    elif typ == list[str]:
        s = st.lists(st.one_of(st.sampled_from(_ENUMS["permissions"]), _text), max_size=5)
    elif typ == list[protocol.SubmitItem]:
        s = st.lists(
            st.builds(protocol.SubmitItem, input=st.builds(lambda v: msgspec.Raw(_enc(v)), msgpack_values),
                      key=st.none() | _names, deadline=st.none() | _iso),
            max_size=5,
        )
    elif typ is protocol.Requirements:  # name -> units / minor units, within 64 bits
        amounts = st.one_of(st.integers(-2, 12), st.sampled_from([2**31, 2**63 - 1, -(2**63)]))
        names = st.one_of(st.sampled_from(pool["names"]), _names)
        s = st.builds(protocol.Requirements, pools=st.dictionaries(names, amounts, max_size=5),
                      budgets=st.dictionaries(names, amounts, max_size=3))
    elif isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        # Nested structs (e.g. CompleteItem): each field biased like a top-level one,
        # so ints stay within the wire's 64 bits.
        s = st.builds(typ, **{f.name: _field_strategy(f.name, f.type, pool) for f in msgspec.structs.fields(typ)})
    elif getattr(typ, "__origin__", None) is list and len(args or ()) == 1:
        s = st.lists(_field_strategy(name, args[0], pool), max_size=5)
    elif getattr(typ, "__origin__", None) is dict and len(args or ()) == 2:
        # e.g. admission.reserve's pools/budgets (name -> amount): values biased like a
        # field of their type, so ints stay within the wire's 64 bits
        s = st.dictionaries(_field_strategy(name, args[0], pool), _field_strategy(name, args[1], pool), max_size=5)
    else:
        s = st.from_type(typ)
    return st.one_of(st.none(), s) if nullable else s


def valid_ops(pool: dict[str, list[Any]], ops: Iterable[type] | None = None) -> st.SearchStrategy[msgspec.Struct]:
    """Well-typed ops (they decode against the Op union of rallypoint.actors.api) with random / pooled values."""
    strategies = []
    for cls in ops or protocol.ALL_OPS:
        kwargs = {}
        for f in msgspec.structs.fields(cls):
            s = _field_strategy(f.name, f.type, pool)
            if f.required:
                kwargs[f.name] = s
            else:
                # a default (omitted on the wire) or a drawn value; a default made by a
                # factory (a dict, a list) is made anew for each op
                default = (st.builds(f.default_factory) if f.default is msgspec.NODEFAULT
                           else st.just(f.default))
                kwargs[f.name] = st.one_of(default, s)
        strategies.append(st.builds(cls, **kwargs))
    return st.one_of(strategies)


@st.composite
def random_op_maps(draw) -> dict:
    """An op tag from ALL_OPS with fields of ANY msgpack type: some dropped, some unknown."""
    cls = draw(st.sampled_from(protocol.ALL_OPS))
    body: dict[Any, Any] = {"op": cls.__struct_config__.tag}
    for f in msgspec.structs.fields(cls):
        choice = draw(st.integers(0, 3))
        if choice == 0:
            continue  # dropped
        if choice == 1:
            body[f.name] = draw(msgpack_values)
        else:
            body[f.name] = draw(_field_strategy(f.name, f.type, {"ids": ["scp_x"], "names": ["x"], "tokens": []}))
    if draw(st.integers(0, 5)) == 0:
        body[draw(st.one_of(_text, st.integers(-(2**63), 2**63 - 1)))] = draw(msgpack_values)
    if draw(st.integers(0, 9)) == 0:
        body["op"] = draw(st.one_of(_text, msgpack_values))
    return body


def typed_random_op() -> st.SearchStrategy[msgspec.Struct]:
    """Type-correct random ops straight from ``st.from_type`` (values unbiased)."""
    return st.sampled_from(protocol.ALL_OPS).flatmap(st.from_type).filter(_encodable)


def _encodable(op: msgspec.Struct) -> bool:
    # from_type draws unbounded ints; msgpack (and so the wire) stops at 64 bits.
    try:
        protocol.encoder.encode(op)
    except OverflowError:
        return False
    return True


_good_ids = st.integers(1, 2**32)
_any_ids = st.one_of(_good_ids, st.sampled_from([0, -1, 2**32, 2**63 - 1, 2**64 - 1, -(2**63)]))


def _op_body(op: Any) -> bytes:
    return protocol.encoder.encode(op) if isinstance(op, msgspec.Struct) else _enc(op)


@st.composite
def envelopes(draw, bodies: st.SearchStrategy[Any], ids: st.SearchStrategy[int] = _any_ids):
    """(frame bodies, {rid: op type}) for one Request or a Batch of requests."""
    n = draw(st.integers(1, 4))
    reqs = []
    ops_by_id: dict[int, type] = {}
    for _ in range(n):
        op = draw(bodies)
        rid = draw(ids)
        raw = _op_body(op)
        reqs.append({"t": "req", "id": rid, "body": msgspec.Raw(raw)})
        try:
            ops_by_id[rid] = type(op_decoder.decode(raw))
        except msgspec.MsgspecError:
            ops_by_id.pop(rid, None)
    if n == 1 or draw(st.booleans()):
        frames = [_enc(r) for r in reqs]
    else:
        frames = [_enc({"t": "batch", "reqs": reqs})]
    # duplicate ids make the reply->op mapping ambiguous: only check bodies generically
    for rid in [r["id"] for r in reqs]:
        if [r["id"] for r in reqs].count(rid) > 1:
            ops_by_id.pop(rid, None)
    return frames, ops_by_id


@st.composite
def random_frames(draw):
    """('framed', [bodies]) or ('raw', bytes): random bytes and random msgpack values."""
    kind = draw(st.sampled_from(["bytes", "msgpack", "envelope-ish", "raw"]))
    if kind == "raw":
        data = draw(st.one_of(
            st.binary(max_size=256),
            st.builds(lambda n, tail: n.to_bytes(4, "big") + tail, st.integers(0, 2**32 - 1), st.binary(max_size=64)),
        ))
        return "raw", data
    count = draw(st.integers(1, 3))
    bodies = []
    for _ in range(count):
        if kind == "bytes":
            bodies.append(draw(st.binary(max_size=300)))
        elif kind == "msgpack":
            bodies.append(_enc(draw(msgpack_values)))
        else:
            env = {"t": draw(st.one_of(st.sampled_from(["req", "batch", "hello", "ping", "pong", "ok", "err"]),
                                       msgpack_values))}
            for field in ("id", "body", "reqs", "nonce", "version", "api_key", "code"):
                if draw(st.booleans()):
                    env[field] = draw(msgpack_values)
            bodies.append(_enc(env))
    return "framed", bodies


# ------------------------------------------------------------------------------ daemon


def admin_key_for(port: int) -> str:
    """Switch an open daemon to keyed mode with an admin key (so fuzzed key.create /
    key.revoke cannot lock the fuzzer out) and return the key."""
    c = SyncClient(port, None)
    try:
        k = call(c, {"op": "key.create", "space": "default", "permissions": ["admin"], "name": "fuzz-admin"})
        return k["secret"]
    finally:
        c.close()


class LogDrain:
    """Reads a subprocess's stderr in a thread (a full pipe would block the daemon)."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def problems(self) -> list[str]:
        """Log records at ERROR (with their tracebacks)."""
        out: list[str] = []
        keep = False
        for ln in self.lines:
            if ln[:4].isdigit():  # a new record: "2026-01-01 12:00:00,000 LEVEL name: ..."
                keep = " ERROR " in ln or " CRITICAL " in ln
            if keep:
                out.append(ln)
        return out


def _start_daemon(extra: list[str]) -> tuple[subprocess.Popen, int, LogDrain]:
    args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", "memory"] + extra
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"daemon did not start: {line!r} {proc.stderr.read()}")
    return proc, urlsplit(line.split()[1]).port, LogDrain(proc.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz (default %(default)s)")
    ap.add_argument("--url", help="fuzz a running daemon (tcp://127.0.0.1:PORT) instead of starting one")
    ap.add_argument("--api-key", default=os.environ.get("RALLYPOINT_API_KEY"))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--log-file", help="write the daemon's log here")
    args = ap.parse_args(argv)

    import random

    from hypothesis import HealthCheck, given, seed, settings

    proc = drain = None
    if args.url:
        u = urlsplit(args.url)
        if u.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("the fuzzer only targets loopback daemons")
        port, key = u.port, args.api_key
        if key is None:
            key = admin_key_for(port)
    else:
        proc, port, drain = _start_daemon(["--log-level", "INFO"])
        key = admin_key_for(port)
    pool = build_pool(port, key)
    target = Target(port, key, pool)
    stats = Stats()
    rng = random.Random(args.seed)

    families = {
        "bytes": random_frames(),
        "envelopes": envelopes(st.one_of(random_op_maps(), typed_random_op())),
        "ops": envelopes(valid_ops(pool), ids=_good_ids),
    }
    t_end = time.monotonic() + args.seconds
    failures: list[str] = []

    def run_family(name: str, strat, round_no: int) -> None:
        @settings(max_examples=200, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strat)
        def one(example):
            if time.monotonic() > t_end:
                return
            if name == "bytes":
                kind, data = example
                if kind == "raw":
                    target.run_raw(data, stats)
                else:
                    target.run_framed(data, {}, stats)
            else:
                frames, ops_by_id = example
                target.run_framed(frames, ops_by_id, stats)

        if args.seed is not None:
            one = seed(args.seed * 1000 + round_no)(one)

        try:
            one()
        except Exception as exc:  # a failure Hypothesis shrank: report it with the example
            notes = "\n    ".join(getattr(exc, "__notes__", []))
            failures.append(f"[{name}] {type(exc).__name__}: {exc}\n    {notes}")
            target.drop()

    names = list(families)
    rounds = 0
    while time.monotonic() < t_end and not failures:
        name = rng.choice(names)
        run_family(name, families[name], rounds)
        rounds += 1
        if proc is not None and proc.poll() is not None:
            failures.append(f"the daemon died (exit {proc.returncode})")
            break
    try:
        target.alive()
        print("after fuzzing: a fresh connection works")
    except Exception as exc:
        failures.append(f"a fresh connection fails after fuzzing: {exc!r}")
    print(stats.summary())
    if drain is not None:
        probs = drain.problems()
        if probs:
            failures.append("daemon log shows errors:\n" + "".join(probs[:80]))
        if args.log_file:
            with open(args.log_file, "w") as fh:
                fh.writelines(drain.lines)
    if proc is not None:
        proc.terminate()
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if rc != 0:
            failures.append(f"daemon exited {rc} on SIGTERM")
    for f in failures:
        print("FAIL:", f)
    print("INTERNAL replies:", stats.internal)
    return 1 if failures or stats.internal else 0


if __name__ == "__main__":
    sys.exit(main())
