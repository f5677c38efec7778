"""Protocol fuzzing against ONE live daemon (``rallypoint serve`` subprocess, 127.0.0.1).

(a) random bytes, as frame bodies and as a raw unframed stream; (b) structurally valid
envelopes carrying ops from ``protocol.ALL_OPS`` with random field values (type-correct
via ``st.from_type``, or of any msgpack type); (c) well-typed ops with random or real
ids, names, strings and ints. After each example every frame the daemon sent up to a
status probe is checked: it decodes as ``wire.ServerFrame``; Err codes are in
``errors.CODES`` and never INTERNAL; no message leaks exception text; an Ok to a valid op
decodes as its reply type. The daemon never dies, logs no ERROR, and a fresh connection
works afterwards. Bounded for CI (~20 s in all); ``scripts/fuzz_protocol.py --seconds N``
is the long run, with the same strategies and checks.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import threading
import warnings
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import NonInteractiveExampleWarning
from hypothesis import strategies as st

from rallypoint import protocol, wire
from rallypoint.actors.api import op_decoder

from conftest import Daemon

_path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "fuzz_protocol.py"
_spec = importlib.util.spec_from_file_location("fuzz_protocol", _path)
fz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_protocol"] = fz
_spec.loader.exec_module(fz)

FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def target():
    """One daemon for the whole module, switched to keyed mode with an admin key (so a
    fuzzed key.create cannot lock the fuzzer out), with a pool of real entities."""
    d = Daemon(None, "memory", extra=["--log-level", "INFO"]).start()
    lines: list[str] = []
    t = threading.Thread(target=lambda: lines.extend(d.proc.stderr), daemon=True)
    t.start()
    port = urlsplit(d.url).port
    try:
        key = fz.admin_key_for(port)
        tg = fz.Target(port, key, fz.build_pool(port, key))
        tg.stats = fz.Stats()
        tg.log = lines
        tg.proc = d.proc
        yield tg
        tg.drop()
        assert d.proc.poll() is None, "the daemon died during fuzzing:\n" + "".join(lines)
        tg.alive()  # after all the fuzzing, a fresh connection works
        print("\nfuzz:", tg.stats.summary())
    finally:
        rc = d.stop()
        t.join(5)
    assert rc == 0, "".join(lines)
    errors = [ln for ln in lines if " ERROR " in ln or "Traceback" in ln]
    assert not errors, "the daemon logged errors (INTERNAL replies?):\n" + "".join(lines)


def _check_daemon_alive(target) -> None:
    assert target.proc.poll() is None, "the daemon died:\n" + "".join(target.log)


@settings(FUZZ, max_examples=250)
@given(fz.random_frames())
def test_random_bytes(target, example):
    kind, data = example
    if kind == "raw":
        target.run_raw(data, target.stats)
    else:
        target.run_framed(data, {}, target.stats)
    _check_daemon_alive(target)


@settings(FUZZ, max_examples=300)
@given(fz.envelopes(st.one_of(fz.random_op_maps(), fz.typed_random_op())))
def test_envelopes_with_random_op_fields(target, example):
    frames, ops_by_id = example
    target.run_framed(frames, ops_by_id, target.stats)
    _check_daemon_alive(target)


@pytest.fixture(scope="module")
def valid_ops_strategy(target):
    return fz.envelopes(fz.valid_ops(target.pool), ids=fz._good_ids)


@settings(FUZZ, max_examples=400)
@given(data=st.data())
def test_valid_ops_random_values(target, valid_ops_strategy, data):
    frames, ops_by_id = data.draw(valid_ops_strategy)
    target.run_framed(frames, ops_by_id, target.stats)
    _check_daemon_alive(target)


def test_every_op_is_reachable_by_the_fuzzer(target):
    """The strategy of (c) yields, for each op of ALL_OPS, bodies that decode as that op
    (so the fuzz reaches every handler, not only validation)."""
    for cls in protocol.ALL_OPS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonInteractiveExampleWarning)
            op = fz.valid_ops(target.pool, [cls]).example()
        assert type(op_decoder.decode(protocol.encoder.encode(op))) is cls


def test_checker_rejects_bad_replies():
    """The invariants themselves: INTERNAL, unknown codes, leaked text, bad Ok bodies."""
    import msgspec

    bad = [
        wire.Err(1, "INTERNAL", "internal error; the server logged it as ref 1"),
        wire.Err(1, "WHATEVER", "x"),
        wire.Err(1, "NOT_FOUND", "KeyError: 'scp_1'"),
        wire.Err(1, "VALIDATION_FAILED", 'Traceback (most recent call last):\n  File "x.py", line 1'),
        wire.Err(1, "CONFLICT", ""),
        wire.Ok(1, msgspec.Raw(msgspec.msgpack.encode({"id": 1}))),  # not a ScopeView
    ]
    for frame in bad:
        with pytest.raises(fz.ProtocolViolation):
            fz.check_frame(frame, b"", {1: protocol.ScopeStatus}, None)
    # user input echoed back is not a leak
    fz.check_frame(wire.Err(1, "VALIDATION_FAILED", "name 'KeyError' is invalid"), b"KeyError", {}, None)


# Regression (found by this fuzzer): an instant that is valid ISO 8601 but outside years
# 1-9999 once converted to UTC milliseconds ("9999-12-31T23:59:59.999999Z" rounds up to
# year 10000; "+14:00" on 0001-01-01 lands in year 0) was journaled, then rendering it
# raised ValueError: INTERNAL, and every later view of the entity failed too.
_INSTANT_OPS = [
    ("scope.create", "deadline", {}),
    ("task.submit", "deadline", {"mailbox": "fuzz-mbx", "scope_id": "RUN"}),
    ("group.create", "deadline", {"scope_id": "RUN", "mailbox": "fuzz-mbx", "condition": "ALL_TERMINAL"}),
    ("timer.create", "at", {"scope_id": "RUN"}),
    ("joinset.submit_delay", "at", {"joinset_id": "JS"}),
    ("joinset.submit", "deadline", {"joinset_id": "JS", "mailbox": "fuzz-mbx"}),
    ("message.send", "deadline", {"mailbox": "fuzz-inbox", "scope_id": "RUN"}),
    ("budget.reserve", "settle_by", {"budget": "fuzz-budget", "scope_id": "RUN", "amount_minor": 1}),
]


@pytest.mark.parametrize("instant", ["9999-12-31T23:59:59.999999Z", "9999-12-31T23:59:59-14:00",
                                     "0001-01-01T00:00:00+14:00", "0001-01-01T00:00:00-14:00"])
def test_out_of_range_instants_are_validation_errors(target, instant):
    c = fz.SyncClient(target.port, target.api_key)
    try:
        run = fz.call(c, {"op": "scope.create"}, 100)["id"]  # fresh: the fuzz may cancel the pool's
        js = fz.call(c, {"op": "joinset.create", "scope_id": run}, 101)["id"]
        for i, (op, field, base) in enumerate(_INSTANT_OPS, start=1):
            body = {"op": op, field: instant}
            body.update({k: {"RUN": run, "JS": js}.get(v, v) for k, v in base.items()})
            try:
                fz.call(c, body, i)
            except Exception as exc:
                assert getattr(exc, "code", None) == "VALIDATION_FAILED", (op, exc)
                assert field in exc.message, (op, exc.message)
            else:
                # in range after all (e.g. -14:00 on year 1): accepted, and renders back
                assert instant.startswith("0001-01-01T00:00:00-"), (op, instant)
        # the run is intact and renders
        fz.call(c, {"op": "scope.status", "scope_id": run}, 99)
    finally:
        c.close()
