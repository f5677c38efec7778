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

Security (:class:`EtcdAccess` bundles it with the endpoints):

- TLS: ``https://`` endpoints are verified against :attr:`EtcdTls.ca_file` (the system's
  CAs when None) including the host name, with a client certificate for etcd's
  ``--client-cert-auth`` when :attr:`EtcdTls.cert_file` is set (an ``ssl.SSLContext`` given
  to httpx). A handshake that fails on every endpoint is raised at once
  (:class:`EtcdTlsError`), not retried: it is a configuration error;
- authentication (:class:`EtcdAuth`, etcd's user/password RBAC): the client asks
  ``/v3/auth/authenticate`` for a token before its first call and sends it as the
  ``Authorization`` header of every request (unary calls, lease keepalives, watch
  openings). etcd forgets a token (a simple token after ``--auth-token-ttl`` seconds
  unused, or when the member restarts; a JWT when it expires): the call it fails is
  retried once with a new token (the watch re-opens with one); the password is kept in
  memory only and never logged. A wrong password is :class:`EtcdAuthError`, a missing
  permission :class:`EtcdPermissionError`, both raised at once.

Errors (all :class:`EtcdError`, a :class:`~rallypoint.errors.RallypointError`):
:class:`EtcdUnavailableError` (UNAVAILABLE: no endpoint answered in time),
:class:`EtcdAuthError` (UNAUTHENTICATED: wrong user or password, or etcd wants one),
:class:`EtcdTlsError` (UNAUTHENTICATED: a TLS handshake failed: an untrusted server
certificate, a refused or missing client certificate, TLS against a plaintext etcd),
:class:`EtcdPermissionError` (FORBIDDEN: the user's roles do not grant the key),
:class:`EtcdCompactedError` (CURSOR_EXPIRED: the revision asked for was compacted),
:class:`EtcdLeaseNotFoundError` (NOT_FOUND: the lease expired or was revoked), and
:class:`EtcdError` itself (INTERNAL: etcd refused the request; its message is etcd's).
"""

from __future__ import annotations

import logging
import ssl
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit
from typing import Any, Literal, Sequence

import httpx
import msgspec
import trio

from rallypoint.backoff import Backoff
from rallypoint.errors import (
    CursorExpiredError,
    ForbiddenError,
    NotFoundError,
    RallypointError,
    UnauthenticatedError,
    UnavailableError,
    ValidationError,
)

__all__ = [
    "EtcdClient",
    "EtcdAccess",
    "EtcdTls",
    "EtcdAuth",
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
    "EtcdAuthError",
    "EtcdTlsError",
    "EtcdPermissionError",
    "prefix_end",
]

log = logging.getLogger("rallypoint.cluster")

_UNAVAILABLE_GRPC = {1, 4, 14}  # CANCELLED (a closing member), DEADLINE_EXCEEDED, UNAVAILABLE
_NOT_FOUND_GRPC = 5
_OUT_OF_RANGE_GRPC = 11
_PERMISSION_DENIED_GRPC = 7
_FAILED_PRECONDITION_GRPC = 9
_UNAUTHENTICATED_GRPC = 16
#: etcd's answers that the token a request carried is no good (any more): authenticate
#: again and retry once (what etcd's own clientv3 does, ``shouldRefreshToken``)
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old")
#: a watch stream's error line that only says the member went away (its gateway's own
#: gRPC stream broke: a stopping member over TLS says so with code 2 or 13): resume
_STREAM_LOST = ("closed the stream without sending trailers", "transport is closing", "error reading from server")
#: auth is on and the request carried no token
_NO_USER = "user name is empty"
#: etcd 3.4 with --client-cert-auth and auth on refuses a gateway request whose client
#: certificate has a Common Name (it cannot pass the CN on as the user): HTTP 400
_GATEWAY_CN = "CommonName of client sending a request against gateway"


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


class EtcdAuthError(EtcdError, UnauthenticatedError):
    """UNAUTHENTICATED: etcd refused the user name or password (``details``: ``user``,
    ``path``), or it has authentication on and the client has no user. Not retried:
    fix the credentials."""

    code = "UNAUTHENTICATED"


class EtcdTlsError(EtcdError, UnauthenticatedError):
    """UNAUTHENTICATED: the TLS handshake with every endpoint failed (``details``:
    ``endpoints``, ``reason``): etcd's certificate is not signed by the CA given (or the
    system's), etcd refused the client certificate or wanted one, or the endpoint does
    not speak TLS. Not retried."""

    code = "UNAUTHENTICATED"


class EtcdPermissionError(EtcdError, ForbiddenError):
    """FORBIDDEN: etcd's RBAC does not let the user do this (``details``: ``user``,
    ``path``, ``key``): grant its role the cluster's key prefix."""

    code = "FORBIDDEN"


# -- settings ------------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd's ``https://`` client URLs.

    ``ca_file``: PEM CA certificate(s) that signed etcd's server certificate (etcd's
    ``--trusted-ca-file`` CA, usually); None: the system's CAs. ``cert_file``/``key_file``:
    this client's certificate and key (PEM) for etcd's ``--client-cert-auth``; ``key_file``
    None: the key is in ``cert_file``. With etcd's authentication on as well, etcd 3.4's
    JSON gateway refuses a client certificate that carries a Common Name."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def context(self) -> ssl.SSLContext:
        """A client ``ssl.SSLContext`` that verifies etcd's certificate and host name.
        Raises ValidationError (VALIDATION_FAILED) naming the file that cannot be read,
        is not PEM, or a certificate and key that do not match."""
        if self.key_file and not self.cert_file:
            raise ValidationError(f"an etcd client key ({self.key_file}) needs its certificate too (the cert file)")
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except ssl.SSLError as e:  # (an OSError too: first)
            raise ValidationError(f"the etcd CA file {self.ca_file} holds no usable PEM certificate ({e.reason or e})"
                                  ) from None
        except OSError as e:
            raise ValidationError(f"cannot read the etcd CA file {self.ca_file}: {e.strerror or e}") from None
        if self.cert_file:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except OSError as e:
                if isinstance(e, ssl.SSLError):
                    what = "do not match" if "KEY_VALUES_MISMATCH" in str(e) else f"are not PEM ({e.reason or e})"
                    raise ValidationError(f"the etcd client certificate {self.cert_file} and key "
                                          f"{self.key_file or '(in the same file)'} {what}") from None
                raise ValidationError(f"cannot read the etcd client certificate/key {e.filename or self.cert_file}: "
                                      f"{e.strerror or e}") from None
        return ctx


@dataclass(frozen=True)
class EtcdAuth:
    """etcd user/password authentication (``etcdctl user add``, ``auth enable``).
    ``password`` stays out of ``repr`` and every message and log line."""

    user: str
    password: str = field(repr=False)

    def __post_init__(self) -> None:
        if not self.user:
            raise ValidationError("an etcd user name cannot be empty")


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach one etcd cluster: ``endpoints`` (client URLs as :class:`EtcdClient`
    takes them; all ``http://`` or all ``https://``), ``tls`` (None: system CAs for
    ``https://``, nothing for ``http://``) and ``auth`` (None: no user). Raises
    ValidationError as :class:`EtcdClient` does (checked here, before any connection)."""

    endpoints: tuple[str, ...]
    tls: EtcdTls | None = None
    auth: EtcdAuth | None = None

    def __post_init__(self) -> None:
        eps = [self.endpoints] if isinstance(self.endpoints, str) else list(self.endpoints)
        object.__setattr__(self, "endpoints", tuple(_endpoints(eps, self.tls)))

    @property
    def secure(self) -> bool:
        """The endpoints are ``https://``."""
        return self.endpoints[0].startswith("https://")

    @property
    def url(self) -> str:
        """The endpoints as ``--cluster`` takes them, with the user and never a password:
        ``etcd://h1:p1,h2:p2`` (plaintext) or ``https://user@h1:p1,h2:p2``."""
        hosts = ",".join(e.split("://", 1)[1] for e in self.endpoints)
        user = f"{self.auth.user}@" if self.auth is not None else ""
        return ("https://" if self.secure else "etcd://") + user + hosts

    def cli_args(self) -> list[str]:
        """``--cluster URL`` and the TLS and user flags that reach this etcd (no
        password: that comes from ``--etcd-password-file`` or the environment)."""
        out = ["--cluster", self.url]
        if self.tls is not None:
            for flag, value in (("--etcd-ca", self.tls.ca_file), ("--etcd-cert", self.tls.cert_file),
                                ("--etcd-key", self.tls.key_file)):
                if value:
                    out += [flag, value]
        return out

    def client(self, **kwargs: Any) -> "EtcdClient":
        """An :class:`EtcdClient` for these settings (``kwargs``: its ``timeout_s``,
        ``backoff_max_s``)."""
        return EtcdClient(self.endpoints, tls=self.tls, auth=self.auth, **kwargs)


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
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValidationError(f"etcd endpoint {url!r}: the scheme must be http://, https:// or etcd://")
    if "@" in parts.netloc:
        raise ValidationError(f"etcd endpoint {parts.scheme}://...@{parts.netloc.rsplit('@', 1)[1]}: give the user "
                              "and password as EtcdAuth, not in the URL (etcd reads no credentials there)")
    if parts.path:
        raise ValidationError(f"etcd endpoint {url!r}: a client URL has no path (http[s]://HOST:PORT)")
    return url


def _endpoints(endpoints: Sequence[str] | str, tls: "EtcdTls | None") -> list[str]:
    """Normalized client URLs; ValidationError for none, mixed schemes, TLS settings
    with ``http://``."""
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    out = [_endpoint(e) for e in endpoints if e.strip()]
    if not out:
        raise ValidationError("EtcdClient needs at least one etcd endpoint (http://host:port or https://host:port)")
    schemes = {e.split("://", 1)[0] for e in out}
    if len(schemes) > 1:
        raise ValidationError(f"etcd endpoints mix http:// and https:// ({', '.join(out)}): one etcd cluster "
                              "serves one scheme")
    if tls is not None and schemes == {"http"}:
        raise ValidationError(f"TLS settings (a CA, a client certificate) need https:// endpoints, not "
                              f"{', '.join(out)}")
    return out


def _tls_reason(exc: BaseException) -> tuple[str, str] | None:
    """``(kind, reason)`` if a transport error is a failed TLS handshake: ``verify``
    (etcd's certificate not trusted), ``refused`` (etcd refused or wanted our
    certificate), ``plaintext`` (the endpoint does not speak TLS), ``tls`` (another)."""
    e: BaseException | None = exc
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, ssl.SSLCertVerificationError):
            return "verify", e.verify_message or e.reason or str(e)
        if isinstance(e, ssl.SSLError):
            reason = (e.reason or str(e)).lower()
            if "wrong_version_number" in reason or "record_layer_failure" in reason or "http_request" in reason:
                return "plaintext", e.reason or str(e)
            if "unexpected_eof" in reason or "eof occurred" in reason:
                return "closed", e.reason or str(e)
            if "certificate" in reason or "alert" in reason:
                return "refused", e.reason or str(e)
            return "tls", e.reason or str(e)
        e = e.__cause__ or e.__context__
        seen += 1
    return None


_TLS_HINTS = {
    "verify": "etcd's certificate is not signed by the CA given (or, without one, by a system CA), or does not "
              "name this host: give the CA that signed it (--etcd-ca)",
    "refused": "etcd refused this client's certificate, or wanted one and got none (--client-cert-auth): give a "
               "certificate signed by etcd's --trusted-ca-file (--etcd-cert/--etcd-key)",
    "plaintext": "the endpoint does not speak TLS: give http:// (or etcd://) for a plaintext etcd",
    "closed": "the endpoint closed the connection in the TLS handshake, as a plaintext etcd does: give http:// (or "
              "etcd://) if it serves no TLS",
    "tls": "the TLS handshake failed",
}


# -- the client ----------------------------------------------------------------------


def plaintext_hint(last_error: str, endpoint: str) -> str:
    """The hint for an etcd that closed a plaintext request unanswered (it serves TLS):
    " (... give https://)" when ``last_error`` is such a close -- a FIN ("disconnected
    without sending a response") or an RST while the request was still unread
    ("Connection reset by peer", seen on a loaded machine) -- and ``endpoint`` is
    ``http://``; else ""."""
    closed = "disconnected without sending a response" in last_error or "Connection reset by peer" in last_error
    if closed and not endpoint.startswith("https"):
        return " (an etcd serving TLS closes a plain http:// connection like this: give https://)"
    return ""


class EtcdClient:
    """A client of one etcd cluster through its members' JSON gateways.

    ``endpoints``: client URLs (``http://host:port`` or ``https://host:port``; ``etcd://``
    and bare ``host:port`` are read as http), a list or one comma-separated string, all of
    one scheme. ``tls``: :class:`EtcdTls` for ``https://`` (None: the system's CAs, no
    client certificate). ``auth``: :class:`EtcdAuth` when etcd has authentication on.
    ``timeout_s`` (seconds) bounds every unary call (each call may pass its own), the
    authentication it may need included; ``backoff_max_s`` caps the pause between rounds
    of failed tries. Use as ``async with EtcdClient([...]) as etcd:`` or call
    :meth:`aclose`. Calls may run concurrently from many tasks (they share one token).

    Raises ValidationError for no endpoint, mixed schemes, credentials in a URL, TLS
    settings with ``http://`` endpoints or a CA/certificate file that cannot be loaded.
    ``authentications``: how many tokens etcd granted this client so far.
    """

    def __init__(
        self,
        endpoints: Sequence[str] | str,
        *,
        tls: EtcdTls | None = None,
        auth: EtcdAuth | None = None,
        timeout_s: float = 2.0,
        backoff_max_s: float = 0.5,
    ) -> None:
        self.endpoints = _endpoints(endpoints, tls)
        if self.endpoints[0].startswith("https://") and tls is None:
            tls = EtcdTls()
        self.tls = tls
        self.auth = auth
        self.timeout_s = timeout_s
        self.backoff_max_s = backoff_max_s
        self.authentications = 0
        self._preferred = 0
        self._token: str | None = None
        self._auth_lock = trio.Lock()
        #: etcd said authentication is off: calls go without a token until it says otherwise
        self._auth_off = False
        #: (until, error): a refused password, not asked again before ``until`` (etcd
        #: spends a bcrypt hash on each try)
        self._auth_refused: tuple[float, EtcdError] | None = None
        verify: ssl.SSLContext | bool = tls.context() if tls is not None else True
        self._http = httpx.AsyncClient(timeout=None, verify=verify, limits=httpx.Limits(max_keepalive_connections=8))

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
        """POST ``body`` to ``path`` with endpoint failover and the auth token (renewed
        once if etcd no longer takes it); the 200 body, or raises."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = trio.current_time() + timeout
        token = await self._current_token(deadline, timeout)
        try:
            return await self._send(path, body, deadline, timeout, token)
        except _StaleToken:
            token = await self._renew_token(token, deadline, timeout)
            try:
                return await self._send(path, body, deadline, timeout, token)
            except _StaleToken as e:
                raise self._auth_refusal(path, e.message) from None

    async def _send(self, path: str, body: dict[str, Any], deadline: float, timeout: float, token: str | None) -> bytes:
        """One call with endpoint failover until ``deadline``; raises _StaleToken when
        etcd does not take ``token`` (or wants one), the refusal otherwise."""
        content = msgspec.json.encode(body)
        headers = {"Authorization": token} if token else None
        last_error = "no try made"
        backoff = Backoff(0.02, max(0.02, self.backoff_max_s))
        while True:
            order = self._order()
            tls_failures: list[tuple[str, str, str]] = []
            for n, i in enumerate(order):
                remaining = deadline - trio.current_time()
                if remaining <= 0:
                    break
                url = self.endpoints[i] + path
                with trio.move_on_after(remaining / (len(order) - n)):
                    try:
                        resp = await self._http.post(url, content=content, headers=headers)
                    except httpx.TransportError as e:
                        last_error = f"{url}: {type(e).__name__}: {e}"
                        tls = _tls_reason(e)
                        if tls is not None:
                            tls_failures.append((self.endpoints[i], *tls))
                            last_error = f"{url}: TLS: {tls[1]}"
                        continue
                    if resp.status_code == 200:
                        self._preferred = i
                        return resp.content
                    err = _decode_unary_error(resp.content)
                    if err.code in _UNAVAILABLE_GRPC or resp.status_code == 503:
                        last_error = f"{url}: {err.message or resp.status_code}"
                        continue
                    self._check_refusal(path, err.code, err.message, token)
                    raise self._refusal(path, body, err.code, err.message)
                last_error = f"{url}: no answer in {remaining / (len(order) - n):.2f} s"
            if tls_failures and len(tls_failures) == len(order):
                raise self._tls_error(tls_failures)
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                hint = plaintext_hint(last_error, self.endpoints[0])
                raise EtcdUnavailableError(
                    f"etcd did not answer {path} within {timeout:g} s at {', '.join(self.endpoints)} "
                    f"(last: {last_error}){hint}; check that etcd runs and the endpoints are right",
                    details={"endpoints": self.endpoints, "path": path, "last_error": last_error},
                )
            await backoff.sleep(at_most=remaining)

    # -- authentication --------------------------------------------------------------

    def _stale(self, grpc_code: int, message: str, token: str | None) -> bool:
        """etcd refused the request for its token (or for having none) and a new token
        may fix it."""
        if self.auth is None:
            return False
        if any(m in message for m in _STALE_TOKEN):
            return True
        return token is None and (_NO_USER in message or grpc_code == _UNAUTHENTICATED_GRPC)

    def _check_refusal(self, path: str, grpc_code: int, message: str, token: str | None) -> None:
        """Raise _StaleToken or the auth/TLS error a refusal stands for (else return)."""
        if self._stale(grpc_code, message, token):
            raise _StaleToken(message)
        if _GATEWAY_CN in message:
            raise EtcdTlsError(
                "etcd (client certificates required and authentication on) refuses a client certificate that "
                "carries a Common Name on its JSON gateway: use a certificate with an empty subject (as the "
                "client.pem of rallypoint.cluster.pki) or none",
                details={"endpoints": self.endpoints, "reason": message},
            )

    def _auth_refusal(self, path: str, message: str) -> EtcdAuthError:
        if self.auth is None:
            return EtcdAuthError(
                f"etcd has authentication on ({message}): give a user and password (rallypoint: --etcd-user, "
                "--etcd-password-file or $RALLYPOINT_ETCD_PASSWORD)",
                details={"path": path, "user": None},
            )
        return EtcdAuthError(
            f"etcd refused a fresh token of user {self.auth.user!r} for {path} ({message})",
            details={"path": path, "user": self.auth.user},
        )

    def _refusal(self, path: str, body: dict[str, Any], grpc_code: int, message: str) -> EtcdError:
        return _refusal(path, body, grpc_code, message, user=self.auth.user if self.auth else None)

    def _tls_error(self, failures: list[tuple[str, str, str]]) -> EtcdTlsError:
        endpoint, kind, reason = failures[-1]
        where = endpoint if len(failures) == 1 else f"{', '.join(f[0] for f in failures)}"
        return EtcdTlsError(f"TLS with etcd at {where} failed ({reason}): {_TLS_HINTS[kind]}",
                            details={"endpoints": [f[0] for f in failures], "reason": reason, "kind": kind})

    async def _current_token(self, deadline: float, timeout: float) -> str | None:
        """The token to send (None: no auth, or etcd has it off); authenticates first
        if there is none yet."""
        if self.auth is None or self._auth_off:
            return None
        if self._token is not None:
            return self._token
        return await self._renew_token(None, deadline, timeout)

    async def _renew_token(self, stale: str | None, deadline: float, timeout: float) -> str | None:
        """A token other than ``stale``: the one another task just got, or a new one
        from ``/v3/auth/authenticate``. Raises EtcdAuthError for a refused password (and,
        for a second, without asking etcd again), EtcdUnavailableError."""
        assert self.auth is not None
        async with self._auth_lock:
            if self._token is not None and self._token != stale:
                return self._token
            self._token = None
            now = trio.current_time()
            if self._auth_refused is not None and now < self._auth_refused[0]:
                raise self._auth_refused[1]
            body = {"name": self.auth.user, "password": self.auth.password}
            try:
                try:
                    raw = await self._send("/v3/auth/authenticate", body, deadline, timeout, None)
                except _StaleToken as e:
                    raise self._auth_refusal("/v3/auth/authenticate", e.message) from None
            except EtcdAuthError as e:
                self._auth_refused = (trio.current_time() + 1.0, e)
                raise
            except EtcdError as e:
                if (e.details or {}).get("grpc_code") == _FAILED_PRECONDITION_GRPC and "not enabled" in e.message:
                    if not self._auth_off:
                        log.warning("etcd has authentication off: user %r is not used (turn it on: etcdctl auth "
                                    "enable)", self.auth.user)
                    self._auth_off = True
                    return None
                raise
            self._auth_off = False
            self._auth_refused = None
            self._token = msgspec.json.decode(raw, type=_AuthenticateResponse, strict=False).token
            self.authentications += 1
            if self.authentications > 1:
                log.info("etcd: authenticated again as %r (the previous token expired or was invalidated)",
                         self.auth.user)
            return self._token

    async def check_access(self, prefix: str | bytes, *, write: bool = True, timeout_s: float | None = None) -> None:
        """Check that this client may read (and, with ``write``, write) every key under
        ``prefix``, writing nothing: a range of one key, and a transaction whose put is
        behind a compare that never holds (etcd checks the permissions of both branches).
        Raises EtcdAuthError, EtcdPermissionError, EtcdTlsError, EtcdUnavailableError."""
        await self.range(prefix, prefix=True, limit=1, timeout_s=timeout_s)
        if write:
            probe = _b(prefix) + b"\0access-check"
            await self.txn([Compare.create_revision(probe, "<", 0)], [Put(probe, b"")], timeout_s=timeout_s)

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
        for attempt in (0, 1):
            token = self._token
            raw = await self._post("/v3/lease/keepalive", {"ID": str(lease_id)}, timeout_s)
            line = msgspec.json.decode(raw.split(b"\n", 1)[0], type=_KeepAliveLine, strict=False)
            if line.error is not None and attempt == 0 and self._stale(line.error.grpc_code, line.error.message, token):
                timeout = self.timeout_s if timeout_s is None else timeout_s
                await self._renew_token(token, trio.current_time() + timeout, timeout)
                continue
            break
        if line.error is not None:
            if self._stale(line.error.grpc_code, line.error.message, token):
                raise self._auth_refusal("/v3/lease/keepalive", line.error.message)
            raise self._refusal("/v3/lease/keepalive", {}, line.error.grpc_code, line.error.message)
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

    async def auth_step(self, path: str, body: dict[str, Any], *, timeout_s: float | None = None) -> dict:
        """One of etcd's ``/v3/auth/...`` administration calls (``user/add``,
        ``role/grant``, ``enable``...) with this client's TLS and token: its JSON answer.
        Raises the EtcdError etcd answered (e.g. "user name already exists")."""
        if not path.startswith("/v3/auth/"):
            raise ValueError(f"not an auth call: {path}")
        return msgspec.json.decode(await self._post(path, body, timeout_s))

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


#: the gRPC status names etcd writes into a watch's ``cancel_reason``
#: (``rpc error: code = Unauthenticated desc = ...``), as codes
_CANCEL_CODES = {"Unauthenticated": _UNAUTHENTICATED_GRPC, "PermissionDenied": _PERMISSION_DENIED_GRPC,
                 "InvalidArgument": 3}


class _StaleToken(Exception):
    """etcd did not take the request's token (or wants one): authenticate, retry once."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _AuthenticateResponse(msgspec.Struct):
    token: str = ""


