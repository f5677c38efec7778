"""A small Trio client for etcd 3.4's v3 JSON gateway, over ``httpx.AsyncClient``.

etcd's gRPC clients do not run under Trio (grpc.aio is asyncio-only), so this speaks the
gateway that every etcd member serves on its client URL (``POST /v3/kv/range`` ...,
https://etcd.io/docs/v3.4/dev-guide/api_grpc_gateway/). The JSON details are hidden:
keys and values are ``str | bytes`` here (base64 on the wire), revisions and lease ids are
``int`` (strings on the wire), results are msgspec Structs.

Calls and their limits:

- every unary call is bounded by ``timeout_s`` (seconds; the client's default or the
  call's own): within it the call tries each endpoint in turn, starting with the one that
  last answered, and retries the round (backoff up to ``backoff_max_s``) until an endpoint
  answers or the time is up (:class:`EtcdUnavailableError`). Connection failures, timeouts
  of one try and etcd's UNAVAILABLE (no leader, leader changed, request timed out) move
  on to the next endpoint; any other refusal is raised at once. A write whose try timed
  out after it reached etcd may therefore be applied twice: use puts of a whole value and
  compare-guarded transactions (what ``leader.py`` does);
- the gateway's lease keepalive is a stream; one POST per renewal works and is what
  :meth:`EtcdClient.lease_keepalive` does;
- :meth:`EtcdClient.watch` streams ``/v3/watch`` (NDJSON) and resumes from the next
  revision after a lost connection or a restarted member; only its opening is bounded by
  ``timeout_s`` (a watch idles for as long as nothing changes).

Errors (all :class:`EtcdError`, a :class:`~rallypoint.errors.RallypointError`):
:class:`EtcdUnavailableError` (UNAVAILABLE: no endpoint answered in time),
:class:`EtcdCompactedError` (CURSOR_EXPIRED: the revision asked for was compacted),
:class:`EtcdLeaseNotFoundError` (NOT_FOUND: the lease expired or was revoked), and
:class:`EtcdError` itself (INTERNAL: etcd refused the request; its message is etcd's).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import httpx
import msgspec
import trio

from rallypoint.errors import CursorExpiredError, NotFoundError, RallypointError, UnavailableError, ValidationError

__all__ = [
    "EtcdClient",
    "Watch",
    "Compare",
    "Put",
    "Range",
    "Delete",
    "KeyValue",
    "RangeResult",
    "PutResult",
    "DeleteResult",
    "TxnResult",
    "LeaseGrant",
    "LeaseTimeToLive",
    "WatchEvent",
    "WatchStatistics",
    "Status",
    "EtcdError",
    "EtcdUnavailableError",
    "EtcdCompactedError",
    "EtcdLeaseNotFoundError",
    "prefix_end",
]

log = logging.getLogger("rallypoint.cluster")

_UNAVAILABLE_GRPC = {1, 4, 14}  # CANCELLED (a closing member), DEADLINE_EXCEEDED, UNAVAILABLE
_NOT_FOUND_GRPC = 5
_OUT_OF_RANGE_GRPC = 11


# -- errors -------------------------------------------------------------------------


class EtcdError(RallypointError):
    """INTERNAL: etcd refused a request (``details``: ``grpc_code``, ``path``); the
    message is etcd's own. Base of the other etcd errors."""

    code = "INTERNAL"


class EtcdUnavailableError(EtcdError, UnavailableError):
    """UNAVAILABLE: no etcd endpoint answered within the call's ``timeout_s``
    (``details``: ``endpoints``, ``path``, ``last_error``)."""

    code = "UNAVAILABLE"


class EtcdCompactedError(EtcdError, CursorExpiredError):
    """CURSOR_EXPIRED: the revision asked for is older than etcd's compaction point.
    Attributes ``revision`` (asked) and ``compact_revision`` (the oldest still kept; 0
    when etcd did not say). Read the current state again and watch from its revision."""

    code = "CURSOR_EXPIRED"

    def __init__(self, message: str, *, revision: int, compact_revision: int) -> None:
        super().__init__(message, details={"revision": revision, "compact_revision": compact_revision})
        self.revision = revision
        self.compact_revision = compact_revision


