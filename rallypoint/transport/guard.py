"""What every listener of the daemon shares to refuse hostile clients cheaply: a cap of
connections per peer address, the handling of a failed ``accept`` (EMFILE & co), and
the process's descriptor limit.

- :class:`PeerSlots`: connections open per peer *address* (the IP, not the port), with a
  cap. A listener takes a slot when it accepts a connection and gives it back when the
  connection ends; the ``cap + 1``-th connection from one address is refused at once
  (the TCP listener answers ``Err(0, UNAVAILABLE)``, HTTP ``503``), while every other
  address still connects. One client can so hold at most ``cap`` of the listener's
  ``--max-connections`` slots, however it holds them (silent, slowloris, idle).
- :class:`Evictable`: the connections a full listener may close for a new one (idle,
  silent, a slow head), chosen max-min fair: only from an address holding at least two
  more than the newcomer's, the biggest holder first.
- :class:`RefusalPacer`: a refused connection of an address refused again within a
  couple of seconds is held a second before its answer (at most so many held; past
  that, closed at once), so reconnecting attackers come back once a second, not as fast
  as the listener can refuse them.
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
import random
import socket
import struct
from typing import Any, Awaitable, Callable

import trio

__all__ = ["PeerSlots", "Evictable", "RefusalPacer", "drop", "spread", "AcceptFailures", "raise_nofile_limit", "peer_address"]


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
        #: the addresses holding each count of connections (count -> addresses), and
        #: the highest count held: :meth:`largest` in O(1) a step, under a flood
        self._at: dict[int, set[str]] = {}
        self._top = 0
        #: connections refused because their address held ``cap`` (since creation)
        self.refused = 0

    def take(self, addr: str) -> bool:
        """Count one more connection from ``addr``: True, or False (nothing counted) when
        ``addr`` already holds ``cap``."""
        n = self._open.get(addr, 0)
        if self.cap and n >= self.cap:
            self.refused += 1
            return False
        self._move(addr, n, n + 1)
        return True

    def give(self, addr: str) -> None:
        """A connection from ``addr`` (counted by :meth:`take`) ended."""
        n = self._open.get(addr, 0)
        if n > 0:
            self._move(addr, n, n - 1)

    def _move(self, addr: str, n: int, m: int) -> None:
        if n:
            holders = self._at[n]
            holders.discard(addr)
            if not holders:
                del self._at[n]
        if m:
            self._open[addr] = m
            self._at.setdefault(m, set()).add(addr)
            if m > self._top:
                self._top = m
        else:
            self._open.pop(addr, None)
        while self._top and self._top not in self._at:
            self._top -= 1

    def count(self, addr: str) -> int:
        """Connections ``addr`` holds now."""
        return self._open.get(addr, 0)

    def largest(self, limit: int = 8) -> list[tuple[str, int]]:
        """Up to ``limit`` ``(address, connections)`` pairs, the most connections first
        (a list: the caller may close connections meanwhile)."""
        out: list[tuple[str, int]] = []
        n = self._top
        while n > 0 and len(out) < limit:
            for addr in self._at.get(n, ()):
                out.append((addr, n))
                if len(out) >= limit:
                    break
            n -= 1
        return out

    def statistics(self) -> dict[str, int]:
        """``peers`` (addresses with a connection open), ``max_per_peer`` (the most one
        address holds now), ``refused_per_peer`` (refused at the cap, since creation)."""
        return {"peers": len(self._open), "max_per_peer": self._top, "refused_per_peer": self.refused}


class Evictable:
    """The connections a full listener may close to make room for a new one, kept per
    peer address, in ``ranks`` classes (rank 0 closed first: e.g. idle keep-alive, then
    silent since accept, then a slow request head), each oldest first.

    The victim is chosen max-min fair (issue 41 item 7). With ``a`` the connections the
    newcomer's address holds and ``n`` those of a candidate victim's:

    - ``n >= a + 2``: the shares get more equal; always allowed;
    - ``n == a + 1``: a neutral swap (the counts trade places), allowed only when the
      newcomer's address has not itself lost a connection this way in the last
      ``recent_s`` seconds: a client with few connections still gets in, one connection
      from each of many addresses included, but attackers on many addresses, each
      holding its share, cannot close one another's connections in a loop (the
      reconnect-evict cascade that kept a full listener accepting thousands of
      connections a second and made a new client wait behind them in the accept
      queue);
    - otherwise the newcomer is refused.

    Among the allowed victims, the biggest holder goes first, then the lowest class,
    then the oldest in it (over the :attr:`LOOK_AT` biggest holders); only a connection
    in its class for ``min_age_s`` seconds at least may be closed.

    Args:
        slots: the listener's per-address counts (:class:`PeerSlots`).
        ranks: how many classes (>= 1).
        min_age_s: seconds a connection must have been in its class to be closed (>= 0).
        recent_s: seconds an address that lost a connection may not swap (>= 0).

    Raises:
        ValueError: ``ranks`` < 1, ``min_age_s`` or ``recent_s`` < 0.
    """

    #: the addresses looked at per eviction, the biggest holders first
    LOOK_AT = 8
    #: addresses remembered as having lost a connection (the oldest forgotten first)
    REMEMBER = 65536

    def __init__(self, slots: PeerSlots, ranks: int, min_age_s: float, recent_s: float = 10.0) -> None:
        if ranks < 1 or min_age_s < 0 or recent_s < 0:
            raise ValueError(f"ranks must be >= 1, min_age_s and recent_s >= 0, got {ranks!r}, "
                             f"{min_age_s!r}, {recent_s!r}")
        self.slots = slots
        self.ranks = ranks
        self.min_age_s = min_age_s
        self.recent_s = recent_s
        self._by_addr: dict[str, list[dict[Any, float]]] = {}
        self._where: dict[Any, tuple[str, int]] = {}
        #: address -> when it last lost a connection to make room (oldest first)
        self._lost: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: Any) -> bool:
        return item in self._where

    def add(self, addr: str, item: Any, rank: int, since: float) -> None:
        """``item`` (a connection of ``addr``) is in class ``rank`` since ``since`` (trio
        time, seconds: now, normally): the newest of its class (it leaves any other)."""
        self.discard(item)
        classes = self._by_addr.get(addr)
        if classes is None:
            classes = self._by_addr[addr] = [{} for _ in range(self.ranks)]
        classes[rank][item] = since
        self._where[item] = (addr, rank)

    def discard(self, item: Any) -> None:
        """``item`` can no longer be closed to make room (busy, or gone); no-op if unknown."""
        where = self._where.pop(item, None)
        if where is None:
            return
        addr, rank = where
        classes = self._by_addr[addr]
        del classes[rank][item]
        if not any(classes):
            del self._by_addr[addr]

    def lost_recently(self, addr: str, now: float) -> bool:
        """Whether ``addr`` lost a connection to make room in the last ``recent_s`` s."""
        lost = self._lost
        while lost:  # (forget the expired: the oldest first)
            first, at = next(iter(lost.items()))
            if now - at < self.recent_s and len(lost) <= self.REMEMBER:
                break
            del lost[first]
        at = lost.get(addr)
        return at is not None and now - at < self.recent_s

    def pick(self, addr: str, now: float, close: Callable[[Any, int], bool]) -> bool:
        """Make room for a new connection from ``addr``: call ``close(item, rank)`` on the
        fair victim (see the class) until one returns True (it was closed: its slot is
        free) and return True; False when no connection may be closed for it. An item
        ``close`` declines (False: it became busy) leaves the set."""
        held = self.slots.count(addr)
        floor = held + 1 if not self.lost_recently(addr, now) else held + 2
        while True:
            best = None
            for victim, n in self.slots.largest(self.LOOK_AT):
                if n < floor:
                    break
                classes = self._by_addr.get(victim)
                if classes is None:
                    continue
                for rank, items in enumerate(classes):
                    if items:
                        item, since = next(iter(items.items()))
                        if now - since >= self.min_age_s:
                            key = (-n, rank, since)
                            if best is None or key < best[0]:
                                best = (key, victim, item, rank)
                            break
            if best is None:
                return False
            _key, victim, item, rank = best
            self.discard(item)
            if close(item, rank):
                self._lost.pop(victim, None)
                self._lost[victim] = now
                return True


class RefusalPacer:
    """How long a listener holds a connection it refuses before answering: at once the
    first time, ``hold_s`` seconds for an address refused again within ``window_s``
    seconds (a client told ``Retry-After`` that reconnects at once), and, when
    ``max_held`` refused connections are held already, none at all: it is closed at
    once without an answer.

    A full listener refusing attackers' reconnections at once accepts them as fast as
    they come (2,700 a second in the soak's keep-alive attack, each a task, a 503 and a
    close, on the cores the well-behaved clients need, who wait behind them in the accept
    queue); held, each attacker connection comes back once per ``hold_s`` at most. A held
    connection costs a descriptor and a sleeping task (no read, no buffer), never a slot.

    Args:
        hold_s: seconds a repeat refusal is held (> 0).
        window_s: seconds within which a refusal of the same address is a repeat (> 0).
        max_held: refused connections held at once (>= 0).

    Raises:
        ValueError: a bound out of range.
    """

    #: addresses remembered as refused (the oldest forgotten first)
    REMEMBER = 65536

    def __init__(self, hold_s: float = 1.0, window_s: float = 2.0, max_held: int = 512) -> None:
        if hold_s <= 0 or window_s <= 0 or max_held < 0:
            raise ValueError(f"hold_s and window_s must be > 0 and max_held >= 0, got {hold_s!r}, "
                             f"{window_s!r}, {max_held!r}")
        self.hold_s = hold_s
        self.window_s = window_s
        self.max_held = max_held
        self.held = 0
        #: refusals held, and closed without an answer (since creation)
        self.held_total = 0
        self.dropped = 0
        self._last: dict[str, float] = {}  # address -> its last refusal (oldest first)

    def hold(self, addr: str, now: float) -> float | None:
        """A connection from ``addr`` is refused at ``now`` (trio time, seconds): seconds
        to hold it before answering (0: at once), or None: close it at once, no answer.
        A non-zero answer counts the connection held until :meth:`release`."""
        last = self._last
        while last:  # (forget the expired)
            first, at = next(iter(last.items()))
            if now - at < self.window_s and len(last) <= self.REMEMBER:
                break
            del last[first]
        repeat = addr in last
        last.pop(addr, None)
        last[addr] = now
        if not repeat:
            return 0.0
        if self.held >= self.max_held:
            self.dropped += 1
            return None
        self.held += 1
        self.held_total += 1
        return self.hold_s

    def release(self) -> None:
        """A connection :meth:`hold` held is answered (or gone)."""
        self.held -= 1

    def refuse(self, nursery: trio.Nursery, stream: Any, addr: str,
               answer: Callable[[Any, str | None], Awaitable[None]], why: str | None = None) -> None:
        """Refuse ``stream`` (accepted from ``addr``): ``await answer(stream, why)`` (the
        listener's refusal, which closes it) at once, or in a task after the hold for
        an address refused again (nothing read meanwhile), or a reset at once when
        ``max_held`` are held (:func:`drop`)."""
        hold = self.hold(addr, trio.current_time())
        if hold is None:
            drop(stream)
            return
        nursery.start_soon(self._answer, answer, stream, why, hold)

    async def _answer(self, answer, stream: Any, why: str | None, hold: float) -> None:
        if hold:
            try:
                await trio.sleep(hold)
            finally:
                self.release()
        await answer(stream, why)

    def statistics(self) -> dict[str, int]:
        """``refusals_held`` (held now), ``refusals_held_total``, ``refusals_dropped``
        (closed without an answer: the hold was full)."""
        return {"refusals_held": self.held, "refusals_held_total": self.held_total,
                "refusals_dropped": self.dropped}


#: the share of a hostile-holder time-out by which each connection's is shortened at
#: random (:func:`spread`)
SPREAD = 0.1


def spread(seconds: float, fraction: float = SPREAD) -> float:
    """``seconds`` shortened by a random share of at most ``fraction`` (a time-out between
    90 % and 100 % of the configured one, by default): connections opened together --
    a thousand slowloris or silent holders -- are not all cut in one instant, with their
    thousand reconnections behind it (issue 41: those instants were the worst samples
    of every well-behaved probe). Never longer than configured."""
    return seconds * (1.0 - fraction * random.random())


def drop(stream: Any) -> None:
    """Close an accepted ``trio.SocketStream`` at once with a TCP reset (SO_LINGER 0: no
    FIN handshake, no TIME_WAIT left here), sending nothing: the cheapest refusal."""
    sock = stream.socket
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


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
