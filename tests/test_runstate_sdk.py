"""The unchanged runstate SDK (0.2.0 and 0.3.0, from the package index) against
``rallypoint serve --http``: every verb of both versions, errors, retries with the same
idempotency key, lease loss, cancellation, once across processes, limit windows, budget
capping, and one queue shared by a 0.3 producer and a native ``rallypoint.consume``
worker.

Each SDK program runs in the SDK version's own virtual environment (tests/sdk_compat.py)
as a subprocess of this test, against one daemon with authentication on (an admin key of
space ``compat``); its last stdout line is a JSON summary that the test checks.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter

import httpx
import pytest
import trio

import rallypoint
from conftest import until_sync
from sdk_compat import HttpDaemon, run_script, sdk_python

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = HttpDaemon(str(tmp_path_factory.mktemp("sdk-daemon"))).start()
    yield d
    rc = d.stop()
    assert rc == 0, d.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def py02():
    return sdk_python("0.2.0")


@pytest.fixture(scope="module")
def py03():
    return sdk_python("0.3.0")


# ============================================================================ 0.2.0
VERBS_02 = r'''
import asyncio, json, time
from runstate import (AsyncRunstate, ConflictError, NotFoundError, ScopeCancelledError, LeaseLostError,
                      RateLimitError, RunstateError, WaitTimeoutError)

async def main():
    out = {}
    rs = AsyncRunstate(holder="verbs-02")
    # scopes: create (name, deadline, childLimit), status, child, cancel, complete
    run = await rs.scopes.create(name="verbs 02", deadline="2099-01-01T00:00:00.000Z", child_limit=50)
    st = await run.status()
    out["scope"] = [st["name"], st["storedState"], st["effective"], st["childLimit"]]
    child = await run.child(name="kid")
    out["child_parent"] = (await child.status())["parentId"] == run.id
    # mailboxes: ensure (list then create), mode conflict
    work = await rs.mailboxes.ensure("v02-work", mode="WORK")
    inbox = await rs.mailboxes.ensure("v02-inbox", mode="INBOX", backlog_limit=100)
    out["modes"] = [work["mode"], inbox["mode"], inbox["backlogLimit"]]
    try:
        await rs.mailboxes.ensure("v02-inbox", mode="WORK"); out["mode_conflict"] = False
    except ConflictError:
        out["mode_conflict"] = True
    # messages: send, receive (recv), renew, complete; retry -> attempt 2; reject
    mb = run.mailbox("v02-inbox")
    sent = await mb.send({"hello": 1}, work_key="m-1")
    d = await mb.receive()
    await d.renew(lease_seconds=20)
    await d.complete({"payload": "ok"})
    out["message"] = [sent["state"], d.data, d.attempt]
    await mb.send({"n": 2})
    d2 = await mb.receive()
    await d2.retry()
    d3 = await mb.receive()
    out["retry_attempt"] = d3.attempt
    await d3.reject()
    out["empty_receive"] = await mb.receive() is None
    # tasks: submit (key replays), admit, complete, status/result, cancel
    wm = run.mailbox("v02-work")
    t1 = await wm.submit({"x": 1}, key="t-1")
    t1b = await wm.submit({"x": 1}, key="t-1")
    out["submit_replay"] = t1.id == t1b.id
    adm = await wm.admit(lease_seconds=30)
    out["admitted"] = [adm.task.id == t1.id, adm.attempt, adm.delivery.data]
    await adm.delivery.complete({"payload": {"y": 2}})
    res = await t1.result(timeout_ms=5000)
    out["result"] = [res["state"], res["outcome"]]
    t5 = await wm.submit({"x": 5}, key="t-5", subscriber_id="sub-1")
    await t5.join("sub-2", run.id); await t5.join("sub-2", run.id)
    await t5.detach("sub-1")
    out["subscribers"] = (await t5.status())["subscribers"]
    await t5.cancel()
    t2 = await wm.submit({"x": 2}, key="t-2")
    out["cancel"] = (await t2.cancel(reason="not needed"))["state"]
    out["admit_none"] = await wm.admit(wait_ms=300) is None
    # groups: create, submit, status, accept/reject verdicts, close, wait, seal after
    g = await run.groups.create(mailbox="v02-work", condition="N_ACCEPTED", threshold=1, parent_scope_id=run.id)
    m1 = await g.submit({"g": 1}, key="g-1")
    m2 = await g.submit({"g": 2}, key="g-2")
    for _ in range(2):
        a = await wm.admit(lease_seconds=30)
        await a.delivery.complete({"payload": a.delivery.data})
    await m1.result(timeout_ms=5000); await m2.result(timeout_ms=5000)
    await g.reject(m2.id)
    await g.accept(m1.id)
    w = await g.wait(timeout_ms=5000)
    out["group"] = [w["outcome"], w["outcomeReason"]]
    out["group_close"] = (await g.close())["state"]
    try:
        await g.seal(); out["seal_after_final"] = "no error"
    except ConflictError:
        out["seal_after_final"] = "ConflictError"
    g2 = await run.groups.create(mailbox="v02-work", condition="ALL_TERMINAL", parent_scope_id=run.id)
    outside = await wm.submit({"o": 1}, key="outside")
    try:
        await g2.join_task(outside.id); out["join_task"] = "joined"
    except RunstateError as e:
        out["join_task"] = e.code
    # allowances: ensure, status, try_take, take (durable waiter), cooldown
    await rs.quotas.ensure("v02-quota", units_per_window=2, window_seconds=3600)
    q = run.quota("v02-quota")
    st = await q.status()
    out["quota_status"] = [st["unitsLimit"], st["remaining"]]
    a1 = await q.try_take(units=1)
    a2 = await q.take(units=1)
    a3 = await q.try_take(units=1)
    out["quota_takes"] = [a1["kind"], bool(a2.get("consumptionId")), a3["kind"]]
    try:
        await q.take(units=1, timeout_ms=1500); out["take_timeout"] = False
    except WaitTimeoutError:
        out["take_timeout"] = True
    out["cooldown"] = bool((await q.cooldown(5, reason="429"))["cooldownUntil"])
    # budgets: ensure, status, reserve, settle (capped, idempotent), void
    await rs.budgets.ensure("v02-budget", currency="USD", scale=2, limit="1.00")
    b = run.budget("v02-budget")
    r0 = await b.reserve(amount="0.50")
    r1 = await b.reserve(amount="0.40")
    s1 = await r1.settle(amount="0.90", usage_key="u-1")
    s1b = await r1.settle(amount="0.90", usage_key="u-1")
    await r0.void(usage_key="v-0")
    r2 = await b.reserve(amount="0.05")
    await r2.void(usage_key="v-2")
    bst = await b.status()
    out["budget"] = [r1.reserved, s1["chargedMinor"], s1b["replayed"], bst["settledMinor"], bst["reservedMinor"]]
    try:
        await b.reserve(amount="0.60"); out["insufficient"] = False
    except ConflictError as e:
        out["insufficient"] = e.code
    # barriers: create, arrive, status, wait, get
    bar = await run.barriers.create(target=2)
    await bar.arrive(key="a"); await bar.arrive(key="a")
    out["barrier_open"] = (await bar.status())["arrivals"]
    await run.barriers.get(bar.id).arrive(key="b")
    out["barrier"] = (await bar.wait(timeout_ms=3000))["state"]
    # timers: create, wait (poll + ack), cancel
    tm = await run.timers.create(after_seconds=1)
    fired = await tm.wait(timeout_ms=10000, poll_ms=100)
    out["timer"] = fired["fired_at"] is not None
    tc = await run.timers.create(after_seconds=60)
    out["timer_cancel"] = (await tc.cancel())["state"]
    # diagnostics
    out["waits"] = "parked" in await rs.diagnostics.waits()
    out["ops_run"] = (await rs.diagnostics.run(run.id))["rootScopeId"] == run.id
    # errors
    try:
        await run.task("tsk_00000000000000000000000000").status(); out["not_found"] = None
    except NotFoundError as e:
        out["not_found"] = [e.code, e.status]
    # lease loss: complete with a stale token after another worker took the task over
    t4 = await wm.submit({"x": 4}, key="t-4")
    first = await wm.admit(lease_seconds=5)
    await asyncio.sleep(6)
    second = await wm.admit(lease_seconds=30)
    try:
        await first.delivery.complete({"payload": 1}); out["lease_lost"] = None
    except LeaseLostError as e:
        out["lease_lost"] = e.code
    out["takeover_attempt"] = second.attempt
    await second.delivery.complete({"payload": 2})
    # cancel / complete the run; writes then refused with SCOPE_CANCELLED
    await child.complete()
    out["child_done"] = (await child.status())["storedState"]
    await run.cancel(); await run.cancel()
    try:
        await mb.send({"late": 1}); out["after_cancel"] = None
    except ScopeCancelledError as e:
        out["after_cancel"] = e.code
    out["cancelled_view"] = [(await run.status())["storedState"], (await run.status())["effective"]]
    await rs.aclose()
    print(json.dumps(out))

asyncio.run(main())
'''


def test_sdk02_every_verb(daemon, py02):
    out = run_script(py02, daemon, VERBS_02)
    assert out["scope"] == ["verbs 02", "ACTIVE", "ACTIVE", 50]
    assert out["child_parent"] is True
    assert out["modes"] == ["WORK", "INBOX", 100] and out["mode_conflict"] is True
    assert out["message"] == ["QUEUED", {"hello": 1}, 1]
    assert out["retry_attempt"] == 2 and out["empty_receive"] is True
    assert out["submit_replay"] is True
    assert out["admitted"] == [True, 1, {"x": 1}]
    assert out["result"] == ["SUCCEEDED", {"y": 2}]
    assert out["subscribers"] == ["sub-2"]
    assert out["cancel"] == "CANCELLED" and out["admit_none"] is True
    assert out["group"] == ["SUCCESS", "threshold_reached"] and out["group_close"] == "FINALIZED"
    assert out["seal_after_final"] == "ConflictError"
    assert out["join_task"] == "joined"
    assert out["quota_status"] == [2, 2]
    assert out["quota_takes"] == ["consumed", True, "exhausted"]
    assert out["take_timeout"] is True and out["cooldown"] is True
    # 1.00: 0.50 and 0.40 reserved; settling 0.90 on the 0.40 is capped at 0.40 + the 0.10 left
    assert out["budget"] == ["0.40", "50", True, "50", "0"]
    assert out["insufficient"] == "INSUFFICIENT_BUDGET"
    assert out["barrier_open"] == 1 and out["barrier"] == "RELEASED"
    assert out["timer"] is True and out["timer_cancel"] == "CANCELLED"
    assert out["waits"] is True and out["ops_run"] is True
    assert out["not_found"] == ["NOT_FOUND", 404]
    assert out["lease_lost"] == "STALE_CLAIM" and out["takeover_attempt"] == 2
    assert out["child_done"] == "COMPLETED"
    assert out["after_cancel"] == "SCOPE_CANCELLED"
    assert out["cancelled_view"] == ["CANCELLED", "INACTIVE"]


# ============================================================================ 0.3.0
VERBS_03 = r'''
import asyncio, json, threading, time, os
import runstate
from runstate import (ConflictError, StoppedError, TaskFailedError, BudgetExceededError, OnceFailedError,
                      RunstateError)

run_name = os.environ["RUN_NAME"]
out = {}
rs = runstate.Runstate(run=run_name, worker="verbs-03")
out["run_id"] = rs.run_id()
# once: runs once, context, fail then FAILED
calls = []
@rs.once
def research(x):
    calls.append(x)
    ctx = runstate.context()
    return {"x": x, "attempt": ctx.attempt}
out["once"] = [research(1), research(1), len(calls)]
@rs.once(attempts=2)
def broken():
    raise ValueError("nope")
try:
    broken()
except ValueError:
    pass  # attempt 1 of 2: the caller's own error
out["once_failed"] = []
for _ in range(2):
    try:
        broken()
    except OnceFailedError as e:  # attempt 2 failed: FAILED for good, for every later caller
        out["once_failed"].append(e.attempts)
# limit / take / setup
rs.setup(limits={"v03-search": {"max": 2, "per": "1s"}})
@rs.limit("v03-search", max=2, per="1s")
def search(q):
    return q.upper()
out["limit"] = [search("a"), search("b"), search("c")]
rs.take("v03-search")
# budget
@rs.budget("v03-budget", reserve=0.50, limit=1)
def ask(p):
    return p
out["budget"] = [ask("a"), ask("b")]
try:
    ask("c"); out["budget_exceeded"] = False
except BudgetExceededError:
    out["budget_exceeded"] = True
# queue: serve + call + send/result + gather + failure
@rs.queue("v03-work", attempts=2, concurrency=2)
def work(doc):
    if doc.get("fail"):
        raise ValueError("bad doc")
    return {"n": doc["n"] * 2, "attempt": runstate.context().attempt}
stop = threading.Event()
server = threading.Thread(target=rs.serve, kwargs={"signal": stop})
server.start()
try:
    out["call"] = work({"n": 1})
    job = work.send({"n": 2})
    out["send"] = [job.result(timeout="10s")]
    out["gather"] = sorted(r["n"] for r in work.gather([{"n": 3}, {"n": 4}, {"n": 5}], need=2))
    try:
        work({"fail": True}); out["failed"] = None
    except TaskFailedError as e:
        out["failed"] = "bad doc" in str(e)
finally:
    stop.set(); server.join(30)
out["served_stopped"] = not server.is_alive()
# sleep (durable by name) and together
t0 = time.monotonic(); rs.sleep("nap", "1s"); out["slept"] = time.monotonic() - t0 >= 0.9
t0 = time.monotonic(); rs.sleep("nap", "1s"); out["slept_again"] = time.monotonic() - t0 < 0.5
rs.together("solo", 1)
# child run, status, events-free stop/finish
kid = rs.child("kid")
out["child"] = kid.run_id() != rs.run_id()
st = rs.status()
out["status"] = [st.run.name, st.run.state]
kid.finish()
try:
    kid.take("v03-search"); out["after_finish"] = None
except StoppedError:
    out["after_finish"] = "StoppedError"
rs.stop()
out["stopped"] = rs.status().run.state
print(json.dumps(out))
'''


def test_sdk03_every_verb(daemon, py03):
    out = run_script(py03, daemon, VERBS_03, env={"RUN_NAME": "verbs-03"})
    assert out["run_id"].startswith("scp_")
    assert out["once"] == [{"x": 1, "attempt": 1}, {"x": 1, "attempt": 1}, 1]
    assert out["once_failed"] == [2, 2]
    assert out["limit"] == ["A", "B", "C"]
    assert out["budget"] == ["a", "b"] and out["budget_exceeded"] is True
    assert out["call"] == {"n": 2, "attempt": 1}
    assert out["send"] == [{"n": 4, "attempt": 1}]
    assert len(out["gather"]) == 2 and set(out["gather"]) <= {6, 8, 10}
    assert out["failed"] is True and out["served_stopped"] is True
    assert out["slept"] is True and out["slept_again"] is True
    assert out["child"] is True and out["status"] == ["verbs-03", "running"]
    assert out["after_finish"] == "StoppedError"
    assert out["stopped"] == "stopped"


ONCE_WORKER = r'''
import json, os, time
import runstate
rs = runstate.Runstate(run=os.environ["RUN_NAME"])
@rs.once(lease="5s")
def expensive(x):
    with open(os.environ["LOG"], "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    return {"x": x}
print(json.dumps(expensive(7)))
'''


def test_once_across_two_processes(daemon, py03, tmp_path):
    """Two processes call the same once function in the same run at once: it runs once
    (the other waits on GET /once and gets the result)."""
    import subprocess

    log = tmp_path / "calls.log"
    env = daemon.sdk_env() | {"RUN_NAME": "once-2p", "LOG": str(log)}
    procs = [subprocess.Popen([py03, "-c", ONCE_WORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert [json.loads(o.strip().splitlines()[-1]) for o, _ in outs] == [{"x": 7}, {"x": 7}]
    assert len(log.read_text().split()) == 1


LIMIT_WINDOWS = r'''
import asyncio, json, os
import runstate
rs = runstate.Runstate(run=os.environ["RUN_NAME"])
@rs.limit("win-" + os.environ["RUN_NAME"], max=2, per="1s")
async def hit(i):
    return i
async def main():
    return await asyncio.gather(*(hit(i) for i in range(6)))
out = asyncio.run(main())
print(json.dumps({"out": out}))
'''


async def test_limit_windows_are_fixed_and_aligned(daemon, py03):
    """``limit(max=2, per="1s")``: at most 2 calls in each second-aligned window; six calls
    need at least three windows. Judged by the server's record of each take (the window
    its grant was counted in), not by the client's clock: the SDK sees a queued grant
    only at its next poll, maybe in the next second on a loaded machine."""
    out = await trio.to_thread.run_sync(lambda: run_script(py03, daemon, LIMIT_WINDOWS, env={"RUN_NAME": "limit-win"}))
    assert out["out"] == list(range(6))
    async with rallypoint.connect(daemon.tcp_url, api_key=daemon.secret) as rs:
        quota = rs.quota("win-limit-win")
        info = await quota.status()
        assert (info.units_limit, info.window_ms) == (2, 1000)
        page = await rs.events.list(types=["quota.consumed", "quota.granted"], aggregate=f"quota:{info.id}")
        waiters = [e.data["waiter"] for e in page.events]
        assert len(waiters) == len(set(waiters)) == 6, page.events  # one take per call
        takes = [await quota.waiter(w).status() for w in waiters]
    assert all(tk.state == "GRANTED" for tk in takes), takes
    windows = sorted(tk.window_start for tk in takes)
    assert all((tk.window_end - tk.window_start).total_seconds() == 1 for tk in takes), takes
    # fixed windows: one grid, whole seconds apart (not a window per first take) ...
    assert all((w - windows[0]).total_seconds() == int((w - windows[0]).total_seconds()) for w in windows), windows
    # ... aligned on the second of server time, which is the wall time read (to the ms)
    # at the data dir's first start
    assert min(windows[0].microsecond, 1_000_000 - windows[0].microsecond) <= 50_000, windows
    per = Counter(windows)
    assert max(per.values()) <= 2 and len(per) >= 3, per


SERVE_STOP = r'''
import json, os, threading, time
import runstate
name = os.environ["RUN_NAME"]
worker = runstate.Runstate(run=name, worker="stopper")
seen = {}
running = threading.Event()
@worker.queue("stop-q", concurrency=1, lease="5s")
def slow(x):
    ctx = runstate.context()
    running.set()
    seen["signal"] = ctx.signal.wait(30)
    return x
th = threading.Thread(target=worker.serve)
th.start()
producer = runstate.Runstate(run=name, worker="producer")
job = producer.queue("stop-q").send(1)
assert running.wait(60), "the handler never ran"
t0 = time.monotonic()
runstate.Runstate(run=name, worker="stopper-2").stop()
th.join(40)
try:
    job.result(timeout="5s"); res = "ok"
except runstate.StoppedError:
    res = "StoppedError"
print(json.dumps({"alive": th.is_alive(), "took": time.monotonic() - t0, "signal": seen.get("signal"),
                  "result": res}))
'''


def test_stop_ends_serve_and_signals_running_handlers(daemon, py03):
    """stop() from another client: the worker's running handler sees its signal (lease
    renewals answer SCOPE_CANCELLED) and serve() returns; the producer's job is stopped."""
    out = run_script(py03, daemon, SERVE_STOP, env={"RUN_NAME": "serve-stop"})
    assert out["alive"] is False and out["signal"] is True
    assert out["took"] < 25
    assert out["result"] == "StoppedError"


