"""Every journal record type round-trips through the journal codec and has an apply.

Instances are built generically from each record Struct's type hints, so a record type
added to :data:`rallypoint.records.ALL_RECORD_TYPES` is covered without touching this
file, and one whose fields the codec cannot carry fails here. A record class that is not
in the union (so the decoder would refuse it at recovery) fails too.
"""

from __future__ import annotations

import types
import typing

import msgspec
import pytest

import rallypoint.actors  # noqa: F401  (registers every kind's apply functions)
from rallypoint import records
from rallypoint.actors import Coordinator
from rallypoint.records import ALL_RECORD_TYPES, decode_commit, encode_commit

_MISSING = object()


def sample(tp, field_name: str, variant: int):
    """A value of type ``tp`` (variant 0: 'full', 1: other values, 2: the smallest)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if variant == 2 and type(None) in typing.get_args(tp):
            return None
        return sample(args[variant % len(args)], field_name, variant)
    if origin is typing.Literal:
        return typing.get_args(tp)[variant % len(typing.get_args(tp))]
    if origin in (list, tuple, set, frozenset):
        (arg, *_) = typing.get_args(tp) or (int,)
        n = (2, 1, 0)[variant]
        items = [sample(arg, field_name, variant) for _ in range(n)]
        return origin(items) if origin is not list else items
    if origin is dict:
        k, v = typing.get_args(tp)
        return {} if variant == 2 else {sample(k, field_name, variant): sample(v, field_name, variant)}
    if tp is bool:
        return variant != 0  # non-default in one variant whatever the default is
    if tp is int:
        return (1_754_000_000_123, 7, 0)[variant]
    if tp is float:
        return (1.5, -2.25, 0.0)[variant]
    if tp is str:
        return (f"{field_name}_01hx\u00e9", "x", "")[variant]
    if tp is bytes:
        return (b"\x81\xa1k\x01", b"\xc0", b"")[variant]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return build(tp, variant)
    raise AssertionError(
        f"tests/test_durability_records.py cannot build a {tp!r} for field {field_name!r}: "
        "extend sample() so the new record type gets a round trip"
    )


def build(cls, variant: int):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in msgspec.structs.fields(cls):
        if variant == 2 and (f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT):
            continue  # leave defaults (omitted on the wire by omit_defaults)
        kwargs[f.name] = sample(hints[f.name], f.name, variant)
    return cls(**kwargs)


@pytest.mark.parametrize("cls", ALL_RECORD_TYPES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("variant", [0, 1, 2], ids=["full", "other", "minimal"])
def test_record_round_trips_through_the_journal_codec(cls, variant):
    rec = build(cls, variant)
    payload = encode_commit([rec])
    (back,) = decode_commit(payload)
    assert type(back) is cls
    assert back == rec
    assert msgspec.structs.asdict(back) == msgspec.structs.asdict(rec)


def test_a_commit_of_every_record_type_round_trips_in_order():
    recs = [build(cls, v) for v in (0, 1, 2) for cls in ALL_RECORD_TYPES]
    assert decode_commit(encode_commit(recs)) == recs


def test_every_record_class_is_in_the_union_with_a_unique_tag():
    defined = {
        obj
        for obj in vars(records).values()
        if isinstance(obj, type) and issubclass(obj, records._Rec) and obj is not records._Rec
    }
    missing = sorted(c.__name__ for c in defined - set(ALL_RECORD_TYPES))
    assert not missing, f"record classes not in records.Record (recovery could not decode them): {missing}"
    tags = [c.__struct_config__.tag for c in ALL_RECORD_TYPES]
    assert len(tags) == len(set(tags)), f"duplicate record tags: {tags}"


def test_every_record_type_has_exactly_one_apply():
    applied = Coordinator()._apply
    assert sorted(t.__name__ for t in ALL_RECORD_TYPES if t not in applied) == []


def test_a_corrupt_commit_payload_raises_decode_error():
    with pytest.raises(msgspec.DecodeError):
        decode_commit(b"\x91\x81\xa1r\xa7nothing")


@pytest.mark.parametrize("prefix", sorted(Coordinator().entity_tables()))
def test_entity_state_round_trips_through_the_snapshot_codec(prefix):
    """What the Snapshotter encodes, load_entities decodes to an equal Struct."""
    _table, typ = Coordinator().entity_tables()[prefix]
    for variant in (0, 1, 2):
        ent = build(typ, variant)
        back = msgspec.msgpack.Decoder(typ).decode(msgspec.msgpack.Encoder().encode(ent))
        assert back == ent
