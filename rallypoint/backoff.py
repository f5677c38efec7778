"""One back-off policy for every retry loop of a node (issue 43: seven loops of the
cluster each doubled a delay of its own).

:class:`Backoff` is an exponential back-off without jitter: waits of ``first_s``, then
doubled (``factor``) up to ``max_s``, back to ``first_s`` after :meth:`reset` (a success).
No jitter, on purpose: the seeded simulators (``rallypoint.testing.replsim``) replay a
seed exactly, and the loops it paces retry one peer or one etcd, not a herd of clients
(the client's reconnect policy, :class:`rallypoint.client.reconnect.ReconnectPolicy`,
has its own jitter for that). Sans I/O but for :meth:`sleep` (Trio's clock: MockClock in
tests).
"""

from __future__ import annotations

import trio

__all__ = ["Backoff"]


class Backoff:
    """Exponential back-off: ``first_s``, ``first_s * factor``, ... at most ``max_s``.

    Args:
        first_s: seconds of the first wait, and after :meth:`reset` (> 0).
        max_s: the longest wait, seconds (>= first_s).
        factor: how much each wait grows over the previous one (>= 1).

    Raises:
        ValueError: a bound out of range.
    """

    __slots__ = ("first_s", "max_s", "factor", "_next")

    def __init__(self, first_s: float, max_s: float, factor: float = 2.0) -> None:
        if not first_s > 0 or max_s < first_s or factor < 1:
            raise ValueError(f"need 0 < first_s <= max_s and factor >= 1, got {first_s!r}, {max_s!r}, {factor!r}")
        self.first_s = first_s
        self.max_s = max_s
        self.factor = factor
        self._next = first_s

    @property
    def current(self) -> float:
        """Seconds the next wait will be."""
        return self._next

    def next(self) -> float:
        """The next wait, seconds; the one after it grows by ``factor`` (up to ``max_s``)."""
        wait = self._next
        self._next = min(self.max_s, wait * self.factor)
        return wait

    def reset(self) -> None:
        """A success: the next wait is ``first_s`` again."""
        self._next = self.first_s

    async def sleep(self, at_most: float | None = None) -> None:
        """Sleep the next wait (``at_most`` seconds at most, e.g. what is left before a
        deadline)."""
        wait = self.next()
        await trio.sleep(wait if at_most is None else max(0.0, min(wait, at_most)))
