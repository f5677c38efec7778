"""A snapshot of the wire contract of every operation: its tag, its request Struct's
fields in order, the bytes of a sample request, its reply Struct's fields and the bytes
of a sample reply. ``tests/data/wire_ops.json`` holds the snapshot taken from main
before the op table was built from the ``@op`` marks (issue 28); ``test_op_table.py``
compares today's contract with it: an op gone, another request or reply Struct for a
tag, a field gone, another encoding option, or other bytes for the same fields fail it
(an op or a field added since is an addition, and needs no new snapshot).

Run ``python tests/_wire_snapshot.py > tests/data/wire_ops.json`` to record it anew
(only on purpose: a deliberate wire change, with a protocol version bump).
"""

from __future__ import annotations

import json
import sys

import msgspec
import msgspec.inspect as mi


def sample(t: mi.Type, depth: int = 0):
    """A deterministic value of type ``t`` (every field of a Struct filled in)."""
    if isinstance(t, mi.IntType):
        return 1
    if isinstance(t, mi.FloatType):
        return 1.5
    if isinstance(t, mi.StrType):
        return "s"
    if isinstance(t, mi.BoolType):
        return True
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.RawType):
        return msgspec.Raw(b"\x01")
    if isinstance(t, (mi.BytesType, mi.ByteArrayType)):
        return b"b"
    if isinstance(t, mi.AnyType):
        return 1
    if isinstance(t, mi.LiteralType):
        return t.values[0]
    if isinstance(t, mi.EnumType):
        return next(iter(t.cls))
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        return [] if depth > 3 else [sample(t.item_type, depth + 1)]
    if isinstance(t, mi.TupleType):
        return tuple(sample(x, depth + 1) for x in t.item_types)
    if isinstance(t, mi.DictType):
        return {} if depth > 3 else {sample(t.key_type, depth + 1): sample(t.value_type, depth + 1)}
    if isinstance(t, mi.UnionType):
        types = [x for x in t.types if not isinstance(x, mi.NoneType)]
        if depth > 3 and len(types) < len(t.types):
            return None
        return sample(types[0], depth + 1)
    if isinstance(t, mi.StructType):
        return t.cls(**{f.name: sample(f.type, depth + 1) for f in t.fields})
    raise TypeError(f"no sample for {t!r}")


def struct_sample(cls):
    return sample(mi.type_info(cls))


def _default(d) -> str:
    if isinstance(d, msgspec.Raw):
        return f"Raw({bytes(d).hex()})"
    factory = getattr(d, "factory", None)
    if factory is not None:
        return f"factory {factory.__name__}"
    return repr(d)


def describe(cls) -> dict:
    cfg = cls.__struct_config__
    return {
        "name": cls.__name__,
        "fields": list(cls.__struct_fields__),
        "encode_fields": list(getattr(cls, "__struct_encode_fields__", cls.__struct_fields__)),
        "defaults": [_default(d) for d in cls.__struct_defaults__],
        "omit_defaults": cfg.omit_defaults,
        "forbid_unknown_fields": cfg.forbid_unknown_fields,
        "tag_field": cfg.tag_field,
        "bytes": msgspec.msgpack.encode(struct_sample(cls)).hex(),
    }


def snapshot(ops, reply_types) -> dict:
    """tag -> {"request": describe(op), "reply": describe(reply)} for every op."""
    return {t.__struct_config__.tag: {"request": describe(t), "reply": describe(reply_types[t])}
            for t in sorted(ops, key=lambda t: t.__struct_config__.tag)}


if __name__ == "__main__":
    from rallypoint import protocol as p
    from rallypoint.actors.api import REPLY_TYPES

    json.dump(snapshot(p.ALL_OPS, REPLY_TYPES), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
