"""One schema per view: every protocol view's fields reach the SDK and the HTTP JSON.

The protocol views (``rallypoint.protocol``, subclasses of ``_View``) are the one
declaration of what an entity shows. The SDK's types are generated from them
(``rallypoint.client.types``) and the HTTP JSON is derived from them
(``rallypoint.http.shapes``). :func:`drift` compares every view's fields across the three;
the tests run it on the real tables and, to show it bites, on a view with a field that
reaches neither (the way ``DeliveryView.key`` and ``TaskView.subscribers`` once shipped).
"""

from __future__ import annotations

import random
import types as pytypes
from datetime import datetime, timezone
from typing import Annotated, Any, Union, get_args, get_origin

import msgspec
import pytest

from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.http import shapes as sh


def all_views() -> list[type]:
    return [v for v in vars(p).values() if isinstance(v, type) and issubclass(v, p._View) and v is not p._View]


def _expected_sdk_type(tp: Any, sdk_types: dict) -> Any:
    """What the SDK must show for a view field of wire type ``tp``."""
    if tp is msgspec.Raw:
        return Any
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return datetime if any(isinstance(m, p.InstantMark) for m in args[1:]) else _expected_sdk_type(args[0], sdk_types)
    if isinstance(tp, type) and issubclass(tp, p._View):
        return sdk_types.get(tp)
    if origin in (Union, pytypes.UnionType):
        return Union[tuple(_expected_sdk_type(a, sdk_types) for a in args)]
    if origin is not None and args:
        return origin[tuple(_expected_sdk_type(a, sdk_types) for a in args)]
    return tp


#: fields whose SDK type is declared in the SDK class body (the wire type does not say it)
SDK_DECLARED = {
    (p.MailboxView, "requirements"): dict[str, dict[str, int]] | None,
    (p.EventPageView, "events"): list[t.Event],
    # over several shards the SDK's merged page carries vector cursors (strings)
    (p.EventPageView, "next_cursor"): int | str,
    (p.EventPageView, "oldest"): int | str,
    (p.EventPageView, "newest"): int | str,
}


def drift(views, sdk_types: dict, shapes: list, not_served: dict) -> list[str]:
    """Every way a view's fields fail to reach the SDK or the HTTP JSON, as messages
    (empty: none)."""
    problems = []
    by_view: dict[type, list] = {}
    for s in shapes:
        by_view.setdefault(s.view, []).append(s)
    for v in views:
        wire = msgspec.structs.fields(v)
        names = [f.name for f in wire]
        # --- SDK: the same fields, in the same order, the instants as datetime
        sdk = sdk_types.get(v)
        if sdk is None:
            problems.append(f"{v.__name__}: no SDK type")
        else:
            got = {f.name: f.type for f in msgspec.structs.fields(sdk)}
            missing = [n for n in names if n not in got]
            if missing:
                problems.append(f"{v.__name__}: fields {missing} do not reach the SDK ({sdk.__name__})")
            elif list(got) != names:
                problems.append(f"{v.__name__}: the SDK's fields are in another order ({sdk.__name__})")
            for f in wire:
                want = SDK_DECLARED.get((v, f.name)) or _expected_sdk_type(f.type, sdk_types)
                if f.name in got and got[f.name] != want:
                    problems.append(f"{v.__name__}.{f.name}: SDK type {got[f.name]}, expected {want}")
        # --- HTTP: a shape showing or hiding (with a reason) every field, or not served
        vs = by_view.get(v, [])
        if v in not_served:
            if not str(not_served[v]).strip():
                problems.append(f"{v.__name__}: declared not served over HTTP without a reason")
            if vs:
                problems.append(f"{v.__name__}: declared not served over HTTP, yet has {vs}")
            continue
        if not vs:
            problems.append(f"{v.__name__}: no HTTP shape (and not declared NOT_SERVED with a reason)")
        for s in vs:
            for n in names:
                if n not in s.shown and not str(s.hidden.get(n, "")).strip():
                    problems.append(f"{s!r}: field {n} is neither shown nor hidden with a reason")
    return problems


def test_every_view_reaches_the_sdk_and_the_http_json():
    assert drift(all_views(), t.SDK_TYPES, sh.SHAPES, sh.NOT_SERVED) == []


