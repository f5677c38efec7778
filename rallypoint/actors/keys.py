"""API keys and spaces (SPEC §1, §10).

A key belongs to one space and carries permissions (``resource_config``,
``coordination_write``, ``coordination_read``, ``admin``, ``operator``). The secret is
shown once at creation and only its SHA-256 is stored (the secret is 32 random bytes, so
a plain hash is enough: there is nothing to brute-force). Keys are entities like any
other: journaled, snapshotted, recovered.

**A key acts only in its own space.** An ``admin`` key creates, lists and revokes the
keys of its own space; another space's keys answer NOT_FOUND and creating a key for
another space is FORBIDDEN. Managing keys across spaces needs the ``operator``
permission, which can only be granted offline (``rallypoint keys create --data-dir``
on a stopped daemon), never over the wire, so no key can mint its way into another
space.

Until the first key is created the server runs in *open mode*: every connection gets
the ``default`` space and every permission (the daemon allows that on loopback only,
unless ``--insecure``). Once a key has been created, every connection must present a
valid one, even after every key was revoked.

Key operations run on the space's actor.

**Rights are decided per request from the current key table, and a change reaches what
is open.** A session carries its *grant*: the id of the key it presented, or
:data:`OPEN_MODE` for one admitted because no key existed (:func:`grant_of`; a trusted
in-process session -- the embedded client, the local operator, a cluster node -- has
none). :meth:`Keys.refusal` says whether a grant still holds: the service asks it before
queueing a request and the coordinator again before handling it (a request queued before
a revocation is refused after it). When a grant ends -- ``KeyRevoked`` applied, or the
first ``KeyCreated`` ending open mode -- the apply calls :meth:`Coordinator.end_grant
<rallypoint.actors.coordinator.Coordinator.end_grant>`, which in that same step ends
every parked wait of the grant (UNAUTHENTICATED, answered once the revocation is
durable), ends its subscriptions (once the revocation is durable, with nothing pushed
after it) and tells the listeners (the TCP server closes the grant's connections). It
is one path for every way a key ends: ``key.revoke`` over the wire, ``keys revoke
--data-dir``, and a cluster's ``key.adopt`` of etcd's revocation. Keys have no
permission change: a key's permissions are fixed when it is made.

**A cluster** (``rallypoint serve --cluster``) keeps its keys in etcd
(:mod:`rallypoint.cluster.keystore`, ``rallypoint keys create|list|revoke --cluster``):
each shard's leader takes every key record there as it is (``key.adopt``: the store's
id and hash in a ``KeyCreated``, its revocation in a ``KeyRevoked``), so authentication
stays local and replicated to the standby. On such a node (:attr:`Keys.store` set)
``key.create`` and ``key.revoke`` over the wire are FORBIDDEN, naming the command.
"""

from __future__ import annotations

import logging

import hashlib
import hmac
import secrets

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, ForbiddenError, NotFoundError, UnauthenticatedError, ValidationError
from ..ids import is_id
from ..protocol import KeyAdopt, KeyCreate, KeyList, KeyListView, KeyRevoke, KeyView
from ..records import KeyCreated, KeyRevoked
from .opmark import PERMISSIONS
from .common import applies, check_name, short
from .common import data
from ..events import emits, ev
from .kind import Kind
from .opmark import A, ALWAYS, LOCAL, NEVER, PEER, SPACE, op

__all__ = ["KeyState", "Keys", "hash_secret", "new_secret", "check_key", "SECRET_PREFIX", "OPEN_MODE", "grant_of"]

SECRET_PREFIX = "rpk_"

#: The grant of a session admitted by open mode (no key existed when it connected):
#: it ends when the first key is created. Not a key id (those start with ``key_``).
OPEN_MODE = "open-mode"


def grant_of(session) -> str | None:
    """What a session's rights rest on: its key's id, :data:`OPEN_MODE` for a session
    admitted by open mode (``session.open``), None for a trusted in-process session
    (the embedded client, the local operator, a cluster node: nothing a key change
    ends). ``session`` may be None (an internal command)."""
    kid = getattr(session, "key_id", None)
    if kid is not None:
        return kid
    return OPEN_MODE if getattr(session, "open", False) else None


_log = logging.getLogger("rallypoint.keys")


def _who(session) -> str:
    if getattr(session, "local", False):
        return "the local operator (--data-dir)"
    return f"key {session.key_id}" if getattr(session, "key_id", None) else f"open mode ({getattr(session, 'peer', '')})"


