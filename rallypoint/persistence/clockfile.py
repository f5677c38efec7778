"""The data dir's clock heartbeat: the last ``(server time, wall time)`` pair seen.

Server time (:meth:`rallypoint.clock.Clock.mono_ms`) must continue across restarts and
never go backward, even when the wall clock was set back while the daemon was down; and
after a restart, leases are extended by the time the server could not hear renewals.
Both need to know when the server was last alive. The coordinator writes that pair here
every tick (0.5 s) with one ``pwrite`` of 24 bytes, without fsync: a process crash
keeps the page cache, so the pair is at most one tick old; after a machine crash it may
be older, which only makes the lease extension larger (never shorter) and server time
continue from an older point plus the wall time that passed.

**Deaf since.** A daemon that stops stops hearing renewals as soon as it stops
accepting requests (SIGTERM's drain), well before its last heartbeat (after the final
snapshot). It records that instant (:meth:`Recovery.stop_hearing`), carried by every
later write, so the next start extends leases from there rather than from the last
heartbeat (docs/architecture.md, "Time").

Layout: ``b"RPCK"``, mono ms (int64 BE), wall ms (int64 BE), CRC-32 of the first 20
bytes (uint32 BE); then ``b"RPDF"``, deaf-since mono ms (int64 BE, 0: hearing), CRC-32
of those 12 bytes (uint32 BE). A reader of the first 24 bytes only (before the deaf
mark) reads the same pair. A missing or damaged file reads as None (a first start); a
missing or damaged deaf block as "hearing".
"""

from __future__ import annotations

import os
import struct
import zlib

__all__ = ["ClockFile", "CLOCK_FILE"]

CLOCK_FILE = "CLOCK"
_FMT = struct.Struct(">4sqqI")
_MAGIC = b"RPCK"
_DEAF = struct.Struct(">4sqI")
_DEAF_MAGIC = b"RPDF"


class ClockFile:
    """Read at start-up, written by the coordinator's tick."""

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, CLOCK_FILE)
        self._fd: int | None = None

    def read(self) -> tuple[int, int] | None:
        """``(mono_ms, wall_ms)`` last written, or None (missing or damaged)."""
        full = self.read_full()
        return None if full is None else full[:2]

    def read_full(self) -> tuple[int, int, int | None] | None:
        """``(mono_ms, wall_ms, deaf_since_mono_ms or None)`` last written, or None."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(_FMT.size + _DEAF.size)
        except FileNotFoundError:
            return None
        if len(data) < _FMT.size:
            return None
        magic, mono, wall, crc = _FMT.unpack(data[:_FMT.size])
        if magic != _MAGIC or zlib.crc32(data[:20]) != crc:
            return None
        deaf = None
        if len(data) == _FMT.size + _DEAF.size:
            dmagic, dmono, dcrc = _DEAF.unpack(data[_FMT.size:])
            if dmagic == _DEAF_MAGIC and zlib.crc32(data[_FMT.size:_FMT.size + 12]) == dcrc and dmono > 0:
                deaf = dmono
        return mono, wall, deaf

    def write(self, mono_ms: int, wall_ms: int, deaf_since_ms: int | None = None) -> None:
        """Overwrite the pair and the deaf mark (None: hearing), one pwrite, no fsync."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        head = struct.pack(">4sqq", _MAGIC, mono_ms, wall_ms)
        deaf = struct.pack(">4sq", _DEAF_MAGIC, deaf_since_ms or 0)
        os.pwrite(self._fd, head + struct.pack(">I", zlib.crc32(head)) + deaf + struct.pack(">I", zlib.crc32(deaf)),
                  0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