def test_the_drift_check_catches_a_field_that_reaches_neither():
    # A hand-written SDK copy without the view's newest field, and a view nobody shaped
    # for HTTP: what shipped before the SDK types were generated.
    class WidgetView(p._View):
        id: str
        created_at: p.Instant
        colour: str | None = None  # the field added later

    class HandWidgetInfo(msgspec.Struct):
        id: str
        created_at: datetime

    problems = drift([WidgetView], {WidgetView: HandWidgetInfo}, sh.SHAPES, sh.NOT_SERVED)
    assert "WidgetView: fields ['colour'] do not reach the SDK (HandWidgetInfo)" in problems
    assert "WidgetView: no HTTP shape (and not declared NOT_SERVED with a reason)" in problems
    # the pre-generation TaskInfo (no subscribers) is caught the same way
    class OldTaskInfo(msgspec.Struct):
        id: str

    assert any("subscribers" in m for m in drift([p.TaskView], {p.TaskView: OldTaskInfo}, [], {p.TaskView: "x"}))
    # generated, it reaches the SDK; shaped without a declaration, it reaches HTTP too
    sdk = t.sdk_type(WidgetView)
    shape = sh.Shape(WidgetView)
    try:
        assert drift([WidgetView], t.SDK_TYPES, [shape], {}) == []
        assert [f.name for f in msgspec.structs.fields(sdk)] == ["id", "created_at", "colour"]
        assert shape.json(WidgetView(id="w1", created_at="2026-01-31T12:00:00.000Z", colour="red")) == {
            "id": "w1", "createdAt": "2026-01-31T12:00:00.000Z", "colour": "red"}
        # hiding a field needs a reason
        with pytest.raises(TypeError, match="needs a reason"):
            sh.Shape(WidgetView, hide={"colour": ""})
        with pytest.raises(TypeError, match="not fields of the view"):
            sh.Shape(WidgetView, rename={"color": "c"})
    finally:
        del t.SDK_TYPES[WidgetView]
        sh.SHAPES.remove(shape)


# ------------------------------------------------------------------ the values, not only the names

_rng = random.Random(28)


def sample(tp: Any, name: str) -> Any:
    """A value of wire type ``tp`` for field ``name`` (never None where a value fits)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        if any(isinstance(m, p.InstantMark) for m in args[1:]):
            return "2026-01-%02dT12:34:56.%03dZ" % (_rng.randint(1, 28), _rng.randint(0, 999))
        return sample(args[0], name)
    if origin in (Union, pytypes.UnionType):
        return sample(next(a for a in args if a is not type(None)), name)
    if origin is list:
        return [sample(args[0], name) for _ in range(2)]
    if origin is dict:
        return {"k": sample(args[1], name)}
    if tp is msgspec.Raw:
        return msgspec.Raw(msgspec.msgpack.encode({"field": name, "n": _rng.randint(0, 99)}))
    if tp is p.Requirements:
        return p.Requirements(pools={"gpu": 1}, budgets={"spend": 40})
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return make(tp)
    return {str: lambda: f"{name}-{_rng.randint(0, 99)}", int: lambda: _rng.randint(1, 10**6), bool: lambda: True,
            float: lambda: 0.5, bytes: lambda: b"body", dict: lambda: {"a": 1}, Any: lambda: {"any": 1}}[tp]()


def make(view: type) -> Any:
    if view is p.EventPageView:  # its events are encoded EventViews
        return view(events=[msgspec.Raw(msgspec.msgpack.encode(make(p.EventView))) for _ in range(2)],
                    next_cursor=7, oldest=1, newest=9)
    return view(**{f.name: sample(f.type, f.name) for f in msgspec.structs.fields(view)})


def _unoptional(tp: Any) -> Any:
    if get_origin(tp) in (Union, pytypes.UnionType):
        (tp,) = [a for a in get_args(tp) if a is not type(None)]
    return tp


def _same(wire_value: Any, tp: Any, sdk_value: Any, where: str) -> None:
    """The SDK's value is the wire value as the SDK shows it."""
    tp = _unoptional(tp)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated and any(isinstance(m, p.InstantMark) for m in args[1:]):
        assert sdk_value == datetime.fromisoformat(wire_value.replace("Z", "+00:00")), where
        assert sdk_value.tzinfo is not None and sdk_value.utcoffset() == timezone.utc.utcoffset(None), where
    elif tp is msgspec.Raw:
        assert sdk_value == msgspec.msgpack.decode(wire_value), where
    elif isinstance(wire_value, p._View):
        check_decoded(wire_value, sdk_value)
    elif isinstance(wire_value, msgspec.Struct):  # Requirements: a dict by name
        assert sdk_value == msgspec.to_builtins(wire_value), where
    elif (isinstance(wire_value, list) and get_origin(tp) is list and get_origin(get_args(tp)[0]) is Annotated
          and any(isinstance(m, p.InstantMark) for m in get_args(get_args(tp)[0])[1:])):  # list[Instant]
        assert sdk_value == [datetime.fromisoformat(w.replace("Z", "+00:00")) for w in wire_value], where
    elif isinstance(wire_value, list) and wire_value and isinstance(wire_value[0], (p._View, msgspec.Raw)):
        (item,) = get_args(_unoptional(tp))
        for w, s in zip(wire_value, sdk_value, strict=True):
            _same(w, item, s, where)
    else:
        assert sdk_value == wire_value, where


