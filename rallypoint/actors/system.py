"""The coordinator root: entity tables, the commit pipeline, activities and recovery.

Everything that changes state goes through :meth:`Coordinator.commit`:

1. a kind's ``decide`` (an ``op_*`` handler or a timer firing) validates and returns
   records;
2. ``commit`` applies them to every entity they touch (synchronously, no ``await``),
   lets *reactions* add follow-up records to the same commit (a member finishing can
   finalize its group), then appends the whole list to the journal as one entry with
   one LSN;
3. the transport sends the reply only once the journal is durable past the LSN the
   request observed (``journal.last_lsn`` when the handler returned).

Replay (recovery) calls :meth:`apply` on each journaled record with reactions off: the
follow-ups are already in the journal.

The op handlers and apply functions live in the kind modules (``scope.py``,
``mailbox.py``, ``group.py``) as mixins of :class:`Coordinator`.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

import msgspec
import trio

from .._version import __version__
from ..clock import Clock, from_iso, to_iso
from ..errors import (
    DeadlineExceededError,
    NotFoundError,
    RallypointError,
    ScopeCancelledError,
    UnavailableError,
    ValidationError,
)
from ..ids import IdGenerator
from ..records import ALL_RECORD_TYPES, decode_commit, encode_commit
from ..wire import MAX_PAYLOAD_BYTES
from .actor import Notifier, TimerHeap

log = logging.getLogger("rallypoint.coordinator")

__all__ = ["CoordinatorBase", "MemoryJournal", "applies", "check_name", "MAX_WAIT_MS"]

#: Longest server-side wait in one request, ms (SPEC §13); the SDK re-issues longer ones.
MAX_WAIT_MS = 60_000

_NAME_RE = re.compile(r"^[A-Za-z0-9\-_./:]{1,128}$")


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that quote input."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 15] + f"...({len(r)} chars)"


def check_name(field: str, value: Any) -> str:
    """A name (mailboxes, pools, named runs...): 1-128 chars of letters, digits, ``-_./:``.

    Raises VALIDATION_FAILED naming ``field``."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValidationError(
            f"{field} must be 1 to 128 characters of letters, digits and -_./: (got {short(value)})",
            details={"field": field},
        )
    return value


def check_payload(field: str, raw: msgspec.Raw | bytes) -> bytes:
    """An encoded payload, at most 64 KiB. Raises VALIDATION_FAILED naming size and limit."""
    b = bytes(raw)
    if len(b) > MAX_PAYLOAD_BYTES:
        raise ValidationError(
            f"{field} is {len(b)} bytes encoded; the limit is {MAX_PAYLOAD_BYTES} bytes (64 KiB)",
            details={"field": field, "size": len(b), "limit": MAX_PAYLOAD_BYTES},
        )
    return b


def parse_instant(field: str, value: str | None) -> int | None:
    """ISO 8601 -> ms since the epoch, or VALIDATION_FAILED naming ``field``."""
    if value is None:
        return None
    try:
        return from_iso(value)
    except (ValueError, TypeError):
        raise ValidationError(
            f"{field} must be an ISO 8601 instant such as 2026-01-31T12:00:00Z (got {value!r})",
            details={"field": field},
        ) from None


def check_range(field: str, value: int, lo: int, hi: int, unit: str = "") -> int:
    if not (lo <= value <= hi):
        raise ValidationError(
            f"{field} must be between {lo} and {hi}{unit} (got {value})", details={"field": field}
        )
    return value


def clamp_wait(wait_ms: int) -> int:
    if wait_ms < 0:
        raise ValidationError("wait_ms must be >= 0", details={"field": "wait_ms"})
    return min(wait_ms, MAX_WAIT_MS)


_APPLY: dict[type, str] = {}


def applies(rec_type: type) -> Callable:
    """Register a method as the ``apply`` of a record type (one per type)."""

    def deco(fn):
        if rec_type in _APPLY:
            raise RuntimeError(f"two apply functions for {rec_type.__name__}")
        _APPLY[rec_type] = fn.__name__
        return fn

    return deco


