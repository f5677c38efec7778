"""Ctrl-C (SIGINT) of a ``consume()`` worker process (issue 31 item 4), for the async
loop (``rallypoint.consume`` under ``trio.run``) and the blocking one
(``rallypoint.sync.consume``), each a real worker subprocess against a real daemon.

The first Ctrl-C stops taking work, lets a running handler finish (its outcome is
recorded), gives back what is still running after ``drain_timeout`` without counting an
attempt (``delivery.release``), and exits 0 with one line on stderr (no traceback);
the second exits at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import rallypoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    url, mailbox, run_id, marker, mode, drain = sys.argv[1:7]
    # Ctrl-C as in a terminal, however the suite was started: a process started in the
    # background by a non-interactive shell (`cmd &`, nohup) inherits SIGINT ignored,
    # and Python then leaves it ignored (the second SIGINT did nothing: a 30 s time-out)
    signal.signal(signal.SIGINT, signal.SIG_IGN if os.environ.get("SIGINT_IGNORED") else signal.default_int_handler)

    def say(line):  # one write: lines from two handler threads never interleave
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

    if mode == "async":
        import trio, rallypoint

        async def handler(d):
            say(f"HOLDING {d.input}")
            while not (d.input == "finish" and os.path.exists(marker)):
                await trio.sleep(0.02)
            return {"finished": d.input}

        async def main():
            async with rallypoint.connect(url) as rs:
                return await rallypoint.consume(rs, mailbox, run_id, handler, concurrency=2,
                                                lease_seconds=30, drain_timeout=float(drain))

        stats = trio.run(main)
    else:
        import rallypoint.sync

        def handler(d):
            say(f"HOLDING {d.input}")
            while not (d.input == "finish" and os.path.exists(marker)):
                time.sleep(0.02)
            return {"finished": d.input}

        with rallypoint.sync.connect(url) as rs:
            stats = rallypoint.sync.consume(rs, mailbox, run_id, handler, concurrency=2, lease_seconds=30,
                                            drain_timeout=float(drain))
    print(json.dumps({k: getattr(stats, k) for k in
                      ("received", "completed", "retried", "released", "lost", "stop_reason")}), flush=True)
    """
)


class Worker:
    """The worker subprocess; stdout and stderr read by threads into lists (so the test
    can wait for a line without blocking on a pipe)."""

    def __init__(self, *args: str, sigint_ignored: bool = False) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("SIGINT_IGNORED", None)
        if sigint_ignored:
            env["SIGINT_IGNORED"] = "1"
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(s, l), daemon=True)
                         for s, l in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, lines: list[str], pred, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not pred(lines):
            if self.proc.poll() is not None:
                time.sleep(0.1)  # (let the pumps finish)
                if pred(lines):
                    return
                pytest.fail(f"the worker exited {self.proc.returncode} before {what}:\n"
                            + "\n".join(self.out + self.err))
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n" + "\n".join(self.out + self.err)
            time.sleep(0.02)

    def finish(self, timeout: float = 60) -> int:
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(10)
        return rc


def _setup(daemon, tag: str, inputs: list[str]):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create(name=f"interrupt-{tag}")
        name = f"interrupt-{tag}-{time.monotonic_ns()}"
        m = rs.mailboxes.ensure(name, max_attempts=3)
        ids = [m.submit(x, scope=run).id for x in inputs]
    return run.id, name, ids


