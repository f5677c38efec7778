"""Sequential HTTP requests against one daemon (one keep-alive connection): the cost of
the HTTP layer per request, with and without an Idempotency-Key.

    python3 scripts/bench_http_requests.py fsync|interval
"""
import os
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, REPO)
from sdk_compat import HttpDaemon  # noqa: E402

d = HttpDaemon(tempfile.mkdtemp(), durability=sys.argv[1] if len(sys.argv) > 1 else "fsync").start()
base = f"{d.base_url}/v1/spaces/{d.space}"
h = {"authorization": f"Bearer {d.secret}"}
c = httpx.Client(headers=h)
run = c.post(f"{base}/scopes", json={}).json()["id"]
N = 300
def bench(name, fn):
    t0 = time.perf_counter()
    for i in range(N): fn(i)
    dt = time.perf_counter() - t0
    print(f"{name:40} {N/dt:7.0f} req/s  {dt/N*1000:6.2f} ms/req")
bench("GET /scopes/{id}", lambda i: c.get(f"{base}/scopes/{run}"))
bench("POST /scopes (no idempotency key)", lambda i: c.post(f"{base}/scopes", json={"parentId": run}))
bench("POST /scopes (idempotency key)", lambda i: c.post(f"{base}/scopes", json={"parentId": run}, headers={"idempotency-key": f"k{i}"}))
d.stop()