_VERBS = {"/v3/kv/range": "read", "/v3/kv/put": "write", "/v3/kv/deleterange": "delete", "/v3/kv/txn": "write",
          "/v3/watch": "watch", "/v3/kv/compaction": "compact", "/v3/lease/revoke": "revoke a lease of"}


def _refusal(path: str, body: dict[str, Any], grpc_code: int, message: str, *, user: str | None = None) -> EtcdError:
    if grpc_code == _NOT_FOUND_GRPC and "lease not found" in message:
        lease = body.get("ID") or body.get("lease") or 0
        return EtcdLeaseNotFoundError(int(lease))
    if "authentication failed" in message or "invalid user ID or password" in message:
        return EtcdAuthError(
            f"etcd refused user {user!r}: wrong user name or password ({message}); check --etcd-user and the "
            "password (--etcd-password-file or $RALLYPOINT_ETCD_PASSWORD)",
            details={"path": path, "user": user, "grpc_code": grpc_code},
        )
    if grpc_code == _PERMISSION_DENIED_GRPC or "permission denied" in message:
        key = body.get("key")
        key_text = key.decode("utf-8", "replace") if isinstance(key, bytes) else None
        verb = _VERBS.get(path, path)
        return EtcdPermissionError(
            f"etcd user {user!r} may not {verb}{f' {key_text!r}' if key_text else ''} ({path}): permission denied; "
            "grant its role readwrite on the cluster's prefix (etcdctl role grant-permission ROLE --prefix=true "
            "readwrite /rallypoint/NAME/)",
            details={"path": path, "user": user, "key": key_text, "grpc_code": grpc_code},
        )
    if grpc_code == _UNAUTHENTICATED_GRPC or _NO_USER in message:
        return EtcdAuthError(
            f"etcd has authentication on and refused {path} ({message}): give a user and password "
            "(rallypoint: --etcd-user, --etcd-password-file or $RALLYPOINT_ETCD_PASSWORD)",
            details={"path": path, "user": user, "grpc_code": grpc_code},
        )
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
        #: the token of the open stream, and whether this opening already renewed one
        self._token: str | None = None
        self._auth_retried = False

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
        backoff = Backoff(0.02, max(0.02, client.backoff_max_s))
        last_error = ""
        while True:
            try:
                token = await client._current_token(trio.current_time() + client.timeout_s, client.timeout_s)
            except EtcdUnavailableError as e:  # no token without etcd: the next round tries again
                last_error = e.message
                order = []
            else:
                order = client._order()
            tls_failures: list[tuple[str, str, str]] = []
            for i in order:
                url = client.endpoints[i] + "/v3/watch"
                resp = None
                with trio.move_on_after(client.timeout_s):
                    try:
                        req = client._http.build_request(
                            "POST", url, content=content, headers={"Authorization": token} if token else None)
                        resp = await client._http.send(req, stream=True)
                    except httpx.TransportError as e:
                        last_error = f"{url}: {type(e).__name__}: {e}"
                        tls = _tls_reason(e)
                        if tls is not None:
                            tls_failures.append((client.endpoints[i], *tls))
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
                    if client._stale(err.code, err.message, token):
                        await self._renew(token, err.message)
                        break  # open again, with the new token
                    client._check_refusal("/v3/watch", err.code, err.message, token)
                    raise client._refusal("/v3/watch", {}, err.code, err.message)
                self._resp, self._lines = resp, resp.aiter_lines()
                self._token = token
                self._connects += 1
                client._preferred = i
                return
            else:
                if order and len(tls_failures) == len(order):
                    raise client._tls_error(tls_failures)
                if self._give_up_after_s is not None and trio.current_time() - started >= self._give_up_after_s:
                    raise EtcdUnavailableError(
                        f"could not open an etcd watch for {self._give_up_after_s:g} s at "
                        f"{', '.join(client.endpoints)} (last: {last_error}); check that etcd runs",
                        details={"endpoints": client.endpoints, "path": "/v3/watch", "last_error": last_error},
                    )
                await backoff.sleep()

    async def _renew(self, token: str | None, message: str) -> None:
        """etcd refused the opening's token: get a new one (once per opening: a fresh
        token refused too is EtcdAuthError). etcd out of reach meanwhile: the next
        opening authenticates."""
        client = self._client
        if self._auth_retried:
            raise client._auth_refusal("/v3/watch", message)
        self._auth_retried = True
        try:
            await client._renew_token(token, trio.current_time() + client.timeout_s, client.timeout_s)
        except EtcdUnavailableError:
            pass

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
                if msg.error.grpc_code in _UNAVAILABLE_GRPC or any(m in msg.error.message for m in _STREAM_LOST):
                    log.info("etcd watch on %r lost (%s); resuming from revision %d", self._key, msg.error.message,
                             self._next_rev)
                    continue
                if self._client._stale(msg.error.grpc_code, msg.error.message, self._token):
                    await self._renew(self._token, msg.error.message)
                    continue
                raise self._client._refusal("/v3/watch", {}, msg.error.grpc_code, msg.error.message)
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
                reason = r.cancel_reason
                code = next((c for name, c in _CANCEL_CODES.items() if f"code = {name} " in reason), 0)
                if code and self._client._stale(code, reason, self._token):
                    await self._renew(self._token, reason)  # (an opening's token that etcd no longer takes)
                    continue
                if code:
                    raise self._client._refusal("/v3/watch", {"key": self._key}, code, reason)
                raise EtcdError(f"etcd cancelled the watch on {self._key!r}: {r.cancel_reason or 'no reason given'}")
            if r.created:
                self._auth_retried = False
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
