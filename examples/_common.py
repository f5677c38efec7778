"""Shared bits of the examples: ``--connect URL [--api-key KEY] [--tls-ca CA]`` or
``--spawn``, and worker processes."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import sys
from typing import Iterator

DEFAULT_URL = os.environ.get("RALLYPOINT_URL", "tcp://127.0.0.1:7411")
DEFAULT_KEY = os.environ.get("RALLYPOINT_API_KEY")


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--connect", default=DEFAULT_URL, help="daemon URL (default %(default)s)")
    g.add_argument("--spawn", action="store_true", help="start an in-memory daemon for this run, stop it after")
    ap.add_argument("--api-key", default=DEFAULT_KEY,
                    help="API key, for a daemon with keys (default $RALLYPOINT_API_KEY)")
    ap.add_argument("--tls-ca", default=None, help="CA file to verify a tls:// daemon")
    ap.add_argument("--quick", action="store_true", help="small sizes (for tests)")
    return ap


@contextlib.contextmanager
def daemon(args) -> Iterator[dict]:
    """How to reach the daemon: the keyword arguments of ``rallypoint.connect``
    (``url``, ``api_key``, ``tls_ca``), passed as they are to the worker processes."""
    if not args.spawn:
        yield {"url": args.connect, "api_key": args.api_key, "tls_ca": args.tls_ca}
        return
    from rallypoint.loadtest.runner import SpawnedDaemon

    d = SpawnedDaemon("memory")
    url = d.start()
    print(f"(spawned an in-memory daemon at {url})", flush=True)
    try:
        yield {"url": url, "api_key": None, "tls_ca": None}
    finally:
        d.stop()


def start_processes(target, n: int, *args) -> list:
    """Start ``n`` processes (spawn) running ``target(i, *args)``."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(i, *args), daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    return procs


def join_processes(procs, timeout: float = 30.0) -> None:
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            print(f"warning: {p.name} did not stop; terminating it", file=sys.stderr)
            p.terminate()
            p.join()


def mp_context():
    return mp.get_context("spawn")
