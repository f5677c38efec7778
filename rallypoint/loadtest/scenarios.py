"""What one producer or worker process does (runs in a child process, under Trio).

A child connects, says ``ready``, waits for the parent's ``go`` (which carries the
common start instant), then runs until ``start + warmup + duration``. Latencies are
recorded for operations *started* inside the measured window; throughput counts
operations *finished* inside it. Every error is counted by its code, in or out of the
window. Progress (cumulative counters) goes to the parent twice a second; at the end a
``final`` message carries the encoded histograms.

Task inputs are small dicts with a kind ``k``: ``noop`` (complete at once) or
``arrive`` (arrive at barrier ``b`` as ``key``, then complete).
"""

from __future__ import annotations

import collections
import time
import traceback
from typing import Any

import trio

from ..errors import LeaseLostError, RallypointError, ScopeInactiveError, WaitTimeout
from .hist import Recorder
from .schedule import OpenLoopSchedule

GRACE_S = 10.0  # how long producers wait for outstanding results after the window
# Short server-side waits: the daemon (0.1.0) can miss the wake-up of a receive or a
# join_next that was parked in the same scheduler tick as the submit/completion that
# should wake it (see docs/performance.md); a short wait bounds such a stall.
RECEIVE_WAIT_S = 0.25
JOIN_WAIT_S = 0.25


class Ctx:
    """Counters, histograms and the measured window of one child process."""

    def __init__(self, spec: dict, q) -> None:
        self.spec = spec
        self.q = q
        self.role = spec["role"]
        self.index = spec["index"]
        self.rec = Recorder()
        self.errors: collections.Counter[str] = collections.Counter()
        self.error_samples: list[str] = []
        self.ops_all = 0  # requests finished, whole run (for the progress display)
        self.ops = 0  # requests finished inside the window
        self.lifecycles_all = 0
        self.lifecycles = 0
        self.rounds_all: collections.Counter[str] = collections.Counter()
        self.rounds: collections.Counter[str] = collections.Counter()
        self.lost = 0  # deliveries whose gate run was cancelled under them (expected)
        self.unfinished = 0  # lifecycles still without a result GRACE_S after the window
        self.start = self.m_start = self.m_end = 0.0
        self.rs = None
        self.run = None

    def set_window(self, start_wall: float) -> None:
        now_t, now_w = trio.current_time(), time.time()
        self.start = now_t + (start_wall - now_w)
        self.m_start = self.start + self.spec["warmup"]
        self.m_end = self.m_start + self.spec["duration"]

    def in_window(self, t: float) -> bool:
        return self.m_start <= t < self.m_end

    def over(self) -> bool:
        return trio.current_time() >= self.m_end

    def error(self, e: BaseException) -> None:
        code = e.code if isinstance(e, RallypointError) else type(e).__name__
        self.errors[code] += 1
        if len(self.error_samples) < 5:
            # a RallypointError's str() already starts with its code
            self.error_samples.append(f"{self.role}{self.index}: {e}" if isinstance(e, RallypointError)
                                      else f"{self.role}{self.index}: {code}: {e}")

    def done_op(self, op: str, t0: float, t1: float) -> None:
        self.ops_all += 1
        if self.in_window(t1):
            self.ops += 1
        if self.in_window(t0):
            self.rec.record(op, t1 - t0)

    async def timed(self, op: str, fn, *args, **kw):
        t0 = trio.current_time()
        try:
            r = await fn(*args, **kw)
        except RallypointError as e:
            if not isinstance(e, WaitTimeout):
                self.error(e)
            raise
        self.done_op(op, t0, trio.current_time())
        return r

    def lifecycle(self, t0: float, t1: float) -> None:
        self.lifecycles_all += 1
        if self.in_window(t1):
            self.lifecycles += 1
        if self.in_window(t0):
            self.rec.record("lifecycle", t1 - t0)

    def round(self, kind: str, t0: float, t1: float) -> None:
        self.rounds_all[kind] += 1
        if self.in_window(t1):
            self.rounds[kind] += 1
        if self.in_window(t0):
            self.rec.record(kind + "_round", t1 - t0)

    def progress(self) -> dict:
        return {
            "ops": self.ops_all,
            "lifecycles": self.lifecycles_all,
            "rounds": sum(self.rounds_all.values()),
            "errors": sum(self.errors.values()),
        }

    def final(self) -> dict:
        return {
            "hist": self.rec.encode(),
            "ops": self.ops,
            "lifecycles": self.lifecycles,
            "rounds": dict(self.rounds),
            "errors": dict(self.errors),
            "error_samples": self.error_samples,
            "lost": self.lost,
            "unfinished": self.unfinished,
            "progress": self.progress(),
        }