# ============================================================================ native + HTTP
PRODUCER_03 = r'''
import json, os
import runstate
rs = runstate.Runstate(run=os.environ["RUN_NAME"], worker="http-producer")
q = rs.queue("shared-q")
results = [q({"n": i}) for i in range(3)]
print(json.dumps({"run_id": rs.run_id(), "results": results}))
'''


async def test_runstate_producer_and_native_consumer_share_a_queue(daemon, py03):
    """A 0.3 ``queue`` producer over HTTP and a native ``rallypoint.consume`` worker over
    TCP, on one daemon: the same run (joined by name), the same queue, the same values."""
    async with rallypoint.connect(daemon.tcp_url, api_key=daemon.secret) as rs:
        run_id = (await trio.to_thread.run_sync(lambda: httpx.put(
            f"{daemon.base_url}/v1/spaces/{daemon.space}/runs/shared-run", json={},
            headers={"authorization": f"Bearer {daemon.secret}"}).json()))["id"]
        mailbox = await rs.mailboxes.ensure("shared-q")
        seen = []

        async def handler(delivery):
            seen.append(delivery.input)
            return {"doubled": delivery.input["n"] * 2, "by": "native"}

        async with trio.open_nursery() as n:
            n.start_soon(rallypoint.consume, rs, mailbox, run_id, handler)
            out = await trio.to_thread.run_sync(lambda: run_script(py03, daemon, PRODUCER_03,
                                                                   env={"RUN_NAME": "shared-run"}))
            n.cancel_scope.cancel()
    assert out["run_id"] == run_id
    assert out["results"] == [{"doubled": 0, "by": "native"}, {"doubled": 2, "by": "native"},
                              {"doubled": 4, "by": "native"}]
    assert seen == [{"n": 0}, {"n": 1}, {"n": 2}]