class EtcdLeaseNotFoundError(EtcdError, NotFoundError):
    """NOT_FOUND: the lease does not exist at etcd (it expired, or was revoked);
    attribute ``lease_id``. Grant a new lease."""

    code = "NOT_FOUND"

    def __init__(self, lease_id: int) -> None:
        super().__init__(
            f"etcd lease {lease_id:#x} not found: it expired or was revoked; grant a new one",
            details={"lease_id": lease_id},
        )
        self.lease_id = lease_id


# -- results (decoded straight from the gateway's JSON; int64 strings accepted) -----


class _Header(msgspec.Struct):
    revision: int = 0
    member_id: int = 0
    raft_term: int = 0


class KeyValue(msgspec.Struct, frozen=True):
    """One key at one revision: ``create_revision`` (0 once deleted), ``mod_revision``,
    ``version`` (puts since creation), ``lease`` (0 = none)."""

    key: bytes
    value: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0


class RangeResult(msgspec.Struct, frozen=True):
    """``kvs`` in key order; ``count`` of keys in the range; ``revision``: the store
    revision the read saw."""

    header: _Header = msgspec.field(default_factory=_Header)
    kvs: list[KeyValue] = []
    count: int = 0
    more: bool = False

    @property
    def revision(self) -> int:
        return self.header.revision


class PutResult(msgspec.Struct, frozen=True):
    """``revision``: the store revision of the put; ``prev_kv`` when asked for."""

    header: _Header = msgspec.field(default_factory=_Header)
    prev_kv: KeyValue | None = None

    @property
    def revision(self) -> int:
        return self.header.revision


class DeleteResult(msgspec.Struct, frozen=True):
    """``deleted``: how many keys went; ``prev_kvs`` when asked for."""

    header: _Header = msgspec.field(default_factory=_Header)
    deleted: int = 0
    prev_kvs: list[KeyValue] = []

    @property
    def revision(self) -> int:
        return self.header.revision


class TxnResult(msgspec.Struct, frozen=True):
    """``succeeded``: every compare held (the ``success`` ops ran, else ``failure``);
    ``responses``: one result per op that ran, in order; ``revision``: the store revision
    after the transaction (a write in it happened at this revision)."""

    revision: int
    succeeded: bool
    responses: tuple[RangeResult | PutResult | DeleteResult, ...]


class LeaseGrant(msgspec.Struct, frozen=True):
    """A granted lease: ``lease_id`` and ``ttl_s`` (seconds, as etcd granted it: never
    less than its minimum, 2 s with the default election timeout)."""

    header: _Header = msgspec.field(default_factory=_Header)
    lease_id: int = msgspec.field(name="ID", default=0)
    ttl_s: int = msgspec.field(name="TTL", default=0)


class LeaseTimeToLive(msgspec.Struct, frozen=True):
    """``ttl_s``: seconds left (whole seconds, rounded by etcd), ``granted_ttl_s``, and
    the ``keys`` attached when asked for."""

    header: _Header = msgspec.field(default_factory=_Header)
    lease_id: int = msgspec.field(name="ID", default=0)
    ttl_s: int = msgspec.field(name="TTL", default=0)
    granted_ttl_s: int = msgspec.field(name="grantedTTL", default=0)
    keys: list[bytes] = []


class WatchEvent(msgspec.Struct, frozen=True):
    """A change: ``type`` PUT or DELETE; ``kv`` (for DELETE only key and mod_revision);
    ``prev_kv`` when the watch asked for it and etcd still had it."""

    kv: KeyValue
    type: Literal["PUT", "DELETE"] = "PUT"
    prev_kv: KeyValue | None = None


class Status(msgspec.Struct, frozen=True):
    """A member's ``/v3/maintenance/status``: ``version``, ``leader`` (member id of the
    raft leader, 0 = none), ``member_id`` and ``revision`` (from the header)."""

    header: _Header = msgspec.field(default_factory=_Header)
    version: str = ""
    leader: int = 0
    raft_term: int = msgspec.field(name="raftTerm", default=0)

    @property
    def member_id(self) -> int:
        return self.header.member_id

    @property
    def revision(self) -> int:
        return self.header.revision