def hash_secret(secret: str) -> str:
    """The SHA-256 of a key's secret, hex (what is stored)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    """A new key's secret: ``rpk_`` and 32 random bytes (url-safe base64)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def check_key(space: str, permissions: list[str], name: str | None = None, *,
              allow_operator: bool = True) -> list[str]:
    """Check a key's fields; returns its permissions, sorted and without repeats.

    Raises VALIDATION_FAILED for a bad space or name, no permission or an unknown one,
    FORBIDDEN for ``operator`` when ``allow_operator`` is False."""
    check_name("space", space)
    if name is not None:
        check_name("name", name)
    if not isinstance(permissions, list) or not all(isinstance(x, str) for x in permissions):
        raise ValidationError("permissions must be a list of names", details={"field": "permissions"})
    perms = sorted(set(permissions))
    if not perms:
        raise ValidationError("give at least one permission", details={"field": "permissions"})
    for perm in perms:
        if perm not in PERMISSIONS:
            raise ValidationError(
                f"unknown permission {perm!r}; use one of {', '.join(PERMISSIONS)}",
                details={"field": "permissions"},
            )
    if "operator" in perms and not allow_operator:
        raise ForbiddenError(
            "the operator permission (keys of every space) can only be granted offline: "
            "rallypoint keys create --data-dir DIR --permission operator (daemon stopped), or in a cluster "
            "rallypoint keys create --cluster etcd://HOST:PORT",
            details={"permission": "operator"},
        )
    return perms


def key_revoked(key_id: str) -> UnauthenticatedError:
    """The answer to a session whose key ``key_id`` was revoked (its connection closes)."""
    return UnauthenticatedError(
        f"API key {key_id} was revoked: this connection's rights ended; connect again with a live key",
        details={"reason": "key_revoked", "key_id": key_id})


def open_mode_ended() -> UnauthenticatedError:
    """The answer to a session admitted by open mode once the first key exists."""
    return UnauthenticatedError(
        "open mode ended (an API key was created): every client must now present a key; connect again with "
        "api_key=... (rallypoint.connect(url, api_key=KEY))", details={"reason": "open_mode_ended"})


class KeyState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    permissions: list[str]
    secret_sha256: str
    created_at_ms: int
    name: str | None = None
    revoked_at_ms: int | None = None


def _cross_space(session) -> bool:
    """May this session manage keys of every space? Open mode, an offline (local)
    session, or a key with ``operator``."""
    perms = session.permissions
    return perms is None or "operator" in perms


