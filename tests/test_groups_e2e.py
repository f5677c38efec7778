"""Task groups end to end over TCP: the seed's example with worker PROCESSES, and the
decision surviving a daemon restart (``--durability fsync --data-dir``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import trio

import rallypoint

from _groups_util import decision, in_, submit_n, take, uniq

from conftest import Daemon

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent(
    """
    import sys
    import trio
    import rallypoint

    def score(draft):
        return (draft * 7) % 10

    async def main(url, mailbox, scope):
        async with rallypoint.connect(url) as rs:
            async def handler(d):
                await trio.sleep(0.2)  # "scoring" takes a while
                return {"draft": d.input["draft"], "score": score(d.input["draft"])}

            stats = await rallypoint.consume(rs, mailbox, scope, handler, lease_seconds=10, wait=10)
            print(f"STOPPED {stats.stop_reason} completed={stats.completed} lost={stats.lost}", flush=True)

    trio.run(main, *sys.argv[1:])
    """
)


def good(outcome) -> bool:
    return outcome["score"] >= 5


async def test_seed_example_twelve_drafts_three_worker_processes(daemon, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    async with rallypoint.connect(daemon.url) as rs:
        mailbox = uniq("reviews")
        await rs.mailboxes.ensure(mailbox, mode="WORK")
        run = await rs.scopes.create()
        group = await run.groups.create(mailbox, "N_ACCEPTED", threshold=5, parent_scope_id=run.id)
        tickets = [await group.submit({"draft": i}, key=f"draft-{i}") for i in range(12)]
        assert decision(await group.close()) == ("SEALED", None, None)
        gate = (await group.status()).scope_id
        workers = [
            subprocess.Popen(
                [sys.executable, str(script), daemon.url, mailbox, gate],
                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                # a script's sys.path starts at its own folder: this checkout's package
                env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
            )
            for _ in range(3)
        ]
        try:
            # the reviewer: judge each finished member in order, accept the good ones
            with trio.fail_after(30):
                for ticket in tickets:
                    result = await ticket.result(timeout=30)
                    if result.state != "SUCCEEDED" or not good(result.outcome):
                        continue
                    verdict = await group.accept(ticket)
                    if verdict.group_state == "FINALIZED":
                        break
                final = await group.wait(timeout=30)
            assert decision(final) == ("FINALIZED", "SUCCESS", "threshold_reached")
            accepted = [m for m in final.members if m.verdict == "ACCEPTED"]
            assert len(accepted) == 5 and not any(m.late for m in accepted)
            states = [m.task_state for m in final.members]
            assert set(states) <= {"SUCCEEDED", "CANCELLED"} and "CANCELLED" in states
            # the members not finished when the decision came are CANCELLED, the last
            # draft among them (drafts are handed out in order)
            assert final.members[-1].task_state == "CANCELLED"
            # a verdict sent afterwards is recorded late and changes nothing
            bad = next(m for m in final.members if m.task_state == "SUCCEEDED" and m.verdict is None)
            late = await group.reject(bad.task_id)
            assert late.late and (late.outcome, late.outcome_reason) == ("SUCCESS", "threshold_reached")
            st = await group.status()
            assert decision(st) == decision(final)
            assert next(m for m in st.members if m.task_id == bad.task_id).late
            # the worker processes exit by themselves: consume returned when the gate stopped
            for w in workers:
                out, err = await trio.to_thread.run_sync(lambda: w.communicate(timeout=20))
                assert w.returncode == 0, err
                assert out.startswith("STOPPED SCOPE_CANCELLED"), (out, err)
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()


def snapshot(st):
    return (
        decision(st),
        st.finalized_at,
        [(m.task_id, m.task_state, m.verdict, m.late) for m in st.members],
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_the_decision_survives_a_daemon_restart(tmp_path, sig):
    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        async with rallypoint.connect(d.url) as rs:
            mbx = await rs.mailboxes.ensure(uniq("restart"))
            run = await rs.scopes.create()
            # 1: N_ACCEPTED decided, the rest cancelled, one late verdict
            g1 = await run.groups.create(mbx, "N_ACCEPTED", threshold=2)
            ts = await submit_n(g1, 4)
            ds = await take(mbx, g1.scope_id, 3)
            for t in ts[:3]:
                await ds[t.id].complete({"ok": 1})
            await g1.accept(ts[0])
            await g1.accept(ts[1])
            assert (await g1.reject(ts[2])).late
            # 2: ALL_TERMINAL with a rejected member
            g2 = await run.groups.create(mbx, "ALL_TERMINAL", expected_members=2)
            a, b = await submit_n(g2, 2)
            ds = await take(mbx, g2.scope_id)
            await ds[a.id].complete(1)
            await ds[b.id].complete(2)
            await g2.accept(a)
            await g2.reject(b)
            # 3: cancelled with its run
            sub = await run.child()
            g3 = await sub.groups.create(mbx, "FIRST_ACCEPTED")
            await submit_n(g3, 2)
            await sub.cancel()
            # 4: undecided (sealed, one member succeeded and not judged yet)
            g4 = await run.groups.create(mbx, "FIRST_ACCEPTED")
            (m4,) = await submit_n(g4, 1)
            await (await take(mbx, g4.scope_id))[m4.id].complete("draft")
            await g4.close()
            # 5: a deadline that passes while the daemon is down (or just after)
            g5 = await run.groups.create(mbx, "FIRST_ACCEPTED", deadline=in_(2))
            await submit_n(g5, 1)
            decided = [g1, g2, g3]
            before = {g.id: snapshot(await g.status()) for g in decided + [g4]}
        assert [before[g.id][0] for g in decided] == [
            ("FINALIZED", "SUCCESS", "threshold_reached"),
            ("FINALIZED", "FAILURE", "all_terminal"),
            ("FINALIZED", "FAILURE", "cancelled"),
        ]
        d.stop(sig)
        d = Daemon(data, "fsync").start()
        async with rallypoint.connect(d.url) as rs:
            run = rs.scope(run.id)
            for g in decided:
                h = run.groups.by_id(g.id)
                assert snapshot(await h.status()) == before[g.id]
                assert snapshot(await h.wait(timeout=5)) == before[g.id]
            h4 = run.groups.by_id(g4.id)
            assert snapshot(await h4.status()) == before[g4.id]  # still SEALED, undecided
            v = await h4.accept(m4.id)  # and it can still be decided after the restart
            assert (v.group_state, v.outcome, v.outcome_reason) == ("FINALIZED", "SUCCESS", "first_accepted")
            assert decision(await h4.wait(timeout=5)) == ("FINALIZED", "SUCCESS", "first_accepted")
            assert decision(await run.groups.by_id(g5.id).wait(timeout=10)) == ("FINALIZED", "FAILURE", "deadline")
        assert d.stop() == 0
    finally:
        d.kill()
