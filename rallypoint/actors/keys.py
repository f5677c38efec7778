"""API keys and spaces (SPEC §1, §10).

A key belongs to one space and carries permissions (``resource_config``,
``coordination_write``, ``coordination_read``, ``admin``). The secret is shown once at
creation and only its SHA-256 is stored (the secret is 32 random bytes, so a plain hash
is enough: there is nothing to brute-force). Keys are entities like any other: journaled,
snapshotted, recovered.

Until the first key is created the server runs in *open mode*: every connection gets
the ``default`` space and every permission (the daemon allows that on loopback only,
unless ``--insecure``). Once a key has been created, every connection must present a
valid one, even after every key was revoked.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

from ..clock import to_iso
from ..errors import NotFoundError, UnauthenticatedError, ValidationError
from ..protocol import KeyCreate, KeyList, KeyListView, KeyRevoke, KeyView
from ..records import KeyCreated, KeyRevoked
from .api import PERMISSIONS
from .system import short, applies, check_name

__all__ = ["KeyState", "KeyKind", "hash_secret", "SECRET_PREFIX"]

SECRET_PREFIX = "rpk_"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    permissions: list[str]
    secret_sha256: str
    created_at_ms: int
    name: str | None = None
    revoked_at_ms: int | None = None


class KeyKind:
    def _init_tables(self) -> None:
        super()._init_tables()
        self.keys: dict[str, KeyState] = {}
        self.key_by_hash: dict[str, str] = {}

    def entity_tables(self):
        t = super().entity_tables()
        t["key"] = (self.keys, KeyState)
        return t

    @property
    def open_mode(self) -> bool:
        """True only while no key was ever created. Revoking every key does NOT reopen
        the server: it then refuses everyone until a new key is created (offline with
        ``rallypoint keys create --data-dir``), so a revoke can never turn
        authentication off."""
        return not self.keys

    def create_key(self, space: str, permissions: list[str], name: str | None = None) -> tuple[KeyState, str]:
        """Create a key; returns (state, secret). The secret is not stored.

        Raises VALIDATION_FAILED for an unknown permission or a bad space/name."""
        check_name("space", space)
        if name is not None:
            check_name("name", name)
        perms = sorted(set(permissions))
        if not perms:
            raise ValidationError("give at least one permission", details={"field": "permissions"})
        for perm in perms:
            if perm not in PERMISSIONS:
                raise ValidationError(
                    f"unknown permission {perm!r}; use one of {', '.join(PERMISSIONS)}",
                    details={"field": "permissions"},
                )
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        rec = KeyCreated(id=self.ids.new("key"), space=space, permissions=perms,
                         secret_sha256=hash_secret(secret), at_ms=self.now_ms(), name=name)
        self.commit([rec])
        return self.keys[rec.id], secret

    def revoke_key(self, key_id: str) -> KeyState:
        k = self.keys.get(key_id)
        if k is None:
            raise NotFoundError(f"no API key {short(key_id)}")
        if k.revoked_at_ms is None:
            self.commit([KeyRevoked(id=k.id, at_ms=self.now_ms())])
        return k

    def authenticate(self, secret: str | None) -> KeyState | None:
        """The live key for ``secret``; None in open mode with no secret.

        Raises UNAUTHENTICATED for a missing, unknown or revoked key."""
        if not secret:
            if self.open_mode:
                return None
            raise UnauthenticatedError("this server requires an API key; pass api_key=...")
        kid = self.key_by_hash.get(hash_secret(secret))
        k = self.keys.get(kid) if kid else None
        if k is None or not hmac.compare_digest(k.secret_sha256, hash_secret(secret)):
            raise UnauthenticatedError("unknown or revoked API key")
        return k

    def key_view(self, k: KeyState, secret: str | None = None) -> KeyView:
        return KeyView(
            id=k.id,
            space=k.space,
            name=k.name,
            permissions=list(k.permissions),
            created_at=to_iso(k.created_at_ms),
            revoked_at=to_iso(k.revoked_at_ms),
            secret=secret,
        )

    # admin operations (permission ``admin``; in open mode every session has it)
    def op_key_create(self, session, op: KeyCreate) -> KeyView:
        k, secret = self.create_key(op.space, op.permissions, op.name)
        return self.key_view(k, secret)

    def op_key_list(self, session, op: KeyList) -> KeyListView:
        return KeyListView(keys=[self.key_view(k) for k in self.keys.values() if op.space in (None, k.space)])

    def op_key_revoke(self, session, op: KeyRevoke) -> KeyView:
        return self.key_view(self.revoke_key(op.key_id))

    @applies(KeyCreated)
    def _apply_key_created(self, r: KeyCreated) -> None:
        k = KeyState(id=r.id, space=r.space, permissions=list(r.permissions), secret_sha256=r.secret_sha256,
                     created_at_ms=r.at_ms, name=r.name)
        self.keys[k.id] = k
        self.key_by_hash[k.secret_sha256] = k.id
        self.touch(k.id)

    @applies(KeyRevoked)
    def _apply_key_revoked(self, r: KeyRevoked) -> None:
        k = self.keys[r.id]
        k.revoked_at_ms = r.at_ms
        self.key_by_hash.pop(k.secret_sha256, None)
        self.touch(k.id)

    def rebuild_indexes(self) -> None:
        super().rebuild_indexes()
        self.key_by_hash = {k.secret_sha256: k.id for k in self.keys.values() if k.revoked_at_ms is None}
