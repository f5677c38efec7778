#!/usr/bin/env python
"""The least a Python replay of a journal of run creations can cost, to read
``bench_snapshot.py``'s recovery figure against (issue 33).

On a data dir whose journal holds only ``ScopeCreated`` records (what
``bench_snapshot.py --dir DIR`` leaves in ``DIR/journal-only``), prints the CPU seconds of:

1. the one-pass read and check of every frame (``JournalStream``: map, length, CRC, LSN);
2. the same + msgspec's decode of every payload (the records dropped);
3. the same + per record one ``ScopeState`` kept and the three dict inserts every run
   lands in (the run table, its space's roots, the dirty ids), hand-inlined: no events,
   no counts, no function calls.

``recover_coordinator`` does all of 3 and more; the difference is what the replay's own
code costs above the floor.

Usage::

    python scripts/bench_snapshot.py --n 1000000 --dir /tmp/snap
    python scripts/bench_replay_floor.py /tmp/snap/journal-only
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="the floor of a Python replay")
    ap.add_argument("data_dir")
    args = ap.parse_args(argv)
    from rallypoint.actors.run import ScopeState
    from rallypoint.persistence.journal import JournalStream
    from rallypoint.records import ScopeCreated, _dec

    gc.disable()  # as recovery runs
    d = args.data_dir
    c = time.process_time()
    n = sum(len(b) for b in JournalStream(d, 0, cut_torn_tail=False).batches())
    print(f"{n:,} records: read + check {time.process_time() - c:.3f} s CPU")
    dec = _dec.decode
    c = time.process_time()
    for batch in JournalStream(d, 0, cut_torn_tail=False).batches():
        for p in batch:
            dec(p)
    print(f"read + check + decode {time.process_time() - c:.3f} s CPU")
    c = time.process_time()
    table: dict = {}
    roots: dict = {}
    dirty: dict = {}
    for batch in JournalStream(d, 0, cut_torn_tail=False).batches():
        for p in batch:
            for r in dec(p):
                if type(r) is not ScopeCreated:
                    raise SystemExit(f"not a journal of run creations: {type(r).__name__}")
                sid = r.id
                table[sid] = ScopeState(sid, sys.intern(r.space), r.parent_id, r.name, r.deadline_ms,
                                        r.child_limit, r.at_ms)
                roots[sid] = None
                dirty[sid] = None
    print(f"read + check + decode + state + 3 dicts (inline) {time.process_time() - c:.3f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
