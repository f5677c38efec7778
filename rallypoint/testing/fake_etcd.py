"""An in-memory etcd for the two-node simulator (:mod:`rallypoint.testing.replsim`).

It keeps etcd's semantics as far as :mod:`rallypoint.cluster` relies on them, on Trio's
(virtual) clock:

- one store revision, raised by one for every write (a transaction's writes share it);
  a key's ``create_revision`` (0 once deleted: the epoch of a leader key),
  ``mod_revision``, ``version`` and ``lease``;
- transactions with compares on CREATE / MOD / VERSION / VALUE (of one key, or of every
  key of a range: ``Compare(..., prefix=True)``), then the success or
  the failure ops (put, range, delete), atomically; a put naming a lease that is gone
  fails the whole call (``EtcdLeaseNotFoundError``);
- leases with a TTL (at least 2 s, etcd's minimum), restarted by each keepalive *when
  etcd receives it*, expired by a background task exactly at their deadline (every key
  bound to one is deleted in one revision), revoked on request;
- watches from any revision (the whole history is kept: never compacted), each event
  once, in revision order.

Each node has its own :class:`FakeEtcdClient`. :meth:`FakeEtcdClient.cut` models a node
cut off from etcd (every call waits out its timeout and raises
``EtcdUnavailableError``, watches deliver nothing until :meth:`heal`); :meth:`kill` a
dead process (every call fails at once and changes nothing: a kill -9 revokes no
lease); :attr:`FakeEtcdClient.watch_delay_s` delays each watch event it delivers.
The client API is :class:`rallypoint.cluster.etcd.EtcdClient`'s.
"""

from __future__ import annotations

from typing import Sequence

import trio

from ..cluster.etcd import (
    Compare,
    Delete,
    DeleteResult,
    EtcdLeaseNotFoundError,
    EtcdUnavailableError,
    KeyValue,
    LeaseGrant,
    Put,
    PutResult,
    Range,
    RangeResult,
    TxnResult,
    WatchEvent,
    _b,
    _Header,
    prefix_end,
)

__all__ = ["FakeEtcd", "FakeEtcdClient"]

#: etcd's smallest lease TTL with the default election timeout, seconds
MIN_TTL_S = 2