# ============================================================================ idempotent retries
class DroppingProxy:
    """A TCP proxy in front of the daemon that forwards every request but, for the first
    request whose head contains ``trigger``, closes the client's connection instead of
    passing the response on: the request was applied, its answer lost."""

    def __init__(self, upstream: str, trigger: bytes) -> None:
        host, port = upstream.split("//")[1].split(":")
        self.upstream = (host, int(port))
        self.trigger = trigger
        self.dropped = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            state = {"drop": False}
            threading.Thread(target=self._up, args=(c, u, state), daemon=True).start()
            threading.Thread(target=self._down, args=(u, c, state), daemon=True).start()

    def _up(self, c, u, state):
        try:
            while data := c.recv(65536):
                if self.trigger in data and not self.dropped:
                    self.dropped += 1
                    state["drop"] = True
                u.sendall(data)
        except OSError:
            pass

    def _down(self, u, c, state):
        try:
            while data := u.recv(65536):
                if state["drop"]:
                    c.close()
                    u.close()
                    return
                c.sendall(data)
        except OSError:
            pass

    def close(self):
        self.sock.close()


RESERVE_RETRY_02 = r'''
import asyncio, json, os
from runstate import AsyncRunstate
async def main():
    rs = AsyncRunstate(holder="retry", base_url=os.environ["PROXY"])
    await rs.budgets.ensure("retry-budget", currency="USD", scale=2, limit="10.00")
    run = await rs.scopes.create(name="retry")
    r = await run.budget("retry-budget").reserve(amount="1.00")
    st = await run.budget("retry-budget").status()
    print(json.dumps({"reservation": r.id, "reserved": st["reservedMinor"], "open": st["openReservations"]}))
    await rs.aclose()
asyncio.run(main())
'''