def check_decoded(view: Any, sdk: Any) -> None:
    assert type(sdk) is t.SDK_TYPES[type(view)]
    for f in msgspec.structs.fields(type(view)):
        w = getattr(view, f.name)
        if type(view) is p.EventPageView and f.name == "events":
            for raw, ev in zip(w, sdk.events, strict=True):
                check_decoded(msgspec.msgpack.decode(raw, type=p.EventView), ev)
            continue
        _same(w, f.type, getattr(sdk, f.name), f"{type(view).__name__}.{f.name}")


@pytest.mark.parametrize("view", all_views(), ids=lambda v: v.__name__)
def test_the_sdk_decodes_every_field_of_the_wire(view):
    # the reply's bytes, decoded as the SDK decodes them: every field, instants as aware
    # datetimes, payloads as the encoded values
    v = make(view)
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(v), type=t.SDK_TYPES[view])
    check_decoded(v, got)


@pytest.mark.parametrize("shape", sh.SHAPES, ids=lambda s: f"{s.view.__name__}-{sh.SHAPES.index(s)}")
def test_every_shape_renders_its_declared_keys(shape):
    out = shape.json(make(shape.view))
    if shape._drop_none:
        assert set(out) <= set(shape.keys) and set(shape._keep_none) <= set(out)
    else:
        assert list(out) == shape.keys
    for field, names in shape.shown.items():
        for n in names:
            assert n in out or shape._drop_none, (shape, field, n)


def test_sdk_types_are_generated_not_copied():
    # the public names users import are the generated types, with the view they come from
    import rallypoint

    for name, view in [("TaskInfo", p.TaskView), ("RunStatus", p.ScopeView), ("DeliveryInfo", p.DeliveryView),
                       ("GrantInfo", p.GrantView), ("TaskOutcome", p.TaskOutcomeView)]:
        cls = getattr(t, name)
        assert cls.__view__ is view and t.SDK_TYPES[view] is cls
    assert rallypoint.TaskInfo is t.TaskInfo and rallypoint.RunStatus is t.RunStatus
    # what the hand types offered on top of the fields is still there
    info = msgspec.msgpack.decode(msgspec.msgpack.encode(make(p.TaskView)), type=t.TaskInfo)
    assert info["id"] == info.id and info.to_dict()["id"] == info.id and info.finished is False
    with pytest.raises(KeyError):
        info["nope"]
    with pytest.raises(AttributeError):
        info.id = "x"  # read-only
    outcome = msgspec.msgpack.decode(msgspec.msgpack.encode(make(p.TaskOutcomeView)), type=t.TaskOutcome)
    assert isinstance(outcome.outcome, dict)  # array-like on the wire, as the view


def test_a_declaration_that_names_no_field_fails_at_import_time():
    class GadgetView(p._View):
        id: str

    with pytest.raises(TypeError, match="not fields of GadgetView"):
        class Bad(t._Info, view=GadgetView):  # noqa: F841
            colour: str
    assert GadgetView not in t.SDK_TYPES
    with pytest.raises(TypeError, match="already has the SDK type"):
        class Twice(t._Info, view=p.GrantView):  # noqa: F841
            pass