class FakeEtcd:
    """The store. Run :meth:`run` (the lease expirer) in the simulation's nursery."""

    def __init__(self) -> None:
        self.revision = 1
        self.kv: dict[bytes, KeyValue] = {}
        self.leases: dict[int, tuple[int, float]] = {}  # id -> (ttl_s, deadline)
        self.history: list[tuple[int, WatchEvent]] = []
        self._next_lease = 0x1000
        self._changed = trio.Event()
        self._leases_changed = trio.Event()
        #: (revision, description) of every write, for traces
        self.log: list[tuple[int, str]] = []

    # ---------------------------------------------------------------- internals
    def _notify(self) -> None:
        ev, self._changed = self._changed, trio.Event()
        ev.set()

    def _lease_notify(self) -> None:
        ev, self._leases_changed = self._leases_changed, trio.Event()
        ev.set()

    def _range(self, key: bytes, prefix: bool) -> list[KeyValue]:
        if not prefix:
            kv = self.kv.get(key)
            return [kv] if kv is not None else []
        end = prefix_end(key)
        return [self.kv[k] for k in sorted(self.kv) if key <= k and (end == b"\0" or k < end)]

    def _compare(self, c: Compare) -> bool:
        if c.range_end is not None:  # every key of the range (none: judged as a missing key)
            kvs = [kv for k, kv in sorted(self.kv.items()) if c.key <= k and (c.range_end == b"\0" or k < c.range_end)]
            if not kvs:
                return c.target != "VALUE" and self._compare_kv(c, None)
            return all(self._compare_kv(c, kv) for kv in kvs)
        return self._compare_kv(c, self.kv.get(c.key))

    def _compare_kv(self, c: Compare, kv: KeyValue | None) -> bool:
        if c.target == "CREATE":
            have = kv.create_revision if kv else 0
        elif c.target == "MOD":
            have = kv.mod_revision if kv else 0
        elif c.target == "VERSION":
            have = kv.version if kv else 0
        else:
            have = kv.value if kv else b""
        want = c.operand
        return {"==": have == want, "!=": have != want, "<": have < want, ">": have > want}[c.op]

    def _put(self, key: bytes, value: bytes, lease: int, rev: int) -> None:
        old = self.kv.get(key)
        kv = KeyValue(key=key, value=value, create_revision=old.create_revision if old else rev, mod_revision=rev,
                      version=(old.version + 1) if old else 1, lease=lease)
        self.kv[key] = kv
        self.history.append((rev, WatchEvent(kv=kv, type="PUT")))
        self.log.append((rev, f"put {key.decode(errors='replace')}"))

    def _delete(self, key: bytes, rev: int) -> None:
        if self.kv.pop(key, None) is not None:
            self.history.append((rev, WatchEvent(kv=KeyValue(key=key, mod_revision=rev), type="DELETE")))
            self.log.append((rev, f"delete {key.decode(errors='replace')}"))

    def _expire(self, lease_id: int, why: str) -> None:
        if self.leases.pop(lease_id, None) is None:
            return
        keys = [k for k, kv in self.kv.items() if kv.lease == lease_id]
        if keys:
            self.revision += 1
            for k in keys:
                self._delete(k, self.revision)
            self._notify()
        self.log.append((self.revision, f"lease {lease_id:#x} {why}"))
        self._lease_notify()

    # ---------------------------------------------------------------- operations
    def txn(self, compare: Sequence[Compare], success: Sequence, failure: Sequence) -> TxnResult:
        ok = all(self._compare(c) for c in compare)
        ops = success if ok else failure
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self.leases:
                raise EtcdLeaseNotFoundError(op.lease)
        writes = any(isinstance(op, Put) or (isinstance(op, Delete) and self._range(_b(op.key), op.prefix))
                     for op in ops)
        if writes:
            self.revision += 1
        rev = self.revision
        out = []
        for op in ops:
            if isinstance(op, Put):
                self._put(_b(op.key), _b(op.value), op.lease, rev)
                out.append(PutResult(header=_Header(revision=rev)))
            elif isinstance(op, Range):
                kvs = self._range(_b(op.key), op.prefix)
                out.append(RangeResult(header=_Header(revision=rev), kvs=kvs, count=len(kvs)))
            elif isinstance(op, Delete):
                kvs = self._range(_b(op.key), op.prefix)
                for kv in kvs:
                    self._delete(kv.key, rev)
                out.append(DeleteResult(header=_Header(revision=rev), deleted=len(kvs)))
            else:  # pragma: no cover
                raise TypeError(f"not a transaction op: {op!r}")
        if writes:
            self._notify()
        return TxnResult(revision=rev, succeeded=ok, responses=tuple(out))

    def grant(self, ttl_s: int) -> LeaseGrant:
        ttl = max(MIN_TTL_S, int(ttl_s))
        self._next_lease += 1
        self.leases[self._next_lease] = (ttl, trio.current_time() + ttl)
        self._lease_notify()
        return LeaseGrant(header=_Header(revision=self.revision), lease_id=self._next_lease, ttl_s=ttl)

    def keepalive(self, lease_id: int) -> int:
        got = self.leases.get(lease_id)
        if got is None:
            raise EtcdLeaseNotFoundError(lease_id)
        ttl = got[0]
        self.leases[lease_id] = (ttl, trio.current_time() + ttl)
        self._lease_notify()
        return ttl

    def revoke(self, lease_id: int) -> None:
        if lease_id not in self.leases:
            raise EtcdLeaseNotFoundError(lease_id)
        self._expire(lease_id, "revoked")

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Expire leases at their deadlines, until cancelled."""
        task_status.started()
        while True:
            now = trio.current_time()
            for lid, (_ttl, deadline) in sorted(self.leases.items()):
                if deadline <= now:
                    self._expire(lid, "expired")
            nxt = min((d for _t, d in self.leases.values()), default=float("inf"))
            ev = self._leases_changed
            with trio.move_on_at(nxt):
                await ev.wait()


class _FakeWatch:
    """A watch of one key or prefix (the API of :class:`rallypoint.cluster.etcd.Watch`)."""

    def __init__(self, client: "FakeEtcdClient", key: bytes, prefix: bool, start_revision: int) -> None:
        self._client = client
        self._key = key
        self._end = prefix_end(key) if prefix else None
        self._next = start_revision or client.etcd.revision + 1
        self._pos = 0

    async def __aenter__(self) -> "_FakeWatch":
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def __aiter__(self) -> "_FakeWatch":
        return self

    def _match(self, key: bytes) -> bool:
        if self._end is None:
            return key == self._key
        return self._key <= key and (self._end == b"\0" or key < self._end)

    async def __anext__(self) -> WatchEvent:
        etcd = self._client.etcd
        while True:
            if self._client.dead:
                await trio.sleep_forever()
            if not self._client.is_cut:
                hist = etcd.history
                while self._pos < len(hist):
                    rev, ev = hist[self._pos]
                    if rev >= self._next and self._match(ev.kv.key):
                        self._pos += 1
                        self._next = rev  # (later events of the same revision follow)
                        if self._client.watch_delay_s:
                            await trio.sleep(self._client.watch_delay_s)
                        return ev
                    self._pos += 1
            await self._client.changed()


class FakeEtcdClient:
    """One node's client of a :class:`FakeEtcd` (see the module docstring)."""

    def __init__(self, etcd: FakeEtcd, *, timeout_s: float = 2.0) -> None:
        self.etcd = etcd
        self.timeout_s = timeout_s
        self.is_cut = False
        self.dead = False
        #: each watch event reaches this client this much later (seconds; a slow etcd
        #: member or a congested link: the cluster simulator's ``watch_lag``)
        self.watch_delay_s = 0.0
        self._healed = trio.Event()

    # ---------------------------------------------------------------- faults
    def cut(self) -> None:
        """This node can no longer reach etcd (until :meth:`heal`)."""
        self.is_cut = True

    def heal(self) -> None:
        self.is_cut = False
        ev, self._healed = self._healed, trio.Event()
        ev.set()

    def kill(self) -> None:
        """The process died: nothing it sends reaches etcd any more."""
        self.dead = True

    async def changed(self) -> None:
        """Wait for a write at etcd or a heal."""
        a, b = self.etcd._changed, self._healed
        async with trio.open_nursery() as n:
            async def one(ev):
                await ev.wait()
                n.cancel_scope.cancel()
            n.start_soon(one, a)
            n.start_soon(one, b)

    async def _call(self, timeout_s: float | None, path: str) -> None:
        if self.dead:
            raise EtcdUnavailableError(f"etcd {path}: this process is dead")
        await trio.lowlevel.checkpoint()
        if self.is_cut:
            await trio.sleep(self.timeout_s if timeout_s is None else timeout_s)
            raise EtcdUnavailableError(f"etcd did not answer {path} (the node is cut off from etcd)")

    # ---------------------------------------------------------------- the API
    async def __aenter__(self) -> "FakeEtcdClient":
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def range(self, key, *, prefix: bool = False, revision: int = 0, limit: int = 0,
                    timeout_s: float | None = None) -> RangeResult:
        await self._call(timeout_s, "range")
        kvs = self.etcd._range(_b(key), prefix)
        return RangeResult(header=_Header(revision=self.etcd.revision), kvs=kvs, count=len(kvs))

    async def get(self, key, *, timeout_s: float | None = None) -> KeyValue | None:
        r = await self.range(key, timeout_s=timeout_s)
        return r.kvs[0] if r.kvs else None

    async def put(self, key, value, *, lease: int = 0, prev_kv: bool = False,
                  timeout_s: float | None = None) -> PutResult:
        await self._call(timeout_s, "put")
        return self.etcd.txn([], [Put(key, value, lease)], []).responses[0]

    async def delete(self, key, *, prefix: bool = False, prev_kv: bool = False,
                     timeout_s: float | None = None) -> DeleteResult:
        await self._call(timeout_s, "delete")
        return self.etcd.txn([], [Delete(key, prefix)], []).responses[0]

    async def txn(self, compare, success=(), failure=(), *, timeout_s: float | None = None) -> TxnResult:
        await self._call(timeout_s, "txn")
        return self.etcd.txn(compare, success, failure)

    async def lease_grant(self, ttl_s: int, *, timeout_s: float | None = None) -> LeaseGrant:
        await self._call(timeout_s, "lease/grant")
        return self.etcd.grant(ttl_s)

    async def lease_keepalive(self, lease_id: int, *, timeout_s: float | None = None) -> int:
        await self._call(timeout_s, "lease/keepalive")
        return self.etcd.keepalive(lease_id)

    async def lease_revoke(self, lease_id: int, *, timeout_s: float | None = None) -> None:
        await self._call(timeout_s, "lease/revoke")
        self.etcd.revoke(lease_id)

    def watch(self, key, *, prefix: bool = False, start_revision: int = 0, prev_kv: bool = False,
              give_up_after_s: float | None = None) -> _FakeWatch:
        return _FakeWatch(self, _b(key), prefix, start_revision)
