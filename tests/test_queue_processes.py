"""Over TCP with producer and worker PROCESSES: every task SUCCEEDED exactly once.

Workers use the blocking client (``rallypoint.sync.connect``, one of them from several
threads) and the async SDK's ``consume``; the producer uses the blocking client.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

import rallypoint.sync as rsync
from rallypoint.errors import ConflictError, LeaseLostError, ScopeCancelledError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRODUCER = textwrap.dedent(
    """
    import sys, rallypoint.sync as rsync
    url, mbx, run_id, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with rsync.connect(url) as rs:
        m = rs.mailbox(mbx)
        run = rs.scope(run_id)
        for lo in range(0, n, 50):
            ts = m.submit_many([{"x": i} for i in range(lo, min(n, lo + 50))], scope=run,
                               keys=[f"k{i}" for i in range(lo, min(n, lo + 50))])
        print("submitted", n, flush=True)
    """
)

SYNC_WORKER = textwrap.dedent(
    """
    import json, sys, threading, rallypoint.sync as rsync
    from rallypoint.errors import LeaseLostError, ScopeInactiveError
    url, mbx, run_id, name, nthreads = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    done, lock = [], threading.Lock()

    def loop(rs, tname):
        m = rs.mailbox(mbx)
        while True:
            try:
                ds = m.receive(run_id, lease_seconds=30, wait=1, max_messages=4)
            except ScopeInactiveError:
                return
            for d in ds:
                try:
                    d.complete({"worker": tname, "y": d.input["x"] * 2})
                except LeaseLostError:
                    continue
                with lock:
                    done.append(d.task_id)

    with rsync.connect(url) as rs:
        ts = [threading.Thread(target=loop, args=(rs, f"{name}.{i}")) for i in range(nthreads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    print(json.dumps(done), flush=True)
    """
)

ASYNC_WORKER = textwrap.dedent(
    """
    import json, sys, trio, rallypoint
    url, mbx, run_id, name = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]

    async def main():
        done = []

        async def handler(d):
            return {"worker": name, "y": d.input["x"] * 2}

        async with rallypoint.connect(url) as rs:
            # consume() completes in batches (complete_many) or with its next receive
            # (complete_and_next): record the accepted items
            import rallypoint.client.consume as c
            orig = c.complete_many

            async def complete_many(rs, items, **kw):
                items = list(items)
                out = await orig(rs, items, **kw)
                done.extend(d.task_id for (d, _), r in zip(items, out) if not isinstance(r, Exception))
                return out

            c.complete_many = complete_many
            # ... and the complete that rides with the next receive (delivery.complete_next)
            from rallypoint.client.api import Delivery
            orig_next = Delivery.complete_and_next

            async def complete_and_next(self, outcome=None, **kw):
                got = await orig_next(self, outcome, **kw)  # (a refused complete raises)
                done.append(self.task_id)
                return got

            Delivery.complete_and_next = complete_and_next
            stats = await rallypoint.consume(rs, mbx, run_id, handler, concurrency=3, wait=1)
        print(json.dumps(done), flush=True)

    trio.run(main)
    """
)


def _spawn(tmp_path, name: str, source: str, *args) -> subprocess.Popen:
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def test_workers_in_processes_complete_every_task_exactly_once(daemon, tmp_path):
    n = 600
    mbx = f"procs-{uuid.uuid4().hex[:8]}"
    with rsync.connect(daemon.url) as rs:
        rs.mailboxes.ensure(mbx)
        run = rs.scopes.create(name="procs")
        workers = {
            "w1": _spawn(tmp_path, "w1", SYNC_WORKER, daemon.url, mbx, run.id, "w1", 3),
            "w2": _spawn(tmp_path, "w2", SYNC_WORKER, daemon.url, mbx, run.id, "w2", 1),
            "w3": _spawn(tmp_path, "w3", ASYNC_WORKER, daemon.url, mbx, run.id, "w3"),
        }
        # every worker is waiting for work (its receive parked on the run) before any is
        # submitted, so the work is shared even on a loaded machine
        deadline = time.monotonic() + 30
        while rs.status().actors.get("runs", {}).get("waiters", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        producer = _spawn(tmp_path, "producer", PRODUCER, daemon.url, mbx, run.id, n)
        try:
            out, err = producer.communicate(timeout=30)
            assert producer.returncode == 0, err
            assert out.strip() == f"submitted {n}"
            # the producer's task ids, through the idempotent keys (same keys and inputs:
            # the existing tasks, not new ones); then wait on the server for each
            results = {}
            task_ids = []
            for lo in range(0, n, 100):
                ts = rs.mailbox(mbx).submit_many(
                    [{"x": i} for i in range(lo, lo + 100)], keys=[f"k{i}" for i in range(lo, lo + 100)], scope=run
                )
                task_ids += [t.id for t in ts]
            assert len(set(task_ids)) == n
            for tid in task_ids:
                results[tid] = rs.task(tid).result(timeout=30)
            st = run.status()
            assert st.tasks == {"SUCCEEDED": n}
            run.cancel()
            outs = {}
            for name, proc in workers.items():
                o, e = proc.communicate(timeout=30)
                assert proc.returncode == 0, f"{name}: {e}"
                outs[name] = json.loads(o.strip().splitlines()[-1])
        finally:
            for proc in [producer, *workers.values()]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    completed = [tid for done in outs.values() for tid in done]
    assert len(completed) == n and set(completed) == set(task_ids)  # each exactly once
    for name, done in outs.items():
        for tid in done:
            r = results[tid]
            assert r.state == "SUCCEEDED" and r.outcome["worker"].split(".")[0] == name
            assert r.outcome["y"] == r.input["x"] * 2
    assert sum(1 for d in outs.values() if d) >= 2  # the work was actually shared


def test_sync_client_from_threads(daemon):
    mbx = f"sync-{uuid.uuid4().hex[:8]}"
    with rsync.connect(daemon.url) as rs:
        m = rs.mailboxes.ensure(mbx, max_attempts=2)
        run = rs.scopes.create()
        again = rs.scope(run.id)  # re-attach: a blocking handle too
        assert again.status().id == run.id
        tickets = m.submit_many(list(range(40)), scope=run)
        done, errors = [], []

        def worker():
            h = rs.mailbox(mbx)
            try:
                while True:
                    d = h.receive(run, wait=0.2)
                    if d is None:
                        return
                    done.append(d.complete(d.input + 1).id)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert sorted(done) == sorted(t.id for t in tickets)
        assert [t.result(timeout=1).outcome for t in tickets] == list(range(1, 41))
        assert rs.task(tickets[0].id).status().state == "SUCCEEDED"
        with pytest.raises(ConflictError):
            m.submit(99, key="a", scope=run) and m.submit(100, key="a", scope=run)
        d = m.receive(run, wait=1)
        assert d.input == 99
        rs.task(d.task_id).cancel()
        with pytest.raises(LeaseLostError):
            d.complete("late")
        run.cancel()
        with pytest.raises(ScopeCancelledError):
            m.receive(run, wait=0)
