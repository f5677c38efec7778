#!/usr/bin/env python
"""Crash test: SIGKILL a real daemon at random moments; nothing acknowledged is lost,
nothing unacknowledged is half-applied (SPEC §11).

Each cycle starts ``rallypoint serve --durability fsync --data-dir D`` (every other
cycle with ``--snapshot-every-records 200`` so snapshots and journal truncation run
under the kills), starts a client *process* that creates runs and children, submits
tasks (with keys, and atomic batches), receives and completes some, cancels and
completes runs and tasks, and appends one line per acknowledged operation to a log
(written and flushed only after the reply arrived). At a random moment the harness
SIGKILLs the daemon; the client exits on UNAVAILABLE. The harness then recovers a copy
of the data dir offline and checks:

- every acknowledged operation is reflected: the run exists (with the acknowledged end
  state: CANCELLED/COMPLETED are final), the task exists with its run, key and input,
  a completed task is SUCCEEDED with the acknowledged outcome, a delivery's fencing
  token is never behind the acknowledged one, a cancelled task stays as acknowledged;
- invariants that a half-applied commit would break: no unfinished task under an
  inactive run (cancel is all-or-nothing across the subtree), children counts match
  the tree, a batch submit is all there or not at all, every task's run and mailbox
  exist, every SUCCEEDED task has its outcome.

After the last kill the daemon is started once more, every acknowledged operation is
re-checked over TCP, and it is stopped with SIGTERM (must exit 0).

Usage::

    python scripts/crash_test.py                 # 20 kills
    python scripts/crash_test.py --kills 50 --seed 7 --keep

Prints kills, operations acknowledged, verified, lost (must be 0) and invariant
violations (must be 0); exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"}
MAILBOXES = ("crash-a", "crash-b")


# =============================================================================== client
def read_log(log_path: Path) -> list[dict]:
    if not log_path.exists():
        return []
    out = []
    with open(log_path) as f:
        for line in f:
            if line.endswith("\n"):  # a line is complete only with its newline
                out.append(json.loads(line))
    return out


async def client_main(url: str, log_path: Path, seed: int) -> int:
    import trio  # noqa: F401

    import rallypoint
    from rallypoint.errors import RallypointError, UnavailableError

    rng = random.Random(seed)
    runs: list[str] = []
    tasks: list[str] = []
    for rec in read_log(log_path):
        if rec["op"] == "run":
            runs.append(rec["id"])
        elif rec["op"] == "submit":
            tasks.append(rec["task"])
        elif rec["op"] == "submit_many":
            tasks.extend(rec["tasks"])
    log = open(log_path, "a")

    def ack(**rec) -> None:
        log.write(json.dumps(rec) + "\n")
        log.flush()

    counter = [rng.randrange(1 << 30)]

    def nxt() -> int:
        counter[0] += 1
        return counter[0]

    ops = ["submit", "receive", "complete", "root", "child", "cancel", "complete_run", "cancel_task", "submit_many"]
    weights = [30, 15, 14, 4, 10, 3, 2, 5, 5]
    deliveries = []
    try:
        # reconnect=False: the harness kills the daemon and expects this client to end.
        async with rallypoint.connect(url, client_name="crash-client", reconnect=False) as rs:
            mbxs = {}
            for name in MAILBOXES:
                mbxs[name] = await rs.mailboxes.ensure(name, max_attempts=100)
                ack(op="mailbox", name=name)
            if not runs:
                run = await rs.scopes.create(name="crash-root")
                runs.append(run.id)
                ack(op="run", id=run.id, parent=None)
            print("CLIENT READY", flush=True)
            while True:
                op = rng.choices(ops, weights)[0]
                recent = runs[-40:]
                try:
                    if op == "root":
                        run = await rs.scopes.create(name="crash-root")
                        runs.append(run.id)
                        ack(op="run", id=run.id, parent=None)
                    elif op == "child":
                        parent = rng.choice(recent)
                        run = await rs.scope(parent).child(name="crash-child")
                        runs.append(run.id)
                        ack(op="run", id=run.id, parent=parent)
                    elif op == "submit":
                        run = rng.choice(recent)
                        name = rng.choice(MAILBOXES)
                        key = f"k{nxt()}" if rng.random() < 0.5 else None
                        inp = {"n": nxt()}
                        t = await mbxs[name].submit(inp, key=key, scope=run)
                        tasks.append(t.id)
                        ack(op="submit", task=t.id, run=run, key=key, input=inp, mailbox=name)
                        if key is not None and rng.random() < 0.2:  # idempotent resubmit
                            t2 = await mbxs[name].submit(inp, key=key, scope=run)
                            ack(op="resubmit", task=t2.id, same_as=t.id)
                    elif op == "submit_many":
                        run = rng.choice(recent)
                        name = rng.choice(MAILBOXES)
                        batch = nxt()
                        ts = await mbxs[name].submit_many([{"batch": batch, "i": i} for i in range(3)], scope=run)
                        tasks.extend(t.id for t in ts)
                        ack(op="submit_many", tasks=[t.id for t in ts], run=run, batch=batch)
                    elif op == "receive":
                        name = rng.choice(MAILBOXES)
                        d = await mbxs[name].receive(rng.choice(recent), lease_seconds=120, wait=0)
                        if d is not None:
                            deliveries.append(d)
                            ack(op="receive", task=d.task_id, token=d.token)
                    elif op == "complete" and deliveries:
                        d = deliveries.pop(rng.randrange(len(deliveries)))
                        outcome = {"done": d.task_id, "n": nxt()}
                        await d.complete(outcome)
                        ack(op="complete", task=d.task_id, outcome=outcome)
                    elif op == "cancel":
                        r = rng.choice(recent)
                        await rs.scope(r).cancel(reason="crash test")
                        ack(op="cancel", run=r)
                    elif op == "complete_run":
                        r = rng.choice(recent)
                        await rs.scope(r).complete()
                        ack(op="complete_run", run=r)
                    elif op == "cancel_task" and tasks:
                        tid = rng.choice(tasks[-200:])
                        info = await rs.task(tid).cancel()
                        ack(op="cancel_task", task=tid, state=info.state)
                except UnavailableError:
                    raise
                except RallypointError:
                    pass  # a refusal (run inactive, lease lost...): nothing acknowledged
    except UnavailableError:
        return 0
    except (OSError, EOFError):
        return 0
    except BaseException as e:  # noqa: BLE001 - the harness wants to know
        # A dropped connection may surface as an ExceptionGroup from the transport.
        if all(isinstance(x, (UnavailableError, OSError, EOFError)) for x in _leaves(e)):
            return 0
        raise
    finally:
        log.close()
    return 0


def _leaves(exc: BaseException):
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc


# =============================================================================== verify
def recover_copy(data_dir: Path, scratch: Path):
    """Recover a copy of ``data_dir`` offline (the daemon is dead): a full Coordinator."""
    from rallypoint.actors import Coordinator
    from rallypoint.node import recover_coordinator

    if scratch.exists():
        shutil.rmtree(scratch)
    shutil.copytree(data_dir, scratch)
    coord = Coordinator()
    rec, info = recover_coordinator(str(scratch), coord)
    rec.store.close()
    shutil.rmtree(scratch)
    return coord, info


def _decode(raw):
    return None if raw is None else msgspec.msgpack.decode(raw)


def check_acked(coord, log: list[dict]) -> list[str]:
    """Every acknowledged op against the recovered state; returns the failures."""
    bad = []
    mailbox_ids = {m.name: m.id for m in coord.queues.table.values()}
    for rec in log:
        op = rec["op"]
        if op == "mailbox":
            if rec["name"] not in mailbox_ids:
                bad.append(f"mailbox {rec['name']} lost")
        elif op == "run":
            s = coord.runs.table.get(rec["id"])
            if s is None or s.parent_id != rec["parent"]:
                bad.append(f"run {rec['id']} lost or wrong parent")
        elif op == "cancel":
            s = coord.runs.table.get(rec["run"])
            if s is None or s.state != "CANCELLED":
                bad.append(f"cancel of run {rec['run']} lost ({s and s.state})")
        elif op == "complete_run":
            s = coord.runs.table.get(rec["run"])
            if s is None or s.state != "COMPLETED":
                bad.append(f"complete of run {rec['run']} lost ({s and s.state})")
        elif op == "submit":
            t = coord.queues.tasks.get(rec["task"])
            if t is None:
                bad.append(f"submitted task {rec['task']} lost")
            elif (t.scope_id != rec["run"] or t.key != rec["key"] or _decode(t.input) != rec["input"]
                  or t.mailbox_id != mailbox_ids.get(rec["mailbox"])):
                bad.append(f"task {rec['task']} differs from its acknowledged submit")
        elif op == "resubmit":
            if rec["task"] != rec["same_as"] or rec["task"] not in coord.queues.tasks:
                bad.append(f"idempotent resubmit {rec} broken")
        elif op == "submit_many":
            for tid in rec["tasks"]:
                if tid not in coord.queues.tasks:
                    bad.append(f"batch task {tid} lost")
        elif op == "receive":
            t = coord.queues.tasks.get(rec["task"])
            if t is None or t.token < rec["token"]:
                bad.append(f"delivery of {rec['task']} (token {rec['token']}) lost ({t and t.token})")
        elif op == "complete":
            t = coord.queues.tasks.get(rec["task"])
            if t is None or t.state != "SUCCEEDED" or _decode(t.outcome) != rec["outcome"]:
                bad.append(f"completion of {rec['task']} lost ({t and t.state})")
        elif op == "cancel_task":
            t = coord.queues.tasks.get(rec["task"])
            if t is None or t.state != rec["state"]:
                bad.append(f"cancel of task {rec['task']} lost ({t and t.state}, acknowledged {rec['state']})")
        else:
            bad.append(f"unknown op in log: {rec}")
    return bad


def check_invariants(coord) -> list[str]:
    """What a half-applied commit would break."""
    bad = []
    scopes, tasks = coord.runs.table, coord.queues.tasks
    children: dict[str, int] = {}
    for s in scopes.values():
        if s.parent_id is not None:
            if s.parent_id not in scopes:
                bad.append(f"run {s.id}: parent {s.parent_id} missing")
            children[s.parent_id] = children.get(s.parent_id, 0) + 1
    for s in scopes.values():
        if s.children != children.get(s.id, 0):
            bad.append(f"run {s.id}: children {s.children} but {children.get(s.id, 0)} in the tree")

    def inactive_ancestor(sid):
        s = scopes.get(sid)
        while s is not None:
            if s.state != "ACTIVE" or s.deadline_fired:
                return s
            s = scopes.get(s.parent_id) if s.parent_id else None
        return None

    batches: dict[int, int] = {}
    mbx_ids = set(coord.queues.table)
    for t in tasks.values():
        if t.scope_id not in scopes:
            bad.append(f"task {t.id}: run {t.scope_id} missing")
            continue
        if t.mailbox_id not in mbx_ids:
            bad.append(f"task {t.id}: mailbox {t.mailbox_id} missing")
        if t.state not in TERMINAL:
            a = inactive_ancestor(t.scope_id)
            if a is not None:
                bad.append(f"task {t.id} is {t.state} under inactive run {a.id} ({a.state})")
        else:
            if t.finished_at_ms is None:
                bad.append(f"task {t.id} is {t.state} without finished_at")
        if t.state == "SUCCEEDED" and t.outcome is None:
            bad.append(f"task {t.id} SUCCEEDED without an outcome")
        if t.state == "RUNNING" and t.token < 1:
            bad.append(f"task {t.id} RUNNING without a token")
        inp = _decode(t.input)
        if isinstance(inp, dict) and "batch" in inp:
            batches[inp["batch"]] = batches.get(inp["batch"], 0) + 1
    for b, n in batches.items():
        if n != 3:
            bad.append(f"batch {b} half applied: {n} of 3 tasks")
    return bad


async def check_online(url: str, log: list[dict]) -> list[str]:
    """The acknowledged ops again, through a restarted daemon's API."""
    import rallypoint

    bad = []
    async with rallypoint.connect(url) as rs:
        final_run: dict[str, str] = {}
        for rec in log:
            if rec["op"] == "cancel":
                final_run[rec["run"]] = "CANCELLED"
            elif rec["op"] == "complete_run":
                final_run[rec["run"]] = "COMPLETED"
        completed = {rec["task"]: rec["outcome"] for rec in log if rec["op"] == "complete"}
        for rec in log:
            try:
                if rec["op"] == "run":
                    st = await rs.scope(rec["id"]).status()
                    want = final_run.get(rec["id"])
                    if st.parent_id != rec["parent"] or (want and st.stored_state != want):
                        bad.append(f"online: run {rec['id']} is {st.stored_state}")
                elif rec["op"] == "submit":
                    info = await rs.task(rec["task"]).status()
                    if info.scope_id != rec["run"] or info.input != rec["input"]:
                        bad.append(f"online: task {rec['task']} differs")
                    if rec["task"] in completed and (
                        info.state != "SUCCEEDED" or info.outcome != completed[rec["task"]]
                    ):
                        bad.append(f"online: task {rec['task']} lost its outcome ({info.state})")
            except Exception as e:  # noqa: BLE001
                bad.append(f"online: {rec} -> {type(e).__name__}: {e}")
    return bad


