"""Fault points in the production code (FoundationDB's ``BUGGIFY``): places where a
simulator's seed may delay or fail an operation that real hardware and schedulers
delay or fail only rarely, so that the rare paths run in every simulated campaign.

In production nothing is enabled and :func:`fires` returns False at the cost of one
global read (``scripts/bench_buggify.py`` measures it). The deterministic simulator
(:mod:`rallypoint.testing.sim`) enables it for one schedule with a seeded random
source (:func:`enable`) and disables it afterwards; the same seed then makes the same
points fire in the same order.

As in FoundationDB, a point (a *site*, named by a string) is either active or not for
the whole schedule -- decided the first time it is reached, with probability
:data:`SITE_P` -- and an active one fires with probability ``p`` each time it is
reached. So one schedule hammers a few sites instead of sprinkling faults everywhere.

A site must only ask for what the code already handles on real hardware (a write
delayed to the next round, a preallocation that failed, a sync asked for later): it
never makes a correct program incorrect.

The sites (``grep -n 'buggify.fires' rallypoint/``):

- ``journal.write_now.skip``: the batch-end write (``Journal.write_now``) is left to
  the flusher's next round;
- ``journal.round.delay``: the flusher waits a little before it takes a round (more
  records per group commit; a crash finds more appended and not written);
- ``journal.sync.defer``: a sync request is held until an answer of one in flight
  (as when :data:`~.syncer.MAX_OUTSTANDING` are in flight);
- ``journal.preallocate.fail``: a preallocation fails (the segment is then written
  without one, as after ENOSPC).

A delay is only put where the code may wait anyway and a cancellation is safe (the
flusher's wait for work), never inside a shielded section: a simulated kill must end
the node without virtual time moving.
"""

from __future__ import annotations

import random

__all__ = ["enable", "disable", "fires", "delay", "SITE_P", "fired"]

#: probability that a site is active for a whole schedule (FoundationDB's 25 %)
SITE_P = 0.25

_rng: random.Random | None = None
_active: dict[str, bool] = {}
#: site -> times it fired since :func:`enable` (for traces and tests)
fired: dict[str, int] = {}


def enable(rng: random.Random) -> None:
    """Let the fault points fire, drawn from ``rng`` (a simulator's seeded source).
    Resets which sites are active and the :data:`fired` counts."""
    global _rng
    _rng = rng
    _active.clear()
    fired.clear()


def disable() -> None:
    """Back to production: no point fires."""
    global _rng
    _rng = None
    _active.clear()


def fires(site: str, p: float = 0.25) -> bool:
    """True when the fault point ``site`` should delay or fail its operation now.
    Always False unless a simulator called :func:`enable`."""
    rng = _rng
    if rng is None:
        return False
    active = _active.get(site)
    if active is None:
        active = _active[site] = rng.random() < SITE_P
    if not active or rng.random() >= p:
        return False
    fired[site] = fired.get(site, 0) + 1
    return True


def delay() -> float:
    """A seeded delay for a site that fired, seconds (virtual time in a simulation):
    0 (a yield), 0.5 ms, 5 ms or 50 ms. 0 when not enabled."""
    rng = _rng
    if rng is None:
        return 0.0
    return rng.choice((0.0, 0.0005, 0.005, 0.05))