class MemoryJournal:
    """The journal of ``memory`` durability: LSNs and nothing else (durable at once)."""

    mode = "memory"

    def __init__(self, next_lsn: int = 1) -> None:
        self.last_lsn = next_lsn - 1

    @property
    def durable_lsn(self) -> int:
        return self.last_lsn

    writable = True

    def check_writable(self) -> None:
        """Never refuses: no disk."""

    def append(self, payload: bytes) -> int:
        self.last_lsn += 1
        return self.last_lsn

    async def wait_durable(self, lsn: int) -> None:
        return None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    def truncate_below(self, lsn: int) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def statistics(self) -> dict:
        return {"mode": "memory", "last_lsn": self.last_lsn}


class CoordinatorBase:
    """Tables, commit pipeline, activities, waiters. Kinds are mixed in by
    :class:`rallypoint.actors.Coordinator`.

    Args:
        journal: an object with ``append(bytes) -> lsn``, ``wait_durable(lsn)``,
            ``last_lsn``, ``durable_lsn`` (default: :class:`MemoryJournal`).
        clock: a :class:`~rallypoint.clock.Clock` (default: one made now).
    """

    def __init__(self, *, journal=None, clock: Clock | None = None, durability: str = "memory") -> None:
        self.clock = clock or Clock()
        self.ids = IdGenerator(self.clock.now_ms)
        self.journal = journal if journal is not None else MemoryJournal()
        self.durability = durability
        self.started_at = time.monotonic()
        self.connections = 0
        self.connections_fn = None  # set by the daemon: live connection count
        self.timers = TimerHeap(self.clock, self._fire_activity)
        self.notifier = Notifier()
        self.dirty: set[str] = set()
        self.track_dirty = durability != "memory"
        self._replaying = False
        self._reactions: list[Callable[[], list]] | None = None
        self._touched_groups: set[str] = set()
        self.commits = 0
        self._init_tables()

    # ------------------------------------------------------------------ tables
    def _init_tables(self) -> None:
        """Each kind mixin extends this to create its tables and indexes."""

    def entity_tables(self) -> dict[str, tuple[dict, type]]:
        """id prefix -> (table, state Struct type): what snapshots store."""
        return {}

    def entity(self, entity_id: str):
        t = self.entity_tables().get(entity_id[:3])
        return None if t is None else t[0].get(entity_id)

    def entity_count(self) -> int:
        return sum(len(t) for t, _ in self.entity_tables().values())

    def touch(self, entity_id: str) -> None:
        """Mark an entity changed since the last snapshot (only when snapshots are
        taken: ``track_dirty`` is off in memory mode)."""
        if self.track_dirty:
            self.dirty.add(entity_id)

    # ------------------------------------------------------------------ commit
    def commit(self, records: list) -> int:
        """Apply ``records`` (and the follow-ups reactions add) and journal them as one
        entry. Synchronous: the caller must have validated everything (``apply`` cannot
        fail). Returns the entry's LSN.

        Raises UNAVAILABLE (``DiskFullError``, with ``retry_after``) before applying
        anything while the journal refuses writes (disk full), so memory never runs
        ahead of what the journal can hold."""
        self.journal.check_writable()
        i = 0
        while True:
            while i < len(records):
                self.apply(records[i])
                i += 1
            more = self._react()
            if not more:
                break
            records.extend(more)
        lsn = self.journal.append(encode_commit(records))
        self.commits += 1
        return lsn

    def apply(self, rec) -> None:
        getattr(self, _APPLY[type(rec)])(rec)

    def replay(self, payload: bytes) -> None:
        """Apply one journal entry during recovery (no reactions, no activities fire)."""
        self._replaying = True
        try:
            for rec in decode_commit(payload):
                self.apply(rec)
        finally:
            self._replaying = False
            self._touched_groups.clear()

    def _react(self) -> list:
        """Follow-up decisions after a commit's records were applied (e.g. a group whose
        member finished may finalize). Kinds extend this."""
        return []

    # ------------------------------------------------------------------ activities
    def _fire_activity(self, kind: str, entity_id: str, arg: Any, due_ms: int) -> None:
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None:  # pragma: no cover - a programming error
            log.error("no handler for activity %s", kind)
            return
        try:
            handler(entity_id, arg, due_ms)
        except UnavailableError as exc:  # disk full: refused before applying; try again later
            self.timers.arm(self.clock.now_ms() + int((exc.retry_after or 1.0) * 1000), kind, entity_id, arg)
        except Exception:  # an activity must never kill the timer loop
            log.exception("activity %s on %s failed", kind, entity_id)

    def arm(self, due_ms: int, kind: str, entity_id: str, arg: Any = None) -> None:
        if not self._replaying:
            self.timers.arm(due_ms, kind, entity_id, arg)

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the coordinator's background tasks (journal flusher, the timer heap, the
        snapshotter if any) until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.journal.run)
            await nursery.start(self.timers.run)
            snap = getattr(self, "snapshotter", None)
            if snap is not None:
                await nursery.start(snap.run)
            task_status.started()

    # hooks for run completion (join sets close first; SPEC §5 "structured end")
    def close_records_for_complete(self, scope_id: str, at_ms: int) -> list:
        """Records that must be committed before ``scope_id`` can complete."""
        return []

    def complete_blockers(self, scope_id: str) -> int:
        """How many things still keep ``scope_id`` from completing (0: it can)."""
        return 0

    async def wait_complete_blockers(self, scope_id: str) -> None:
        """Return once :meth:`complete_blockers` is 0."""
        return None

    def rebuild_indexes(self) -> None:
        """After loading a snapshot: rebuild derived indexes from entity state. Kinds
        extend this."""

    def rearm_all(self) -> None:
        """After recovery: rebuild indexes and re-arm deadlines, leases and timers from
        state. Kinds extend this; what is already due fires at once."""

    # ------------------------------------------------------------------ helpers
    def now_ms(self) -> int:
        return self.clock.now_ms()

    def scope_inactive_error(self, scope_id: str) -> RallypointError | None:
        """Why the run (or an ancestor) refuses new work, or None when it is active.

        SCOPE_CANCELLED when it or an ancestor was cancelled or completed,
        DEADLINE_EXCEEDED when it or an ancestor is past its deadline (the first found
        walking up from the run)."""
        scopes = self.scopes
        s = scopes.get(scope_id)
        now = None
        while s is not None:
            if s.state != "ACTIVE":
                what = "cancelled" if s.state == "CANCELLED" else "completed"
                if s.id == scope_id:
                    msg = f"run {s.id} was {what}; it accepts no new work (start a new run)"
                else:
                    msg = f"run {scope_id} is inactive: its ancestor {s.id} was {what}"
                return ScopeCancelledError(msg, details={"scope_id": s.id})
            if s.deadline_ms is not None:
                if now is None:
                    now = self.clock.now_ms()
                if s.deadline_fired or now >= s.deadline_ms:
                    who = "run " + s.id if s.id == scope_id else f"run {scope_id}'s ancestor {s.id}"
                    return DeadlineExceededError(
                        f"{who} passed its deadline {to_iso(s.deadline_ms)}; it accepts no new work",
                        details={"scope_id": s.id},
                    )
            s = scopes.get(s.parent_id) if s.parent_id else None
        return None

    def require_active(self, scope_id: str) -> None:
        err = self.scope_inactive_error(scope_id)
        if err is not None:
            raise err

    def get_scope(self, session_space: str, scope_id: str):
        s = self.scopes.get(scope_id) if isinstance(scope_id, str) else None
        if s is None or s.space != session_space:
            raise NotFoundError(f"no run {short(scope_id)} in this space", details={"scope_id": short(scope_id)})
        return s

    def is_descendant_or_self(self, scope_id: str, ancestor_id: str) -> bool:
        scopes = self.scopes
        s = scopes.get(scope_id)
        while s is not None:
            if s.id == ancestor_id:
                return True
            s = scopes.get(s.parent_id) if s.parent_id else None
        return False

    def server_status(self) -> dict:
        return {
            "version": __version__,
            "uptime_s": time.monotonic() - self.started_at,
            "connections": self.connections_fn() if self.connections_fn else self.connections,
            "durability": self.durability,
            "entities": self.entity_count(),
            "last_lsn": self.journal.last_lsn,
            "durable_lsn": self.journal.durable_lsn,
        }

    def statistics(self) -> dict:
        return {
            "commits": self.commits,
            "timers_armed": len(self.timers),
            "timers_fired": self.timers.fired,
            "waiting_keys": len(self.notifier),
            "dirty": len(self.dirty),
            **self.server_status(),
        }


def record_types_without_apply() -> list[str]:
    """For tests: record types no kind registered an apply for."""
    return [t.__name__ for t in ALL_RECORD_TYPES if t not in _APPLY]