async def _guard(ctx: Ctx, fn, *args) -> bool:
    """Run one round; count an unexpected exception and back off a little. Returns
    False when the round failed."""
    try:
        await fn(*args)
        return True
    except RallypointError:
        pass  # counted by ctx.timed
    except Exception as e:  # noqa: BLE001 - a bench must keep going and report
        ctx.error(e)
    await trio.sleep(0.05)
    return False


# ------------------------------------------------------------------------------ producers
async def lifecycle_closed(ctx: Ctx, pipeline: int) -> None:
    """``pipeline`` lanes, each: submit_many(batch) → wait for every result."""
    rs, run, spec = ctx.rs, ctx.run, ctx.spec
    mbx = rs.mailbox(spec["mailbox"])
    batch = spec["batch"]

    async def one_batch():
        t0 = trio.current_time()
        tickets = await ctx.timed(
            "submit_many", mbx.submit_many, [{"k": "noop", "p": ctx.index}] * batch, scope=run, details=False
        )

        # One frame of server-side waits for the whole batch (rs.results); each
        # lifecycle ends when the batch's last result arrived: an upper bound.
        await ctx.timed("results", rs.results, tickets, 30, details=False)
        t1 = trio.current_time()
        for _ in tickets:
            ctx.lifecycle(t0, t1)

    async def lane():
        while not ctx.over():
            await _guard(ctx, one_batch)

    async with trio.open_nursery() as n:
        for _ in range(pipeline):
            n.start_soon(lane)


async def lifecycle_open(ctx: Ctx) -> None:
    """Fixed arrival rate across producers; latency from the intended send time."""
    rs, run, spec = ctx.rs, ctx.run, ctx.spec
    mbx = rs.mailbox(spec["mailbox"])
    sched = OpenLoopSchedule(spec["rate"], ctx.start, ctx.index, spec["producers"])
    pending = [0]

    async def send(intended: list[float]):
        tickets = await ctx.timed(
            "submit_many", mbx.submit_many, [{"k": "noop", "p": ctx.index}] * len(intended), scope=run,
            details=False,
        )
        t_sent = trio.current_time()
        for it in intended:
            if ctx.in_window(it):
                ctx.rec.record("send_lag", max(t_sent - it, 0.0))

        # One frame of waits for the coalesced arrivals; each lifecycle ends when the
        # last of them has its result (an upper bound on each one's latency).
        try:
            await ctx.timed("results", rs.results, tickets, 30, details=False)
            t1 = trio.current_time()
            for it in intended:
                ctx.lifecycle(it, t1)
        finally:
            pending[0] -= len(intended)

    async with trio.open_nursery() as waiters:
        while True:
            nt = sched.next_time()
            if nt >= ctx.m_end:
                break
            # Wake a little after the next intended time so that arrivals due within
            # ``coalesce_ms`` share one submit_many; latency still counts from each
            # arrival's intended time, so the wait is measured, not hidden.
            await trio.sleep_until(nt + spec.get("coalesce_ms", 0) / 1000)
            due = sched.due(trio.current_time(), limit=spec["batch"])
            pending[0] += len(due)
            waiters.start_soon(_guard, ctx, send, due)
        with trio.move_on_after(GRACE_S):
            while pending[0] > 0:
                await trio.sleep(0.01)
        ctx.unfinished += max(pending[0], 0)
        waiters.cancel_scope.cancel()


async def group_round(ctx: Ctx) -> None:
    """Create an N_ACCEPTED group of ``group_size``; workers complete the members; accept
    the first ``accept_n`` that succeed; the group finalizes and cancels the rest."""
    rs, run, spec = ctx.rs, ctx.run, ctx.spec
    size, need = spec["group_size"], spec["accept_n"]
    t0 = trio.current_time()
    g = await ctx.timed(
        "group_create", run.groups.create, spec["mailbox"], "N_ACCEPTED", threshold=need, expected_members=size
    )
    tickets: list[Any] = [None] * size

    async def submit(i):
        tickets[i] = await ctx.timed("group_submit", g.submit, {"k": "noop", "i": i}, key=f"m{i}")

    async with trio.open_nursery() as n:
        for i in range(size):
            n.start_soon(submit, i)
    send, recv = trio.open_memory_channel(size)

    async def watch(tk):
        try:
            info = await ctx.timed("result", tk.result, 30)
        except RallypointError:
            return
        await send.send((tk, info))

    accepted = 0
    async with trio.open_nursery() as n:
        for tk in tickets:
            n.start_soon(watch, tk)
        async for tk, info in recv:
            if info.state == "SUCCEEDED":
                await ctx.timed("accept", g.accept, tk)
                accepted += 1
                if accepted >= need:
                    break
        n.cancel_scope.cancel()
    st = await ctx.timed("group_wait", g.wait, 30)
    if st.outcome != "SUCCESS":
        ctx.error(RuntimeError(f"group {g.id} finalized {st.outcome} ({st.outcome_reason})"))
        return
    ctx.round("group", t0, trio.current_time())


