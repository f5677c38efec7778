"""How the nodes of a cluster prove to each other who they are.

Two mechanisms, used together (docs/architecture.md, "Trust"):

**The cluster secret** (256 random bits in etcd, ``/rallypoint/<cluster>/node_secret``,
made by ``cluster init`` or the first node; :func:`rallypoint.cluster.shardmap.node_secret`)
is never sent. Every peer connection proves knowledge of it by a challenge-response:

- the replication link (:func:`link_proof`): the standby's ``Hello`` carries a fresh
  nonce, the leader answers with its own nonce and a proof over both nonces, the
  cluster, shard, its node name and its epoch; the standby checks that proof, and that
  the node and epoch are the ones etcd names as the shard's leader, before it takes any
  frame, then sends its own proof (over the same fields, its own node name and the
  other role's label). The leader checks it, and that the node is a configured member of
  the shard (the ``replicas`` key), before it sends anything. The role label in the MAC
  means one side's proof can never be replayed as the other's; the two nonces mean no
  proof can be replayed on another connection.
- the calls between nodes over a client port or an HTTP port (the outbox, remote runs,
  routed requests): a one-message token (:func:`make_token` / :class:`TokenVerifier`),
  an HMAC over the purpose, cluster, caller node, target, a timestamp (ms), a random
  nonce and the request's own bytes where there are any; a verifier accepts it once
  (it keeps the nonces it saw for the time window) and only within ``window_s`` of its
  own wall clock.

HMAC-SHA256 from :mod:`hmac`, compared in constant time.

**Mutual TLS** (``--peer-cert``/``--peer-key``/``--peer-ca``, as etcd's
``--peer-cert-file``/``--peer-trusted-ca-file``): the replication link runs inside TLS
1.2+ with both certificates verified against the cluster's CA; the name a node claims
(``Hello.node``, ``Welcome.leader``) must be a DNS subject alternative name of the
certificate it presented (:func:`names_of`). So a node that holds the secret but not a
node's key still cannot pose as that node. :func:`server_context` and
:func:`client_context` build the :class:`ssl.SSLContext` s.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
import time
from collections import OrderedDict

__all__ = ["link_proof", "make_token", "TokenVerifier", "server_context", "client_context", "names_of", "cert_names",
           "new_nonce", "PeerTls", "TOKEN_PREFIX"]

#: what a node token starts with (so a client key can never be taken for one)
TOKEN_PREFIX = "rpnode1."


def new_nonce() -> bytes:
    """16 random bytes."""
    return os.urandom(16)


def _mac(secret: str | bytes, *parts: object) -> bytes:
    key = secret.encode() if isinstance(secret, str) else secret
    m = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        m.update(len(b).to_bytes(4, "big"))  # length-prefixed: no two field lists share bytes
        m.update(b)
    return m.digest()


def link_proof(secret: str | bytes, *, role: str, cluster: str, shard: int, node: str, epoch: int,
               standby_nonce: bytes, leader_nonce: bytes) -> bytes:
    """The replication link's proof of ``role`` (``"leader"`` or ``"standby"``) for
    ``node``: HMAC-SHA256 of the cluster secret over every field given (32 bytes).
    Raises ValueError for another role or a nonce shorter than 16 bytes."""
    if role not in ("leader", "standby"):
        raise ValueError(f"role must be 'leader' or 'standby', not {role!r}")
    if len(standby_nonce) < 16 or len(leader_nonce) < 16:
        raise ValueError("a link nonce must be at least 16 bytes")
    return _mac(secret, "rallypoint-link-v1", role, cluster, shard, node, epoch, standby_nonce, leader_nonce)


def verify_link_proof(proof: bytes, secret: str | bytes, **fields) -> bool:
    """Whether ``proof`` is :func:`link_proof` of ``fields`` (constant time)."""
    try:
        expected = link_proof(secret, **fields)
    except ValueError:
        return False
    return isinstance(proof, bytes) and hmac.compare_digest(proof, expected)


def make_token(secret: str | bytes, *, purpose: str, cluster: str, node: str, target: str, body: bytes = b"",
               now_ms: int | None = None) -> str:
    """A node token: ``rpnode1.<node, hex of UTF-8>.<ms>.<nonce hex>.<mac hex>`` -- the
    MAC covers the purpose (``"session"``: a handshake on a client port; ``"http"``: a
    routed HTTP request), the cluster, the caller ``node``, the ``target`` (the callee's
    shard, or ``METHOD path`` for HTTP), the time (ms since the epoch) and nonce, and
    ``body`` (hashed)."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    nonce = os.urandom(12).hex()
    mac = _mac(secret, "rallypoint-token-v1", purpose, cluster, node, target, ms, nonce,
               hashlib.sha256(body).digest()).hex()
    return f"{TOKEN_PREFIX}{node.encode().hex()}.{ms}.{nonce}.{mac}"


