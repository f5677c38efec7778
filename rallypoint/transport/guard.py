"""What every listener of the daemon shares to refuse hostile clients cheaply: a cap of
connections per peer address, the handling of a failed ``accept`` (EMFILE & co), and
the process's descriptor limit.

- :class:`PeerSlots`: connections open per peer *address* (the IP, not the port), with a
  cap. A listener takes a slot when it accepts a connection and gives it back when the
  connection ends; the ``cap + 1``-th connection from one address is refused at once
  (the TCP listener answers ``Err(0, UNAVAILABLE)``, HTTP ``503``), while every other
  address still connects. One client can so hold at most ``cap`` of the listener's
  ``--max-connections`` slots, however it holds them (silent, slowloris, idle).
- :class:`AcceptFailures`: an ``accept`` that fails (EMFILE: the process is out of
  descriptors; ENFILE, ENOBUFS, ENOMEM) is retried after a back-off that doubles from
  ``first_s`` to ``max_s`` while it keeps failing (the listening socket stays readable,
  so retrying at once would spin), and logged as ONE line per ``window_s`` with the
  count of failures since the last line -- never a traceback (trio's
  ``serve_listeners`` logged one every 100 ms).
- :func:`raise_nofile_limit`: the soft RLIMIT_NOFILE raised to the hard limit (the
  daemon calls it at start): the default soft limit (often 1024) is smaller than one
  listener's default ``--max-connections``.

Nothing here starts a task; the clocks are Trio's (MockClock in tests).
"""

from __future__ import annotations

import errno
import logging
import math
from typing import Any

import trio

__all__ = ["PeerSlots", "AcceptFailures", "raise_nofile_limit", "peer_address"]


def peer_address(sock: Any) -> str:
    """The peer's address (IP only, no port) of a connected socket, ``"?"`` when it cannot
    be read (the peer reset meanwhile). An IPv4-mapped IPv6 address counts as its IPv4
    address, so one client is one key whichever family it came through."""
    try:
        addr = sock.getpeername()
    except OSError:
        return "?"
    if isinstance(addr, tuple) and addr:
        host = str(addr[0])
        if host.startswith("::ffff:") and "." in host:
            host = host[7:]
        return host
    return str(addr) or "?"  # a Unix socket


class PeerSlots:
    """Connections open per peer address, at most ``cap`` each.

    Args:
        cap: connections one address may hold open at once (>= 1), or 0/None for no cap.

    Raises:
        ValueError: ``cap`` < 0.
    """

    def __init__(self, cap: int | None) -> None:
        if cap is not None and cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap!r}")
        self.cap = cap or 0
        self._open: dict[str, int] = {}
        #: connections refused because their address held ``cap`` (since creation)
        self.refused = 0

    def take(self, addr: str) -> bool:
        """Count one more connection from ``addr``: True, or False (nothing counted) when
        ``addr`` already holds ``cap``."""
        n = self._open.get(addr, 0)
        if self.cap and n >= self.cap:
            self.refused += 1
            return False
        self._open[addr] = n + 1
        return True

    def give(self, addr: str) -> None:
        """A connection from ``addr`` (counted by :meth:`take`) ended."""
        n = self._open.get(addr, 0) - 1
        if n > 0:
            self._open[addr] = n
        else:
            self._open.pop(addr, None)

    def count(self, addr: str) -> int:
        """Connections ``addr`` holds now."""
        return self._open.get(addr, 0)

    def statistics(self) -> dict[str, int]:
        """``peers`` (addresses with a connection open), ``max_per_peer`` (the most one
        address holds now), ``refused_per_peer`` (refused at the cap, since creation)."""
        return {"peers": len(self._open), "max_per_peer": max(self._open.values(), default=0),
                "refused_per_peer": self.refused}


class AcceptFailures:
    """Back-off and logging for a listener whose ``accept`` fails.

    Args:
        logger: where the lines go (WARNING).
        what: names the listener in the line ("TCP listener", "HTTP listener", ...).
        first_s: seconds to wait after the first failure of a run (> 0).
        max_s: the longest wait, seconds (>= first_s); the wait doubles up to it.
        window_s: at most one line per this many seconds (> 0); the line says how many
            accepts failed since the previous one.

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, logger: logging.Logger, what: str, *, first_s: float = 0.1, max_s: float = 1.0,
                 window_s: float = 10.0) -> None:
        if not (first_s > 0 and max_s >= first_s and window_s > 0):
            raise ValueError(f"need 0 < first_s <= max_s and window_s > 0, got {first_s!r}, {max_s!r}, {window_s!r}")
        self.logger = logger
        self.what = what
        self.first_s = first_s
        self.max_s = max_s
        self.window_s = window_s
        #: failed accepts since creation
        self.total = 0
        self._since_line = 0
        self._last_line = -math.inf
        self._wait = first_s
        #: lines written since creation
        self.lines = 0

    async def failed(self, exc: OSError) -> None:
        """One ``accept`` failed with ``exc``: log (at most once per window, with the
        count), then sleep the back-off (doubled for the next failure in a row)."""
        self.total += 1
        self._since_line += 1
        now = trio.current_time()
        if now - self._last_line >= self.window_s:
            name = errno.errorcode.get(exc.errno or 0, "") if isinstance(exc, OSError) else ""
            self.logger.warning(
                "%s: accept failed %d time(s) since the last report (%s%s); retrying with a back-off of up "
                "to %d ms (connections wait in the listen queue)", self.what, self._since_line,
                f"{name}: " if name else "", exc.strerror or exc, self.max_s * 1000,
                extra={"event": "accept_failed", "listener": self.what, "count": self._since_line,
                       "errno": name or None})
            self.lines += 1
            self._since_line = 0
            self._last_line = now
        wait = self._wait
        self._wait = min(self.max_s, wait * 2)
        await trio.sleep(wait)

    def succeeded(self) -> None:
        """An ``accept`` worked: the next failure waits ``first_s`` again."""
        self._wait = self.first_s

    def flush(self) -> None:
        """Report the failures not reported yet (the listener stops)."""
        if self._since_line:
            self.logger.warning("%s: accept failed %d more time(s) since the last report", self.what,
                                self._since_line)
            self.lines += 1
            self._since_line = 0


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit. Returns ``(before,
    after)`` soft limits (equal where nothing changed: already at the hard limit, no
    ``resource`` module, or the change refused)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        # macOS refuses an infinite soft limit; a large finite one is what is wanted
        target = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else soft
    else:
        target = hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return (soft, soft)
    for want in (target, 1 << 16):
        if want <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return (soft, want)
        except (ValueError, OSError):
            continue
    return (soft, soft)
