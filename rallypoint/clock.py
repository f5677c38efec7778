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

_current_time = trio.current_time

__all__ = ["Clock", "to_iso", "from_iso", "ms_to_datetime", "datetime_to_ms"]


class Clock:
    """Wall-clock and server-time milliseconds derived from Trio time.

    Two time bases, both in milliseconds:

    - **wall** (``now_ms``): UTC milliseconds since the epoch, for the instants clients
      give and read (deadlines, ``at=``, ``created_at``). It is mapped onto
      ``trio.current_time()`` once, at construction, so within a process it advances
      exactly with Trio time (and under ``trio.testing.MockClock`` a one-hour deadline
      passes in milliseconds of real time).
    - **server time** (``mono_ms``): what durations are measured on (leases, retry
      delays, timers and delays given in seconds). It advances with Trio time while the
      process runs and never goes backward across restarts: :meth:`resume` continues it
      from the last persisted ``(mono, wall)`` pair plus the wall time that passed, or
      plus nothing when the wall clock was set back. On a first start it equals wall time.

    Outside a Trio run both fall back to ``time.time()``.

    **The step's instant.** :meth:`pin` fixes the Trio time both read until
    :meth:`unpin`: the coordinator pins it for each command batch (one synchronous step,
    no await inside), so every decision, record and id of the step carries one instant
    and a step reads the clock once, not once per task (measured: 4-6 reads per task
    lifecycle before).
    """

    __slots__ = ("_wall0", "_trio0", "_mono0", "_pinned")

    def __init__(self, wall_start: float | None = None) -> None:
        self._wall0 = time.time() if wall_start is None else wall_start
        self._mono0 = self._wall0
        try:
            self._trio0 = trio.current_time()
        except RuntimeError:
            self._trio0 = None
        self._pinned: float | None = None

    def pin(self, trio_now: float) -> None:
        """Read ``trio_now`` (seconds, Trio time) as the current time until :meth:`unpin`."""
        self._pinned = trio_now

    def unpin(self) -> None:
        """Read the live Trio clock again."""
        self._pinned = None

    def _elapsed(self) -> float | None:
        if self._trio0 is None:
            return None
        pinned = self._pinned
        if pinned is not None:
            return pinned - self._trio0
        try:
            return trio.current_time() - self._trio0
        except RuntimeError:
            return None

    def now(self) -> float:
        """Wall seconds since the epoch (float)."""
        e = self._elapsed()
        return time.time() if e is None else self._wall0 + e

    def now_ms(self) -> int:
        """Wall milliseconds since the epoch (int)."""
        t0 = self._trio0
        if t0 is not None:  # inlined now() (a hot path: every record carries instants)
            now = self._pinned
            if now is not None:
                return int((self._wall0 + (now - t0)) * 1000)
            try:
                return int((self._wall0 + (_current_time() - t0)) * 1000)
            except RuntimeError:
                pass
        return int(time.time() * 1000)

    def mono_ms(self) -> int:
        """Server-time milliseconds (int): never backward, not even across restarts."""
        t0 = self._trio0
        if t0 is not None:
            now = self._pinned
            if now is not None:
                return int((self._mono0 + (now - t0)) * 1000)
            try:
                return int((self._mono0 + (_current_time() - t0)) * 1000)
            except RuntimeError:
                pass
        return int((self._mono0 + (time.time() - self._wall0)) * 1000)

    def resume(self, last_mono_ms: int, last_wall_ms: int) -> None:
        """Continue server time from a persisted pair: ``mono_ms()`` becomes
        ``last_mono_ms + max(0, now_ms() - last_wall_ms)`` (a wall clock set back while
        the server was down does not take server time back)."""
        now_wall = self.now_ms()
        mono_now = last_mono_ms + max(0, now_wall - last_wall_ms)
        e = self._elapsed() or 0.0
        self._mono0 = mono_now / 1000 - e

    def trio_time_at(self, at_ms: int) -> float:
        """The ``trio.current_time()`` value at which wall instant ``at_ms`` is reached."""
        if self._trio0 is None:
            return trio.current_time() + (at_ms / 1000 - time.time())
        return self._trio0 + (at_ms / 1000 - self._wall0)

    def trio_time_at_mono(self, mono_ms: int) -> float:
        """The ``trio.current_time()`` value at which server time ``mono_ms`` is reached."""
        if self._trio0 is None:
            return trio.current_time() + (mono_ms - self.mono_ms()) / 1000
        return self._trio0 + (mono_ms / 1000 - self._mono0)

    def mono_to_wall(self, mono_ms: int) -> int:
        """The wall instant (ms) at which server time ``mono_ms`` is (or was) reached."""
        return int(round((self._wall0 - self._mono0) * 1000)) + mono_ms

    def wall_to_mono(self, wall_ms: int) -> int:
        """The server time (ms) at which wall instant ``wall_ms`` is (or was) reached."""
        return int(round((self._mono0 - self._wall0) * 1000)) + wall_ms


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