# =============================================================================== harness
class DaemonProc:
    def __init__(self, data_dir: Path, log_file: Path, extra: list[str]) -> None:
        self.data_dir, self.log_file, self.extra = data_dir, log_file, extra
        self.proc = None
        self.url = None

    def start(self, timeout: float = 30) -> "DaemonProc":
        self._err = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", "fsync",
             "--data-dir", str(self.data_dir), *self.extra],
            stdout=subprocess.PIPE, stderr=self._err, text=True, cwd=ROOT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY "):
                self.url = line.split()[1]
                return self
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"daemon did not start (exit {self.proc.poll()}); see {self.log_file}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._close()

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._close()
        return rc

    def _close(self) -> None:
        self.proc.stdout.close()
        self._err.close()


def run_crash_test(
    kills: int = 20,
    *,
    seed: int | None = None,
    workdir: Path | None = None,
    min_run_s: float = 0.1,
    max_run_s: float = 1.5,
    snapshot_every_records: int = 200,
    daemon_args: tuple[str, ...] = (),
    out=print,
) -> dict:
    """Run ``kills`` kill/restart cycles; returns the figures (see module doc).
    ``daemon_args``: more ``rallypoint serve`` options for every start (say
    ``("--sync-helper", "inline")``)."""
    import trio

    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    own_tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="rallypoint-crash-")) if own_tmp else Path(workdir)
    data_dir, log_path, scratch = workdir / "data", workdir / "acked.log", workdir / "scratch"
    out(f"crash test: {kills} kills, seed {seed}, work dir {workdir}")
    result = {"seed": seed, "kills": 0, "acknowledged": 0, "verified": 0, "lost": 0, "violations": 0,
              "snapshots_seen": 0, "torn_tails": 0, "zero_tails": 0, "workdir": str(workdir), "problems": []}
    t_start = time.monotonic()
    for cycle in range(kills):
        extra = (["--snapshot-every-records", str(snapshot_every_records)] if cycle % 2 else []) + list(daemon_args)
        daemon = DaemonProc(data_dir, workdir / "daemon.log", extra).start()
        client = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "client", daemon.url, str(log_path), str(seed * 1000 + cycle)],
            stdout=subprocess.PIPE, stderr=open(workdir / "client.log", "ab"), text=True, cwd=ROOT,
        )
        line = client.stdout.readline()
        if not line.startswith("CLIENT READY"):
            daemon.kill()
            raise RuntimeError(f"client did not start: {line!r}; see {workdir / 'client.log'}")
        time.sleep(rng.uniform(min_run_s, max_run_s))
        daemon.kill()
        result["kills"] += 1
        try:
            rc = client.wait(60)
        except subprocess.TimeoutExpired:
            client.kill()
            rc = client.wait()
        client.stdout.close()
        if rc != 0:
            result["problems"].append(f"cycle {cycle}: client exited {rc}; see {workdir / 'client.log'}")
        log = read_log(log_path)
        coord, info = recover_copy(data_dir, scratch)
        lost = check_acked(coord, log)
        viol = check_invariants(coord)
        if info["snapshot_lsn"]:
            result["snapshots_seen"] += 1
        from rallypoint.persistence.journal import ZERO_TAIL

        torn = info["torn_tail"]
        zero = torn is not None and torn.reason == ZERO_TAIL  # the journal's preallocated zeros
        if torn is not None:
            result["zero_tails" if zero else "torn_tails"] += 1
        result["problems"] += [f"cycle {cycle}: {p}" for p in lost + viol]
        out(
            f"kill {cycle + 1:3d}: {len(log):6d} ops acknowledged, {len(lost)} lost, {len(viol)} violations; "
            f"recovered {coord.entity_count()} entities (snapshot LSN {info['snapshot_lsn']}, "
            f"{info['replayed']} replayed{', zero tail cut' if zero else ', torn tail cut' if torn else ''})"
        )
    # Final: the daemon itself recovers, every acknowledged op is checked over TCP.
    daemon = DaemonProc(data_dir, workdir / "daemon.log", []).start()
    log = read_log(log_path)
    try:
        online = trio.run(check_online, daemon.url, log)
    finally:
        rc = daemon.terminate()
    if rc != 0:
        result["problems"].append(f"final daemon exited {rc} on SIGTERM")
    coord, _ = recover_copy(data_dir, scratch)
    lost = check_acked(coord, log)
    viol = check_invariants(coord)
    result["problems"] += [f"final: {p}" for p in online + lost + viol]
    result["acknowledged"] = len(log)
    result["lost"] = len(lost) + len(online)
    result["verified"] = len(log) - len(lost)
    result["violations"] = len(viol)
    result["seconds"] = round(time.monotonic() - t_start, 1)
    if any(p.startswith("cycle") for p in result["problems"]):
        result["lost"] += sum(1 for p in result["problems"] if "lost" in p and p.startswith("cycle"))
        result["violations"] += sum(1 for p in result["problems"] if p.startswith("cycle") and "lost" not in p)
    out(
        f"kills {result['kills']}, operations acknowledged {result['acknowledged']}, "
        f"verified {result['verified']}, lost {result['lost']}, invariant violations {result['violations']} "
        f"({result['snapshots_seen']} recoveries from a snapshot, {result['torn_tails']} torn tails and "
        f"{result['zero_tails']} preallocated zero tails cut, "
        f"{result['seconds']} s)"
    )
    for p in result["problems"][:20]:
        out("  PROBLEM " + p)
    if own_tmp and not result["problems"]:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "client":
        import trio

        url, log_path, seed = argv[1], Path(argv[2]), int(argv[3])
        return trio.run(client_main, url, log_path, seed)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--workdir", default=None, help="keep everything here (default: a temp dir, removed on success)")
    ap.add_argument("--min-run-s", type=float, default=0.1)
    ap.add_argument("--max-run-s", type=float, default=1.5)
    ap.add_argument("--snapshot-every-records", type=int, default=200)
    ap.add_argument("--sync-helper", choices=["process", "thread", "inline"], default=None,
                    help="the daemon's --sync-helper (default: its own default, process)")
    args = ap.parse_args(argv)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    res = run_crash_test(
        args.kills, seed=args.seed, workdir=args.workdir, min_run_s=args.min_run_s, max_run_s=args.max_run_s,
        snapshot_every_records=args.snapshot_every_records,
        daemon_args=("--sync-helper", args.sync_helper) if args.sync_helper else (),
    )
    return 0 if not res["problems"] and res["lost"] == 0 and res["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