def _tasks(daemon, ids):
    with rallypoint.sync.connect(daemon.url) as rs:
        out = []
        for tid in ids:
            st = rs.task(tid).status()
            out.append((st.state, st.attempt))
        events = [e for e in rs.events.list(limit=10_000).events if e.id in ids]
    return out, events


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_first_ctrl_c_finishes_what_runs_gives_back_the_rest_and_exits_cleanly(daemon, tmp_path, mode):
    # Given a worker (concurrency 2) running two handlers -- one that will finish, one
    # stuck -- and a third task still queued, when it gets SIGINT, then it takes no new
    # work, the finishing handler's outcome is recorded (SUCCEEDED, attempt 1), the stuck
    # one is given back after drain_timeout uncounted (QUEUED, attempt 1, task.released),
    # the queued task was never delivered, and the worker exits 0 with exactly one line
    # on stderr and no traceback.
    run_id, mailbox, (finish, stuck, later) = _setup(daemon, mode, ["finish", "stuck", "later"])
    marker = str(tmp_path / "finish-now")
    w = Worker(daemon.url, mailbox, run_id, marker, mode, "8")
    w.wait_for(w.out, lambda ls: sum(ln.startswith("HOLDING") for ln in ls) == 2, "two running handlers")
    assert sorted(ln.split()[1] for ln in w.out if ln.startswith("HOLDING")) == ["finish", "stuck"]
    w.proc.send_signal(signal.SIGINT)
    w.wait_for(w.err, lambda ls: any("SIGINT" in ln for ln in ls), "the interrupt's line")
    open(marker, "w").close()  # the running handler may finish now
    rc = w.finish()
    assert rc == 0, "\n".join(w.out + w.err)
    assert len(w.err) == 1 and "Traceback" not in w.err[0], w.err
    assert "stopping" in w.err[0] and "again to exit now" in w.err[0], w.err
    stats = json.loads(w.out[-1])
    assert stats == {"received": 2, "completed": 1, "retried": 0, "released": 1, "lost": 0,
                     "stop_reason": "SIGINT"}, stats
    states, events = _tasks(daemon, [finish, stuck, later])
    assert states == [("SUCCEEDED", 1), ("QUEUED", 1), ("QUEUED", 1)], states
    assert [e.type for e in events if e.id == stuck][-1] == "task.released"
    assert not [e for e in events if e.id == later and e.type == "task.delivered"]
    # the given-back task is delivered again as attempt 1: that attempt did not count
    with rallypoint.sync.connect(daemon.url) as rs:
        got = rs.mailbox(mailbox).receive(run_id, wait=5, max_messages=2)
        assert sorted((d.task_id == stuck, d.attempt) for d in got) == [(False, 1), (True, 1)]
        rs.scope(run_id).cancel()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_second_ctrl_c_exits_at_once(daemon, tmp_path, mode):
    # Given a worker draining after a first SIGINT (its handler is stuck and the drain
    # would wait 600 s), when a second SIGINT comes, then it exits at once with
    # KeyboardInterrupt -- not wrapped in an ExceptionGroup.
    run_id, mailbox, _ = _setup(daemon, f"twice-{mode}", ["stuck"])
    w = Worker(daemon.url, mailbox, run_id, str(tmp_path / "never"), mode, "600")
    w.wait_for(w.out, lambda ls: any(ln.startswith("HOLDING") for ln in ls), "a running handler")
    w.proc.send_signal(signal.SIGINT)
    w.wait_for(w.err, lambda ls: any("SIGINT" in ln for ln in ls), "the interrupt's line")
    w.proc.send_signal(signal.SIGINT)
    rc = w.finish(timeout=30)
    text = "\n".join(w.err)
    assert rc != 0 and "KeyboardInterrupt" in text, text
    assert "ExceptionGroup" not in text, text
    with rallypoint.sync.connect(daemon.url) as rs:
        rs.scope(run_id).cancel()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_worker_started_with_sigint_ignored_leaves_ctrl_c_alone_and_drains_on_sigterm(daemon, tmp_path, mode):
    # issue 42: a worker a script started in the background (`worker.py &`: SIGINT
    # ignored) drained on the first Ctrl-C and then ignored the second. The shell's
    # intent holds now: Ctrl-C is not for it, twice; SIGTERM drains it as always.
    run_id, mailbox, ids = _setup(daemon, f"ignored-{mode}", ["finish"])
    marker = tmp_path / "go"
    w = Worker(daemon.url, mailbox, run_id, str(marker), mode, "600", sigint_ignored=True)
    w.wait_for(w.out, lambda ls: any(ln.startswith("HOLDING") for ln in ls), "a running handler")
    w.proc.send_signal(signal.SIGINT)
    w.proc.send_signal(signal.SIGINT)
    # the SIGINTs are delivered (the process has them ignored) before the SIGTERM is
    w.proc.send_signal(signal.SIGTERM)
    w.wait_for(w.err, lambda ls: any("SIGTERM" in ln for ln in ls), "the SIGTERM's drain line")
    assert not any("SIGINT" in ln for ln in w.err), w.err
    marker.write_text("1")  # the running handler may finish: the drain records it
    rc = w.finish(timeout=60)
    assert rc == 0, "\n".join(w.out + w.err)
    stats = json.loads(w.out[-1])
    assert stats["stop_reason"] == "SIGTERM" and stats["completed"] == 1, stats
    (state,), _ = _tasks(daemon, ids)
    assert state == ("SUCCEEDED", 1), state
