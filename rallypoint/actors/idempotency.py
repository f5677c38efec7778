"""Stored answers of HTTP idempotency keys (runstate's ``Idempotency-Key`` header).

The HTTP layer (:mod:`rallypoint.http`) sends every non-GET request that carries a key
through two ops on the space's actor: ``idempotency.lookup`` before it runs the request
(a stored answer is replayed as is; one stored for another method, path or body is
IDEMPOTENCY_CONFLICT) and ``idempotency.record`` after it (the answer -- HTTP status and
encoded body -- is journaled as ``IdempotencyRecorded`` and the reply waits until it is
durable, like every answer). So a client that retries after a lost response gets the
first answer, also across a daemon restart, for the TTL (``--http-idempotency-hours``,
default 24 h); entries past it are forgotten (``IdempotencyExpired``, committed with a
later record, at most 256 at a time, oldest first).

The stored answer and the request's own effect are two commits: a crash between them
loses the stored answer, not the effect, and a retry then runs the request again. Every
runstate write that matters under retries is also idempotent by itself (task keys,
usage keys, ensure, fenced settles), so that window never duplicates work; it can
only turn a replayed answer into a fresh one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import msgspec

from ..errors import IdempotencyConflictError, ValidationError
from ..protocol import IdempotencyLookup, IdempotencyRecord, IdempotencyView
from ..records import IdempotencyExpired, IdempotencyRecorded
from .common import applies
from .kind import Kind
from .opmark import ALWAYS, ANY_KEY, SPACE, op

__all__ = ["IdempotencyState", "Idempotency", "DEFAULT_TTL_MS"]

DEFAULT_TTL_MS = 24 * 3600 * 1000
MAX_KEY = 256
MAX_BODY = 1 << 20
PURGE_BATCH = 256
_B32 = "0123456789abcdefghjkmnpqrstvwxyz"


class IdempotencyState(msgspec.Struct, gc=False):
    id: str
    space: str
    key: str
    fingerprint: str
    status: int
    body: bytes
    at_ms: int  # wall time it was recorded


def entry_id(space: str, key: str) -> str:
    """The entity id of (space, key): ``idm_`` and 26 base32 characters of a SHA-256."""
    n = int.from_bytes(hashlib.sha256(f"{space}\0{key}".encode()).digest()[:17], "big") >> 6
    out = []
    for _ in range(26):
        out.append(_B32[n & 31])
        n >>= 5
    return "idm_" + "".join(out)


class Idempotency(Kind):
    """Stored HTTP answers by (space, key), oldest first."""

    prefix = "idm"
    name = "idempotency"

    def __init__(self, coord, ttl_ms: int = DEFAULT_TTL_MS) -> None:
        super().__init__(coord)
        self.ttl_ms = ttl_ms
        self.table: "OrderedDict[str, IdempotencyState]" = OrderedDict()

    def entity_tables(self):
        return {"idm": (self.table, IdempotencyState)}

    @staticmethod
    def _check(key) -> None:
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY:
            raise ValidationError(f"the idempotency key must be 1 to {MAX_KEY} characters",
                                  details={"field": "idempotency-key"})

    def _live(self, space: str, key: str) -> IdempotencyState | None:
        e = self.table.get(entry_id(space, key))
        if e is None or e.space != space or e.key != key:
            return None
        if e.at_ms + self.ttl_ms <= self.coord.now_ms():
            return None
        return e

    @op(IdempotencyLookup, route=SPACE, permission=ANY_KEY, resend=ALWAYS)
    def op_idempotency_lookup(self, actor, session, op: IdempotencyLookup) -> IdempotencyView:
        """The stored answer, or ``found`` False. IDEMPOTENCY_CONFLICT when the key was
        used for another request (method, path or body)."""
        self._check(op.key)
        e = self._live(session.space, op.key)
        if e is None:
            return IdempotencyView(found=False)
        if e.fingerprint != op.fingerprint:
            raise IdempotencyConflictError(
                "this Idempotency-Key was already used for a different request (method, path or body)",
                details={"key": op.key},
            )
        return IdempotencyView(found=True, status=e.status, body=e.body)

    @op(IdempotencyRecord, route=SPACE, permission=ANY_KEY, resend=ALWAYS)
    def op_idempotency_record(self, actor, session, op: IdempotencyRecord) -> IdempotencyView:
        """Store the answer (the first one wins: a later record answers the stored one),
        and forget up to 256 entries past the TTL in the same commit."""
        self._check(op.key)
        if len(op.body) > MAX_BODY:
            raise ValidationError("answer too large to store", details={"field": "body"})
        e = self._live(session.space, op.key)
        if e is not None:
            return IdempotencyView(found=True, status=e.status, body=e.body)
        now = self.coord.now_ms()
        recs: list = []
        old = self._expired(now)
        if old:
            recs.append(IdempotencyExpired(ids=old))
        self.coord.retention.rearm()  # its tick forgets expired answers when no request comes
        recs.append(IdempotencyRecorded(id=entry_id(session.space, op.key), space=session.space, key=op.key,
                                        fingerprint=op.fingerprint, status=op.status, body=op.body, at_ms=now))
        self.coord.commit(recs)
        return IdempotencyView(found=True, status=op.status, body=op.body)

    def _expired(self, now_ms: int) -> list[str]:
        """Ids of the oldest entries past the TTL at ``now_ms`` (at most PURGE_BATCH)."""
        cutoff = now_ms - self.ttl_ms
        old = []
        for eid, ent in self.table.items():
            if ent.at_ms > cutoff or len(old) >= PURGE_BATCH:
                break
            old.append(eid)
        return old

    def expire_due(self, now_ms: int) -> bool:
        """Retention's tick: forget stored answers past the TTL (one record of at most
        PURGE_BATCH). Returns True when more are due."""
        old = self._expired(now_ms)
        if not old:
            return False
        self.coord.commit([IdempotencyExpired(ids=old)])
        return len(old) >= PURGE_BATCH

    @applies(IdempotencyRecorded)
    def _apply_recorded(self, r: IdempotencyRecorded) -> None:
        self.table.pop(r.id, None)  # an expired entry of the same key: the new one goes last
        self.table[r.id] = IdempotencyState(id=r.id, space=r.space, key=r.key, fingerprint=r.fingerprint,
                                            status=r.status, body=r.body, at_ms=r.at_ms)
        self.coord.touch(r.id)

    @applies(IdempotencyExpired)
    def _apply_expired(self, r: IdempotencyExpired) -> None:
        for eid in r.ids:
            if self.table.pop(eid, None) is not None:
                self.coord.touch(eid)

    def rebuild_indexes(self) -> None:
        # a snapshot loads in id order: put the entries back in recording order
        items = sorted(self.table.items(), key=lambda kv: kv[1].at_ms)
        self.table.clear()  # in place: the coordinator's table registry holds this dict
        self.table.update(items)

    def statistics(self) -> dict:
        return {"idempotency_keys": len(self.table)}