async def barrier_round(ctx: Ctx) -> None:
    """A barrier of ``barrier_n``; the arrivals are tasks done by worker processes;
    two waiters in this process are released."""
    rs, run, spec = ctx.rs, ctx.run, ctx.spec
    n_arr = spec["barrier_n"]
    t0 = trio.current_time()
    b = await ctx.timed("barrier_create", run.barriers.create, n_arr)

    async def waiter():
        st = await ctx.timed("barrier_wait", b.wait, 30)
        if st.state != "RELEASED" and st.epoch == 0:
            raise RuntimeError(f"barrier {b.id} is {st.state}")

    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        n.start_soon(waiter)
        await ctx.timed(
            "submit_many", rs.mailbox(spec["mailbox"]).submit_many,
            [{"k": "arrive", "b": b.id, "key": f"a{i}"} for i in range(n_arr)], scope=run,
        )
    ctx.round("barrier", t0, trio.current_time())


async def joinset_round(ctx: Ctx) -> None:
    """A join set of ``joinset_size`` children, consumed in completion order, closed."""
    rs, run, spec = ctx.rs, ctx.run, ctx.spec
    size = spec["joinset_size"]
    t0 = trio.current_time()
    js = await ctx.timed("joinset_create", run.join_sets.create)
    async with trio.open_nursery() as n:
        for i in range(size):
            n.start_soon(ctx.timed, "joinset_submit", js.submit, spec["mailbox"], {"k": "noop", "i": i})
    seen = set()
    for _ in range(size):
        t0j = trio.current_time()
        while True:
            try:
                cid, _value = await js.join_next(JOIN_WAIT_S)
                break
            except WaitTimeout:
                if trio.current_time() - t0j > 30:
                    raise
            except RallypointError as e:
                ctx.error(e)
                raise
        ctx.done_op("join_next", t0j, trio.current_time())
        seen.add(cid)
    if len(seen) != size:
        raise RuntimeError(f"join set {js.id} returned {len(seen)} distinct children of {size}")
    await ctx.timed("joinset_close", js.close, 30)
    ctx.round("joinset", t0, trio.current_time())


async def rounds_loop(ctx: Ctx, fn, lanes: int = 1) -> None:
    async def lane():
        while not ctx.over():
            await _guard(ctx, fn, ctx)

    async with trio.open_nursery() as n:
        for _ in range(lanes):
            n.start_soon(lane)


