"""Wall-clock time over Trio's clock.

Durable instants are wall-clock UTC. The :class:`Clock` maps ``trio.current_time()`` onto
the wall clock once, at construction, so that under ``trio.testing.MockClock`` a one-hour
deadline passes in milliseconds of real time and every instant the coordinator records
is consistent with Trio's sleeps.

Internally instants are integer milliseconds since the Unix epoch (``*_ms``); on the wire
they are ISO 8601 strings (:func:`to_iso` / :func:`from_iso`).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

import trio

__all__ = ["Clock", "to_iso", "from_iso", "ms_to_datetime", "datetime_to_ms"]


class Clock:
    """Wall-clock milliseconds derived from Trio time.

    ``now_ms()`` = wall time at construction + (trio time now - trio time at construction).
    Outside a Trio run it falls back to ``time.time()``.
    """

    __slots__ = ("_wall0", "_trio0")

    def __init__(self, wall_start: float | None = None) -> None:
        self._wall0 = time.time() if wall_start is None else wall_start
        try:
            self._trio0 = trio.current_time()
        except RuntimeError:
            self._trio0 = None

    def now(self) -> float:
        """Seconds since the epoch (float)."""
        if self._trio0 is None:
            return time.time()
        try:
            return self._wall0 + (trio.current_time() - self._trio0)
        except RuntimeError:
            return time.time()

    def now_ms(self) -> int:
        """Milliseconds since the epoch (int)."""
        return int(self.now() * 1000)

    def trio_time_at(self, at_ms: int) -> float:
        """The ``trio.current_time()`` value at which wall instant ``at_ms`` is reached."""
        if self._trio0 is None:
            return trio.current_time() + (at_ms / 1000 - time.time())
        return self._trio0 + (at_ms / 1000 - self._wall0)


def ms_to_datetime(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def datetime_to_ms(dt: datetime) -> int:
    if dt.tzinfo is None:
        raise ValueError("datetime must be timezone-aware (UTC)")
    return int(round(dt.timestamp() * 1000))


_iso_cache: dict[int, str] = {}


def to_iso(ms: int | None) -> str | None:
    """Milliseconds since the epoch -> ISO 8601 UTC string (``...Z``), None passes.

    Hot path (every reply carries instants): the ``YYYY-MM-DDTHH:MM:SS.`` prefix is
    computed with ``time.gmtime`` once per second and cached."""
    if ms is None:
        return None
    sec, milli = divmod(ms, 1000)
    prefix = _iso_cache.get(sec)
    if prefix is None:
        if len(_iso_cache) > 4096:
            _iso_cache.clear()
        if sec < 0 or sec >= 253402300800:  # outside years 1970-9999: the slow path
            return ms_to_datetime(ms).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        t = time.gmtime(sec)
        prefix = _iso_cache[sec] = (
            f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}."
        )
    return f"{prefix}{milli:03d}Z"


def from_iso(s: str) -> int:
    """ISO 8601 string -> milliseconds since the epoch. Naive strings are UTC.

    Raises ValueError on a malformed string.
    """
    if s.endswith("Z") or s.endswith("z"):
        s = s[:-1] + "+00:00"
    dt = datetime.fromisoformat(s)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    ms = int(round(dt.timestamp() * 1000))
    # In UTC and to the millisecond the instant must still be representable (years
    # 1-9999): "9999-12-31T23:59:59.9999Z" rounds up, and an offset can push an edge
    # date out of range; such an instant cannot be rendered back (to_iso).
    if not _MIN_MS <= ms <= _MAX_MS:
        raise ValueError(f"instant {s!r} is outside years 1 to 9999 UTC")
    return ms


_MIN_MS = -62135596800000  # 0001-01-01T00:00:00.000Z
_MAX_MS = 253402300799999  # 9999-12-31T23:59:59.999Z