class _OpResponse(msgspec.Struct):
    response_range: RangeResult | None = None
    response_put: PutResult | None = None
    response_delete_range: DeleteResult | None = None


class _TxnResponse(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    succeeded: bool = False
    responses: list[_OpResponse] = []


class _StreamError(msgspec.Struct):
    grpc_code: int = 0
    message: str = ""


class _KeepAliveLine(msgspec.Struct):
    result: LeaseGrant | None = None
    error: _StreamError | None = None


class _WatchResponse(msgspec.Struct):
    header: _Header = msgspec.field(default_factory=_Header)
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[WatchEvent] = []


class _WatchLine(msgspec.Struct):
    result: _WatchResponse | None = None
    error: _StreamError | None = None


class _UnaryError(msgspec.Struct):
    code: int = 0
    message: str = ""


# -- requests ------------------------------------------------------------------------


def _b(x: str | bytes) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def prefix_end(prefix: str | bytes) -> bytes:
    """The ``range_end`` that makes ``[prefix, range_end)`` every key starting with
    ``prefix`` (etcd's ``GetPrefixRangeEnd``; ``b"\\0"`` = to the end of the keyspace)."""
    b = bytearray(_b(prefix))
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


class Compare(msgspec.Struct, frozen=True):
    """One compare of a transaction; build it with the class methods, e.g.
    ``Compare.create_revision("/k", "==", 0)`` (the key does not exist). ``op`` is one of
    ``==``, ``!=``, ``<``, ``>``. ``range_end`` (set by ``prefix=True``): the compare
    holds only if it holds for *every* key in ``[key, range_end)`` (etcd 3.3+); over a
    range holding no key it is judged against a key that does not exist (revisions and
    version 0), so ``Compare.mod_revision(p, "<", r + 1, prefix=True)`` means "nothing
    under ``p`` was written after revision ``r``"."""

    key: bytes
    target: Literal["CREATE", "MOD", "VERSION", "VALUE"]
    op: str
    operand: int | bytes
    range_end: bytes | None = None

    @classmethod
    def create_revision(cls, key: str | bytes, op: str, revision: int, *, prefix: bool = False) -> "Compare":
        return cls(_b(key), "CREATE", op, int(revision), prefix_end(key) if prefix else None)

    @classmethod
    def mod_revision(cls, key: str | bytes, op: str, revision: int, *, prefix: bool = False) -> "Compare":
        return cls(_b(key), "MOD", op, int(revision), prefix_end(key) if prefix else None)

    @classmethod
    def version(cls, key: str | bytes, op: str, version: int) -> "Compare":
        return cls(_b(key), "VERSION", op, int(version))

    @classmethod
    def value(cls, key: str | bytes, op: str, value: str | bytes) -> "Compare":
        return cls(_b(key), "VALUE", op, _b(value))

    def to_json(self) -> dict[str, Any]:
        field = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version", "VALUE": "value"}[self.target]
        operand = self.operand if isinstance(self.operand, bytes) else str(self.operand)
        out = {"key": self.key, "target": self.target, "result": _RESULTS[self.op], field: operand}
        if self.range_end is not None:
            out["range_end"] = self.range_end
        return out


@dataclass(frozen=True, slots=True)
class Put:
    """A put in a transaction (``lease`` 0 = none; a put without a lease detaches one)."""

    key: str | bytes
    value: str | bytes
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"request_put": {"key": _b(self.key), "value": _b(self.value), "lease": str(self.lease)}}


@dataclass(frozen=True, slots=True)
class Range:
    """A read in a transaction: one key, or every key under it with ``prefix=True``."""

    key: str | bytes
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"request_range": _range_json(_b(self.key), self.prefix)}


@dataclass(frozen=True, slots=True)
class Delete:
    """A delete in a transaction: one key, or every key under it with ``prefix=True``."""

    key: str | bytes
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"request_delete_range": _range_json(_b(self.key), self.prefix)}


def _range_json(key: bytes, prefix: bool) -> dict[str, Any]:
    return {"key": key, "range_end": prefix_end(key)} if prefix else {"key": key}


