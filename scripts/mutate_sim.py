"""Mutation check of the simulator: re-introduce deliberate bugs, one at a time, and show
that the simulator's CI run (10,000 seeds) catches each.

For every mutant in :data:`MUTANTS` this copies the ``rallypoint`` package to a
temporary directory, replaces one exact snippet of one file (the snippet must occur
exactly once: a mutant that no longer applies fails loudly instead of passing
silently), and runs seeds 0, 1, 2, ... of the simulator against the copy on two
processes until the first violation (at most ``--seeds``, default the CI budget of
10,000; then the mutant's ``pinned`` regression seeds, which CI runs too). It prints
one row per mutant -- the invariant that caught it, the first failing seed, how many
seeds ran, the wall time -- and a Markdown table for ``docs/testing.md`` with
``--markdown``.

    python3 scripts/mutate_sim.py                    # every mutant, CI budget
    python3 scripts/mutate_sim.py --only skip-fencing --seeds 2000
    python3 scripts/mutate_sim.py --markdown         # the table for docs/testing.md
    python3 scripts/mutate_sim.py --only skip-fencing --shrink 1065   # its shrunk schedule

Exit status 1 when a mutant survives the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    what: str
    #: regression seeds (``REGRESSION_SEEDS`` in tests/test_sim.py, which CI runs too)
    #: run after the budget's seeds: a bug the budget's schedules reach too rarely
    pinned: tuple[int, ...] = ()


MUTANTS = [
    Mutant(
        "reply-before-durable", "rallypoint/actors/coordinator.py",
        "        lsn = self.journal.last_lsn\n        if isinstance(reply, AtOnce)",
        "        lsn = self.journal.durable_lsn\n        if isinstance(reply, AtOnce)",
        "a reply depends only on what is already durable: it may leave before the change it shows",
    ),
    Mutant(
        "skip-wakeup-result", "rallypoint/actors/queue_tasks.py",
        "coord.notify(t.scope_id, t.id)  # result waiters (on the task's run)",
        "pass  # mutant: result waiters are not woken",
        "a task becoming terminal does not wake the waits for its result",
    ),
    Mutant(
        "skip-wakeup-receive", "rallypoint/actors/queue_deliveries.py",
        "            notify(s.id, key)\n",
        "            pass  # mutant: receivers are not woken\n",
        "a task becoming ready does not wake the receives parked on its run and ancestors",
    ),
    Mutant(
        "skip-wakeup-barrier", "rallypoint/actors/barrier.py",
        '            b.released_at_ms = r.at_ms\n            self.coord.notify(b.id, "b")',
        "            b.released_at_ms = r.at_ms",
        "a barrier's release does not wake its waiters",
        pinned=(2706,),  # past the default CI run's 400 seeds (tests/test_sim.py)
    ),
    Mutant(
        "skip-fencing", "rallypoint/actors/queue_deliveries.py",
        "if t.token != token or token <= 0:",
        "if token <= 0:",
        "settle calls do not check the fencing token",
    ),
    Mutant(
        "drop-64-branch", "rallypoint/actors/queue_deliveries.py",
        "for rid in runs.subtree(run_id):",
        "for rid in ():  # mutant",
        "a receive over more than 64 runs with ready work finds nothing (the subtree walk)",
    ),
    Mutant(
        "apply-twice", "rallypoint/actors/coordinator.py",
        "                    i += 1\n                more = self.groups.react()",
        "                    if t.__name__ in ('TaskRetried', 'LeaseExpired'):\n"
        "                        apply[t](rec)  # mutant: applied twice\n"
        "                    i += 1\n                more = self.groups.react()",
        "a retry or a lease expiry is applied twice in memory (journaled once)",
    ),
    Mutant(
        "replay-from-snapshot-lsn", "rallypoint/persistence/recovery.py",
        "JournalStream(d, snapshot_lsn)",
        "JournalStream(d, max(0, snapshot_lsn - 1))",
        "recovery replays the record at the snapshot's LSN on top of the snapshot (applied twice)",
    ),
    Mutant(
        "rearm-timer-wall", "rallypoint/actors/timer.py",
        '            if t.state == "ARMED":\n                self._arm(t)',
        '            if t.state == "ARMED":\n                self.coord.arm_wall(t.fire_at_ms, self._on_fire, t.id)',
        "after a restart timers are re-armed on the wall clock, not at their server-time due time",
        pinned=(922,),  # past the default CI run's 400 seeds (tests/test_sim.py)
    ),
    Mutant(
        "skip-leases-extended", "rallypoint/actors/coordinator.py",
        "if gap_ms > 0 and self.leases_outstanding():",
        "if False:  # mutant",
        "a restart does not give outstanding leases the downtime back (no LeasesExtended)",
    ),
    Mutant(
        "skip-stall-extension", "rallypoint/actors/coordinator.py",
        "        if self.leases_outstanding():\n            log.warning(\"event loop stalled",
        "        if False:  # mutant\n            log.warning(\"event loop stalled",
        "an event-loop stall does not extend outstanding leases",
    ),
    Mutant(
        "skip-nursery-cancel", "rallypoint/actors/run.py",
        "        coord.cancel_actor(root_id)\n",
        "        pass  # mutant: the run's nursery is not cancelled\n",
        "a run's end does not cancel its nursery (its waiters are not answered)",
    ),
    Mutant(
        "decide-twice", "rallypoint/actors/group.py",
        'if g is None or g.state == "FINALIZED":',
        "if g is None:  # mutant",
        "a FINALIZED group is evaluated again and may finalize a second time",
    ),
    Mutant(
        "snapshot-before-sync", "rallypoint/node.py",
        "            await sync(lsn)\n            if getattr(journal, \"replica_floor\", None) is not None:",
        "            await trio.lowlevel.checkpoint()  # mutant: the journal is not synced first\n"
        "            if getattr(journal, \"replica_floor\", None) is not None:",
        "a snapshot is written before the journal is synced past its LSN",
    ),
    Mutant(
        "no-fail-stop", "rallypoint/actors/coordinator.py",
        '            self._fail(exc, records)\n            raise FatalError(f"apply of {type(records[min(i, len(records) - 1)]).__name__} failed: {exc!r}") from exc',
        "            log.error('apply failed: %r', exc)\n            return self.journal.last_lsn  # mutant: goes on",
        "a failed apply is logged and the node goes on (memory ahead of the journal)",
    ),
    Mutant(
        "consume-skips", "rallypoint/actors/joinset.py",
        "JoinSetConsumed(joinset_id=js.id, index=idx, at_ms=coord.now_ms(), step=s",
        "JoinSetConsumed(joinset_id=js.id, index=idx + 1, at_ms=coord.now_ms(), step=s",
        "a join-set consume is journaled with the wrong index (replay skips a record)",
    ),
    # The primitives of issue 15 and the batch ops (one or more per primitive)
    Mutant(
        "claim-skip-fencing", "rallypoint/actors/claim.py",
        'if c.state != "HELD" or c.token != token or token <= 0:',
        'if c.state != "HELD" or token <= 0:  # mutant',
        "claim renew/release/complete do not check the lease's token",
    ),
    Mutant(
        "claim-double-holder", "rallypoint/actors/claim.py",
        '        if c is None or c.state == "FREE":\n',
        '        if c is None or c.state != "COMPLETED":  # mutant\n',
        "an acquire of a held claim takes it over (a second holder)",
    ),
    Mutant(
        "claim-acquire-ended-run", "rallypoint/actors/claim.py",
        "        check_request_id(op.request_id)\n        coord.runs.require_active(run.id)\n",
        "        check_request_id(op.request_id)\n",
        "a cancelled run's claim acquire is not refused",
    ),
    Mutant(
        "pool-over-grant", "rallypoint/actors/pool.py",
        "        if not line and self.free(pool) >= op.units:",
        "        if not line and self.free(pool) + 1 >= op.units:  # mutant",
        "a pool grants one unit more than it has free",
    ),
    Mutant(
        "pool-skip-fencing", "rallypoint/actors/pool.py",
        "        if g.token != token or token <= 0:\n            raise LeaseLostError(",
        "        if token <= 0:  # mutant\n            raise LeaseLostError(",
        "grant renew/release do not check the grant's token",
    ),
    Mutant(
        "pool-admission-leak", "rallypoint/actors/pool.py",
        '            self._end_grant(g, "RELEASED", at_ms, "delivery_ended")\n',
        '            pass  # mutant: the delivery ended, its grant stays\n',
        "admission: a task's grants are not given back when its delivery ends",
    ),
    Mutant(
        "quota-over-limit", "rallypoint/actors/quota.py",
        "            and self.used_in(q, window) + op.units <= q.units_limit",
        "            and self.used_in(q, window) + op.units <= q.units_limit + 1  # mutant",
        "a quota take is granted one unit over the window's limit",
        pinned=(1636,),  # past the default CI run's 400 seeds (tests/test_sim.py)
    ),
    Mutant(
        "quota-ignores-cooldown", "rallypoint/actors/quota.py",
        "            q.cooldown_until_mono_ms <= mono\n            and not self.waiting(q.id)",
        "            True  # mutant: no cooldown check\n            and not self.waiting(q.id)",
        "a quota take is granted during the quota's cooldown",
        pinned=(785,),  # past the default CI run's 400 seeds (tests/test_sim.py)
    ),
    Mutant(
        "budget-over-reserve", "rallypoint/actors/budget.py",
        "            if want[b.id] > self.available(b):",
        "            if want[b.id] > self.available(b) + 100:  # mutant",
        "a budget reserves up to 100 minor units more than it has available",
    ),
    Mutant(
        "results-skip-wakeup", "rallypoint/actors/queue_tasks.py",
        "                    for actor_id, key in watchers:  # waits for many tasks, maybe on another run\n"
        "                        coord.notify(actor_id, key)",
        "                    for actor_id, key in watchers:  # waits for many tasks, maybe on another run\n"
        "                        pass  # mutant: task.results waits are not woken",
        "a task becoming terminal does not wake task.results waits",
        pinned=(797,),  # past the default CI run's 400 seeds (tests/test_sim.py)
    ),
    Mutant(
        "complete-many-twice", "rallypoint/actors/queue_batches.py",
        "                if t.id in seen:",
        "                if False:  # mutant",
        "delivery.complete_many accepts the same delivery twice in one batch",
    ),
    # Mailbox default requirements (mailbox.ensure(requirements=), c7e624f)
    Mutant(
        "mailbox-defaults-dropped", "rallypoint/actors/queue_tasks.py",
        "            reqs = q.requirements  # the queue's defaults",
        "            pass  # mutant: the queue's defaults are not applied",
        "a task submitted without requirements does not get its mailbox's default requirements",
    ),
    Mutant(
        "mailbox-defaults-override", "rallypoint/actors/queue_tasks.py",
        "        if reqs is None:\n            reqs = q.requirements  # the queue's defaults",
        "        if q.requirements is not None:  # mutant\n            reqs = q.requirements  # the queue's defaults",
        "a task's own requirements are replaced by its mailbox's default requirements",
    ),
    Mutant(
        "mailbox-requirements-set-ignored", "rallypoint/actors/queue.py",
        "        q.requirements = r.requirements\n",
        "        pass  # mutant: a MailboxRequirementsSet changes nothing in memory\n",
        "a mailbox.ensure that replaces a queue's default requirements is journaled but not applied",
    ),
    Mutant(
        "joinset-requirements-dropped", "rallypoint/actors/joinset.py",
        "joinset_id=js.id, cancellable=bool(op.cancellable), requirements=op.requirements,",
        "joinset_id=js.id, cancellable=bool(op.cancellable),  # mutant: its own requirements dropped",
        "a join-set child's own requirements are dropped (it gets its mailbox's defaults, or none)",
    ),
    # One rule for a cancelled waiter (issue 28 item 5)
    Mutant(
        "cancelled-wait-times-out", "rallypoint/actors/coordinator.py",
        "        if err is not None:\n            return err\n        exc = InternalError(",
        "        if True:\n            return park.expire()  # mutant: the time-out answer\n        exc = InternalError(",
        "a wait whose run ended gets its time-out answer, not the run's code",
    ),
    # The production journal flusher under the simulator (issue 28 item 4): the
    # simulator swaps only its Disk, so the flusher's own bugs are in reach
    Mutant(
        "flusher-write-lost-after-batch-end", "rallypoint/persistence/journal.py",
        "            self._backlog.append([None, data, n])  # the flusher continues where this stopped\n",
        "            pass  # mutant: what the batch-end write did not write is lost\n",
        "what a short (or failed) batch-end write left unwritten is dropped, and the LSNs after it are synced",
    ),
    Mutant(
        "flusher-sync-answer-wrong-lsn", "rallypoint/persistence/journal.py",
        "        while out and out[0][0] <= rid:",
        "        while out and out[0][0] <= rid + 1:  # mutant",
        "a sync answer is taken for the next request's LSN too (records durable before their fsync ran)",
    ),
    Mutant(
        "found-roll-answers-cancelled", "rallypoint/persistence/journal.py",
        "        answers_scope = trio.CancelScope(shield=True)",
        "        answers_scope = trio.CancelScope(shield=False)  # mutant",
        "found bug: a cancel while a segment roll waited for its fsync took away the task reading the answer "
        "(the shutdown hung)",
    ),
    # The bugs the simulator found, re-introduced (their fixes reverted)
    # (seed 2's bug -- a failed journal write reached the embedded client as
    # JournalWriteError, not UNAVAILABLE -- has no mutant any more: main made
    # JournalWriteError itself an UNAVAILABLE RallypointError, so reverting its fix in
    # Service.wait_durable changes nothing a client sees)
    Mutant(
        "found-store-left-open", "rallypoint/node.py",
        "        try:\n            yield recovery\n        finally:\n            rec.store.close()\n",
        "        yield recovery\n        rec.store.close()  # mutant: not when the node's block raised\n",
        "found bug: a failed journal left the LMDB store open (the node could not be reopened in-process)",
    ),
    Mutant(
        "found-fail-stop-loop", "rallypoint/actors/runtime.py",
        "        if self.stopping:  # the runtime stopped (or a fail-stop): nothing starts any more\n            self._refuse(a)\n            return\n",
        "",
        "found bug: after a fail-stop an actor with queued commands was re-activated forever",
    ),
    Mutant(
        "found-closed-root-nursery", "rallypoint/actors/runtime.py",
        "                try:\n                    self.root_nursery.start_soon(a._main)\n                except RuntimeError:",
        "                self.root_nursery.start_soon(a._main)\n                if False:",
        "found bug: a command arriving as the root nursery closed got Trio's RuntimeError, not UNAVAILABLE",
    ),
    Mutant(
        "found-journal-closed-first", "rallypoint/actors/coordinator.py",
        "            with journal_scope:\n                await self.journal.run(task_status=task_status)",
        "            await self.journal.run(task_status=task_status)",
        "found bug: on shutdown the journal closed while cancelled actors still committed",
        # (a request landing as a clean stop cancels the actors; the clean-stop replay check
        # sees the commit the closed journal refused after it was applied; seed 340, also
        # tests/test_sim.py's test of that check)
        pinned=(340,),
    ),
    Mutant(
        "found-interval-never-synced", "rallypoint/persistence/journal.py",
        "                self._next_sync_at = trio.current_time() + self.interval_s\n                self._kick()",
        "                self._kick()",
        "found bug: interval durability never fsynced what a batch's end wrote (only a snapshot, a roll or the "
        "stop did)",
    ),
    Mutant(
        "found-fatal-swallowed", "rallypoint/actors/runtime.py",
        "                    if isinstance(exc, _FatalMarker.fatal_type):\n                        # a check",
        "                    if False:\n                        # a check",
        "found bug: a fail-stop inside a parked waiter's re-check was answered INTERNAL and the node went on",
        pinned=(5208,),  # past the default CI run's 400 seeds (tests/test_sim.py)
    ),
    Mutant(
        "found-timeout-before-recheck", "rallypoint/actors/runtime.py",
        "            reply = w.park.check()\n            if reply is None:\n                if self.cancelled_by(a)",
        "            reply = None  # mutant: the time limit answers first\n            if reply is None:\n"
        "                if self.cancelled_by(a)",
        "found bug: a wait's deadline answered before what fell due in the same round",
        pinned=(1183,),  # past the default CI run's 400 seeds (tests/test_sim.py)
    ),
    Mutant(
        "limits-deadline-uncounted", "rallypoint/actors/run.py",
        "        s.deadline_fired = True\n        self._unname(s)\n        if was_live:\n            self._count_ended(s)",
        "        s.deadline_fired = True\n        self._unname(s)",
        "a run's deadline does not take it (and its live subtree) out of the space's runs limit count",
    ),
    Mutant(
        "limits-not-rebuilt", "rallypoint/actors/coordinator.py",
        "        self.limits.rebuild(self)",
        "        pass  # mutant: the limits' use is not recounted after a snapshot is loaded",
        "the limits per space keep no use after a snapshot is loaded (only the journal's tail counts)",
    ),
]


def apply(mutant: Mutant, dest: str) -> None:
    shutil.copytree(os.path.join(ROOT, "rallypoint"), os.path.join(dest, "rallypoint"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(dest, mutant.path)
    with open(path) as f:
        text = f.read()
    n = text.count(mutant.old)
    if n != 1:
        raise SystemExit(f"mutant {mutant.name}: the snippet occurs {n} times in {mutant.path} (must be once)")
    with open(path, "w") as f:
        f.write(text.replace(mutant.old, mutant.new))


RUNNER = """
import json, sys
from rallypoint.testing.sim import run_seeds
seeds = list(range(int(sys.argv[1]))) + json.loads(sys.argv[4])
out = run_seeds(seeds, processes=int(sys.argv[2]), chunk=int(sys.argv[3]), stop_after=1)
print(json.dumps(out))
"""


def run(mutant: Mutant, seeds: int, processes: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as d:
        apply(mutant, d)
        env = dict(os.environ, PYTHONPATH=d, PYTHONHASHSEED="0")
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", RUNNER, str(seeds), str(processes), "10",
                              json.dumps(list(mutant.pinned))],
                             capture_output=True, text=True, env=env, cwd=d, timeout=3600)
        wall = time.perf_counter() - t0
    if out.returncode != 0:
        if "Fatal Python error" in out.stderr:
            # the simulation killed its own process (say a stack overflow): CI fails the
            # same way, without a seed to replay
            fatal = next(line for line in out.stderr.splitlines() if line.startswith("Fatal Python error"))
            return {"mutant": mutant.name, "what": mutant.what, "seeds_run": "-", "wall_s": round(wall, 1),
                    "caught": True, "seed": "-", "invariant": "process died", "message": fatal[:160], "step": None}
        raise SystemExit(f"mutant {mutant.name}: the runner failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    row = {"mutant": mutant.name, "what": mutant.what, "seeds_run": res["run"], "wall_s": round(wall, 1)}
    if res["failures"]:
        seed, inv, msg, step = res["failures"][0]
        row.update(caught=True, seed=seed, invariant=inv, message=msg.splitlines()[0][:160], step=step)
    else:
        row.update(caught=False)
    return row


SHRINKER = """
import json, sys
from rallypoint.testing.sim import generate, run_seed, shrink
seed = int(sys.argv[1])
res = run_seed(seed)
if res.ok:
    print(json.dumps(None))