async def producer(ctx: Ctx) -> None:
    sc, spec = ctx.spec["scenario"], ctx.spec
    if sc == "lifecycle":
        if spec["rate"]:
            await lifecycle_open(ctx)
        else:
            await lifecycle_closed(ctx, spec["pipeline"])
    elif sc == "groups":
        await rounds_loop(ctx, group_round, spec["pipeline"])
    elif sc == "barriers":
        await rounds_loop(ctx, barrier_round, spec["pipeline"])
    elif sc == "joinsets":
        await rounds_loop(ctx, joinset_round, spec["pipeline"])
    elif sc == "mixed":
        async with trio.open_nursery() as n:
            if spec["rate"]:
                n.start_soon(lifecycle_open, ctx)
            else:
                n.start_soon(lifecycle_closed, ctx, max(1, spec["pipeline"] // 2))
            n.start_soon(rounds_loop, ctx, group_round)
            n.start_soon(rounds_loop, ctx, barrier_round)
            n.start_soon(rounds_loop, ctx, joinset_round)
    else:  # pragma: no cover - argparse checks it
        raise ValueError(f"unknown scenario {sc}")


# ------------------------------------------------------------------------------ workers
def _is_arrival(d) -> bool:
    return isinstance(d.input, dict) and d.input.get("k") == "arrive"


async def worker(ctx: Ctx, stop) -> None:
    """``concurrency`` loops of receive(max_messages) → handle and complete each."""
    rs, run, spec = ctx.rs, ctx.run, ctx.spec
    mbx = rs.mailbox(spec["mailbox"])
    barriers: dict[str, Any] = {}

    async def handle(d):
        try:
            inp = d.input if isinstance(d.input, dict) else {}
            if inp.get("k") == "arrive":
                b = barriers.get(inp["b"])
                if b is None:
                    b = barriers[inp["b"]] = run.barriers.get(inp["b"])
                await ctx.timed("arrive", b.arrive, inp["key"])
            await ctx.timed("complete", d.complete, {"w": ctx.index})
        except (LeaseLostError, ScopeInactiveError) as e:
            if d.group_id is not None:
                ctx.lost += 1  # the group finalized and cancelled this member: expected
                ctx.errors[e.code] -= 1
                if not ctx.errors[e.code]:
                    del ctx.errors[e.code]
        except RallypointError:
            pass  # counted
        except Exception as e:  # noqa: BLE001
            ctx.error(e)

    async def complete_batch(ds):
        out = await ctx.timed("complete_many", mbx.complete_many, [(d, {"w": ctx.index}) for d in ds], details=False)
        for r in out:
            if isinstance(r, RallypointError):
                ctx.errors[r.code] += 1

    together = spec.get("settle", "next") == "next"

    async def complete_next(ds):
        """The batch's completes and the next receive in one round trip."""
        out, nxt = await ctx.timed("complete_next", mbx.complete_many_and_next, [(d, {"w": ctx.index}) for d in ds],
                                   scope=run, max_messages=spec["max_messages"], lease_seconds=spec.get("lease_seconds", 30),
                                   wait=RECEIVE_WAIT_S)
        for r in out:
            if isinstance(r, RallypointError):
                ctx.errors[r.code] += 1
        return nxt

    async def loop():
        ds = []
        while not stop.is_set():
            if not ds:
                try:
                    ds = await ctx.timed(
                        "receive", mbx.receive, run, lease_seconds=spec.get("lease_seconds", 30), wait=RECEIVE_WAIT_S,
                        max_messages=spec["max_messages"]
                    )
                except RallypointError:
                    await trio.sleep(0.05)
                    continue
                if not ds:
                    continue
            plain = [d for d in ds if d.group_id is None and not _is_arrival(d)]
            others = [d for d in ds if d.group_id is not None or _is_arrival(d)]
            ds = []
            if together and plain and not others:
                try:
                    ds = await complete_next(plain)
                except RallypointError:
                    await trio.sleep(0.05)
                except Exception as e:  # noqa: BLE001
                    ctx.error(e)
                continue
            async with trio.open_nursery() as n:
                if plain:  # one batch frame for the plain lifecycle completes
                    n.start_soon(_guard, ctx, complete_batch, plain)
                for d in others:
                    n.start_soon(handle, d)

    async with trio.open_nursery() as n:
        for _ in range(spec["worker_concurrency"]):
            n.start_soon(loop)


# ------------------------------------------------------------------------------ entry
async def _child(spec: dict, q, go, start_value, stop) -> None:
    import rallypoint

    ctx = Ctx(spec, q)
    key = (ctx.role, ctx.index)
    async with rallypoint.connect(spec["url"], api_key=spec.get("api_key"), client_name=f"bench-{ctx.role}{ctx.index}") as rs:
        runs = spec["run_ids"]
        ctx.rs, ctx.run = rs, rs.scope(runs[ctx.index % len(runs)])
        q.put(("ready", key, None))
        await trio.to_thread.run_sync(go.wait)
        ctx.set_window(start_value.value)
        await trio.sleep_until(ctx.start)

        async def reporter():
            while True:
                await trio.sleep(0.5)
                q.put(("progress", key, ctx.progress()))

        async with trio.open_nursery() as n:
            n.start_soon(reporter)
            if ctx.role == "producer":
                await producer(ctx)
            else:
                await worker(ctx, stop)
            n.cancel_scope.cancel()
    q.put(("final", key, ctx.final()))


def child_main(spec: dict, q, go, start_value, stop) -> None:
    """The multiprocessing target (spawn): one producer or worker."""
    try:
        trio.run(_child, spec, q, go, start_value, stop)
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
        q.put(("crash", (spec["role"], spec["index"]), "".join(traceback.format_exception(e))))
        raise SystemExit(1)