def _endpoint(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.startswith("etcd://"):
        url = "http://" + url[len("etcd://") :]
    elif "://" not in url:
        url = "http://" + url
    return url


# -- the client ----------------------------------------------------------------------


class EtcdClient:
    """A client of one etcd cluster through its members' JSON gateways.

    ``endpoints``: client URLs (``http://host:port``; ``etcd://`` and bare ``host:port``
    are read as http), a list or one comma-separated string. ``timeout_s`` (seconds) bounds
    every unary call (each call may pass its own); ``backoff_max_s`` caps the pause
    between rounds of failed tries. Use as ``async with EtcdClient([...]) as etcd:`` or
    call :meth:`aclose`. Calls may run concurrently from many tasks.
    """

    def __init__(self, endpoints: Sequence[str] | str, *, timeout_s: float = 2.0, backoff_max_s: float = 0.5) -> None:
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        self.endpoints = [_endpoint(e) for e in endpoints if e.strip()]
        if not self.endpoints:
            raise ValidationError("EtcdClient needs at least one etcd endpoint (http://host:port)")
        self.timeout_s = timeout_s
        self.backoff_max_s = backoff_max_s
        self._preferred = 0
        self._http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_keepalive_connections=8))

    async def __aenter__(self) -> "EtcdClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- transport ---------------------------------------------------------------

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._preferred + i) % n for i in range(n)]

    async def _post(self, path: str, body: dict[str, Any], timeout_s: float | None) -> bytes:
        """POST ``body`` to ``path`` with endpoint failover; the 200 body, or raises."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = trio.current_time() + timeout
        content = msgspec.json.encode(body)
        last_error = "no try made"
        backoff = 0.02
        while True:
            order = self._order()
            for n, i in enumerate(order):
                remaining = deadline - trio.current_time()
                if remaining <= 0:
                    break
                url = self.endpoints[i] + path
                with trio.move_on_after(remaining / (len(order) - n)):
                    try:
                        resp = await self._http.post(url, content=content)
                    except httpx.TransportError as e:
                        last_error = f"{url}: {type(e).__name__}: {e}"
                        continue
                    if resp.status_code == 200:
                        self._preferred = i
                        return resp.content
                    err = _decode_unary_error(resp.content)
                    if err.code in _UNAVAILABLE_GRPC or resp.status_code == 503:
                        last_error = f"{url}: {err.message or resp.status_code}"
                        continue
                    raise _refusal(path, body, err.code, err.message)
                last_error = f"{url}: no answer in {remaining / (len(order) - n):.2f} s"
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                raise EtcdUnavailableError(
                    f"etcd did not answer {path} within {timeout:g} s at {', '.join(self.endpoints)} "
                    f"(last: {last_error}); check that etcd runs and the endpoints are right",
                    details={"endpoints": self.endpoints, "path": path, "last_error": last_error},
                )
            await trio.sleep(min(backoff, remaining))
            backoff = min(backoff * 2, self.backoff_max_s)

    async def _unary(self, path: str, body: dict[str, Any], type_: type, timeout_s: float | None) -> Any:
        return msgspec.json.decode(await self._post(path, body, timeout_s), type=type_, strict=False)

    # -- kv ----------------------------------------------------------------------

    async def range(
        self, key: str | bytes, *, prefix: bool = False, revision: int = 0, limit: int = 0, timeout_s: float | None = None
    ) -> RangeResult:
        """Read one key, or every key under ``key`` with ``prefix=True``, at the latest
        revision or at ``revision``. Raises EtcdCompactedError if ``revision`` was
        compacted, EtcdUnavailableError."""
        body = _range_json(_b(key), prefix)
        if revision:
            body["revision"] = str(revision)
        if limit:
            body["limit"] = str(limit)
        try:
            return await self._unary("/v3/kv/range", body, RangeResult, timeout_s)
        except EtcdError as e:
            if e.details and e.details.get("grpc_code") == _OUT_OF_RANGE_GRPC:
                raise EtcdCompactedError(
                    f"etcd revision {revision} is compacted; read again without a revision",
                    revision=revision,
                    compact_revision=0,
                ) from None
            raise

    async def get(self, key: str | bytes, *, timeout_s: float | None = None) -> KeyValue | None:
        """One key's current KeyValue, or None."""
        r = await self.range(key, timeout_s=timeout_s)
        return r.kvs[0] if r.kvs else None

    async def put(
        self, key: str | bytes, value: str | bytes, *, lease: int = 0, prev_kv: bool = False, timeout_s: float | None = None
    ) -> PutResult:
        """Set ``key`` to ``value``, bound to ``lease`` (0 = none). Raises
        EtcdLeaseNotFoundError if the lease is gone, EtcdUnavailableError."""
        body: dict[str, Any] = {"key": _b(key), "value": _b(value), "lease": str(lease), "prev_kv": prev_kv}
        return await self._unary("/v3/kv/put", body, PutResult, timeout_s)

    async def delete(
        self, key: str | bytes, *, prefix: bool = False, prev_kv: bool = False, timeout_s: float | None = None
    ) -> DeleteResult:
        """Delete one key, or every key under it with ``prefix=True``."""
        body = _range_json(_b(key), prefix)
        body["prev_kv"] = prev_kv
        return await self._unary("/v3/kv/deleterange", body, DeleteResult, timeout_s)

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Put | Range | Delete] = (),
        failure: Sequence[Put | Range | Delete] = (),
        *,
        timeout_s: float | None = None,
    ) -> TxnResult:
        """If every compare holds, run ``success``, else ``failure``, atomically.
        Raises EtcdLeaseNotFoundError if a put names a lease that is gone,
        EtcdUnavailableError."""
        body = {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }
        r: _TxnResponse = await self._unary("/v3/kv/txn", body, _TxnResponse, timeout_s)
        out = tuple(x.response_range or x.response_put or x.response_delete_range or RangeResult() for x in r.responses)
        return TxnResult(revision=r.header.revision, succeeded=r.succeeded, responses=out)

    async def compact(self, revision: int, *, timeout_s: float | None = None) -> None:
        """Drop the history before ``revision`` (watches and reads from older revisions
        then fail with EtcdCompactedError)."""
        await self._post("/v3/kv/compaction", {"revision": str(revision), "physical": True}, timeout_s)

    # -- leases --------------------------------------------------------------------

    async def lease_grant(self, ttl_s: int, *, timeout_s: float | None = None) -> LeaseGrant:
        """A new lease of ``ttl_s`` seconds (etcd may grant more: read ``ttl_s`` back)."""
        return await self._unary("/v3/lease/grant", {"TTL": str(int(ttl_s))}, LeaseGrant, timeout_s)

    async def lease_keepalive(self, lease_id: int, *, timeout_s: float | None = None) -> int:
        """Renew the lease once; returns its TTL (seconds) restarted at etcd's receipt.
        Raises EtcdLeaseNotFoundError if the lease expired or was revoked."""
        raw = await self._post("/v3/lease/keepalive", {"ID": str(lease_id)}, timeout_s)
        line = msgspec.json.decode(raw.split(b"\n", 1)[0], type=_KeepAliveLine, strict=False)
        if line.error is not None:
            raise _refusal("/v3/lease/keepalive", {}, line.error.grpc_code, line.error.message)
        if line.result is None or line.result.ttl_s <= 0:
            raise EtcdLeaseNotFoundError(lease_id)
        return line.result.ttl_s

    async def lease_revoke(self, lease_id: int, *, timeout_s: float | None = None) -> None:
        """Revoke the lease now: every key bound to it is deleted. Raises
        EtcdLeaseNotFoundError if it was already gone."""
        await self._post("/v3/lease/revoke", {"ID": str(lease_id)}, timeout_s)

    async def lease_time_to_live(
        self, lease_id: int, *, keys: bool = False, timeout_s: float | None = None
    ) -> LeaseTimeToLive:
        """The lease's remaining TTL (and its keys with ``keys=True``). Raises
        EtcdLeaseNotFoundError if it expired or was revoked."""
        r = await self._unary("/v3/lease/timetolive", {"ID": str(lease_id), "keys": keys}, LeaseTimeToLive, timeout_s)
        if r.ttl_s < 0:
            raise EtcdLeaseNotFoundError(lease_id)
        return r

    # -- cluster -------------------------------------------------------------------

    async def status(self, *, timeout_s: float | None = None) -> Status:
        """``/v3/maintenance/status`` of the first member that answers."""
        return await self._unary("/v3/maintenance/status", {}, Status, timeout_s)

    def watch(
        self,
        key: str | bytes,
        *,
        prefix: bool = False,
        start_revision: int = 0,
        prev_kv: bool = False,
        give_up_after_s: float | None = None,
    ) -> "Watch":
        """A :class:`Watch` of one key (or a prefix) from ``start_revision`` (0 = changes
        after now). Use as ``async with etcd.watch(k, start_revision=r) as events:``."""
        return Watch(self, _b(key), prefix, start_revision, prev_kv, give_up_after_s)