class Keys(Kind):
    """API keys: create, list, revoke; authentication of connections."""

    prefix = "key"
    name = "keys"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, KeyState] = {}
        self.by_hash: dict[str, str] = {}
        #: on a node of a cluster: where its keys live, ``(etcd URL, cluster name)``
        #: (``key.create``/``key.revoke`` over the wire are then refused, naming them)
        self.store: tuple[str, str] | None = None

    def entity_tables(self):
        return {"key": (self.table, KeyState)}

    @property
    def open_mode(self) -> bool:
        """True only while no key was ever created. Revoking every key does NOT reopen
        the server: it then refuses everyone until a new key is created (offline with
        ``rallypoint keys create --data-dir``), so a revoke can never turn
        authentication off."""
        return not self.table

    def live_count(self) -> int:
        return sum(1 for k in self.table.values() if k.revoked_at_ms is None)

    def is_revoked(self, key_id: str) -> bool:
        k = self.table.get(key_id)
        return k is None or k.revoked_at_ms is not None

    def refusal(self, session) -> UnauthenticatedError | None:
        """Why ``session`` may no longer act, from the key table as it is now: an
        UNAUTHENTICATED error (``details.reason`` ``key_revoked`` or
        ``open_mode_ended``) -- returned, not raised -- or None while its grant
        (:func:`grant_of`) holds. A trusted session (no grant) is never refused."""
        grant = grant_of(session)
        return None if grant is None else self.grant_refusal(grant)

    def grant_refusal(self, grant: str) -> UnauthenticatedError | None:
        """:meth:`refusal` of a session whose grant (a key id, :data:`OPEN_MODE`) is
        ``grant``."""
        if grant == OPEN_MODE:
            return open_mode_ended() if self.table else None
        k = self.table.get(grant)
        if k is None or k.revoked_at_ms is not None:
            return key_revoked(grant)
        return None

    def create_key(self, space: str, permissions: list[str], name: str | None = None,
                   *, allow_operator: bool = True) -> tuple[KeyState, str]:
        """Create a key; returns (state, secret). The secret is not stored.

        Raises VALIDATION_FAILED for an unknown permission or a bad space/name,
        FORBIDDEN for ``operator`` when ``allow_operator`` is False."""
        perms = check_key(space, permissions, name, allow_operator=allow_operator)
        coord = self.coord
        secret = new_secret()
        rec = KeyCreated(id=coord.new_id("key", space=space), space=space, permissions=perms,
                         secret_sha256=hash_secret(secret), at_ms=coord.now_ms(), name=name)
        coord.commit([rec])
        return self.table[rec.id], secret

    def revoke_key(self, key_id: str) -> KeyState:
        k = self.table.get(key_id)
        if k is None:
            raise NotFoundError(f"no API key {short(key_id)}")
        if k.revoked_at_ms is None:
            self.coord.commit([KeyRevoked(id=k.id, at_ms=self.coord.now_ms())])
        return k

    def authenticate(self, secret: str | None) -> KeyState | None:
        """The live key for ``secret``; None in open mode (no key was ever created), with
        or without a secret: open mode authenticates no one, so any key is accepted, as
        over HTTP (the runstate SDKs always send one).

        Raises UNAUTHENTICATED for a missing, unknown or revoked key once keys exist."""
        if self.open_mode:
            return None
        if not secret:
            raise UnauthenticatedError("this server requires an API key; pass api_key=...")
        kid = self.by_hash.get(hash_secret(secret))
        k = self.table.get(kid) if kid else None
        if k is None or not hmac.compare_digest(k.secret_sha256, hash_secret(secret)):
            raise UnauthenticatedError("unknown or revoked API key")
        return k

    def view(self, k: KeyState, secret: str | None = None) -> KeyView:
        return KeyView(
            id=k.id,
            space=k.space,
            name=k.name,
            permissions=list(k.permissions),
            created_at=to_iso(k.created_at_ms),
            revoked_at=to_iso(k.revoked_at_ms),
            secret=secret,
        )

    def _refuse_in_cluster(self, session, what: str) -> None:
        """On a node of a cluster, keys are made and revoked in etcd: FORBIDDEN over the
        wire (the local operator of a stopped node's data dir is not refused)."""
        if self.store is None or getattr(session, "local", False):
            return
        url, cluster = self.store
        raise ForbiddenError(
            f"in a cluster API keys live in etcd, so every shard has them: {what} with `rallypoint keys "
            f"{what.split()[0]} --cluster {url} --cluster-name {cluster}`",
            details={"key_store": url, "cluster": cluster})

    # ------------------------------------------------------------------ ops (admin)
    @op(KeyCreate, route=SPACE, permission=A, resend=NEVER)
    def op_key_create(self, actor, session, op: KeyCreate) -> KeyView:
        """A key in the session's own space (any space for an operator). FORBIDDEN for
        another space, for ``operator`` over the wire, and on a node of a cluster (its
        keys live in etcd: ``rallypoint keys create --cluster``)."""
        self._refuse_in_cluster(session, "create keys")
        if op.space != session.space and not _cross_space(session):
            raise ForbiddenError(
                f"this key acts in space {session.space!r} only; it cannot create keys for space {short(op.space)}",
                details={"space": op.space},
            )
        k, secret = self.create_key(op.space, op.permissions, op.name, allow_operator=getattr(session, "local", False))
        _log.info("API key %s created in space %s (permissions %s, name %s) by %s", k.id, k.space,
                  ",".join(k.permissions), k.name or "-", _who(session),
                  extra={"event": "key_created", "key_id": k.id, "space": k.space, "permissions": list(k.permissions),
                         "key_name": k.name, "by": _who(session)})
        return self.view(k, secret)

    @op(KeyList, route=SPACE, permission=A, resend=ALWAYS)
    def op_key_list(self, actor, session, op: KeyList) -> KeyListView:
        """Keys of the session's space (``space`` may name another one only for an
        operator; otherwise it is FORBIDDEN)."""
        if _cross_space(session):
            wanted = op.space
        else:
            if op.space is not None and op.space != session.space:
                raise ForbiddenError(
                    f"this key acts in space {session.space!r} only; it cannot list the keys of {short(op.space)}",
                    details={"space": op.space},
                )
            wanted = session.space
        return KeyListView(keys=[self.view(k) for k in self.table.values() if wanted in (None, k.space)])

    @op(KeyRevoke, route=SPACE, permission=A, resend=NEVER)
    def op_key_revoke(self, actor, session, op: KeyRevoke) -> KeyView:
        """Revoke a key of the session's space (NOT_FOUND for another space's). FORBIDDEN
        on a node of a cluster (``rallypoint keys revoke --cluster``)."""
        self._refuse_in_cluster(session, "revoke keys")
        k = self.table.get(op.key_id) if isinstance(op.key_id, str) else None
        if k is None or (k.space != session.space and not _cross_space(session)):
            raise NotFoundError(f"no API key {short(op.key_id)} in this space", details={"key_id": short(op.key_id)})
        view = self.view(self.revoke_key(k.id))
        _log.info("API key %s of space %s revoked by %s", k.id, k.space, _who(session),
                  extra={"event": "key_revoked", "key_id": k.id, "space": k.space, "by": _who(session)})
        return view

    @op(KeyAdopt, route=SPACE, permission=LOCAL, resend=ALWAYS, shard=PEER)
    def op_key_adopt(self, actor, session, op: KeyAdopt) -> KeyView:
        """Take a key of the cluster's key store as it is there (``protocol.KeyAdopt``):
        a ``KeyCreated`` with its id and hash if this shard lacks it, a ``KeyRevoked``
        if the store revoked it and this shard has not. FORBIDDEN unless local (the
        node's own key-store watch); VALIDATION_FAILED for a malformed record; CONFLICT
        when this shard holds the id with another space or secret."""
        if not getattr(session, "local", False):
            raise ForbiddenError("key.adopt is a cluster node's own step (its watch of the key store in etcd); "
                                 "make keys with `rallypoint keys create --cluster etcd://HOST:PORT`")
        if not is_id(op.id, "key"):
            raise ValidationError(f"id must be a key id (key_...), got {short(op.id)}", details={"field": "id"})
        if not (isinstance(op.secret_sha256, str) and len(op.secret_sha256) == 64
                and all(c in "0123456789abcdef" for c in op.secret_sha256)):
            raise ValidationError("secret_sha256 must be 64 lowercase hex digits", details={"field": "secret_sha256"})
        perms = check_key(op.space, op.permissions, op.name)
        k = self.table.get(op.id)
        recs: list = []
        if k is None:
            recs.append(KeyCreated(id=op.id, space=op.space, permissions=perms, secret_sha256=op.secret_sha256,
                                   at_ms=op.created_at_ms, name=op.name))
        elif k.space != op.space or k.secret_sha256 != op.secret_sha256:
            raise ConflictError(f"key {short(op.id)} is held here with another space or secret than the key store's",
                                details={"key_id": op.id})
        if op.revoked_at_ms is not None and (k is None or k.revoked_at_ms is None):
            recs.append(KeyRevoked(id=op.id, at_ms=op.revoked_at_ms))
        if recs:
            self.coord.commit(recs)
            _log.info("API key %s of space %s %s from the cluster's key store", op.id, op.space,
                      "revoked" if op.revoked_at_ms is not None else "taken",
                      extra={"event": "key_adopted", "key_id": op.id, "space": op.space,
                             "revoked": op.revoked_at_ms is not None})
        return self.view(self.table[op.id])

    @applies(KeyCreated)
    def _apply_created(self, r: KeyCreated) -> None:
        was_open = not self.table
        k = KeyState(id=r.id, space=r.space, permissions=list(r.permissions), secret_sha256=r.secret_sha256,
                     created_at_ms=r.at_ms, name=r.name)
        self.table[k.id] = k
        self.by_hash[k.secret_sha256] = k.id
        self.coord.touch(k.id)
        if was_open:  # the first key: open mode ends for every session it admitted
            self.coord.end_grant(OPEN_MODE, open_mode_ended())

    @emits(KeyCreated)
    def _ev_created(self, r: KeyCreated):
        return ev(r.space, "key.created", "key", r.id, None, r.at_ms,
                  data(name=r.name, permissions=list(r.permissions)))

    @emits(KeyRevoked)
    def _ev_revoked(self, r: KeyRevoked):
        k = self.table[r.id]
        return ev(k.space, "key.revoked", "key", k.id, None, r.at_ms, None)

    @applies(KeyRevoked)
    def _apply_revoked(self, r: KeyRevoked) -> None:
        k = self.table[r.id]
        k.revoked_at_ms = r.at_ms
        self.by_hash.pop(k.secret_sha256, None)
        self.coord.touch(k.id)
        self.coord.end_grant(k.id, key_revoked(k.id))  # what the key has open ends in this step

    def rebuild_indexes(self) -> None:
        self.by_hash = {k.secret_sha256: k.id for k in self.table.values() if k.revoked_at_ms is None}
