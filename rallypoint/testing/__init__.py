"""Testing tools: the deterministic simulator (:mod:`rallypoint.testing.sim`).

One integer seed drives simulated clients, Trio's MockClock, a fault-injecting disk
and crashes of a real node, and every step is checked against the invariants listed
in ``docs/testing.md``. ``python -m rallypoint.testing.sim --seed N --trace`` replays a
seed exactly.
"""

from .sim import Profile, Result, Violation, generate, run_seed, run_seeds, shrink

__all__ = ["Profile", "Result", "Violation", "generate", "run_seed", "run_seeds", "shrink"]
