"""Stored answers of HTTP idempotency keys (runstate's ``Idempotency-Key`` header).

The HTTP layer (:mod:`rallypoint.http`) sends every non-GET request that carries a key
through two node-local ops on the space's actor: ``idempotency.lookup`` before it runs the request
(a stored answer is replayed as is; one stored for another method, path or body is
IDEMPOTENCY_CONFLICT) and ``idempotency.record`` after it (the answer -- HTTP status and
encoded body -- is journaled as ``IdempotencyRecorded`` and the reply waits until it is
durable, like every answer). So a client that retries after a lost response gets the
first answer, also across a daemon restart, for the TTL (``--http-idempotency-hours``,
default 24 h); entries past it are forgotten (``IdempotencyExpired``, committed with a
later record, at most 256 at a time, oldest first).

**The effect and its answer are one commit.** A request is one or more operations
(*steps*); the HTTP layer runs step ``i`` of a keyed request with a session carrying
``(key, fingerprint, i)`` (``Session.for_step``). The coordinator journals every
commit that step's handler makes, together with the step's answer -- an
``IdempotencyRecorded`` record with ``step`` ``"<i>:<op tag>"`` and the encoded reply
as ``body`` -- as ONE journal entry (``Coordinator._handle_keyed``). When the request is
retried (a lost response, a crash), its lookup finds no final answer, so it runs
again, and each step whose answer is stored is answered from it without running: the
effect is never applied twice, wherever a kill -9 falls. The final answer
(``idempotency.record``, the rendered HTTP status and body) is a second commit as
before; it only saves re-running the steps. A step that parks is stored when its
wait's check answers with a commit (a long-poll receive leasing once a task comes);
a step that committed nothing (a read) or failed stores nothing and runs again; an
entry holding only steps (``status`` 0) is not a stored answer to a lookup.

**No client's to forge.** Both ops are marked ``LOCAL`` (``actors/opmark.py``): only the
node's own HTTP layer makes them, in process, under a local copy of the request's session
(``Session.as_local``: still refused once the request's key is revoked); over TCP, from
the embedded client or from an open-mode session they are FORBIDDEN, whatever the key
holds. (A client that could record would answer another key's POST with a forged 200 and
``idempotent-replayed``, squat its keys, and store 1 MB blobs without limit; one that
could look up would read other requests' answers.) The answers the node stores are the
answers it gave, at most one request body's size each (``MAX_BODY``).

Old journals replay: an ``IdempotencyRecorded`` without ``step`` is a final answer,
as it always was.
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
from ..limits import entry_bytes
from .opmark import ALWAYS, HERE, LOCAL, SPACE, op

__all__ = ["IdempotencyState", "Idempotency", "DEFAULT_TTL_MS"]

DEFAULT_TTL_MS = 24 * 3600 * 1000
MAX_KEY = 256
MAX_BODY = 1 << 20
PURGE_BATCH = 256
_B32 = "0123456789abcdefghjkmnpqrstvwxyz"


class IdempotencyState(msgspec.Struct, gc=False):
    """The stored answers of one key: ``status``/``body``, the final HTTP answer
    (``status`` 0: none yet); ``steps``: ``"<step>:<op tag>"`` -> the encoded reply of
    each step that changed state."""

    id: str
    space: str
    key: str
    fingerprint: str
    status: int
    body: bytes
    at_ms: int  # wall time it was first recorded
    steps: dict[str, bytes] = msgspec.field(default_factory=dict)


def _step_name(step: int, op) -> str:
    """``"<step>:<op tag>"``: a step is matched by its place in the request and its
    operation (not its fields: a retry may differ in a generated id)."""
    return f"{step}:{type(op).__struct_config__.tag}"


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

    @op(IdempotencyLookup, route=SPACE, permission=LOCAL, resend=ALWAYS, shard=HERE)
    def op_idempotency_lookup(self, actor, session, op: IdempotencyLookup) -> IdempotencyView:
        """The stored answer, or ``found`` False (also while only steps are stored: the
        request runs again, its stored steps answered from the store).
        IDEMPOTENCY_CONFLICT when the key was used for another request (method, path or
        body). LIMIT_EXCEEDED, when the request is to run, while the space's
        ``payload_bytes`` limit is reached: a keyed request is refused at its start,
        never between its effect and its stored answer (``rallypoint/limits.py``)."""
        self._check(op.key)
        e = self._live(session.space, op.key)
        if e is None:
            self.coord.limits.check_payload(session.space, 1)
            return IdempotencyView(found=False)
        self._same_request(e, op.key, op.fingerprint)
        if not e.status:
            self.coord.limits.check_payload(session.space, 1)
            return IdempotencyView(found=False)
        return IdempotencyView(found=True, status=e.status, body=e.body)

    @staticmethod
    def _same_request(e: IdempotencyState, key: str, fingerprint: str) -> None:
        if e.fingerprint != fingerprint:
            raise IdempotencyConflictError(
                "this Idempotency-Key was already used for a different request (method, path or body)",
                details={"key": key},
            )

    # ---------------------------------------------------------------- steps (the coordinator's)
    def step_answer(self, session, op) -> bytes | None:
        """The stored answer of the step ``session.idempotency`` names, if that step
        (same index, same operation) changed state when it ran before; None otherwise.
        IDEMPOTENCY_CONFLICT when the key was used for another request."""
        key, fingerprint, step = session.idempotency
        e = self._live(session.space, key)
        if e is None:
            return None
        self._same_request(e, key, fingerprint)
        return e.steps.get(_step_name(step, op))

    def step_record(self, session, op, answer: bytes, now_ms: int) -> IdempotencyRecorded:
        """The record storing ``answer`` (the encoded reply) of the step
        ``session.idempotency`` names, for the entry that journals its effect."""
        key, fingerprint, step = session.idempotency
        return IdempotencyRecorded(id=entry_id(session.space, key), space=session.space, key=key,
                                   fingerprint=fingerprint, status=0, body=answer, at_ms=now_ms,
                                   step=_step_name(step, op))

    @op(IdempotencyRecord, route=SPACE, permission=LOCAL, resend=ALWAYS, shard=HERE)
    def op_idempotency_record(self, actor, session, op: IdempotencyRecord) -> IdempotencyView:
        """Store the answer (the first one wins: a later record answers the stored one),
        and forget up to 256 entries past the TTL in the same commit."""
        self._check(op.key)
        if len(op.body) > MAX_BODY:
            raise ValidationError("answer too large to store", details={"field": "body"})
        e = self._live(session.space, op.key)
        if e is not None and e.status:
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
        """A step's answer joins its request's entry; a final answer completes it (its
        steps are no longer needed). Anything else -- no entry, an expired one, another
        request's -- starts a new entry, last in line for expiry."""
        e = self.table.get(r.id)
        limits = self.coord.limits
        if (e is not None and e.fingerprint == r.fingerprint and not e.status and e.key == r.key
                and r.at_ms < e.at_ms + self.ttl_ms):
            before = entry_bytes(e)
            if r.step is not None:
                e.steps[r.step] = r.body
            else:
                e.status, e.body, e.steps = r.status, r.body, {}
            limits.bytes_changed(e.space, entry_bytes(e) - before)
        else:
            old = self.table.pop(r.id, None)  # an expired entry of the same key: the new one goes last
            if old is not None:
                limits.bytes_changed(old.space, -entry_bytes(old))
            e = self.table[r.id] = IdempotencyState(id=r.id, space=r.space, key=r.key, fingerprint=r.fingerprint,
                                                    status=r.status, body=r.body, at_ms=r.at_ms)
            if r.step is not None:
                e.body = b""
                e.steps[r.step] = r.body
            limits.bytes_changed(e.space, entry_bytes(e))
        self.coord.touch(r.id)

    @applies(IdempotencyExpired)
    def _apply_expired(self, r: IdempotencyExpired) -> None:
        limits = self.coord.limits
        for eid in r.ids:
            e = self.table.pop(eid, None)
            if e is not None:
                limits.bytes_changed(e.space, -entry_bytes(e))
                self.coord.touch(eid)

    def rebuild_indexes(self) -> None:
        # a snapshot loads in id order: put the entries back in recording order
        items = sorted(self.table.items(), key=lambda kv: kv[1].at_ms)
        self.table.clear()  # in place: the coordinator's table registry holds this dict
        self.table.update(items)

    def statistics(self) -> dict:
        return {"idempotency_keys": len(self.table)}