else:
    keep, small = shrink(seed, res, budget_s=float(sys.argv[2]))
    steps = [s for i, s in enumerate(generate(seed)[1]) if i in keep]
    print(json.dumps({"seed": seed, "invariant": small.violation.invariant, "steps": steps,
                      "trace": small.trace}))
"""


def shrunk(mutant: Mutant, seed: int, budget_s: float = 120.0) -> dict | None:
    """The failing schedule of ``seed`` under ``mutant``, shrunk: ``{"seed", "invariant",
    "steps", "trace"}`` (the literal steps replay with ``run_seed(seed, steps=...)``)."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as d:
        apply(mutant, d)
        env = dict(os.environ, PYTHONPATH=d, PYTHONHASHSEED="0")
        out = subprocess.run([sys.executable, "-c", SHRINKER, str(seed), str(budget_s)],
                             capture_output=True, text=True, env=env, cwd=d, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"mutant {mutant.name}: the shrinker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10_000, help="budget per mutant (the CI run's)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--only", action="append", help="run only this mutant (repeatable)")
    ap.add_argument("--markdown", action="store_true", help="print the table for docs/testing.md")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--shrink", type=int, metavar="SEED",
                    help="with one --only: shrink this failing seed under the mutant and print its steps")
    args = ap.parse_args()
    if args.shrink is not None:
        (name,) = args.only or [None]
        mutant = next(m for m in MUTANTS if m.name == name)
        got = shrunk(mutant, args.shrink)
        if got is None:
            print(f"seed {args.shrink} does not fail under {name}")
            return 1
        print("\n".join(got["trace"]))
        print(f"[{got['invariant']}] seed {got['seed']}, {len(got['steps'])} steps:")
        print(repr([tuple(x) for x in got["steps"]]))
        return 0
    rows = []
    for m in MUTANTS:
        if args.only and m.name not in args.only:
            continue
        row = run(m, args.seeds, args.processes)
        rows.append(row)
        if row["caught"]:
            print(f"{m.name:32} caught by [{row['invariant']}] at seed {row['seed']} "
                  f"({row['seeds_run']} seeds run, {row['wall_s']} s): {row['message']}", flush=True)
        else:
            print(f"{m.name:32} SURVIVED {row['seeds_run']} seeds ({row['wall_s']} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        print("\n| mutant | the deliberate bug | caught by | first failing seed | seeds run | wall s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            caught = f"`{r['invariant']}`" if r["caught"] else "**survived**"
            print(f"| `{r['mutant']}` | {r['what']} | {caught} | {r.get('seed', '-')} | {r['seeds_run']} | {r['wall_s']} |")
    return 0 if all(r["caught"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
