"""What scripts/soak_http.py and scripts/soak_hostile.py share: the probes' samples (p50,
p99, max; the p99 of a phase against the idle one) and the holders' plumbing (a process
with every descriptor it may have, a connection from a given source address, many
connections held at once for a while)."""

from __future__ import annotations

import collections
import resource
import time
from typing import Awaitable, Callable

import trio


class ProbeSamples:
    """Round-trip samples per probe name (seconds), the idle p99 of each, and the p99
    of each phase as a multiple of it (issue 41 asks within 2x).

    A phase's first ``ramp_s`` seconds (from :meth:`mark`: the attackers' processes
    starting and opening their connections, 50 every 10 ms) are summarized apart, as
    ``ramp``: what the ratio judges is the attack held; the ramp's worst is printed
    beside it, never dropped."""

    def __init__(self, *names: str, ramp_s: float = 0.0) -> None:
        self.names = names
        self.ramp_s = ramp_s
        #: (when it began, perf_counter seconds; the round trip, seconds) per name
        self.stamps: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        self._mark = time.perf_counter()  # the start of the phase being sampled
        self.failures: collections.Counter = collections.Counter()
        self.idle: dict[str, float] = {}  # the p99 of each probe alone, seconds
        self.ratios: dict[str, dict[str, float]] = {}  # phase -> probe -> p99 / idle p99
        self.ramps: dict[str, dict[str, float]] = {}  # phase -> probe -> max in the ramp, seconds

    def sample(self, name: str, t0: float) -> None:
        """One round trip of probe ``name`` that began at ``t0`` (perf_counter) ended now."""
        self.stamps[name].append((t0, time.perf_counter() - t0))

    def mark(self) -> None:
        """A phase starts now (its ramp is the next ``ramp_s`` seconds)."""
        self._mark = time.perf_counter()

    @staticmethod
    def _summary(xs: list[float]) -> tuple[str, float]:
        xs = sorted(xs)
        p = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
        return (f"n={len(xs)} p50={p(0.5) * 1e3:.1f} p99={p(0.99) * 1e3:.1f} max={xs[-1] * 1e3:.1f} ms",
                p(0.99))

    def take(self, phase: str | None = None, idle: bool = False) -> str:
        """The samples since the last take, summarized (and dropped); ``idle``: they are
        the baseline (no ramp); ``phase``: record their p99 (past the ramp) against it
        under that name."""
        parts = []
        ramp_end = self._mark + (self.ramp_s if phase is not None else 0.0)
        for name in self.names:
            stamps, self.stamps[name] = self.stamps[name], []
            ramp = [lat for t0, lat in stamps if t0 < ramp_end]
            held = [lat for t0, lat in stamps if t0 >= ramp_end]
            if not held:
                parts.append(f"{name}: no round trip")
                continue
            text, p99 = self._summary(held)
            text = f"{name} {text}"
            worst = sorted(((lat, t0) for t0, lat in stamps if t0 >= ramp_end), reverse=True)[:3]
            text += " (worst " + ", ".join(f"{lat * 1e3:.0f} ms at +{t0 - self._mark:.1f} s" for lat, t0 in worst) + ")"
            if idle:
                self.idle[name] = p99
            elif phase is not None and self.idle.get(name):
                ratio = p99 / self.idle[name]
                self.ratios.setdefault(phase, {})[name] = ratio
                text += f" (p99 {ratio:.2f}x idle)"
            if ramp and phase is not None:
                self.ramps.setdefault(phase, {})[name] = max(ramp)
                text += f" [ramp {self.ramp_s:g} s: n={len(ramp)} max={max(ramp) * 1e3:.0f} ms]"
            parts.append(text)
        return "; ".join(parts)


def raise_nofile() -> None:
    """This process may hold as many descriptors as its hard limit allows."""
    try:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


def sources(kind: str, proc: int) -> list[str]:
    """The loopback source addresses of a holder process: one (127.0.0.9) for the
    ``perpeer`` phase, else eight of the process's own (127.0.P.2-9)."""
    return ["127.0.0.9"] if kind == "perpeer" else [f"127.0.{proc + 1}.{i}" for i in range(2, 10)]


async def connect_from(src: str, port: int, got: collections.Counter) -> trio.SocketStream | None:
    """A TCP connection from ``src`` to 127.0.0.1:``port`` (None when it failed: counted
    in ``got``, after a short pause)."""
    s = trio.socket.socket()
    try:
        await s.bind((src, 0))
        await s.connect(("127.0.0.1", port))
    except OSError as e:
        s.close()
        got[f"connect failed: {e.__class__.__name__}"] += 1
        await trio.sleep(0.5)
        return None
    got["connections"] += 1
    return trio.SocketStream(s)


def hold(one: Callable[[int], Awaitable[None]], holders: int, seconds: float) -> None:
    """Run ``one(i)`` for ``holders`` connections at once (started 50 at a time) for
    ``seconds``, in a Trio run of this process."""

    async def main() -> None:
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as n:
                for i in range(holders):
                    n.start_soon(one, i)
                    if i % 50 == 49:
                        await trio.sleep(0.01)

    trio.run(main)
