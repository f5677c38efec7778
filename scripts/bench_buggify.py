"""What the fault points (``rallypoint/persistence/buggify.py``) cost in production, where
no simulator enabled them: ``buggify.fires(site)`` per call, next to an empty function
call and to the cheapest thing the journal does around it (a 100-byte ``os.write`` to
a file on /dev/shm, the batch-end write's system call). The journal reaches at most
two points per batch-end write (``journal.write_now.skip``, ``journal.sync.defer``)
and two per flusher round.

    PYTHONPATH=. python3 scripts/bench_buggify.py
"""

from __future__ import annotations

import os
import tempfile
import timeit

from rallypoint.persistence import buggify


def per_call_ns(stmt, n: int, **env) -> float:
    return min(timeit.repeat(stmt, globals=env, number=n, repeat=7)) / n * 1e9


def main() -> None:
    n = 1_000_000
    assert buggify._rng is None
    fires = per_call_ns("fires('journal.write_now.skip')", n, fires=buggify.fires)

    def empty(site):
        return False

    call = per_call_ns("f('journal.write_now.skip')", n, f=empty)
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    fd = os.open(os.path.join(d, "w"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        data = b"x" * 100
        write = per_call_ns("w(fd, data)", 100_000, w=os.write, fd=fd, data=data)
    finally:
        os.close(fd)
        os.unlink(os.path.join(d, "w"))
        os.rmdir(d)
    print(f"buggify.fires(), disabled:   {fires:6.1f} ns per call")
    print(f"an empty function call:      {call:6.1f} ns per call")
    print(f"os.write of 100 bytes (shm): {write:6.1f} ns per call")
    print(f"two points per batch-end write: {2 * fires / write * 100:.1f} % of one write() call")


if __name__ == "__main__":
    main()