def test_a_lost_response_is_retried_with_the_same_key_and_applied_once(daemon, py02):
    """The 0.2 SDK's transport retry after a lost response re-sends the budget reserve
    with the same Idempotency-Key: the stored answer comes back, one reservation exists."""
    proxy = DroppingProxy(daemon.base_url, b"/reserve ")
    try:
        out = run_script(py02, daemon, RESERVE_RETRY_02, env={"PROXY": proxy.url})
    finally:
        proxy.close()
    assert proxy.dropped == 1
    assert out["reserved"] == "100" and out["open"] == 1


# ============================================================================ raw HTTP
def _h(d: HttpDaemon, key: str | None = None, **extra) -> dict:
    h = {"authorization": f"Bearer {d.secret}"}
    if key:
        h["idempotency-key"] = key
    return h | extra


def test_idempotency_key_replays_conflicts_and_survives_a_restart(tmp_path):
    d = HttpDaemon(str(tmp_path / "data"), durability="fsync").start()
    try:
        base = f"{d.base_url}/v1/spaces/{d.space}"
        run = httpx.post(f"{base}/scopes", json={"name": "idem"}, headers=_h(d)).json()["id"]
        body = {"name": "idem-budget", "limitMinor": "500", "currency": "EUR", "scale": 2}
        httpx.post(f"{base}/budgets", json=body, headers=_h(d))
        bid = httpx.put(f"{base}/budgets/by-name/idem-budget", json={}, headers=_h(d)).json()["id"]
        req = {"scopeId": run, "amountMinor": "120", "holder": "h"}
        first = httpx.post(f"{base}/budgets/{bid}/reserve", json=req, headers=_h(d, "k-1"))
        again = httpx.post(f"{base}/budgets/{bid}/reserve", json=req, headers=_h(d, "k-1"))
        assert first.status_code == again.status_code == 200
        assert first.json() == again.json() and again.headers["idempotent-replayed"] == "true"
        other = httpx.post(f"{base}/budgets/{bid}/reserve", json=req | {"amountMinor": "1"}, headers=_h(d, "k-1"))
        assert other.status_code == 409 and other.json()["error"]["code"] == "IDEMPOTENCY_CONFLICT"
        # a decided error is stored too: the same key answers it again
        bad = {"scopeId": run, "amountMinor": "100000"}
        e1 = httpx.post(f"{base}/budgets/{bid}/reserve", json=bad, headers=_h(d, "k-2"))
        assert e1.status_code == 409 and e1.json()["error"]["code"] == "INSUFFICIENT_BUDGET"
        assert d.stop() == 0
        d.start()
        base = f"{d.base_url}/v1/spaces/{d.space}"
        after = httpx.post(f"{base}/budgets/{bid}/reserve", json=req, headers=_h(d, "k-1"))
        assert after.json() == first.json()
        assert httpx.get(f"{base}/budgets/{bid}", headers=_h(d)).json()["reservedMinor"] == "120"
        e2 = httpx.post(f"{base}/budgets/{bid}/reserve", json=bad, headers=_h(d, "k-2"))
        assert e2.json()["error"]["code"] == "INSUFFICIENT_BUDGET"
        assert e2.json()["error"]["requestId"] == e1.json()["error"]["requestId"]  # the stored answer
    finally:
        d.stop()


