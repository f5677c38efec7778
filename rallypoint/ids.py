"""Time-ordered, typed, opaque ids (SPEC §1).

An id is ``<prefix>_<26 chars>``: a ULID-style body in lowercase Crockford base32, made
of a 48-bit millisecond timestamp and an 80-bit random part. Ids made by one process are
strictly increasing (within one millisecond the random part is incremented), so sorting
ids sorts by creation.

**Slots.** In a sharded cluster (``rallypoint serve --cluster`` with several shards) an
id also names its *slot*: the top 10 bits of the random part (body characters 11-12)
carry the slot of the root run it was made under (or its space's home slot for a
space-wide entity), so a router maps any id to its shard with no lookup
(:func:`slot_of`; Restate: "the invocation id encodes the partition"). A slot names a
partition, not a process: which shard owns a slot is the cluster's slot map. Ids made
for one slot still strictly increase; ids of different slots made in the same
millisecond sort by slot. A single node makes ids with random slot bits, as before.
"""

from __future__ import annotations

import os
import re
import time

__all__ = ["PREFIXES", "new_id", "is_id", "id_time_ms", "IdGenerator", "slot_of", "MAX_SLOTS", "SLOT_BITS"]

#: Bits of an id's random part that carry its slot, and so the most slots a cluster has.
SLOT_BITS = 10
MAX_SLOTS = 1 << SLOT_BITS
_SLOT_SHIFT = 80 - SLOT_BITS  # the slot's place in the 80-bit random part

#: Known prefixes and what they name.
PREFIXES = {
    "scp": "run (scope)",
    "mbx": "mailbox",
    "tsk": "task",
    "dlv": "delivery",
    "grp": "task group",
    "bar": "barrier",
    "tmr": "timer",
    "jst": "join set",
    "clm": "claim",
    "pol": "pool (permits)",
    "grt": "pool grant",
    "wlm": "work limit",
    "key": "api key",
    "chd": "join-set child (delay)",
    "quo": "quota (allowance)",
    "qwt": "quota waiter",
    "qcn": "quota consumption",
    "bdg": "budget",
    "rsv": "budget reservation",
    "usg": "the keys a purged budget reservation used (kept with its budget)",
    "onc": "once (one execution per run and key)",
    "idm": "stored answer of an HTTP idempotency key",
    "msg": "message (in an INBOX mailbox)",
    "sch": "schedule (recurring actions)",
    "sca": "schedule action (one fire of a schedule)",
}

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
_ID_RE = re.compile(r"^([a-z]{3})_([0-9a-hjkmnp-tv-z]{26})$")
_RAND_MASK = (1 << 80) - 1
_LOW_MASK = (1 << 40) - 1


_PAIRS = [a + b for a in _ALPHABET for b in _ALPHABET]  # 10 bits -> 2 chars


def _b32(n: int) -> str:
    """128-bit int -> 26 chars of lowercase Crockford base32 (2 zero bits + 128 bits),
    two characters per table lookup."""
    p = _PAIRS
    return (
        p[(n >> 120) & 1023] + p[(n >> 110) & 1023] + p[(n >> 100) & 1023] + p[(n >> 90) & 1023]
        + p[(n >> 80) & 1023] + p[(n >> 70) & 1023] + p[(n >> 60) & 1023] + p[(n >> 50) & 1023]
        + p[(n >> 40) & 1023] + p[(n >> 30) & 1023] + p[(n >> 20) & 1023] + p[(n >> 10) & 1023]
        + p[n & 1023]
    )


class IdGenerator:
    """Monotonic id source. ``now_ms`` is a callable giving wall-clock milliseconds.

    Within one millisecond the random part is incremented; the first 18 characters
    (the timestamp and the random part's high 40 bits) are then unchanged unless the
    low 40 bits carry, so only the last 8 characters are formatted (the hot path: a
    batch of tasks and deliveries shares a millisecond)."""

    __slots__ = ("_last_ms", "_last_rand", "_now_ms", "_head", "_slots", "_fixed")

    def __init__(self, now_ms=None, *, slot: int | None = None) -> None:
        if slot is not None and not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot {slot} is not in 0..{MAX_SLOTS - 1}")
        self._last_ms = -1
        self._last_rand = 0
        self._now_ms = now_ms or (lambda: int(time.time() * 1000))
        self._head = ""  # the body's first 18 chars for (_last_ms, _last_rand >> 40)
        self._slots: dict[int, IdGenerator] = {}  # per slot: a generator of its own
        self._fixed = slot  # the slot every id of this generator names (None: random bits)

    def new(self, prefix: str, slot: int | None = None) -> str:
        """A new id with ``prefix``; with ``slot`` (0 to MAX_SLOTS - 1), one that names
        that slot (see the module docstring), strictly after every earlier id of the
        same slot from this generator. Raises ValueError for a slot out of range."""
        if slot is None:
            return self._new(prefix)
        g = self._slots.get(slot)
        if g is None:
            g = self._slots[slot] = IdGenerator(self._now_ms, slot=slot)
        return g._new(prefix)

    def _new(self, prefix: str) -> str:
        ms = self._now_ms()
        if ms <= self._last_ms:
            rand = self._last_rand + 1
            low = rand & _LOW_MASK
            if low and rand <= _RAND_MASK:  # no carry out of the low 40 bits
                self._last_rand = rand
                p = _PAIRS
                return (f"{prefix}_{self._head}{p[(low >> 30) & 1023]}{p[(low >> 20) & 1023]}"
                        f"{p[(low >> 10) & 1023]}{p[low & 1023]}")
            ms = self._last_ms
            rand &= _RAND_MASK
        else:
            rand = int.from_bytes(os.urandom(10), "big")
            if self._fixed is not None:  # the slot's bits; increments never carry into them
                rand = (rand >> SLOT_BITS) | (self._fixed << _SLOT_SHIFT)
        self._last_ms, self._last_rand = ms, rand
        body = _b32((ms << 80) | rand)
        self._head = body[:18]
        return f"{prefix}_{body}"


_default = IdGenerator()


def new_id(prefix: str) -> str:
    """A new id with ``prefix`` from the process-wide generator."""
    return _default.new(prefix)


def is_id(value: object, prefix: str | None = None) -> bool:
    """True when ``value`` is a well-formed id (with ``prefix`` if given)."""
    if not isinstance(value, str):
        return False
    m = _ID_RE.match(value)
    return bool(m) and (prefix is None or m.group(1) == prefix)


_DECODE = {c: i for i, c in enumerate(_ALPHABET)}


def slot_of(value: str) -> int:
    """The slot an id names (its random part's top 10 bits; see the module docstring).
    Reads two characters: no validation beyond what indexing does (``is_id`` first if
    the value is untrusted)."""
    d = _DECODE
    return ((d[value[14]] << 5) | d[value[15]]) & (MAX_SLOTS - 1)


def id_time_ms(value: object) -> int | None:
    """The millisecond timestamp an id was made at (the clock of the process that made
    it: the server's time for server ids), or None for anything that is not an id."""
    if not isinstance(value, str):
        return None
    m = _ID_RE.match(value)
    if not m:
        return None
    n = 0
    for c in m.group(2):
        n = (n << 5) | _DECODE[c]
    return n >> 80
