#!/usr/bin/env python
"""CI performance smoke: the memory-mode lifecycle rate, as a ratio to the transport echo.

A slow or busy machine makes every figure smaller, so this compares two figures measured
in the same run, on the same machine, a few seconds apart:

* ``echo``: requests/s of the rallypoint transport ``Server`` with the echo dispatcher,
  64 requests in flight on one connection, raw pipelined client
  (``scripts/bench_transport_echo.py --client raw``);
* ``lifecycle``: lifecycles/s of ``rallypoint bench --scenario lifecycle --spawn
  --durability memory`` (1 producer, 1 worker, batches of 64, 2 in flight).

``ratio = lifecycle / echo``. It fails (exit 1) when the ratio is more than
``--max-drop`` (default 30 %) below the reference in ``scripts/perf_smoke.json``,
which holds the ratio measured on the development machine with the command that made
it. Each figure is the best of ``--rounds`` interleaved measurements (noise only ever
makes a figure smaller). ``--record`` writes the measured ratio as the new reference.

    python scripts/perf_smoke.py [--rounds 2] [--seconds 3] [--max-drop 0.30] [--record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REFERENCE = os.path.join(HERE, "perf_smoke.json")
ECHO_SCENARIO = "64 in flight, 1 conn"


def measure_echo(seconds: float) -> float:
    """Requests/s of the transport echo (64 in flight, raw client)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "echo.json")
        subprocess.run([sys.executable, os.path.join(HERE, "bench_transport_echo.py"), "--client", "raw",
                        "--seconds", str(seconds), "--json", out], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        rows = json.load(open(out))
    return float(next(r["rps"] for r in rows if r["scenario"] == ECHO_SCENARIO))


def measure_lifecycle(seconds: float) -> float:
    """Lifecycles/s of the memory-mode lifecycle scenario against a spawned daemon."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "life.json")
        p = subprocess.run([sys.executable, "-m", "rallypoint", "bench", "--scenario", "lifecycle", "--spawn",
                            "--durability", "memory", "--duration", str(seconds), "--warmup", "1",
                            "--producers", "1", "--workers", "1", "--batch", "64", "--pipeline", "2",
                            "--json", out], cwd=ROOT, capture_output=True, text=True, timeout=180)
        if not os.path.exists(out):
            raise SystemExit(f"perf smoke: the lifecycle bench wrote no report (exit {p.returncode}):\n"
                             f"{p.stderr[-2000:]}")
        r = json.load(open(out))
    if r["errors"]["total"]:
        raise SystemExit(f"perf smoke: the lifecycle bench had {r['errors']['total']} errors: {r['errors']}")
    return float(r["throughput"]["lifecycles_per_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per figure (default %(default)s)")
    ap.add_argument("--max-drop", type=float, default=0.30, help="allowed drop of the ratio (default %(default)s)")
    ap.add_argument("--record", action="store_true", help="write the measured ratio as the reference")
    a = ap.parse_args()

    echo: list[float] = []
    life: list[float] = []
    for k in range(a.rounds):
        echo.append(measure_echo(a.seconds))
        life.append(measure_lifecycle(a.seconds))
        print(f"perf smoke round {k + 1}/{a.rounds}: transport echo {echo[-1]:,.0f} req/s, "
              f"lifecycle (memory) {life[-1]:,.0f} lifecycles/s", flush=True)
    ratio = max(life) / max(echo)
    print(f"perf smoke: best lifecycle {max(life):,.0f}/s / best echo {max(echo):,.0f}/s = ratio {ratio:.4f}")

    if a.record:
        ref = {"ratio": round(ratio, 4), "echo_rps": max(echo), "lifecycles_per_s": max(life),
               "measured": dt.date.today().isoformat(), "nproc": os.cpu_count(),
               "command": f"python scripts/perf_smoke.py --rounds {a.rounds} --seconds {a.seconds:g} --record"}
        with open(REFERENCE, "w") as f:
            json.dump(ref, f, indent=2)
            f.write("\n")
        print(f"perf smoke: reference written to {os.path.relpath(REFERENCE, ROOT)}")
        return 0

    ref = json.load(open(REFERENCE))
    floor = ref["ratio"] * (1 - a.max_drop)
    verdict = "ok" if ratio >= floor else "FAIL"
    print(f"perf smoke: reference ratio {ref['ratio']:.4f} ({ref['measured']}); floor {floor:.4f} "
          f"(-{a.max_drop:.0%}); {verdict}")
    return 0 if ratio >= floor else 1


if __name__ == "__main__":
    raise SystemExit(main())
