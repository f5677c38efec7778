"""The bench report: machine facts, merged figures, the final table, the JSON schema."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
from importlib import metadata
from typing import Any

from .hist import merge_encoded, summarize

SCHEMA = "rallypoint-bench/1"

REQUIRED_KEYS = {
    "schema": str,
    "date": str,
    "command": str,
    "machine": dict,
    "config": dict,
    "duration_s": (int, float),
    "throughput": dict,
    "latency_ms": dict,
    "errors": dict,
    "ok": bool,
}
MACHINE_KEYS = ("cpu_count", "cpu_model", "platform", "python", "trio", "msgspec", "hdrhistogram", "rallypoint")
CONFIG_KEYS = ("scenario", "mode", "rate", "producers", "workers", "durability", "warmup_s", "url", "spawned")
THROUGHPUT_KEYS = ("ops", "ops_per_s", "lifecycles", "lifecycles_per_s", "rounds", "rounds_per_s")
LATENCY_KEYS = ("count", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "p99_9_ms", "max_ms")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    from .. import __version__

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "trio": _version("trio"),
        "msgspec": _version("msgspec"),
        "hdrhistogram": _version("hdrhistogram"),
        "rallypoint": __version__,
    }


def build_report(*, command: str, config: dict, finals: list[dict], duration: float, crashed: list[str]) -> dict:
    """Merge the per-process ``final`` payloads into the report dict."""
    hists = merge_encoded(f["hist"] for f in finals)
    ops = sum(f["ops"] for f in finals)
    lifecycles = sum(f["lifecycles"] for f in finals)
    rounds: dict[str, int] = {}
    errors: dict[str, int] = {}
    samples: list[str] = []
    for f in finals:
        for k, v in f["rounds"].items():
            rounds[k] = rounds.get(k, 0) + v
        for k, v in f["errors"].items():
            errors[k] = errors.get(k, 0) + v
        samples += f.get("error_samples", [])
    if crashed:
        errors["PROCESS_CRASHED"] = errors.get("PROCESS_CRASHED", 0) + len(crashed)
    total_errors = sum(errors.values())
    return {
        "schema": SCHEMA,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": machine_info(),
        "config": config,
        "duration_s": duration,
        "throughput": {
            "ops": ops,
            "ops_per_s": round(ops / duration, 1),
            "lifecycles": lifecycles,
            "lifecycles_per_s": round(lifecycles / duration, 1),
            # every lifecycle finished, warm-up and drain included (what a daemon's whole CPU served)
            "lifecycles_all": sum(f.get("progress", {}).get("lifecycles", 0) for f in finals),
            "rounds": rounds,
            "rounds_per_s": {k: round(v / duration, 2) for k, v in rounds.items()},
        },
        "latency_ms": {op: summarize(h) for op, h in sorted(hists.items())},
        "errors": {"total": total_errors, "by_code": errors, "samples": samples[:10]},
        "lost_deliveries": sum(f.get("lost", 0) for f in finals),
        "unfinished_lifecycles": sum(f.get("unfinished", 0) for f in finals),
        "crashed_processes": crashed,
        "ok": total_errors == 0,
    }


def validate_report(r: dict) -> list[str]:
    """Problems with a report's shape (empty when it is well formed)."""
    problems = []
    for k, typ in REQUIRED_KEYS.items():
        if k not in r:
            problems.append(f"missing {k}")
        elif not isinstance(r[k], typ):
            problems.append(f"{k} has type {type(r[k]).__name__}")
    for section, keys in (("machine", MACHINE_KEYS), ("config", CONFIG_KEYS), ("throughput", THROUGHPUT_KEYS)):
        for k in keys:
            if k not in r.get(section, {}):
                problems.append(f"missing {section}.{k}")
    for op, s in r.get("latency_ms", {}).items():
        for k in LATENCY_KEYS:
            if k not in s:
                problems.append(f"missing latency_ms.{op}.{k}")
    for k in ("total", "by_code"):
        if k not in r.get("errors", {}):
            problems.append(f"missing errors.{k}")
    return problems


def format_table(r: dict) -> str:
    c, t = r["config"], r["throughput"]
    lines = [
        f"rallypoint bench: scenario {c['scenario']} ({c['mode']} loop"
        + (f", {c['rate']:g}/s" if c.get("rate") else "")
        + f"), {c['producers']} producers, {c['workers']} workers, durability {c['durability']}, "
        f"{r['duration_s']:g} s measured after {c['warmup_s']:g} s warm-up",
        f"machine: {r['machine']['cpu_count']} CPUs, {r['machine']['cpu_model']}",
        "",
        f"throughput: {t['ops_per_s']:,.0f} requests/s, {t['lifecycles_per_s']:,.0f} lifecycles/s"
        + "".join(f", {v:,.1f} {k} rounds/s" for k, v in t["rounds_per_s"].items()),
        "",
        f"{'operation':<16}{'count':>9}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'p99.9 ms':>10}{'max ms':>10}",
    ]
    for op, s in r["latency_ms"].items():
        lines.append(
            f"{op:<16}{s['count']:>9}{s['p50_ms']:>10.2f}{s['p90_ms']:>10.2f}{s['p99_ms']:>10.2f}"
            f"{s['p99_9_ms']:>10.2f}{s['max_ms']:>10.2f}"
        )
    e = r["errors"]
    lines.append("")
    if e["total"]:
        lines.append(f"ERRORS: {e['total']} (" + ", ".join(f"{k} {v}" for k, v in sorted(e["by_code"].items())) + ")")
        for s in e.get("samples", [])[:5]:
            lines.append(f"  e.g. {s}")
    else:
        lines.append("errors: none")
    if r.get("lost_deliveries"):
        lines.append(f"deliveries cancelled by a finalized group (expected): {r['lost_deliveries']}")
    if r.get("unfinished_lifecycles"):
        lines.append(f"lifecycles without a result {10} s after the window: {r['unfinished_lifecycles']}")
    return "\n".join(lines)
