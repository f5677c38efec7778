"""Open-loop arrival scheduling (no coordinated omission).

With ``--rate R`` the k-th arrival of the whole run is *intended* at ``t0 + k / R``,
whatever happened before: a send that is late does not push later ones back. Arrivals
are dealt round-robin to producers (producer ``i`` of ``n`` owns k = i, i+n, i+2n, …),
so together they keep the rate. Latency is measured from the intended time, so time a
request spent waiting to be sent (because the client or server was slow) counts.
"""

from __future__ import annotations


class OpenLoopSchedule:
    def __init__(self, rate: float, t0: float, index: int = 0, count: int = 1) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        if not 0 <= index < count:
            raise ValueError("index must be in [0, count)")
        self.rate = float(rate)
        self.t0 = t0
        self.index = index
        self.count = count
        self._j = 0  # arrivals of this producer handed out so far

    def intended(self, j: int) -> float:
        """Intended time of this producer's j-th arrival (global k = index + j*count)."""
        return self.t0 + (self.index + j * self.count) / self.rate

    def next_time(self) -> float:
        """When the next not-yet-taken arrival is due."""
        return self.intended(self._j)

    def due(self, now: float, limit: int | None = None) -> list[float]:
        """Take every arrival intended at or before ``now`` (at most ``limit``);
        returns their intended times. A caller that is late gets them all at once."""
        out: list[float] = []
        while (limit is None or len(out) < limit) and self.intended(self._j) <= now:
            out.append(self.intended(self._j))
            self._j += 1
        return out

    @property
    def taken(self) -> int:
        return self._j