def is_token(value: object) -> bool:
    """Whether ``value`` has the shape of a node token (not whether it is valid)."""
    return isinstance(value, str) and value.startswith(TOKEN_PREFIX)


class TokenVerifier:
    """Checks node tokens (:func:`make_token`) for one cluster: the MAC, the time
    (within ``window_s`` seconds of this node's wall clock, either way) and that the
    nonce was not seen before (kept for the window; at most ``max_nonces``, oldest
    first out -- a flood of valid tokens cannot grow memory without bound)."""

    def __init__(self, secret: str | bytes, cluster: str, *, window_s: float = 60.0, max_nonces: int = 200_000,
                 clock=time.time) -> None:
        self.secret = secret
        self.cluster = cluster
        self.window_s = window_s
        self.max_nonces = max_nonces
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.refused = 0

    def verify(self, token: object, *, purpose: str, target: str, body: bytes = b"") -> str | None:
        """The caller's node name, or None (refused: counted in ``refused``)."""
        node = self._check(token, purpose, target, body)
        if node is None:
            self.refused += 1
        return node

    def _check(self, token: object, purpose: str, target: str, body: bytes) -> str | None:
        if not is_token(token) or len(token) > 512:
            return None
        parts = token[len(TOKEN_PREFIX):].split(".")
        if len(parts) != 4:
            return None
        node_hex, ms_s, nonce, mac = parts
        if not (ms_s.isascii() and ms_s.isdigit()) or len(nonce) != 24 or len(mac) != 64 or len(ms_s) > 16:
            return None
        try:
            node = bytes.fromhex(node_hex).decode()
        except ValueError:
            return None
        now = self._clock()
        ms = int(ms_s)
        if abs(now - ms / 1000.0) > self.window_s:
            return None
        expected = _mac(self.secret, "rallypoint-token-v1", purpose, self.cluster, node, target, ms, nonce,
                        hashlib.sha256(body).digest()).hex()
        if not hmac.compare_digest(mac, expected):
            return None
        seen = self._seen
        # forget what fell out of the window (insertion order ~ time order)
        while seen and (next(iter(seen.values())) < now - 2 * self.window_s or len(seen) >= self.max_nonces):
            seen.popitem(last=False)
        if nonce in seen:
            return None  # a replay
        seen[nonce] = now
        return node


class PeerTls:
    """The node's peer TLS material (``--peer-cert``, ``--peer-key``, ``--peer-ca``):
    the two contexts of the replication link. Raises ValueError (naming the flag) for a
    file that does not load."""

    def __init__(self, cert: str, key: str, ca: str) -> None:
        self.cert, self.key, self.ca = cert, key, ca
        self.server = server_context(cert, key, ca)
        self.client = client_context(cert, key, ca)
        #: the node names this certificate carries (DNS subject alternative names)
        self.names = cert_names(cert)


def _load(ctx: ssl.SSLContext, cert: str, key: str, ca: str) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--peer-cert/--peer-key: {cert}, {key} do not load: {e}") from None
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--peer-ca: {ca} does not load: {e}") from None


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The leader's side: TLS 1.2+, the peer must present a certificate of ``ca``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, cert, key, ca)
    return ctx


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The standby's side: TLS 1.2+, presents its own certificate, verifies the
    leader's against ``ca`` and, by ``server_hostname``, that it names the leader's node
    (etcd's name for it, not the host it is reached at: a proxy may sit between)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, cert, key, ca)
    return ctx


def cert_names(path: str) -> set[str]:
    """The DNS subject alternative names of the (first) certificate in the PEM file
    ``path``. Raises ValueError if it does not load."""
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a PEM certificate: {e}") from None
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return set(san.get_values_for_type(x509.DNSName))


def names_of(peercert: dict | None) -> set[str]:
    """The DNS subject alternative names of a verified peer certificate (as
    :meth:`ssl.SSLSocket.getpeercert` gives it); empty for none."""
    if not peercert:
        return set()
    return {v for k, v in peercert.get("subjectAltName", ()) if k == "DNS"}
