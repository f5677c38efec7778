"""What every kind shares: input validation, the ``@applies`` mark, the memory journal.

``check_*`` raise VALIDATION_FAILED naming the field; ``short`` quotes input in error
messages (at most 80 characters). Every kind module imports from here, never from
another kind's module, for these.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import msgspec
import trio

from ..clock import from_iso
from ..errors import ForbiddenError, ValidationError
from ..wire import MAX_FRAME_BYTES, MAX_PAYLOAD_BYTES, too_large_message

__all__ = [
    "MemoryJournal", "applies", "check_holder", "check_name", "check_payload", "check_range", "check_key", "clamp_wait",
    "parse_instant", "short", "data", "check_label", "did_you_mean", "MAX_WAIT_MS", "MAX_KEY_LEN", "REPLY_BUDGET_BYTES",
    "fit_count", "require_node", "require_local",
]

#: Longest server-side wait in one request, ms (SPEC §13); the SDK re-issues longer ones.
MAX_WAIT_MS = 60_000

#: Longest idempotency key, arrival key or claim key, characters.
MAX_KEY_LEN = 256

_NAME_RE = re.compile(r"^[A-Za-z0-9\-_./:]{1,128}$")

#: What the list of one reply may hold, bytes: the frame limit (1 MiB, ``wire``) less
#: room for the ``Ok`` envelope (at most 23 bytes) and the reply's other fields. A
#: handler that hands out or echoes many payloads (a batch receive, ``task.results``,
#: the views of ``task.submit_many`` / ``delivery.complete_many``) sizes its answer by
#: it BEFORE it commits: nothing is leased or applied that its reply could not carry.
REPLY_BUDGET_BYTES = MAX_FRAME_BYTES - 4096


def fit_count(sizes, budget: int = REPLY_BUDGET_BYTES) -> int:
    """How many of the leading items fit in ``budget`` bytes, given an upper bound of each
    one's encoded size (an iterable, consumed only as far as needed); at least 1 when
    there is an item (one item always fits a frame: a payload is at most 64 KiB)."""
    n = 0
    for size in sizes:
        budget -= size
        if budget < 0 and n:
            break
        n += 1
    return n


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that quote input."""
    r = repr(value)
    if len(r) <= limit:
        return r
    n = len(value) if isinstance(value, (str, bytes)) else len(r)
    return r[: limit - 15] + f"...({n} {'chars' if isinstance(value, str) else 'bytes' if isinstance(value, bytes) else 'chars of repr'})"


def check_name(field: str, value: Any) -> str:
    """A name (mailboxes, pools, named runs...): 1-128 chars of letters, digits, ``-_./:``.

    Raises VALIDATION_FAILED naming ``field``."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValidationError(
            f"{field} must be 1 to 128 characters of letters, digits and -_./: (got {short(value)})",
            details={"field": field},
        )
    return value


def did_you_mean(name: Any, known: "Iterable[str]") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to a ``name`` that was
    not found (difflib, similarity >= 0.75), else ``""``: appended to a NOT_FOUND
    message for a name a person typed (a mailbox, pool, quota, budget)."""
    if not isinstance(name, str):
        return ""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


#: Characters no label may hold: C0 and C1 controls, DEL, and the bidirectional
#: formatting characters (Trojan Source, CVE-2021-42574: a name that reads one way in a
#: console, a log or a terminal and is another).
_UNSAFE_LABEL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def check_label(field: str, value: Any, limit: int = 256) -> str:
    """A label (a run's name, a named timer or barrier): 1 to ``limit`` characters, any
    but control characters and bidirectional formatting characters (runstate names may
    hold spaces and ``/``).

    Raises VALIDATION_FAILED naming ``field``."""
    if not isinstance(value, str) or not 1 <= len(value) <= limit or _UNSAFE_LABEL.search(value):
        raise ValidationError(
            f"{field} must be 1 to {limit} characters without control or bidirectional formatting characters "
            f"(got {short(value)})",
            details={"field": field},
        )
    return value


def check_payload(field: str, raw: msgspec.Raw | bytes) -> bytes:
    """An encoded payload, at most 64 KiB. Raises VALIDATION_FAILED naming the field,
    the size and the limit (``... exceeds 65536 bytes ...``: :func:`too_large_message`),
    with ``details`` ``{field, size, limit}``."""
    b = bytes(raw)
    if len(b) > MAX_PAYLOAD_BYTES:
        raise ValidationError(
            too_large_message(field, len(b), MAX_PAYLOAD_BYTES,
                              "payloads are at most 64 KiB: store the data elsewhere and pass a reference"),
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


def check_key(field: str, key: Any) -> None:
    """An optional key (idempotency key, arrival key): 1 to 256 characters or None.
    Raises VALIDATION_FAILED naming ``field``."""
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LEN):
        raise ValidationError(f"{field} must be 1 to {MAX_KEY_LEN} characters", details={"field": field})


def check_holder(value) -> None:
    """A lease holder's name (claims, pools, quotas, deliveries): None or 1-128
    characters; VALIDATION_FAILED (field ``holder``) otherwise."""
    if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= 128
                              or _UNSAFE_LABEL.search(value)):
        raise ValidationError("holder must be 1 to 128 characters without control or bidirectional formatting "
                              "characters", details={"field": "holder"})


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


def data(**fields) -> dict | None:
    """An event's payload: the fields that are not None (None when none is)."""
    out = {k: v for k, v in fields.items() if v is not None}
    return out or None


def applies(rec_type: type) -> Callable:
    """Mark a kind's method as the ``apply`` of a journal record type (one per type;
    :class:`~rallypoint.actors.coordinator.Coordinator` builds its dispatch table from
    the marks and refuses two functions for one type)."""

    def deco(fn):
        fn._applies = rec_type
        return fn

    return deco


class MemoryJournal:
    """The journal of ``memory`` durability: LSNs and nothing else (durable at once)."""

    mode = "memory"
    writable = True

    def __init__(self, next_lsn: int = 1) -> None:
        self.last_lsn = next_lsn - 1

    def check_writable(self) -> None:
        """Never refuses: no disk."""

    @property
    def durable_lsn(self) -> int:
        return self.last_lsn

    def append(self, payload: bytes) -> int:
        self.last_lsn += 1
        return self.last_lsn

    async def wait_durable(self, lsn: int) -> None:
        return None

    def add_durable_listener(self, fn) -> None:
        """Nothing to call: every LSN is durable when it is appended (see
        :meth:`rallypoint.persistence.Journal.add_durable_listener`)."""

    def remove_durable_listener(self, fn) -> None:
        """Nothing was added."""

    def write_now(self) -> None:
        """Nothing to write."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    def truncate_below(self, lsn: int) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def statistics(self) -> dict:
        return {"mode": "memory", "last_lsn": self.last_lsn}




def require_node(session, tag: str) -> None:
    """FORBIDDEN unless ``session`` is another node's (authenticated by the cluster's
    node secret: ``Session.node``) or the node's own (``Session.local``): the calls
    between the shards of a sharded cluster (``tag``: the op's tag, for the message)."""
    if not (getattr(session, "node", False) or getattr(session, "local", False)):
        raise ForbiddenError(f"{tag} is a call between the nodes of a sharded cluster, authenticated by the "
                             "cluster's node secret; clients do not make it")


def require_local(session, tag: str) -> None:
    """FORBIDDEN unless ``session`` is the node's own (``Session.local``): an in-process
    step of the node, never taken over the wire."""
    if not getattr(session, "local", False):
        raise ForbiddenError(f"{tag} is a node's own step (in-process); it is not taken over the wire")
