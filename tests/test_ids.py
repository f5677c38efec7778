"""Typed, time-ordered ids (SPEC §1)."""

import random

from rallypoint.ids import IdGenerator, _b32, is_id

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def reference_b32(n: int) -> str:
    """The obvious 5-bits-at-a-time encoding, as the specification of _b32."""
    out = []
    for _ in range(26):
        out.append(_ALPHABET[n & 31])
        n >>= 5
    return "".join(reversed(out))


def test_fast_encoding_matches_the_reference():
    rnd = random.Random(7)
    for n in [0, 1, 2**128 - 1, 2**127, *(rnd.getrandbits(128) for _ in range(20000))]:
        assert _b32(n) == reference_b32(n)


def test_ids_are_typed_time_ordered_and_unique_within_one_millisecond():
    gen = IdGenerator(now_ms=lambda: 1_700_000_000_000)  # a frozen clock
    ids = [gen.new("tsk") for _ in range(5000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(is_id(i, "tsk") and not is_id(i, "scp") for i in ids)
    later = IdGenerator(now_ms=lambda: 1_700_000_000_001).new("tsk")
    assert later > ids[0][:16]  # the timestamp leads the body


def test_is_id_rejects_malformed():
    for bad in ["", "tsk_", "tsk_" + "u" * 26, "TSK_" + "0" * 26, "tsk-" + "0" * 26, 5, None]:
        assert not is_id(bad)