def test_envelope_statuses_spaces_and_auth(daemon):
    base = f"{daemon.base_url}/v1/spaces/{daemon.space}"
    r = httpx.get(f"{base}/scopes/scp_00000000000000000000000000", headers=_h(daemon))
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "NOT_FOUND" and err["message"] and err["requestId"]
    # no key, a wrong key: 401 UNAUTHENTICATED
    r = httpx.get(f"{base}/mailboxes")
    assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"
    r = httpx.get(f"{base}/mailboxes", headers={"authorization": "Bearer nope"})
    assert r.status_code == 401
    # another space in the path: NOT_FOUND, as another space's ids over TCP
    r = httpx.get(f"{daemon.base_url}/v1/spaces/other/mailboxes", headers=_h(daemon))
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
    # validation: 400 with the envelope; a bodyless POST is {}
    r = httpx.post(f"{base}/scopes", content=b"[1,2]", headers=_h(daemon))
    assert r.status_code == 400 and r.json()["error"]["code"] == "VALIDATION_FAILED"
    run = httpx.post(f"{base}/scopes", headers=_h(daemon)).json()["id"]
    assert httpx.post(f"{base}/scopes/{run}/cancel", headers=_h(daemon)).json()["storedState"] == "CANCELLED"
    # an inactive run: 409 SCOPE_CANCELLED
    r = httpx.post(f"{base}/timers", json={"scopeId": run, "afterSeconds": 5}, headers=_h(daemon))
    assert r.status_code == 409 and r.json()["error"]["code"] == "SCOPE_CANCELLED"
    # a contention code carries Retry-After
    httpx.post(f"{base}/allowances", json={"name": "ra", "unitsLimit": 1, "windowSeconds": 3600}, headers=_h(daemon))
    live = httpx.post(f"{base}/scopes", json={}, headers=_h(daemon)).json()["id"]
    qid = httpx.put(f"{base}/allowances/by-name/ra", json={}, headers=_h(daemon)).json()["id"]
    assert httpx.post(f"{base}/allowances/{qid}/consume", json={"scopeId": live}, headers=_h(daemon)).status_code == 200
    r = httpx.post(f"{base}/allowances/{qid}/consume", json={"scopeId": live}, headers=_h(daemon))
    assert r.status_code == 429 and r.json()["error"]["code"] == "ALLOWANCE_EXHAUSTED"
    assert float(r.headers["retry-after"]) > 0
    # names with '/' and spaces route on the raw path
    r = httpx.put(f"{base}/runs/a%2Fb%20c", json={}, headers=_h(daemon))
    assert r.status_code == 200 and r.json()["name"] == "a/b c"
    # a method the path does not take: 405 naming the ones it takes (issue 41, item 10)
    r = httpx.delete(f"{base}/scopes/{run}", headers=_h(daemon))
    assert r.status_code == 405 and r.json()["error"]["code"] == "VALIDATION_FAILED"
    assert r.headers["allow"] == "GET"


