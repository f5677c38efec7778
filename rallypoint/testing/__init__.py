"""Testing tools: the deterministic simulator (:mod:`rallypoint.testing.sim`).

One integer seed drives simulated clients, Trio's MockClock, a fault-injecting disk
and crashes of a real node, and every step is checked against the invariants listed
in ``docs/testing.md``. ``python -m rallypoint.testing.sim --seed N --trace`` replays a
seed exactly.
"""

__all__ = ["Profile", "Result", "Violation", "generate", "run_seed", "run_seeds", "shrink"]


def __getattr__(name: str):
    # lazily, so that ``python -m rallypoint.testing.sim`` does not find the module
    # already imported by its package (runpy's RuntimeWarning)
    if name in __all__:
        from . import sim

        return getattr(sim, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