def _decode_unary_error(content: bytes) -> _UnaryError:
    try:
        return msgspec.json.decode(content, type=_UnaryError, strict=False)
    except msgspec.DecodeError:
        return _UnaryError(0, content[:200].decode("utf-8", "replace"))


def _refusal(path: str, body: dict[str, Any], grpc_code: int, message: str) -> EtcdError:
    if grpc_code == _NOT_FOUND_GRPC and "lease not found" in message:
        lease = body.get("ID") or body.get("lease") or 0
        return EtcdLeaseNotFoundError(int(lease))
    if grpc_code in _UNAVAILABLE_GRPC:
        return EtcdUnavailableError(f"etcd {path}: {message}", details={"path": path, "grpc_code": grpc_code})
    return EtcdError(f"etcd refused {path}: {message}", details={"path": path, "grpc_code": grpc_code})


class WatchStatistics(msgspec.Struct, frozen=True):
    """``connects``: streams opened so far (1 + reconnects); ``connected``: a stream is
    open now; ``next_revision``: the revision the watch resumes from (0 before the
    first stream said where "now" is)."""

    connects: int
    connected: bool
    next_revision: int


class Watch:
    """A watch of one key or prefix as an async iterator of :class:`WatchEvent`.

    Events come in revision order, each once: after a lost stream (a member stopped or
    restarted, a connection reset) the watch re-opens on any endpoint from the revision
    after the last event it gave (or after the revision its first stream reported), so
    nothing is skipped or repeated. If history up to that revision was compacted
    meanwhile (checked before every opening too, since a compaction at exactly the start
    revision drops a DELETE there without etcd refusing the watch), ``__anext__`` raises
    :class:`EtcdCompactedError`: read the state again and start a new watch from its
    revision + 1. Re-opening retries with backoff for ever, or raises
    :class:`EtcdUnavailableError` once no stream could be opened for
    ``give_up_after_s`` seconds. The stream has no read timeout (an idle watch is normal):
    a member that stops answering without closing the connection stalls the watch until
    it answers again. One consumer task at a time; cancellation-safe (a cancelled
    ``__anext__`` loses no event: the next call returns it).
    """

    def __init__(
        self, client: EtcdClient, key: bytes, prefix: bool, start_revision: int, prev_kv: bool, give_up_after_s: float | None
    ) -> None:
        self._client = client
        self._key = key
        self._prefix = prefix
        self._prev_kv = prev_kv
        self._next_rev = start_revision
        self._give_up_after_s = give_up_after_s
        self._pending: deque[WatchEvent] = deque()
        self._resp: httpx.Response | None = None
        self._lines: Any = None
        self._connects = 0
        self._closed = False

    async def __aenter__(self) -> "Watch":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> "Watch":
        return self

    def statistics(self) -> WatchStatistics:
        return WatchStatistics(self._connects, self._resp is not None, self._next_rev)

    async def aclose(self) -> None:
        self._closed = True
        await self._drop()

    async def _drop(self) -> None:
        resp, lines, self._resp, self._lines = self._resp, self._lines, None, None
        with trio.CancelScope(shield=True):
            if lines is not None:
                try:
                    await lines.aclose()
                except Exception:  # a broken stream: closing it is best effort
                    pass
            if resp is not None:
                await resp.aclose()

    async def _open(self) -> None:
        request: dict[str, Any] = {"create_request": {**_range_json(self._key, self._prefix), "prev_kv": self._prev_kv}}
        if self._next_rev:
            request["create_request"]["start_revision"] = str(self._next_rev)
        content = msgspec.json.encode(request)
        client = self._client
        started = trio.current_time()
        await self._check_not_compacted()
        backoff = 0.02
        last_error = ""
        while True:
            for i in client._order():
                url = client.endpoints[i] + "/v3/watch"
                resp = None
                with trio.move_on_after(client.timeout_s):
                    try:
                        req = client._http.build_request("POST", url, content=content)
                        resp = await client._http.send(req, stream=True)
                    except httpx.TransportError as e:
                        last_error = f"{url}: {type(e).__name__}: {e}"
                        continue
                if resp is None:
                    last_error = f"{url}: no answer in {client.timeout_s:g} s"
                    continue
                if resp.status_code != 200:
                    body = await resp.aread()
                    await resp.aclose()
                    err = _decode_unary_error(body)
                    if err.code in _UNAVAILABLE_GRPC or resp.status_code == 503:
                        last_error = f"{url}: {err.message}"
                        continue
                    raise _refusal("/v3/watch", {}, err.code, err.message)
                self._resp, self._lines = resp, resp.aiter_lines()
                self._connects += 1
                client._preferred = i
                return
            if self._give_up_after_s is not None and trio.current_time() - started >= self._give_up_after_s:
                raise EtcdUnavailableError(
                    f"could not open an etcd watch for {self._give_up_after_s:g} s at "
                    f"{', '.join(client.endpoints)} (last: {last_error}); check that etcd runs",
                    details={"endpoints": client.endpoints, "path": "/v3/watch", "last_error": last_error},
                )
            await trio.sleep(backoff)
            backoff = min(backoff * 2, client.backoff_max_s)

    async def _check_not_compacted(self) -> None:
        """etcd accepts a watch from exactly its compaction point R, but compaction
        dropped any DELETE at R (tombstones go): so before opening from R, check that
        R - 1 is still readable, else raise compacted. (A compaction to exactly R in the
        one round trip between this check and the opening still goes unseen.)"""
        if self._next_rev <= 1:
            return
        try:
            await self._client.range(self._key, revision=self._next_rev - 1, limit=1)
        except EtcdCompactedError:
            raise EtcdCompactedError(
                f"etcd watch on {self._key!r} from revision {self._next_rev} came too late: history "
                f"up to it is compacted; read the state again and watch from there",
                revision=self._next_rev,
                compact_revision=0,
            ) from None

    async def __anext__(self) -> WatchEvent:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            if self._lines is None:
                await self._open()
            try:
                line = await self._lines.__anext__()
            except (StopAsyncIteration, httpx.TransportError, httpx.StreamError) as e:
                why = e or "end of stream"
                log.info("etcd watch on %r lost (%s); resuming from revision %d", self._key, why, self._next_rev)
                await self._drop()
                continue
            if not line.strip():
                continue
            msg = msgspec.json.decode(line, type=_WatchLine, strict=False)
            if msg.error is not None:
                await self._drop()
                if msg.error.grpc_code in _UNAVAILABLE_GRPC:
                    continue
                raise _refusal("/v3/watch", {}, msg.error.grpc_code, msg.error.message)
            r = msg.result
            if r is None:
                continue
            if r.canceled:
                await self._drop()
                if r.compact_revision:
                    raise EtcdCompactedError(
                        f"etcd watch on {self._key!r} from revision {self._next_rev} came too late: history "
                        f"before {r.compact_revision} is compacted; read the state again and watch from there",
                        revision=self._next_rev,
                        compact_revision=r.compact_revision,
                    )
                raise EtcdError(f"etcd cancelled the watch on {self._key!r}: {r.cancel_reason or 'no reason given'}")
            if r.created:
                if not self._next_rev:
                    self._next_rev = r.header.revision + 1
                continue
            if not r.events:  # a progress notification: nothing up to its revision is pending
                self._next_rev = max(self._next_rev, r.header.revision + 1)
                continue
            for ev in r.events:
                if ev.kv.mod_revision >= self._next_rev:
                    self._pending.append(ev)
                    self._next_rev = ev.kv.mod_revision + 1
        return self._pending.popleft()