def _parked_http(d: HttpDaemon) -> int:
    """Server-side waits parked now (``GET ops/waits``, every kind)."""
    return sum(httpx.get(f"{d.base_url}/v1/spaces/{d.space}/ops/waits", headers=_h(d)).json()["parked"].values())


def test_long_polls_are_held_and_a_disconnect_ends_them(daemon):
    base = f"{daemon.base_url}/v1/spaces/{daemon.space}"
    run = httpx.post(f"{base}/scopes", json={}, headers=_h(daemon)).json()["id"]
    mbx = httpx.post(f"{base}/mailboxes", json={"name": "lp-q"}, headers=_h(daemon)).json()["id"]
    t0 = time.monotonic()
    r = httpx.post(f"{base}/tasks/admit", json={"scopeId": run, "mailboxId": mbx, "waitMs": 1200},
                   headers=_h(daemon), timeout=10)
    assert r.status_code == 204 and time.monotonic() - t0 >= 1.0
    # a client that gives up on an admit (closes its connection): the wait ends, nothing
    # is leased to it
    parked = _parked_http(daemon)
    body = json.dumps({"scopeId": run, "mailboxId": mbx, "waitMs": 60000}).encode()
    host, port = daemon.base_url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as gone:
        gone.sendall(f"POST /v1/spaces/{daemon.space}/tasks/admit HTTP/1.1\r\nhost: {host}\r\n"
                     f"authorization: Bearer {daemon.secret}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body)
        until_sync(lambda: _parked_http(daemon) > parked, what="the admit parked on the server")
    # (ended by the disconnect: its own 60 s are far from up)
    until_sync(lambda: _parked_http(daemon) == parked, timeout=30, what="the abandoned admit's wait ended")
    tid = httpx.post(f"{base}/tasks", json={"scopeId": run, "mailboxId": mbx, "taskKey": "k", "input": 1},
                     headers=_h(daemon)).json()["taskId"]
    assert httpx.get(f"{base}/tasks/{tid}", headers=_h(daemon)).json()["state"] == "QUEUED"
    # a task result long poll answers as soon as the task ends
    got = httpx.post(f"{base}/tasks/admit", json={"scopeId": run, "mailboxId": mbx}, headers=_h(daemon)).json()

    def finish():  # once the long poll below is parked
        until_sync(lambda: _parked_http(daemon) > parked, what="the result long poll parked on the server")
        httpx.post(f"{base}/messages/{got['messageId']}/complete",
                   json={"token": got["token"], "result": {"payload": "done"}}, headers=_h(daemon))

    threading.Thread(target=finish).start()
    t0 = time.monotonic()
    v = httpx.get(f"{base}/tasks/{tid}", params={"waitMs": 20000}, headers=_h(daemon), timeout=30).json()
    assert v["state"] == "SUCCEEDED" and v["outcome"] == "done" and time.monotonic() - t0 < 5


SLOTS_AT_ADMISSION = r'''
import asyncio, json, os
import runstate
rs = runstate.Runstate(run=os.environ["RUN_NAME"], worker="slots-worker")
running = peak = 0
async def main():
    global running, peak
    await rs.asetup(slots={"gpu-adm": {"max": 1}})
    @rs.queue("render-adm", slots="gpu-adm", concurrency=4)
    async def render(n):
        global running, peak
        running += 1; peak = max(peak, running)
        await asyncio.sleep(0.1)
        running -= 1
        return n
    serving = asyncio.create_task(rs.aserve())
    try:
        out = await asyncio.gather(*(render(n) for n in range(4)))
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    st = await rs.astatus()
    return out
out = asyncio.run(main())
print(json.dumps({"out": out, "peak": peak}))
'''


def test_slots_are_held_at_admission(daemon, py03):
    """A 0.3 queue with ``slots=`` (a pool of 1) and ``concurrency=4``: the pool units are
    taken when a task is admitted and given back when it ends, so one runs at a time."""
    out = run_script(py03, daemon, SLOTS_AT_ADMISSION, env={"RUN_NAME": "slots-adm"})
    assert out == {"out": [0, 1, 2, 3], "peak": 1}
    pools = httpx.get(f"{daemon.base_url}/v1/spaces/{daemon.space}/permits", headers=_h(daemon)).json()["permits"]
    (gpu,) = [x for x in pools if x["name"] == "gpu-adm"]
    assert gpu["unitsTotal"] == 1 and gpu["unitsUsed"] == 0


TOO_LARGE_03 = r'''
import asyncio, json, os, time
import runstate
rs = runstate.Runstate(run=os.environ["RUN_NAME"], worker="too-large-worker")
async def main():
    out = {}
    @rs.queue("too-large-q", attempts=3)
    async def big(n):
        return "x" * 100_000          # encoded: over the 64 KiB payload limit
    serving = asyncio.create_task(rs.aserve())
    try:
        job = await big.asend(1)
        t0 = time.monotonic()
        try:
            await job.aresult(timeout="50s"); out["result"] = "returned"
        except runstate.TaskFailedError as e:
            out["result"] = ["TaskFailedError", e.reason]
        except TimeoutError:
            out["result"] = "timeout"
        out["took"] = time.monotonic() - t0
        out["job"] = job.id
        try:
            await big.asend("y" * 70_000); out["input"] = "accepted"
        except runstate.ResultTooLargeError as e:
            out["input"] = ["ResultTooLargeError", e.code, e.message]
        except runstate.RunstateError as e:
            out["input"] = [type(e).__name__, e.code, e.message]
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    return out
print(json.dumps(asyncio.run(main())))
'''


def test_a_result_or_input_over_64_kib_is_too_large_for_the_sdk_at_once(daemon, py03):
    """Issue 31 item 1: a 0.3 worker whose handler returns more than 64 KiB gets the
    server's VALIDATION_FAILED as ResultTooLargeError (the SDK matches ``exceeds N bytes``)
    and rejects the job at once: FAILED on its first attempt, not after waiting out the
    lease on every attempt; an input over 64 KiB is ResultTooLargeError at send."""
    out = run_script(py03, daemon, TOO_LARGE_03, env={"RUN_NAME": "too-large"}, timeout=120)
    assert out["result"][0] == "TaskFailedError", out
    assert "over 64 KB" in out["result"][1], out   # the SDK's own reject text, after ResultTooLargeError
    task = httpx.get(f"{daemon.base_url}/v1/spaces/{daemon.space}/tasks/{out['job']}", headers=_h(daemon)).json()
    assert (task["state"], task["attempt"]) == ("FAILED", 1), task
    kind, code, message = out["input"]
    assert (kind, code) == ("ResultTooLargeError", "VALIDATION_FAILED"), out
    assert "exceeds 65536 bytes" in message and "input" in message, message


def _readme_runstate_block() -> str:
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("## Using the runstate SDK with rallypoint")
    return re.search(r"```sh\n(.*?)```", text[start:], re.S).group(1)


README_PROGRAM = r'''
import runstate
rs = runstate.Runstate(run="readme-setup")
print("RUN", rs.run_id())
'''


@pytest.mark.parametrize("with_keys", [False, True], ids=["open-mode", "with-keys"])
def test_the_readme_runstate_setup_runs_as_written(tmp_path, py03, with_keys):
    """Issue 31 item 15: the README's runstate set-up, as written (a free port instead of
    8080, the test's SDK environment as ``sdk-env``), works in open mode -- where
    RALLYPOINT_API_KEY is unset and the SDK refuses an empty key -- and with keys."""
    import os
    import subprocess
    import sys

    lines = [ln.split("  #")[0].strip() for ln in _readme_runstate_block().splitlines() if ln.strip()]
    venv, serve, exports = lines[0], lines[1], lines[2:]
    assert venv.startswith("python3 -m venv sdk-env") and "install runstate-sdk" in venv  # what sdk_compat does
    assert serve == "rallypoint serve --http 127.0.0.1:8080" and all(x.startswith("export ") for x in exports)
    os.makedirs(tmp_path / "sdk-env" / "bin")
    wrapper = tmp_path / "sdk-env" / "bin" / "python"  # (a symlink would lose the venv's site-packages)
    wrapper.write_text(f'#!/bin/sh\nexec "{py03}" "$@"\n')
    wrapper.chmod(0o755)
    (tmp_path / "your_program.py").write_text(README_PROGRAM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RALLYPOINT_", "RUNSTATE_"))}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    data = str(tmp_path / "data")
    if with_keys:
        r = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "create", "--data-dir", data, "--space",
                            "default", "--permission", "operator", "--name", "ops", "--secret-only"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        env["RALLYPOINT_API_KEY"] = r.stdout.strip()
    args = serve.replace("8080", str(port)).split()[1:]
    d = subprocess.Popen([sys.executable, "-m", "rallypoint", *args, "--listen", "127.0.0.1:0", "--data-dir", data],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        while not d.stdout.readline().startswith("HTTP "):
            assert d.poll() is None, "the daemon did not start"
        script = "\n".join(x.replace("8080", str(port)) for x in exports) + "\nsdk-env/bin/python your_program.py\n"
        r = subprocess.run(["bash", "-ec", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.startswith("RUN scp_"), r.stdout
    finally:
        d.terminate()
        d.wait(30)


RESTART_WORKER_03 = r'''
import json, os, sys, threading, time
import runstate
marker = os.environ["MARKER"]
rs = runstate.Runstate(run="restart-run", worker="restart-worker")
starts = []
@rs.queue("restart-q", lease="5s", attempts=3)
def long_job(n):
    starts.append(runstate.context().attempt)
    print("START", len(starts), flush=True)
    while not os.path.exists(marker):
        time.sleep(0.02)
    return n * 10
threading.Thread(target=rs.serve, daemon=True).start()
producer = runstate.Runstate(run="restart-run", worker="restart-producer")
# (the same attempts as the worker: whichever declares the queue first, the other agrees)
result = producer.queue("restart-q", attempts=3).send(7).result(timeout="120s")
print(json.dumps({"result": result, "starts": starts}), flush=True)
'''


def test_a_runstate_worker_keeps_its_job_across_a_daemon_restart(tmp_path, py03):
    """Issue 31 item 5: a 0.3 worker holding a job (5 s lease, renewed every ~1.7 s)
    while the daemon restarts (SIGTERM, then the same command again) keeps it: its
    renewals sent meanwhile wait in the listening socket's backlog (kept open by the
    supervisor -- here this test -- across the restart, RALLYPOINT_LISTEN_FDS) and are
    answered once the new process serves, and the lease was extended by everything the
    server could not hear (drain, exit, start-up, recovery), so they are in time. The
    job runs once, attempt 1, long after its first lease would have run out."""
    import os
    import subprocess

    socks = []
    for _ in range(2):  # the daemon's --listen and --http, held by the "supervisor"
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(128)
        s.set_inheritable(True)
        socks.append(s)
    (tcp_port, http_port) = (s.getsockname()[1] for s in socks)
    fds = tuple(s.fileno() for s in socks)
    d = HttpDaemon(str(tmp_path / "data"), durability="fsync", open_mode=True, space="default",
                   extra=["--listen", f"127.0.0.1:{tcp_port}", "--http", f"127.0.0.1:{http_port}"],
                   pass_fds=fds, env={"RALLYPOINT_LISTEN_FDS": ",".join(map(str, fds))}).start()
    marker = tmp_path / "finish"
    env = d.sdk_env()
    env["MARKER"] = str(marker)
    worker = subprocess.Popen([py03, "-c", RESTART_WORKER_03], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert worker.stdout.readline().split() == ["START", "1"], worker.stderr.read()[-3000:]
        base = f"{d.base_url}/v1/spaces/default"
        (mbx,) = [m["id"] for m in httpx.get(f"{base}/mailboxes").json()["mailboxes"] if m["name"] == "restart-q"]
        (task,) = httpx.get(f"{base}/mailboxes/{mbx}/messages").json()["messages"]
        assert d.stop() == 0  # SIGTERM: drain, final snapshot, exit
        d.start()  # the same command again (the held sockets: no connect is refused meanwhile)
        ready = time.monotonic()
        # one full lease and more after the restart, the job is still this worker's
        while time.monotonic() < ready + 7:
            v = httpx.get(f"{base}/tasks/{task['id']}").json()
            assert (v["state"], v["attempt"]) == ("RUNNING", 1), v
            time.sleep(0.2)
        marker.touch()
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"result": 70, "starts": [1]}, out + err[-2000:]
        v = httpx.get(f"{base}/tasks/{task['id']}").json()
        assert (v["state"], v["attempt"], v["outcome"]) == ("SUCCEEDED", 1, 70), v
    finally:
        if worker.poll() is None:
            worker.kill()
        assert d.stop() == 0, d.log.read_text()[-3000:]
        for s in socks:
            s.close()


HOLDER_03 = r'''
import json, os, threading
import runstate

rs = runstate.Runstate(run=os.environ["RUN_NAME"], worker="holder-sdk-1")

@rs.queue("holder-work")
def work(doc):
    return doc["n"] + 1

stop = threading.Event()
server = threading.Thread(target=rs.serve, kwargs={"signal": stop})
server.start()
try:
    got = [work({"n": 1}), work({"n": 2})]
finally:
    stop.set(); server.join(30)
print(json.dumps({"run_id": rs.run_id(), "got": got}))
'''


def test_sdk03_worker_id_is_each_deliverys_holder(daemon, py03):
    """Issue 32 item 2: the worker id runstate 0.3 sends with its admits (``holder``) is
    recorded as each delivery's holder: on the task and in its task.delivered event."""
    out = run_script(py03, daemon, HOLDER_03, env={"RUN_NAME": "holder-03"})
    assert out["got"] == [2, 3]
    base = f"{daemon.base_url}/v1/spaces/{daemon.space}"
    h = {"authorization": f"Bearer {daemon.secret}"}
    evs = httpx.get(f"{base}/events", params={"types": "task.delivered", "scopeId": out["run_id"]}, headers=h,
                    timeout=30).json()["events"]
    assert len(evs) == 2 and {e["payload"]["holder"] for e in evs} == {"holder-sdk-1"}, evs
    for e in evs:
        task = httpx.get(f"{base}/tasks/{e['aggregateId']}", headers=h, timeout=30).json()
        assert task["state"] == "SUCCEEDED" and task["holder"] == "holder-sdk-1"
