#!/usr/bin/env python
"""Word count over the standard library (ALL_TERMINAL map, a barrier, then a merge).

The .py files of the running Python's standard library are split into chunks; each
chunk is a member of an ALL_TERMINAL group. Mapper PROCESSES count words under
``rallypoint.consume`` on the group's gate run; the coordinator accepts each member
that succeeded. When every member is finished and judged the group finalizes (and its
gate run closes, so the mappers' ``consume`` returns); each mapper then arrives at a
barrier, and once all have arrived the coordinator merges the partial counts and
prints the top words.

    python examples/wordcount.py --connect tcp://127.0.0.1:7411 [--api-key KEY]
    python examples/wordcount.py --spawn --quick
"""

from __future__ import annotations

import collections
import os
import re
import sysconfig
import time

import trio

import rallypoint
from _common import daemon, join_processes, parser, start_processes

WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
TOP_PER_CHUNK = 400  # partial results stay far below the 64 KiB payload limit


def stdlib_files(limit: int | None) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests", "__pycache__"))
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out[:limit] if limit else out


def count_words(paths: list[str]) -> dict:
    c: collections.Counter[str] = collections.Counter()
    lines = 0
    for p in paths:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        lines += text.count("\n")
        c.update(w.lower() for w in WORD.findall(text))
    return {"files": len(paths), "lines": lines, "words": sum(c.values()), "top": dict(c.most_common(TOP_PER_CHUNK))}


def mapper_process(index: int, server: dict, run_id: str, gate_id: str, barrier_id: str) -> None:
    def handler(delivery):  # a plain function: consume runs it in a worker thread
        return count_words(delivery.input["paths"])

    async def main():
        async with rallypoint.connect(**server, client_name=f"mapper-{index}") as rs:
            stats = await rallypoint.consume(rs, "wordcount", gate_id, handler, concurrency=1, lease_seconds=30)
            await rs.scope(run_id).barriers.get(barrier_id).arrive(f"mapper-{index}")
            print(f"  mapper {index}: {stats.completed} chunks, then arrived at the barrier", flush=True)

    trio.run(main)


async def coordinate(server: dict, mappers: int, chunks: int, limit: int | None) -> int:
    files = stdlib_files(limit)
    parts = [files[i::chunks] for i in range(chunks)]
    parts = [p for p in parts if p]
    root = sysconfig.get_paths()["stdlib"]
    print(f"{len(files)} files under {root}, {len(parts)} chunks, {mappers} mapper processes")
    t0 = time.monotonic()
    async with rallypoint.connect(**server, client_name="wordcount") as rs:
        run = await rs.scopes.create(name="wordcount")
        mbx = await rs.mailboxes.ensure("wordcount")
        group = await run.groups.create(mbx, "ALL_TERMINAL", expected_members=len(parts))
        barrier = await run.barriers.create(mappers)
        procs = start_processes(mapper_process, mappers, server, run.id, group.scope_id, barrier.id)
        tickets = [await group.submit({"paths": p}, key=f"chunk-{i}") for i, p in enumerate(parts)]
        results = []

        async def judge(t):
            info = await t.result(timeout=600)
            if info.state == "SUCCEEDED":
                await group.accept(t)
                results.append(info.outcome)
            else:
                await group.reject(t)

        async with trio.open_nursery() as n:
            for t in tickets:
                n.start_soon(judge, t)
        st = await group.wait(timeout=60)
        print(f"map: {st.outcome} ({st.outcome_reason}), {st.counts}")
        await barrier.wait(timeout=120)
        print(f"barrier released: all {mappers} mappers done")
        total: collections.Counter[str] = collections.Counter()
        for r in results:
            total.update(r["top"])
        await trio.to_thread.run_sync(join_processes, procs)
        await run.complete()
    files_n = sum(r["files"] for r in results)
    lines = sum(r["lines"] for r in results)
    words = sum(r["words"] for r in results)
    print(f"\nmerged {len(results)} partial counts: {files_n} files, {lines:,} lines, {words:,} words "
          f"in {time.monotonic() - t0:.2f} s")
    print("top words (each chunk reports its top " + str(TOP_PER_CHUNK) + "):")
    for w, n_ in total.most_common(15):
        print(f"  {w:<16}{n_:>10,}")
    return 0 if st.outcome == "SUCCESS" else 1


def main() -> int:
    ap = parser(__doc__.splitlines()[1])
    ap.add_argument("--mappers", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=None, help="group members (default 24; 4 with --quick)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N files (default all; 60 with --quick)")
    args = ap.parse_args()
    chunks = args.chunks or (4 if args.quick else 24)
    limit = args.limit or (60 if args.quick else None)
    with daemon(args) as server:
        return trio.run(coordinate, server, args.mappers, min(chunks, 100), limit)


if __name__ == "__main__":
    raise SystemExit(main())
