"""What the simulator knows about each kind: its random operations, what a reply lets a
client rely on, and the invariants of its state. One class per kind, listed in
:data:`KINDS`: a new kind (claims, pools, quotas, budgets...) adds one class here and
nothing else in the simulator changes.

A :class:`SimKind` has (every method optional):

- ``ops``: ``{name: (weight, generator)}``; ``generator(gen)`` returns a protocol op
  (or a list of ops sent back to back, or a :class:`Script`), or None when the world
  has nothing to aim it at. ``gen`` (:class:`Gen`) gives the shared :class:`World`, a
  random source for this op only, and the server's wall time.
- ``observe(obs, op, reply, err)``: a reply (a decoded view, or the RallypointError)
  was released to a client: learn ids (``obs.world``) and record *facts* -- what the
  client may rely on from now on, forever (``obs.fact(...)``). Facts are checked at
  once against the durable state (what a crash would recover), after every step
  against the live state, and after every restart against the recovered state.
- ``check_fact(coord, fact)``: None when ``fact`` holds in ``coord``, else why not.
  (``fact_invariants`` names the invariant of a fact that a reply showed wrongly --
  the live state does not hold it either; otherwise it is a ``durability`` failure.)
- ``made(chk, coord, op, reply, err)``: the reply was just made (the state it was made
  from is the live state, unchanged): is it consistent with it?
- ``quiescent(chk, coord)``: every task is blocked, time stands still: nothing due is
  pending (timeliness), nothing is pending under an ended run, models agree.
- ``waiter_due(coord, actor_id, key, waiters)``: a waiter parked on ``key`` in that
  actor has an answer now (True), has none yet (False), or the key is another kind's
  (None); ``waiters`` are the parked :class:`~rallypoint.actors.runtime.Waiter`s (a
  kind whose check is pure may call ``w.park.check()``). At quiescence a parked waiter
  with an answer is a lost wake-up.
- ``monotone(coord)``: ``{entity id: value}`` of what may only move forward; and
  ``regressed(eid, old, new)`` says why a change is a regression (None: fine).
- ``audits()``: ``{record type: fn(chk, mirror, rec, now_ms, mono_ms)}`` run on every
  journal append against the state *before* the record (a reference check of
  preconditions: fencing, decide-once, timing).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from .. import protocol as p
from .. import records as r
from ..clock import to_iso
from ..errors import RallypointError

__all__ = ["KINDS", "SimKind", "World", "Gen", "Script", "ended", "SLACK_MS"]

from ..actors.queue_state import DEFAULT_PRIORITY
TERMINAL = frozenset({"SUCCEEDED", "ACKED", "FAILED", "CANCELLED", "EXPIRED"})
DONE = frozenset({"SUCCEEDED", "ACKED"})  # a task / a message completed
#: timing tolerance of the checks, ms (ms rounding between Trio time and wall/server ms)
SLACK_MS = 2


def _raw(value) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(value))


def ended(coord, run_id: str | None) -> str | None:
    """Why ``run_id`` (or an ancestor) ended by a record -- cancelled, completed or its
    deadline fired -- or None while it and its ancestors stand."""
    table = coord.runs.table
    s = table.get(run_id) if run_id else None
    while s is not None:
        if s.state != "ACTIVE":
            return f"run {s.id} {s.state}"
        if s.deadline_fired:
            return f"run {s.id} past its deadline"
        s = table.get(s.parent_id) if s.parent_id else None
    return None


# ============================================================================ the world
class World:
    """What the simulated clients know, learned from replies (shared by all clients).

    ``ids[prefix]`` lists every id seen, in order; ``info[id]`` holds what the kinds
    noted about it; kinds keep anything else as attributes they set in ``init_world``."""

    def __init__(self) -> None:
        self.ids: dict[str, list[str]] = {}
        self.known: set[str] = set()
        self.info: dict[str, dict] = {}

    def add(self, eid: str | None, **info) -> None:
        if not eid:
            return
        if eid not in self.known:
            self.known.add(eid)
            self.ids.setdefault(eid[:3], []).append(eid)
            self.info[eid] = dict(info)
        elif info:
            self.info[eid].update(info)

    def pick(self, rng: random.Random, prefix: str, recent: float = 0.6) -> str | None:
        """A known id of that prefix, biased to the most recent ones."""
        lst = self.ids.get(prefix)
        if not lst:
            return None
        if rng.random() < recent:
            return lst[-1 - min(len(lst) - 1, int(rng.expovariate(0.7)))]
        return rng.choice(lst)


@dataclass
class Gen:
    """What an op generator sees: the world, its own random source, the server's wall
    time (ms)."""

    world: World
    rng: random.Random
    now_ms: int

    def iso_in(self, lo_s: float, hi_s: float) -> str:
        return to_iso(self.now_ms + int(self.rng.uniform(lo_s, hi_s) * 1000))

    def wait_ms(self) -> int:
        return self.rng.choice((0, 0, 0, 500, 2000, 5000, 15000))


@dataclass
class Script:
    """A sequence of requests whose later ops depend on earlier replies:
    ``await fn(call, call_all)`` with ``call(op) -> reply view or RallypointError`` and
    ``call_all(ops) -> [reply, ...]`` (sent in order, answered concurrently)."""

    fn: Callable
    label: str = "script"


class SimKind:
    """Base class (see the module docstring)."""

    name = ""
    #: the fact names this kind checks (``check_fact``)
    facts: tuple[str, ...] = ()
    #: fact name -> the invariant a reply showing it wrongly violates (when the live
    #: state does not hold it either); the others: ``durability``
    fact_invariants: dict[str, str] = {}

    def init_world(self, world: World) -> None:
        pass

    def ops(self) -> dict[str, tuple[float, Callable[[Gen], Any]]]:
        return {}

    def fallbacks(self, world: World) -> list[str]:
        """Ops to issue instead when one of this kind's ops has nothing to aim at (so a
        schedule's steps are not wasted: they create what later ops need)."""
        return []

    def observe(self, obs, op, reply, err) -> None:
        pass

    def check_fact(self, coord, fact: tuple) -> str | None:  # pragma: no cover - per kind
        return None

    def made(self, chk, coord, op, reply, err) -> None:
        pass

    def quiescent(self, chk, coord) -> None:
        pass

    def waiter_due(self, coord, actor_id: str, key, waiters=()) -> bool | None:
        return None

    def monotone(self, coord) -> dict[str, Any]:
        return {}

    def regressed(self, eid: str, old, new) -> str | None:
        return None

    def audits(self) -> dict[type, Callable]:
        return {}


def _err_detail(err, name: str):
    return (err.details or {}).get(name) if isinstance(err, RallypointError) else None


# ============================================================================ requirements
def requirements(g: Gen, p_none: float = 0.6) -> p.Requirements | None:
    """Admission: sometimes (1 - ``p_none``) what a delivery must hold (pool units, a
    budget amount), over the pools and budgets the world knows; None when it knows none."""
    w = g.world
    if not (w.pools or w.budgets) or g.rng.random() < p_none:
        return None
    pools = {n: g.rng.choice((1, 1, 2)) for n in sorted(w.pools) if g.rng.random() < 0.7}
    budgets = {n: g.rng.choice((100, 300)) for n in sorted(w.budgets) if g.rng.random() < 0.5}
    return p.Requirements(pools=pools, budgets=budgets) if pools or budgets else None


def declared_requirements(g: Gen) -> p.Requirements:
    """What a ``mailbox.ensure`` declares as the queue's default requirements (never None,
    which declares nothing): empty (clears them), an unknown pool or budget (NOT_FOUND),
    more units than a pool has (VALIDATION_FAILED), or :func:`requirements` over the
    pools and budgets the world knows."""
    w, x = g.world, g.rng.random()
    if x < 0.12 or not (w.pools or w.budgets):
        return p.Requirements()
    if x < 0.17:
        return p.Requirements(pools={"nosuch": 1}) if g.rng.random() < 0.5 else p.Requirements(budgets={"nosuch": 100})
    if x < 0.2 and w.pools:
        name = g.rng.choice(sorted(w.pools))
        return p.Requirements(pools={name: POOLS[name] + 1})
    return requirements(g, p_none=0.0) or p.Requirements()


def req_key(pools: dict, budgets: dict) -> tuple | None:
    """Requirements by name in one comparable (hashable) form; None when there are none."""
    if not pools and not budgets:
        return None
    return tuple(sorted(pools.items())), tuple(sorted(budgets.items()))


def wire_req_key(req: p.Requirements | None) -> tuple | None:
    return None if req is None else req_key(req.pools, req.budgets)


def stored_req_key(coord, stored: r.TaskRequirements | None) -> tuple | None:
    """Stored requirements (pool / budget ids) by name again, read from the pool and budget
    tables themselves (not through ``Admission.describe``, which is under test)."""
    if stored is None:
        return None
    pools, budgets = coord.pools.table, coord.budgets.table
    return req_key({pools[i].name if i in pools else i: n for i, n in stored.pools.items()},
                   {budgets[i].name if i in budgets else i: n for i, n in stored.budgets.items()})


def requirements_fact(obs, task_id: str, own: p.Requirements | None) -> None:
    """A new task (a submission without a key: it made the task) holds its own
    requirements, or, without any, the ones its mailbox declared when its
    ``TaskSubmitted`` was journaled (noted by the audit: ``world.submit_defaults``)."""
    want = wire_req_key(own)
    if want is not None:
        obs.fact("task_requirements", task_id, want, "its own")
    elif task_id in obs.world.submit_defaults:
        obs.fact("task_requirements", task_id, obs.world.submit_defaults[task_id], "its mailbox's")


# ============================================================================ runs
class SimRuns(SimKind):
    name = "runs"
    facts = ("run_ended",)

    def fallbacks(self, world):
        return ["scope.create"]

    def ops(self):
        def create_root(g: Gen):
            return p.ScopeCreate(
                name=g.rng.choice((None, "job", "crawl")),
                deadline=g.iso_in(2, 90) if g.rng.random() < 0.25 else None,
                child_limit=g.rng.choice((1000, 1000, 2)),
            )

        def create_child(g: Gen):
            parent = g.world.pick(g.rng, "scp")
            if parent is None:
                return create_root(g)
            return p.ScopeCreate(parent_id=parent, deadline=g.iso_in(1, 60) if g.rng.random() < 0.2 else None)

        def cancel(g: Gen):
            rid = g.world.pick(g.rng, "scp", recent=0.3)
            return rid and p.ScopeCancel(scope_id=rid)

        def complete(g: Gen):
            rid = g.world.pick(g.rng, "scp", recent=0.3)
            return rid and p.ScopeComplete(scope_id=rid, wait_ms=g.rng.choice((0, 0, 3000, 20000)))

        def status(g: Gen):
            rid = g.world.pick(g.rng, "scp")
            return rid and p.ScopeStatus(scope_id=rid)

        return {
            "scope.create": (2.0, create_root),
            "scope.child": (3.0, create_child),
            "scope.cancel": (0.8, cancel),
            "scope.complete": (0.8, complete),
            "scope.status": (0.6, status),
        }

    def observe(self, obs, op, reply, err):
        if isinstance(reply, p.ScopeView):
            obs.world.add(reply.id, parent=reply.parent_id)
            obs.fact("exists", reply.id)
            if reply.stored_state in ("CANCELLED", "COMPLETED"):
                obs.fact("run_ended", reply.id, reply.stored_state)
        elif err is not None and err.code == "SCOPE_CANCELLED":
            sid, why = _err_detail(err, "scope_id"), _err_detail(err, "reason")
            if sid and why in ("cancelled", "completed"):
                obs.fact("run_ended", sid, "CANCELLED" if why == "cancelled" else "COMPLETED")

    def check_fact(self, coord, fact):
        if fact[0] == "run_ended":
            s = coord.runs.table.get(fact[1])
            if s is None or s.state != fact[2]:
                return f"run {fact[1]} was seen {fact[2]}, is {s.state if s else 'missing'}"
        return None

    def quiescent(self, chk, coord):
        now = coord.now_ms()
        for s in coord.runs.table.values():
            if s.deadline_ms is not None and not s.deadline_fired and s.deadline_ms + SLACK_MS < now:
                chk.fail("timeliness", f"run {s.id}'s deadline passed {now - s.deadline_ms} ms ago and did not fire")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if key != "complete":
            return None
        s = coord.runs.table[actor_id]
        if s.state != "ACTIVE":
            return True
        sets = [coord.joinsets.table[j] for j in coord.joinsets.by_run.get(actor_id, ())]
        return any(js.state == "OPEN" for js in sets) or all(js.state == "CLOSED" for js in sets)

    def monotone(self, coord):
        return {s.id: (s.state, s.deadline_fired) for s in coord.runs.table.values()}

    def regressed(self, eid, old, new):
        if old[0] != "ACTIVE" and new[0] != old[0]:
            return f"run {eid} went from {old[0]} to {new[0]}"
        if old[1] and not new[1]:
            return f"run {eid}'s fired deadline came back"
        return None

    def audits(self):
        def ended_rec(chk, m, rec: r.ScopeEnded, now, mono):
            s = m.runs.table.get(rec.id)
            if s is None or s.state != "ACTIVE":
                chk.fail("audit", f"ScopeEnded({rec.state}) for run {rec.id} that is {s.state if s else 'missing'}")

        def deadline(chk, m, rec: r.ScopeDeadlinePassed, now, mono):
            s = m.runs.table.get(rec.id)
            if s is None or s.deadline_fired:
                chk.fail("audit", f"ScopeDeadlinePassed twice for run {rec.id}")
            elif s.deadline_ms is None or now + SLACK_MS < s.deadline_ms:
                chk.fail("timeliness", f"run {rec.id}'s deadline fired {s.deadline_ms - now} ms early")

        return {r.ScopeEnded: ended_rec, r.ScopeDeadlinePassed: deadline}


# ============================================================================ queues
MAILBOXES = ("q0", "q1")


def _scheduling(mailbox: str, n: int) -> dict:
    """Issue 44: the tasks of ``q1`` carry a priority (1..5) and a fairness key (one of
    three, or none) derived from their input's number (no draw of the generator: the
    schedules of every seed stay what they were up to the order of deliveries); ``q0``
    stays plain first in, first out."""
    if mailbox != "q1":
        return {}
    return {"priority": 1 + n % 5, "fair_key": ("ta", "tb", None)[(n // 5) % 3]}


class SimQueues(SimKind):
    """Work queues, tasks and deliveries; the lease model (``sim.leases``)."""

    name = "queues"
    facts = ("task_terminal", "task_token_ge", "task_attempt_ge", "task_completed_with", "task_requirements")
    fact_invariants = {"task_requirements": "defaults"}

    def init_world(self, world):
        world.deliveries = []  # (task id, token), every delivery ever seen (held or stale)
        world.released_attempt = {}  # task id -> its attempt when its holder released it
        world.mailbox_attempts = {}
        # task id -> its mailbox's default requirements (req_key) when its TaskSubmitted
        # was journaled (the audit notes it, from the state before the record)
        world.submit_defaults = {}

    def fallbacks(self, world):
        if world.ids.get("tsk") and not world.deliveries:
            return ["receive", "task.submit"]
        return ["task.submit", "mailbox.ensure"]

    def ops(self):
        def mailbox(g: Gen):
            return g.rng.choice(MAILBOXES) if g.world.ids.get("mbx") or g.rng.random() < 0.8 else "nosuch"

        def ensure(g: Gen, declare: float = 0.25):
            """A producer's ensure (declares nothing, mostly) or, with ``declare``, a
            worker's: default requirements for the queue's tasks (mailbox.declare)."""
            name = g.rng.choice(MAILBOXES)
            attempts = g.world.mailbox_attempts.get(name) or g.rng.choice((1, 2, 3, 5))
            if g.rng.random() < 0.1:
                attempts = g.rng.choice((1, 2, 3, 5))  # maybe a CONFLICT
            reqs = None
            if g.rng.random() < declare and (g.world.pools or g.world.budgets or g.rng.random() < 0.2):
                reqs = declared_requirements(g)
            return p.MailboxEnsure(name=name, max_attempts=attempts, requirements=reqs)

        def declare(g: Gen):
            """A worker declaring its queue's default requirements (empty: clearing them);
            while the world knows no pool or budget to require, it makes one first."""
            if g.world.pools or g.world.budgets:
                return ensure(g, declare=1.0)
            first = (p.PoolEnsure(name="p0", units_total=POOLS["p0"]) if g.rng.random() < 0.6
                     else p.BudgetEnsure(name="b0", limit_minor=BUDGETS["b0"]))
            reqs = (p.Requirements(pools={"p0": g.rng.choice((1, 2))}) if isinstance(first, p.PoolEnsure)
                    else p.Requirements(budgets={"b0": g.rng.choice((100, 300))}))
            then = msgspec.structs.replace(ensure(g, declare=0.0), requirements=reqs)

            async def script(call, call_all):
                await call(first)
                await call(then)

            return Script(script, label="declare")

        def submit(g: Gen):
            run = g.world.pick(g.rng, "scp")
            if run is None:
                return None
            key = g.rng.choice((None, None, "k0", "k1", "k2"))
            name = mailbox(g)
            n = g.rng.randrange(3) if key else g.rng.randrange(10**6)
            return p.TaskSubmit(
                mailbox=name, scope_id=run, input=_raw({"n": n}),
                key=key, deadline=g.iso_in(1, 60) if g.rng.random() < 0.15 else None, requirements=requirements(g),
                **_scheduling(name, n),
            )

        def submit_many(g: Gen):
            run = g.world.pick(g.rng, "scp")
            if run is None:
                return None
            name = mailbox(g)
            items = []
            for _ in range(g.rng.randint(1, 4)):
                n = g.rng.randrange(10**6)
                items.append(p.SubmitItem(input=_raw({"m": n}), key=g.rng.choice((None, None, "k0", "k3")),
                                          requirements=requirements(g, p_none=0.75), **_scheduling(name, n)))
            return p.TaskSubmitMany(mailbox=name, scope_id=run, items=items)

        def receive(g: Gen):
            run = g.world.pick(g.rng, "scp", recent=0.4)
            if run is None:
                return None
            return p.Receive(mailbox=mailbox(g), scope_id=run, lease_ms=g.rng.choice((5000, 8000, 30000)),
                             wait_ms=g.wait_ms(), max_messages=g.rng.choice((1, 1, 2, 5)))

        def delivery(g: Gen):
            ds = g.world.deliveries
            if not ds:
                return None
            if g.rng.random() < 0.7:
                return ds[-1 - min(len(ds) - 1, int(g.rng.expovariate(0.5)))]
            return g.rng.choice(ds)

        def renew(g: Gen):
            d = delivery(g)
            return d and p.DeliveryRenew(task_id=d[0], token=d[1], lease_ms=g.rng.choice((5000, 10000, 30000)))

        def complete(g: Gen):
            d = delivery(g)
            return d and p.DeliveryComplete(task_id=d[0], token=d[1], outcome=_raw({"ok": g.rng.randrange(100)}))

        def retry(g: Gen):
            d = delivery(g)
            return d and p.DeliveryRetry(task_id=d[0], token=d[1], delay_ms=g.rng.choice((0, 0, 1000, 4000)),
                                         error=_raw("try again"))

        def reject(g: Gen):
            d = delivery(g)
            return d and p.DeliveryReject(task_id=d[0], token=d[1], error=_raw("no"))

        def release(g: Gen):
            d = delivery(g)
            return d and p.DeliveryRelease(task_id=d[0], token=d[1])

        def task(g: Gen):
            return g.world.pick(g.rng, "tsk")

        def status(g: Gen):
            t = task(g)
            return t and p.TaskStatus(task_id=t)

        def result(g: Gen):
            t = task(g)
            return t and p.TaskResult(task_id=t, wait_ms=g.wait_ms())

        def cancel(g: Gen):
            t = task(g)
            return t and p.TaskCancel(task_id=t)

        def results(g: Gen):
            ids = g.world.ids.get("tsk")
            if not ids:
                return None
            pick = sorted({g.rng.choice(ids[-6:]) for _ in range(g.rng.randint(1, 4))})
            return p.TaskResults(task_ids=pick, wait_ms=g.wait_ms(), brief=g.rng.random() < 0.5)

        def complete_many(g: Gen):
            ds = g.world.deliveries
            if not ds:
                return None
            first = delivery(g)
            run = g.world.info.get(first[0], {}).get("run")
            same = [d for d in ds[-8:] if g.world.info.get(d[0], {}).get("run") == run] if run else []
            items = [first] + g.rng.sample(same, min(len(same), g.rng.randint(0, 3)))
            return p.DeliveryCompleteMany(items=[p.CompleteItem(task_id=t, token=k, outcome=_raw({"ok": i}))
                                                 for i, (t, k) in enumerate(items)], brief=g.rng.random() < 0.5)

        return {
            "mailbox.ensure": (1.0, ensure),
            "mailbox.declare": (3.0, declare),
            "task.submit": (6.0, submit),
            "task.submit_many": (1.0, submit_many),
            "receive": (5.0, receive),
            "delivery.renew": (1.5, renew),
            "delivery.complete": (4.0, complete),
            "delivery.retry": (1.2, retry),
            "delivery.reject": (0.7, reject),
            "delivery.release": (0.5, release),
            "task.status": (0.5, status),
            "task.result": (1.5, result),
            "task.cancel": (0.7, cancel),
            "task.results": (1.0, results),
            "delivery.complete_many": (1.5, complete_many),
        }

    def observe(self, obs, op, reply, err):
        w = obs.world
        if isinstance(reply, p.MailboxView):
            w.add(reply.id)
            w.mailbox_attempts[reply.name] = reply.max_attempts
            obs.fact("exists", reply.id)
        elif isinstance(reply, p.TaskView):
            self._task(obs, reply)
            if isinstance(op, p.DeliveryComplete):
                obs.fact("task_completed_with", op.task_id, op.token)
            elif isinstance(op, p.TaskSubmit) and op.key is None:
                requirements_fact(obs, reply.id, op.requirements)
        elif isinstance(reply, p.TaskListView):
            for t in reply.tasks:
                self._task(obs, t)
            if isinstance(op, p.TaskSubmitMany):
                for item, tid in zip(op.items, reply.ids or [t.id for t in reply.tasks]):
                    if item.key is None:
                        requirements_fact(obs, tid, item.requirements)
            for o in reply.outcomes:  # a brief task.results
                obs.fact("task_attempt_ge", o.id, o.attempt)
                if o.state in TERMINAL:
                    obs.fact("task_terminal", o.id, o.state, bytes(o.outcome) if o.state in DONE else None)
        elif isinstance(reply, p.SettledListView) and isinstance(op, p.DeliveryCompleteMany):
            for it, item in zip(op.items, reply.items):
                if item.error is None:
                    obs.fact("task_completed_with", it.task_id, it.token)
                    if item.task is not None:
                        self._task(obs, item.task)
        elif isinstance(reply, p.ReceiveView):
            for d in reply.deliveries:
                w.add(d.task_id)
                w.deliveries.append((d.task_id, d.token))
                obs.fact("exists", d.task_id)
                obs.fact("task_token_ge", d.task_id, d.token)
        elif isinstance(reply, p.LeaseView):
            obs.fact("task_token_ge", reply.task_id, reply.token)

    @staticmethod
    def _task(obs, t: p.TaskView) -> None:
        obs.world.add(t.id, run=t.scope_id)
        obs.world.add(t.scope_id)
        obs.fact("exists", t.id)
        obs.fact("task_attempt_ge", t.id, t.attempt)
        if t.state in TERMINAL:
            obs.fact("task_terminal", t.id, t.state, bytes(t.outcome) if t.state in DONE else None)

    def check_fact(self, coord, fact):
        what = fact[0]
        t = coord.queues.tasks.get(fact[1])
        if t is None:
            return f"task {fact[1]} is missing"
        if what == "task_terminal":
            out = t.outcome if t.outcome is not None else b"\xc0"
            if t.state != fact[2] or (fact[3] is not None and out != fact[3]):
                return f"task {t.id} was seen {fact[2]}, is {t.state}"
        elif what == "task_token_ge":
            if t.token < fact[2]:
                return f"task {t.id} handed out token {fact[2]}, holds token {t.token}: a token could be honoured twice"
        elif what == "task_attempt_ge":
            if t.attempt < fact[2]:
                return f"task {t.id} was seen at attempt {fact[2]}, is at {t.attempt}"
        elif what == "task_completed_with":
            if t.state not in DONE or t.token != fact[2]:
                return (f"a complete with token {fact[2]} of task {t.id} succeeded, but the task is "
                        f"{t.state} with token {t.token} (a stale token was honoured)")
        elif what == "task_requirements":
            have = stored_req_key(coord, t.requirements)
            if have != fact[2]:
                return (f"task {t.id} holds requirements {have}; it should hold {fact[3]}: {fact[2]} (a task's own "
                        "requirements replace its mailbox's; without any it gets the mailbox's at its submission)")
        return None

    # ------------------------------------------------------------------ made-time checks
    def made(self, chk, coord, op, reply, err):
        if isinstance(op, p.Receive):
            q = coord.queues.by_name.get(("default", op.mailbox))
            if q is None or err is not None or reply is None:
                return
            eligible = self._eligible(coord, q, op.scope_id)
            if not reply.deliveries:
                if eligible and coord.runs.inactive_error(op.scope_id) is None:
                    chk.fail("receive", f"receive({op.mailbox}, {op.scope_id}) answered nothing while "
                                        f"{len(eligible)} task(s) were ready in its subtree: {eligible[:3]}")
            else:
                seqs = []
                for d in reply.deliveries:
                    t = coord.queues.tasks[d.task_id]
                    seqs.append(t.seq)
                    if not coord.runs.is_descendant_or_self(t.scope_id, op.scope_id):
                        chk.fail("receive", f"receive for run {op.scope_id} got task {t.id} of run {t.scope_id}")
                    if t.state != "RUNNING" or t.token != d.token:
                        chk.fail("receive", f"delivered task {t.id} is {t.state} with token {t.token}, not {d.token}")
                self._check_order(chk, coord, op, reply, eligible)
        elif isinstance(op, p.DeliveryCompleteMany) and err is None and reply is not None:
            for it, item in zip(op.items, reply.items):
                t = coord.queues.tasks.get(it.task_id)
                if item.error is None and t is not None and (t.token != it.token or t.state not in DONE):
                    chk.fail("fencing", f"complete_many: the item with token {it.token} of task {t.id} was accepted; "
                                        f"the task holds token {t.token} and is {t.state}")
        elif isinstance(op, p.DeliveryComplete) and err is None and reply is not None:
            t = coord.queues.tasks.get(op.task_id)
            if t is not None and (t.token != op.token or t.state not in DONE):
                chk.fail("fencing", f"complete with token {op.token} of task {t.id} succeeded; the task holds "
                                    f"token {t.token} and is {t.state}")
        elif isinstance(op, p.MailboxEnsure) and err is None and reply is not None:
            q = coord.queues.table.get(reply.id)
            have = stored_req_key(coord, q.requirements) if q is not None else None
            if wire_req_key(reply.requirements) != have:
                chk.fail("defaults", f"mailbox.ensure({op.name}) shows default requirements "
                                     f"{wire_req_key(reply.requirements)}; the mailbox holds {have}")
            if op.requirements is not None and wire_req_key(op.requirements) != have:
                chk.fail("defaults", f"mailbox.ensure({op.name}) declared {wire_req_key(op.requirements)} and succeeded; "
                                     f"the mailbox holds {have} (given requirements replace the stored ones)")

    @staticmethod
    def _check_order(chk, coord, op, reply, eligible: list[str]) -> None:
        """Issue 44's order invariant: no task left ready (and eligible) in the receive's
        subtree is more urgent than one it delivered; within one run, priority and
        fairness key, first in, first out; a queue whose tasks carry no priority or key
        is strictly oldest first."""
        tasks = coord.queues.tasks
        got = [tasks[d.task_id] for d in reply.deliveries]
        left = [tasks[e] for e in eligible]
        if not left:
            return
        worst = max(t.priority for t in got)
        best = min(u.priority for u in left)
        if best < worst:
            u = min(left, key=lambda u: u.priority)
            chk.fail("order", f"receive delivered a priority-{worst} task while task {u.id} of priority {best} "
                              "was ready in its subtree")
        for t in got:
            for u in left:
                if (u.scope_id, u.priority, u.fair_key) == (t.scope_id, t.priority, t.fair_key) and u.seq < t.seq:
                    chk.fail("fifo", f"receive delivered seq {t.seq} while seq {u.seq} of the same run, priority "
                                     f"{t.priority} and key {t.fair_key} was ready (not oldest first)")
                    return
        if all(t.priority == DEFAULT_PRIORITY and t.fair_key is None for t in got + left):
            if max(t.seq for t in got) > min(u.seq for u in left):
                chk.fail("fifo", f"receive delivered seq {max(t.seq for t in got)} while seq "
                                 f"{min(u.seq for u in left)} was ready (not oldest first)")

    @staticmethod
    def _eligible(coord, q_id: str, run_id: str) -> list[str]:
        mono = coord.mono_ms()
        runs = coord.runs
        adm = coord.admission
        return [t.id for t in coord.queues.tasks.values()
                if t.mailbox_id == q_id and t.state == "QUEUED" and t.available_at_ms + SLACK_MS <= mono
                and runs.is_descendant_or_self(t.scope_id, run_id)
                and (t.requirements is None or adm.try_take(t, {}))]  # admission: it fits now

    # ------------------------------------------------------------------ quiescence
    def quiescent(self, chk, coord):
        now, mono = coord.now_ms(), coord.mono_ms()
        qs = coord.queues
        for t in qs.tasks.values():
            if t.state in TERMINAL:
                continue
            if t.deadline_ms is not None and t.deadline_ms + SLACK_MS < now:
                chk.fail("timeliness", f"task {t.id} is {t.state} {now - t.deadline_ms} ms past its deadline")
            if t.state == "RUNNING" and t.lease_expires_ms + SLACK_MS < mono:
                chk.fail("timeliness", f"task {t.id}'s lease ran out {mono - t.lease_expires_ms} ms ago; still RUNNING")
            if t.state == "QUEUED" and t.available_at_ms + SLACK_MS < mono and t.id not in qs.ready_set:
                chk.fail("index", f"QUEUED task {t.id} is due but not in the ready index")
            why = ended(coord, t.scope_id)
            if why:
                chk.fail("ended-run", f"task {t.id} is {t.state} under an ended run ({why})")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if isinstance(key, tuple) and key and key[0] == "recv":
            if coord.runs.inactive_error(actor_id) is not None:
                return True
            return bool(self._eligible(coord, key[1], actor_id))
        if isinstance(key, str) and key.startswith("tsk_"):
            return coord.queues.tasks[key].state in TERMINAL
        if isinstance(key, tuple) and key and key[0] == "results":
            return _pure_due(waiters)
        return None

    def monotone(self, coord):
        return {t.id: (t.state, t.outcome, t.token, t.attempt) for t in coord.queues.tasks.values()}

    def regressed(self, eid, old, new):
        if old[0] in TERMINAL and (new[0], new[1]) != (old[0], old[1]):
            return f"task {eid} went from {old[0]} to {new[0]} (a terminal state changed)"
        if new[2] < old[2]:
            return f"task {eid}'s token went back from {old[2]} to {new[2]}"
        if new[3] < old[3]:
            return f"task {eid}'s attempt went back from {old[3]} to {new[3]}"
        return None

    # ------------------------------------------------------------------ audits
    def audits(self):
        def task_of(chk, m, rec, what):
            t = m.queues.tasks.get(rec.task_id)
            if t is None:
                chk.fail("audit", f"{what} for unknown task {rec.task_id}")
            return t

        def holder(chk, m, rec, what, mono):
            t = task_of(chk, m, rec, what)
            if t is None:
                return None
            if t.state != "RUNNING" or t.token != rec.token:
                chk.fail("fencing", f"{what} of task {t.id} with token {rec.token}, but it is {t.state} with token {t.token}")
            elif t.lease_expires_ms + SLACK_MS <= mono:
                chk.fail("fencing", f"{what} of task {t.id} {mono - t.lease_expires_ms} ms after its lease ran out")
            return t

        def delivered(chk, m, rec: r.TaskDelivered, now, mono):
            t = task_of(chk, m, rec, "TaskDelivered")
            if t is None:
                return
            if t.state != "QUEUED":
                chk.fail("audit", f"task {t.id} delivered while {t.state}")
            if rec.token != t.token + 1:
                chk.fail("fencing", f"task {t.id} delivered with token {rec.token} after token {t.token}")
            kept = chk.sim.world.released_attempt.pop(t.id, None)
            if kept is not None and t.attempt != kept:
                chk.fail("audit", f"task {t.id} was released at attempt {kept} but is delivered again as attempt "
                                  f"{t.attempt}: a release must not count an attempt")
            if t.available_at_ms > mono + SLACK_MS:
                chk.fail("timeliness", f"task {t.id} delivered {t.available_at_ms - mono} ms before its retry delay ran out")
            if m.runs.inactive_error(t.scope_id, now) is not None:
                chk.fail("ended-run", f"task {t.id} delivered while its run refuses work")
            chk.sim.lease_granted(t.id, rec.token, rec.lease_expires_ms)

        def completed(chk, m, rec: r.TaskCompleted, now, mono):
            t = holder(chk, m, rec, "TaskCompleted", mono)
            if t is not None and m.runs.inactive_error(t.scope_id, now) is not None:
                chk.fail("ended-run", f"task {t.id} completed while its run refuses work")

        def retried(chk, m, rec, now, mono):
            holder(chk, m, rec, type(rec).__name__, mono)

        def released(chk, m, rec: r.TaskReleased, now, mono):
            t = holder(chk, m, rec, "TaskReleased", mono)
            if t is not None:  # (checked before the apply) the attempt it keeps is the one delivered
                chk.sim.world.released_attempt[t.id] = t.attempt

        def renewed(chk, m, rec: r.LeaseRenewed, now, mono):
            t = holder(chk, m, rec, "LeaseRenewed", mono)
            if t is not None:
                chk.sim.lease_granted(t.id, rec.token, rec.lease_expires_ms)

        def lease_expired(chk, m, rec: r.LeaseExpired, now, mono):
            t = task_of(chk, m, rec, "LeaseExpired")
            if t is None:
                return
            if t.state != "RUNNING" or t.token != rec.token:
                chk.fail("audit", f"LeaseExpired for task {t.id} token {rec.token}, but it is {t.state}/{t.token}")
            due = chk.sim.lease_due(t.id, rec.token)
            if due is not None and mono + SLACK_MS < due:
                chk.fail("lease", f"task {t.id}'s lease (token {rec.token}) expired {due - mono} ms early: the holder "
                                  "was owed that time (downtime and stalls extend leases)")

        def not_terminal(chk, m, rec, now, mono):
            t = task_of(chk, m, rec, type(rec).__name__)
            if t is not None and t.state in TERMINAL:
                chk.fail("audit", f"{type(rec).__name__} for task {t.id} that is already {t.state}")
            if isinstance(rec, r.TaskExpired) and t is not None and (t.deadline_ms is None or now + SLACK_MS < t.deadline_ms):
                chk.fail("timeliness", f"task {t.id} expired before its deadline")

        def submitted(chk, m, rec: r.TaskSubmitted, now, mono):
            q = m.queues.table.get(rec.mailbox_id)
            if q is None:
                chk.fail("audit", f"task {rec.id} submitted to unknown mailbox {rec.mailbox_id}")
                return
            default = stored_req_key(m, q.requirements)
            chk.sim.world.submit_defaults[rec.id] = default
            if default is not None and stored_req_key(m, rec.requirements) is None:
                chk.fail("defaults", f"task {rec.id} was submitted to mailbox {q.name!r} without requirements while "
                                     f"the mailbox declares {default}: it must get them")

        def requirements_set(chk, m, rec: r.MailboxRequirementsSet, now, mono):
            q = m.queues.table.get(rec.id)
            if q is None or q.mode != "WORK":
                chk.fail("audit", f"MailboxRequirementsSet for {q.mode if q else 'unknown'} mailbox {rec.id}")
            elif stored_req_key(m, rec.requirements) == stored_req_key(m, q.requirements):
                chk.fail("audit", f"MailboxRequirementsSet for mailbox {q.name!r} changes nothing (journaled only "
                                  "when they change)")

        return {
            r.TaskSubmitted: submitted,
            r.MailboxRequirementsSet: requirements_set,
            r.TaskDelivered: delivered,
            r.TaskCompleted: completed,
            r.TaskRetried: retried,
            r.TaskRejected: retried,
            r.TaskReleased: released,
            r.LeaseRenewed: renewed,
            r.LeaseExpired: lease_expired,
            r.TaskCancelled: not_terminal,
            r.TaskExpired: not_terminal,
        }


# ============================================================================ groups
def reference_decision(coord, g) -> tuple[str, str] | None:
    """SPEC §4's decision table, written from the SPEC (not from ``Groups.evaluate``):
    the decision the group must have reached given its members now (None: undecided)."""
    tasks = coord.queues.tasks
    accepted = sum(1 for m in g.members if m.verdict == "ACCEPTED" and not m.late)
    rejected = sum(1 for m in g.members if m.verdict == "REJECTED" and not m.late)

    def could_still_be_accepted(m) -> bool:
        st = tasks[m.task_id].state
        return m.verdict is None and (st not in TERMINAL or st == "SUCCEEDED")

    still = sum(1 for m in g.members if not m.late and could_still_be_accepted(m))
    sealed = g.state == "SEALED"
    if g.condition == "FIRST_ACCEPTED":
        return ("SUCCESS", "first_accepted") if accepted else None
    if g.condition == "N_ACCEPTED":
        if accepted >= g.threshold:
            return ("SUCCESS", "threshold_reached")
        if sealed and accepted + still < g.threshold:
            return ("FAILURE", "threshold_unreachable")
        return None
    if sealed and still == 0:
        return ("SUCCESS" if accepted >= 1 and rejected == 0 else "FAILURE", "all_terminal")
    return None


class SimGroups(SimKind):
    name = "groups"
    facts = ("group_final", "member", "verdict")

    def init_world(self, world):
        world.members = {}  # group id -> member task ids seen

    def fallbacks(self, world):
        return ["group.submit", "group.create"] if world.ids.get("grp") else ["group.create"]

    def ops(self):
        def group(g: Gen):
            return g.world.pick(g.rng, "grp")

        def create(g: Gen):
            run = g.world.pick(g.rng, "scp")
            if run is None:
                return None
            cond = g.rng.choice(("FIRST_ACCEPTED", "N_ACCEPTED", "ALL_TERMINAL"))
            threshold = g.rng.randint(1, 3) if cond == "N_ACCEPTED" else None
            expected = g.rng.choice((None, None, 2, 3, 4))
            if threshold is not None and expected is not None and expected < threshold:
                expected = threshold
            other = g.world.pick(g.rng, "scp") if g.rng.random() < 0.2 else None
            return p.GroupCreate(scope_id=run, mailbox=g.rng.choice(MAILBOXES), condition=cond, threshold=threshold,
                                 expected_members=expected, deadline=g.iso_in(3, 90) if g.rng.random() < 0.3 else None,
                                 parent_scope_id=other)

        def submit(g: Gen):
            gid = group(g)
            key = g.rng.choice((None, "m0", "m1", "m2", "m3"))
            return gid and p.GroupSubmit(group_id=gid, key=key, input=_raw({"draft": g.rng.randrange(3 if key else 10**6)}),
                                         requirements=requirements(g, p_none=0.7))

        def join(g: Gen):
            gid, tid = group(g), g.world.pick(g.rng, "tsk")
            return gid and tid and p.GroupJoinTask(group_id=gid, task_id=tid)

        def verdict(g: Gen):
            gid = group(g)
            if gid is None:
                return None
            members = g.world.members.get(gid) or g.world.ids.get("tsk") or []
            if not members:
                return None
            return p.GroupVerdictOp(group_id=gid, task_id=g.rng.choice(members),
                                    verdict=g.rng.choice(("ACCEPTED", "ACCEPTED", "REJECTED")))

        def close(g: Gen):
            gid = group(g)
            return gid and p.GroupClose(group_id=gid)

        def wait(g: Gen):
            gid = group(g)
            return gid and p.GroupWait(group_id=gid, wait_ms=g.wait_ms())

        def status(g: Gen):
            gid = group(g)
            return gid and p.GroupStatus(group_id=gid)

        return {
            "group.create": (1.2, create),
            "group.submit": (2.5, submit),
            "group.join_task": (0.4, join),
            "group.verdict": (2.5, verdict),
            "group.close": (0.8, close),
            "group.wait": (0.8, wait),
            "group.status": (0.4, status),
        }

    def observe(self, obs, op, reply, err):
        w = obs.world
        if isinstance(reply, p.GroupView):
            w.add(reply.id)
            w.add(reply.scope_id, gate_of=reply.id)
            obs.fact("exists", reply.id)
            obs.fact("exists", reply.scope_id)
            mem = w.members.setdefault(reply.id, [])
            for m in reply.members:
                if m.task_id not in mem:
                    mem.append(m.task_id)
                w.add(m.task_id)
                obs.fact("member", reply.id, m.task_id)
                if m.verdict is not None and not m.late:
                    obs.fact("verdict", reply.id, m.task_id, m.verdict)
            if reply.state == "FINALIZED":
                obs.fact("group_final", reply.id, reply.outcome, reply.outcome_reason)
        elif isinstance(reply, p.GroupMemberAddedView):
            gid = op.group_id
            w.add(reply.task.id, run=reply.task.scope_id)
            mem = w.members.setdefault(gid, [])
            if reply.task.id not in mem:
                mem.append(reply.task.id)
            obs.fact("member", gid, reply.task.id)
            SimQueues._task(obs, reply.task)
            if isinstance(op, p.GroupSubmit) and op.key is None:
                requirements_fact(obs, reply.task.id, op.requirements)
        elif isinstance(reply, p.VerdictView):
            if not reply.late:
                obs.fact("verdict", op.group_id, reply.task_id, reply.verdict)
            if reply.group_state == "FINALIZED":
                obs.fact("group_final", op.group_id, reply.outcome, reply.outcome_reason)
        elif isinstance(reply, p.GroupDecisionView) and reply.state == "FINALIZED":
            obs.fact("group_final", op.group_id, reply.outcome, reply.outcome_reason)

    def check_fact(self, coord, fact):
        g = coord.groups.table.get(fact[1])
        if g is None:
            return f"group {fact[1]} is missing"
        if fact[0] == "group_final":
            if (g.state, g.outcome, g.outcome_reason) != ("FINALIZED", fact[2], fact[3]):
                return f"group {g.id} was seen FINALIZED {fact[2]} {fact[3]}, is {g.state} {g.outcome} {g.outcome_reason}"
        elif fact[0] == "member":
            if fact[2] not in coord.groups.member_index.get(g.id, {}):
                return f"task {fact[2]} was seen a member of group {g.id}, is not"
        elif fact[0] == "verdict":
            m = coord.groups.member_index.get(g.id, {}).get(fact[2])
            if m is None or m.verdict != fact[3]:
                return f"member {fact[2]} of group {g.id} was seen {fact[3]}, is {m.verdict if m else 'missing'}"
        return None

    def quiescent(self, chk, coord):
        tasks = coord.queues.tasks
        for g in coord.groups.table.values():
            if g.state == "FINALIZED":
                gate = coord.runs.table[g.gate_scope_id]
                if gate.state == "ACTIVE":
                    chk.fail("group", f"group {g.id} is FINALIZED but its gate run is ACTIVE")
                for m in g.members:
                    if tasks[m.task_id].state not in TERMINAL and tasks[m.task_id].scope_id == g.gate_scope_id:
                        chk.fail("group", f"group {g.id} is FINALIZED but member {m.task_id} is {tasks[m.task_id].state}")
                continue
            why = ended(coord, g.gate_scope_id)
            if why:
                chk.fail("ended-run", f"group {g.id} is {g.state} under an ended run ({why})")
                continue
            now = coord.now_ms()
            if coord.runs.deadline_passed(g.gate_scope_id, now - SLACK_MS):
                chk.fail("timeliness", f"group {g.id} is past its deadline and not FINALIZED")
                continue
            want = reference_decision(coord, g)
            if want is not None:
                chk.fail("group-model", f"group {g.id} ({g.condition}) should have decided {want}, is {g.state}")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if key == "final" and actor_id.startswith("grp_"):
            return coord.groups.table[actor_id].state == "FINALIZED"
        return None

    def monotone(self, coord):
        return {g.id: (g.state == "FINALIZED", g.outcome, g.outcome_reason,
                       tuple((m.task_id, m.verdict) for m in g.members))
                for g in coord.groups.table.values()}

    def regressed(self, eid, old, new):
        if old[0] and new[:3] != old[:3]:
            return f"group {eid} decided {old[1:3]} and changed to {new[1:3]} (a group decides once)"
        olds = dict(old[3])
        for tid, v in new[3]:
            if olds.get(tid) is not None and olds[tid] != v:
                return f"member {tid} of group {eid} changed verdict {olds[tid]} -> {v}"
        if len(new[3]) < len(old[3]):
            return f"group {eid} lost members"
        return None

    def audits(self):
        def finalized(chk, m, rec: r.GroupFinalized, now, mono):
            g = m.groups.table.get(rec.group_id)
            if g is None or g.state == "FINALIZED":
                chk.fail("decide-once", f"group {rec.group_id} finalized twice ({g.outcome if g else '?'} then {rec.outcome})")

        def verdict(chk, m, rec: r.GroupVerdict, now, mono):
            mem = m.groups.member_index.get(rec.group_id, {}).get(rec.task_id)
            if mem is None:
                chk.fail("audit", f"verdict for non-member {rec.task_id} of group {rec.group_id}")
            elif mem.verdict is not None:
                chk.fail("audit", f"second verdict {rec.verdict} for member {rec.task_id} (was {mem.verdict})")
            elif rec.verdict == "ACCEPTED" and m.queues.tasks[rec.task_id].state != "SUCCEEDED":
                chk.fail("audit", f"member {rec.task_id} accepted while {m.queues.tasks[rec.task_id].state}")

        def joined(chk, m, rec: r.GroupMemberJoined, now, mono):
            if rec.task_id in m.groups.member_index.get(rec.group_id, {}):
                chk.fail("audit", f"task {rec.task_id} joined group {rec.group_id} twice")

        return {r.GroupFinalized: finalized, r.GroupVerdict: verdict, r.GroupMemberJoined: joined}


# ============================================================================ barriers
class SimBarriers(SimKind):
    name = "barriers"
    facts = ("bar_epoch_ge", "bar_released", "bar_arrived", "bar_cancelled")

    def fallbacks(self, world):
        return ["barrier.create"]

    def ops(self):
        def bar(g: Gen):
            return g.world.pick(g.rng, "bar")

        def create(g: Gen):
            run = g.world.pick(g.rng, "scp")
            return run and p.BarrierCreate(scope_id=run, target=g.rng.randint(1, 3))

        def arrive(g: Gen):
            b = bar(g)
            return b and p.BarrierArrive(barrier_id=b, key=g.rng.choice(("a", "b", "c", "d")))

        def wait(g: Gen):
            b = bar(g)
            if b is None:
                return None
            epoch = None
            if g.rng.random() < 0.3:
                epoch = g.world.info[b].get("epoch", 1) + g.rng.choice((0, 1))
            return p.BarrierWait(barrier_id=b, wait_ms=g.wait_ms(), epoch=epoch)

        def next_epoch(g: Gen):
            b = bar(g)
            return b and p.BarrierNextEpochOp(barrier_id=b)

        return {
            "barrier.create": (0.8, create),
            "barrier.arrive": (2.0, arrive),
            "barrier.wait": (1.0, wait),
            "barrier.next_epoch": (0.5, next_epoch),
        }

    def observe(self, obs, op, reply, err):
        if isinstance(reply, p.BarrierView):
            obs.world.add(reply.id, epoch=reply.epoch)
            obs.world.info[reply.id]["epoch"] = reply.epoch
            obs.fact("exists", reply.id)
            obs.fact("bar_epoch_ge", reply.id, reply.epoch)
            if reply.state == "RELEASED":
                obs.fact("bar_released", reply.id, reply.epoch)
            if reply.state == "CANCELLED":
                obs.fact("bar_cancelled", reply.id)
            for k in reply.keys:
                obs.fact("bar_arrived", reply.id, reply.epoch, k)
        elif err is not None and err.code == "BARRIER_CANCELLED" and _err_detail(err, "barrier_id"):
            obs.fact("bar_cancelled", _err_detail(err, "barrier_id"))

    def check_fact(self, coord, fact):
        b = coord.barriers.table.get(fact[1])
        if b is None:
            return f"barrier {fact[1]} is missing"
        what = fact[0]
        if what == "bar_epoch_ge" and b.epoch < fact[2]:
            return f"barrier {b.id} was seen in epoch {fact[2]}, is in {b.epoch}"
        if what == "bar_released" and not (b.epoch > fact[2] or (b.epoch == fact[2] and b.state == "RELEASED")):
            return f"barrier {b.id} was seen RELEASED in epoch {fact[2]}, is {b.state} in epoch {b.epoch}"
        if what == "bar_arrived" and not (b.epoch > fact[2] or fact[3] in b.keys):
            return f"barrier {b.id} was seen with arrival {fact[3]!r} in epoch {fact[2]}, has {b.keys} in {b.epoch}"
        if what == "bar_cancelled" and b.state != "CANCELLED":
            return f"barrier {b.id} was seen CANCELLED, is {b.state}"
        return None

    def quiescent(self, chk, coord):
        for b in coord.barriers.table.values():
            if b.state == "WAITING":
                if len(b.keys) >= b.target:
                    chk.fail("barrier", f"barrier {b.id} has {len(b.keys)} arrivals of {b.target} and is WAITING")
                why = ended(coord, b.scope_id)
                if why:
                    chk.fail("ended-run", f"barrier {b.id} is WAITING under an ended run ({why})")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if key == "b" and actor_id.startswith("bar_"):
            # a barrier wait's check is pure (it commits nothing): ask it (a waiter pinned
            # to a later epoch may still wait on a RELEASED barrier)
            for w in waiters:
                try:
                    if w.park.check() is not None:
                        return True
                except RallypointError:
                    return True  # BARRIER_CANCELLED is its answer
            return False
        return None

    def monotone(self, coord):
        return {b.id: (b.epoch, b.state) for b in coord.barriers.table.values()}

    def regressed(self, eid, old, new):
        if new[0] < old[0]:
            return f"barrier {eid}'s epoch went back from {old[0]} to {new[0]}"
        if old[1] == "CANCELLED" and new[1] != "CANCELLED":
            return f"barrier {eid} came back from CANCELLED"
        if new[0] == old[0] and old[1] == "RELEASED" and new[1] == "WAITING":
            return f"barrier {eid} went from RELEASED back to WAITING in epoch {old[0]}"
        return None

    def audits(self):
        def arrived(chk, m, rec: r.BarrierArrived, now, mono):
            b = m.barriers.table.get(rec.id)
            if b is None or b.state != "WAITING" or rec.key in b.keys or rec.epoch != b.epoch:
                chk.fail("audit", f"arrival {rec.key!r} on barrier {rec.id} in state "
                                  f"{b.state if b else '?'} epoch {b.epoch if b else '?'} with {b.keys if b else []}")
            elif rec.releases != (len(b.keys) + 1 >= b.target):
                chk.fail("audit", f"arrival on barrier {rec.id} releases={rec.releases} with {len(b.keys)}+1 of {b.target}")

        def next_epoch(chk, m, rec: r.BarrierNextEpoch, now, mono):
            b = m.barriers.table.get(rec.id)
            if b is None or b.state != "RELEASED" or rec.epoch != b.epoch + 1:
                chk.fail("audit", f"next epoch of barrier {rec.id} from {b.state if b else '?'}")

        return {r.BarrierArrived: arrived, r.BarrierNextEpoch: next_epoch}


# ============================================================================ timers
class SimTimers(SimKind):
    name = "timers"
    facts = ("timer_state",)

    def fallbacks(self, world):
        return ["timer.create"]

    def ops(self):
        def tmr(g: Gen):
            return g.world.pick(g.rng, "tmr")

        def create(g: Gen):
            run = g.world.pick(g.rng, "scp")
            if run is None:
                return None
            if g.rng.random() < 0.3:
                return p.TimerCreate(scope_id=run, at=g.iso_in(-1, 30))
            return p.TimerCreate(scope_id=run, after_ms=g.rng.choice((0, 500, 3000, 10000, 30000)))

        def wait(g: Gen):
            t = tmr(g)
            return t and p.TimerWait(timer_id=t, wait_ms=g.wait_ms())

        def cancel(g: Gen):
            t = tmr(g)
            return t and p.TimerCancel(timer_id=t)

        return {"timer.create": (1.0, create), "timer.wait": (1.0, wait), "timer.cancel": (0.4, cancel)}

    def observe(self, obs, op, reply, err):
        if isinstance(reply, p.TimerView):
            obs.world.add(reply.id)
            obs.fact("exists", reply.id)
            if reply.state in ("FIRED", "ACKED", "CANCELLED"):
                obs.fact("timer_state", reply.id, reply.state)
        elif err is not None and err.code == "TIMER_CANCELLED" and _err_detail(err, "timer_id"):
            obs.fact("timer_state", _err_detail(err, "timer_id"), "CANCELLED")

    def check_fact(self, coord, fact):
        t = coord.timers.table.get(fact[1])
        if t is None:
            return f"timer {fact[1]} is missing"
        ok = {"FIRED": ("FIRED", "ACKED"), "ACKED": ("ACKED",), "CANCELLED": ("CANCELLED",)}[fact[2]]
        if t.state not in ok:
            return f"timer {t.id} was seen {fact[2]}, is {t.state}"
        return None

    @staticmethod
    def due(coord, t) -> tuple[bool, int]:
        """(is the due time server time?, due ms)"""
        return (True, t.fire_mono_ms) if t.fire_mono_ms is not None else (False, t.fire_at_ms)

    def quiescent(self, chk, coord):
        now, mono = coord.now_ms(), coord.mono_ms()
        for t in coord.timers.table.values():
            if t.state != "ARMED":
                continue
            is_mono, due = self.due(coord, t)
            late = (mono if is_mono else now) - due
            if late > SLACK_MS:
                chk.fail("timeliness", f"timer {t.id} is ARMED {late} ms past its due time")
            why = ended(coord, t.scope_id)
            if why:
                chk.fail("ended-run", f"timer {t.id} is ARMED under an ended run ({why})")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if key == "t" and actor_id.startswith("tmr_"):
            return coord.timers.table[actor_id].state != "ARMED"
        return None

    def monotone(self, coord):
        return {t.id: t.state for t in coord.timers.table.values()}

    def regressed(self, eid, old, new):
        order = {"ARMED": 0, "FIRED": 1, "ACKED": 2, "CANCELLED": 3}
        if old != new and (old in ("ACKED", "CANCELLED") or order[new] < order[old]):
            return f"timer {eid} went from {old} to {new}"
        return None

    def audits(self):
        def fired(chk, m, rec: r.TimerFired, now, mono):
            t = m.timers.table.get(rec.id)
            if t is None or t.state != "ARMED":
                chk.fail("audit", f"timer {rec.id} fired while {t.state if t else 'missing'}")
                return
            is_mono, due = self.due(m, t)
            early = due - (mono if is_mono else now)
            if early > SLACK_MS:
                chk.fail("timeliness", f"timer {t.id} fired {early} ms before its due time")

        def acked(chk, m, rec: r.TimerAcked, now, mono):
            t = m.timers.table.get(rec.id)
            if t is None or t.state != "FIRED":
                chk.fail("audit", f"timer {rec.id} acked while {t.state if t else 'missing'}")

        def cancelled(chk, m, rec: r.TimerCancelled, now, mono):
            t = m.timers.table.get(rec.id)
            if t is None or t.state != "ARMED":
                chk.fail("audit", f"timer {rec.id} cancelled while {t.state if t else 'missing'}")

        return {r.TimerFired: fired, r.TimerAcked: acked, r.TimerCancelled: cancelled}


# ============================================================================ join sets
class SimJoinSets(SimKind):
    name = "joinsets"
    facts = ("js_child", "js_has_child", "js_closed", "js_record")

    def fallbacks(self, world):
        return ["joinset.submit", "joinset.create"] if world.ids.get("jst") else ["joinset.create"]

    def ops(self):
        def js(g: Gen):
            return g.world.pick(g.rng, "jst")

        def create(g: Gen):
            run = g.world.pick(g.rng, "scp")
            return run and p.JoinSetCreate(scope_id=run, name=g.rng.choice((None, None, "fetch", "poll")))

        def submit(g: Gen):
            j = js(g)
            return j and p.JoinSetSubmit(joinset_id=j, mailbox=g.rng.choice(MAILBOXES),
                                         input=_raw({"c": g.rng.randrange(10**6)}), cancellable=g.rng.random() < 0.8,
                                         key=g.rng.choice((None, None, None, "c0")),
                                         requirements=requirements(g, p_none=0.7))

        def delay(g: Gen):
            j = js(g)
            if j is None:
                return None
            if g.rng.random() < 0.2:
                return p.JoinSetSubmitDelay(joinset_id=j, at=g.iso_in(0, 20))
            return p.JoinSetSubmitDelay(joinset_id=j, after_ms=g.rng.choice((0, 1000, 5000, 20000)))

        def join_next(g: Gen):
            j = js(g)
            if j is None:
                return None
            consumed = g.world.info[j].get("consumed", 0)
            if consumed and g.rng.random() < 0.25:
                return p.JoinNext(joinset_id=j, index=g.rng.randrange(consumed))  # a positional re-read
            return p.JoinNext(joinset_id=j, wait_ms=g.wait_ms(), try_only=g.rng.random() < 0.2)

        def close(g: Gen):
            j = js(g)
            return j and p.JoinSetClose(joinset_id=j, wait_ms=g.rng.choice((0, 5000)))

        def get(g: Gen):
            j = js(g)
            return j and p.JoinSetGet(joinset_id=j)

        return {
            "joinset.create": (0.8, create),
            "joinset.submit": (1.5, submit),
            "joinset.delay": (1.0, delay),
            "joinset.join_next": (1.8, join_next),
            "joinset.close": (0.5, close),
            "joinset.get": (0.3, get),
        }

    def observe(self, obs, op, reply, err):
        w = obs.world
        if isinstance(reply, p.JoinSetView):
            w.add(reply.id)
            info = w.info[reply.id]
            info["consumed"] = max(info.get("consumed", 0), reply.consumed)
            obs.fact("exists", reply.id)
            for i, c in enumerate(reply.children):
                obs.fact("js_child", reply.id, i, c.child_id)
                if c.kind == "task":
                    w.add(c.child_id)
            if reply.state == "CLOSED":
                obs.fact("js_closed", reply.id)
        elif isinstance(reply, p.JoinSetChildAdded):
            obs.fact("js_has_child", op.joinset_id, reply.child_id)
            if reply.kind == "task":
                w.add(reply.child_id)
                if op.key is None:
                    requirements_fact(obs, reply.child_id, op.requirements)
        elif isinstance(reply, p.JoinNextView) and reply.status == "record":
            info = w.info.setdefault(op.joinset_id, {})
            info["consumed"] = max(info.get("consumed", 0), reply.index + 1)
            obs.fact("js_record", op.joinset_id, reply.index, reply.child_id, reply.ok, reply.failure_kind,
                     bytes(reply.value))

    def check_fact(self, coord, fact):
        js = coord.joinsets.table.get(fact[1])
        if js is None:
            return f"join set {fact[1]} is missing"
        what = fact[0]
        if what == "js_child":
            if fact[2] >= len(js.children) or js.children[fact[2]].child_id != fact[3]:
                return f"join set {js.id}'s child #{fact[2]} was seen as {fact[3]}"
        elif what == "js_has_child":
            if fact[2] not in {c.child_id for c in js.children}:
                return f"child {fact[2]} of join set {js.id} is missing"
        elif what == "js_closed":
            if js.state != "CLOSED":
                return f"join set {js.id} was seen CLOSED, is {js.state}"
        elif what == "js_record":
            _, _, k, child, ok, fk, value = fact
            if k >= len(js.completions) or js.consumed <= k:
                return f"record #{k} of join set {js.id} was consumed, but it has {len(js.completions)} records, {js.consumed} consumed"
            c = js.completions[k]
            have = (c.child_id, c.ok, c.failure_kind, c.value if c.value is not None else b"\xc0")
            if have != (child, ok, fk, value):
                return f"record #{k} of join set {js.id} was {(child, ok, fk)}, replays as {have[:3]}"
        return None

    def quiescent(self, chk, coord):
        now, mono = coord.now_ms(), coord.mono_ms()
        for js in coord.joinsets.table.values():
            if not js.consumed <= len(js.completions) <= len(js.children):
                chk.fail("joinset", f"join set {js.id}: {js.consumed} consumed, {len(js.completions)} records, "
                                    f"{len(js.children)} children")
            for c in js.children:
                if c.kind == "delay" and not c.done:
                    late = (mono - c.fire_mono_ms) if c.fire_mono_ms is not None else (now - c.fire_at_ms)
                    if late > SLACK_MS:
                        chk.fail("timeliness", f"delay {c.child_id} of join set {js.id} is {late} ms overdue")
            if js.state == "CLOSING" and all(c.done for c in js.children):
                chk.fail("joinset", f"join set {js.id} is CLOSING with every child finished")
            if js.state != "CLOSED":
                why = ended(coord, js.scope_id)
                if why:
                    chk.fail("ended-run", f"join set {js.id} is {js.state} under an ended run ({why})")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if key == "j" and actor_id.startswith("jst_"):
            js = coord.joinsets.table[actor_id]
            return js.state == "CLOSED" or (js.state == "OPEN" and len(js.completions) > js.consumed)
        return None

    def monotone(self, coord):
        return {js.id: (js.state, js.consumed, tuple(c.child_id for c in js.completions))
                for js in coord.joinsets.table.values()}

    def regressed(self, eid, old, new):
        if new[1] < old[1]:
            return f"join set {eid}'s consumed count went back from {old[1]} to {new[1]}"
        if new[2][: len(old[2])] != old[2]:
            return f"join set {eid}'s completion records changed: {old[2]} -> {new[2]}"
        if old[0] == "CLOSED" and new[0] != "CLOSED":
            return f"join set {eid} reopened"
        return None

    def audits(self):
        def consumed(chk, m, rec: r.JoinSetConsumed, now, mono):
            js = m.joinsets.table.get(rec.joinset_id)
            if js is None or rec.index != js.consumed or rec.index >= len(js.completions):
                chk.fail("audit", f"consume #{rec.index} of join set {rec.joinset_id} with "
                                  f"{js.consumed if js else '?'} consumed, {len(js.completions) if js else '?'} records")

        def delay_fired(chk, m, rec: r.JoinSetDelayFired, now, mono):
            js = m.joinsets.table.get(rec.joinset_id)
            pos = m.joinsets.child_pos.get(rec.child_id)
            if js is None or pos is None:
                chk.fail("audit", f"delay {rec.child_id} fired in an unknown join set")
                return
            c = js.children[pos[1]]
            if c.done:
                chk.fail("audit", f"delay {rec.child_id} fired twice")
            early = (c.fire_mono_ms - mono) if c.fire_mono_ms is not None else (c.fire_at_ms - now)
            if early > SLACK_MS:
                chk.fail("timeliness", f"delay {rec.child_id} fired {early} ms early")

        return {r.JoinSetConsumed: consumed, r.JoinSetDelayFired: delay_fired}




# ============================================================================ shared by the primitives
#: errors that say "your run ended" (a release must never get one: it is allowed on an
#: ended run)
RUN_ENDED_CODES = frozenset({"SCOPE_CANCELLED", "DEADLINE_EXCEEDED", "SCOPE_COMPLETED"})


def _pure_due(waiters) -> bool:
    """Whether any parked waiter's (pure) re-check has an answer now: a reply, or an
    error that is the answer."""
    for w in waiters:
        try:
            if w.park.check() is not None:
                return True
        except RallypointError:
            return True
    return False


def _refused_release(chk, op, err, what: str) -> None:
    if err is not None and err.code in RUN_ENDED_CODES:
        chk.fail("ended-run", f"{what} was refused with {err.code}: a release must be allowed on an ended run")


def _acquired_in_ended_run(chk, m, rec, now: int, what: str) -> None:
    why = m.runs.inactive_error(rec.scope_id, now)
    if why is not None:
        chk.fail("ended-run", f"{what} for run {rec.scope_id}, which refuses new requests ({why.code})")


def _request_id(g: Gen) -> str | None:
    return g.rng.choice((None, None, "rq0", "rq1", f"rq{g.rng.randrange(1000)}"))


# ============================================================================ claims
CLAIM_KEYS = ("c0", "c1")


class SimClaims(SimKind):
    """Claims: exclusive, fenced leases on a key. A key has at most one holder; its
    generation (the fencing number) only grows; renew, release and complete carry the
    current lease's token; a lease expires at its time, never early; a cancelled run's
    acquires are refused but its releases are not."""

    name = "claims"
    facts = ("claim_gen_ge", "claim_completed")

    def init_world(self, world):
        world.claim_leases = []  # (key, token), every lease ever handed out
        world.claim_requests = []  # (key, request_id) of acquires that waited
        world.claim_gens = {}  # (claim id, token) -> the generation of that lease (journal audit)

    def fallbacks(self, world):
        return ["claim.acquire"]

    def ops(self):
        def lease(g: Gen):
            ls = g.world.claim_leases
            if not ls:
                return None
            return ls[-1 - min(len(ls) - 1, int(g.rng.expovariate(0.6)))] if g.rng.random() < 0.8 else g.rng.choice(ls)

        def acquire(g: Gen):
            run = g.world.pick(g.rng, "scp")
            return run and p.ClaimAcquire(
                scope_id=run, key=g.rng.choice(CLAIM_KEYS), lease_ms=g.rng.choice((5000, 8000, 30000)),
                wait_ms=g.rng.choice((0, 0, 1000, 5000, 20000)), holder=g.rng.choice((None, "w1")),
                request_id=_request_id(g))

        def renew(g: Gen):
            l = lease(g)
            return l and p.ClaimRenew(key=l[0], token=l[1], lease_ms=g.rng.choice((5000, 30000)))

        def release(g: Gen):
            l = lease(g)
            return l and p.ClaimRelease(key=l[0], token=l[1], observation=_raw({"seen": g.rng.randrange(9)}))

        def complete(g: Gen):
            l = lease(g)
            return l and p.ClaimComplete(key=l[0], token=l[1], result=_raw({"done": g.rng.randrange(9)}))

        def cancel_wait(g: Gen):
            rq = g.world.claim_requests
            if not rq:
                return None
            key, rid = g.rng.choice(rq)
            return p.ClaimCancelWait(key=key, request_id=rid)

        def status(g: Gen):
            return p.ClaimStatus(key=g.rng.choice(CLAIM_KEYS))

        return {"claim.acquire": (3.0, acquire), "claim.renew": (1.0, renew), "claim.release": (1.5, release),
                "claim.complete": (0.6, complete), "claim.cancel_wait": (0.5, cancel_wait),
                "claim.status": (0.4, status)}

    def _claim(self, obs, c: p.ClaimView) -> None:
        obs.world.add(c.id)
        obs.fact("exists", c.id)
        obs.fact("claim_gen_ge", c.id, c.generation)
        if c.state == "COMPLETED":
            obs.fact("claim_completed", c.id, bytes(c.result))

    def observe(self, obs, op, reply, err):
        if isinstance(reply, p.ClaimLeaseView):
            self._claim(obs, reply.claim)
            if reply.status == "ACQUIRED" and reply.token:
                obs.world.claim_leases.append((reply.claim.key, reply.token))
            elif reply.status == "WAITING" and reply.request_id:
                obs.world.claim_requests.append((reply.claim.key, reply.request_id))
        elif isinstance(reply, p.ClaimView):
            self._claim(obs, reply)

    def check_fact(self, coord, fact):
        c = coord.claims.table.get(fact[1])
        if c is None:
            return f"claim {fact[1]} is missing"
        if fact[0] == "claim_gen_ge" and c.generation < fact[2]:
            return f"claim {c.id} was seen at generation {fact[2]}, is at {c.generation} (a fencing number went back)"
        if fact[0] == "claim_completed" and (c.state != "COMPLETED" or (c.result or b"\xc0") != fact[2]):
            return f"claim {c.id} was seen COMPLETED, is {c.state}"
        return None

    def made(self, chk, coord, op, reply, err):
        if isinstance(op, p.ClaimAcquire) and isinstance(reply, p.ClaimLeaseView) and reply.status == "ACQUIRED":
            c = coord.claims.table.get(reply.claim.id)
            if c is None or c.state != "HELD" or c.token != reply.token or c.generation != reply.claim.generation:
                chk.fail("fencing", f"acquire of claim {op.key!r} answered ACQUIRED (generation "
                                    f"{reply.claim.generation}) but the claim is {c.state if c else 'missing'} at "
                                    f"generation {c.generation if c else '?'}")
        elif isinstance(op, (p.ClaimRenew, p.ClaimRelease, p.ClaimComplete)):
            if isinstance(op, p.ClaimRelease):
                _refused_release(chk, op, err, f"claim.release({op.key})")
            cid = coord.claims.by_key.get(("default", op.key))
            c = coord.claims.table.get(cid) if cid else None
            if err is not None or c is None:
                return
            # the records carry the claim's own token: the token the client sent is
            # checked here, against the lease (generation) it was handed out with
            gen = chk.sim.world.claim_gens.get((c.id, op.token))
            name = type(op).__name__
            if gen is None:
                chk.fail("fencing", f"{name} of claim {op.key!r} with token {op.token}, never handed out, succeeded")
            elif isinstance(op, p.ClaimRenew) and (c.state != "HELD" or c.generation != gen):
                chk.fail("fencing", f"renew with the token of generation {gen} succeeded on claim {op.key!r} at "
                                    f"generation {c.generation} ({c.state})")
            elif isinstance(op, p.ClaimComplete) and c.generation != gen:
                chk.fail("fencing", f"complete with the token of generation {gen} succeeded on claim {op.key!r} at "
                                    f"generation {c.generation}")
            elif isinstance(op, p.ClaimRelease) and not (c.generation == gen or (c.generation == gen + 1
                                                                                 and c.state == "HELD")):
                chk.fail("fencing", f"release with the token of generation {gen} succeeded on claim {op.key!r} at "
                                    f"generation {c.generation} ({c.state})")

    def quiescent(self, chk, coord):
        mono = coord.mono_ms()
        for c in coord.claims.table.values():
            if c.state == "HELD" and c.lease_expires_ms + SLACK_MS < mono:
                chk.fail("timeliness", f"claim {c.key!r}'s lease ran out {mono - c.lease_expires_ms} ms ago; still HELD")
            if c.state == "FREE" and c.waiters:
                chk.fail("wakeup", f"claim {c.key!r} is FREE with {len(c.waiters)} waiter(s) in line: nobody was "
                                   "handed the lease")
            for w in c.waiters:
                if w.expires_mono_ms + SLACK_MS < mono:
                    chk.fail("timeliness", f"claim {c.key!r}'s waiter {w.request_id} is {mono - w.expires_mono_ms} ms "
                                           "past its time limit")
                why = ended(coord, w.scope_id)
                if why:
                    chk.fail("ended-run", f"claim {c.key!r}'s waiter {w.request_id} is in line under an ended run ({why})")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if actor_id.startswith("scp_") and isinstance(key, str) and key.startswith(("rq", "srv-")):
            return _pure_due(waiters)
        return None

    def monotone(self, coord):
        return {c.id: (c.generation, c.state) for c in coord.claims.table.values()}

    def regressed(self, eid, old, new):
        if new[0] < old[0]:
            return f"claim {eid}'s generation went back from {old[0]} to {new[0]}"
        if old[1] == "COMPLETED" and new[1] != "COMPLETED":
            return f"claim {eid} went from COMPLETED to {new[1]}"
        return None

    def audits(self):
        def held(chk, m, rec, what, mono, lease=True):
            c = m.claims.table.get(rec.claim_id)
            if c is None or c.state != "HELD" or c.token != rec.token:
                chk.fail("fencing", f"{what} of claim {rec.claim_id} with token {rec.token}, but it is "
                                    f"{c.state if c else 'missing'} with token {c.token if c else '?'}")
                return None
            if lease and c.lease_expires_ms + SLACK_MS <= mono:
                chk.fail("fencing", f"{what} of claim {c.key!r} {mono - c.lease_expires_ms} ms after its lease ran out")
            return c

        def acquired(chk, m, rec: r.ClaimAcquired, now, mono):
            chk.sim.world.claim_gens[(rec.claim_id, rec.token)] = rec.generation
            c = m.claims.table.get(rec.claim_id)
            if c is not None and c.state != "FREE":
                chk.fail("fencing", f"claim {rec.key!r} got a second holder (generation {rec.generation}) while "
                                    f"{c.state} (generation {c.generation}, lease until {c.lease_expires_ms}, now {mono})")
            if rec.generation != (c.generation if c is not None else 0) + 1:
                chk.fail("fencing", f"claim {rec.key!r} acquired at generation {rec.generation} after "
                                    f"{c.generation if c else 0}: the fencing number must grow by one")
            _acquired_in_ended_run(chk, m, rec, now, f"claim {rec.key!r} acquired")

        def renewed(chk, m, rec, now, mono):
            held(chk, m, rec, "ClaimRenewed", mono)

        def completed(chk, m, rec, now, mono):
            held(chk, m, rec, "ClaimCompleted", mono)

        def released(chk, m, rec, now, mono):
            held(chk, m, rec, "ClaimReleased", mono, lease=False)

        def expired(chk, m, rec: r.ClaimLeaseExpired, now, mono):
            c = held(chk, m, rec, "ClaimLeaseExpired", mono, lease=False)
            if c is not None and mono + SLACK_MS < c.lease_expires_ms:
                chk.fail("lease", f"claim {c.key!r}'s lease expired {c.lease_expires_ms - mono} ms early")

        return {r.ClaimAcquired: acquired, r.ClaimRenewed: renewed, r.ClaimCompleted: completed,
                r.ClaimReleased: released, r.ClaimLeaseExpired: expired}


# ============================================================================ pools (permits)
POOLS = {"p0": 2, "p1": 3}


class SimPools(SimKind):
    """Pools of units granted under leases. Units held never exceed the pool's total; a
    grant id is granted once; renew and release carry the grant's token; a lease expires
    at its time; a task's grant (admission) is held only while the task is RUNNING."""

    name = "pools"
    facts = ("grant_ended",)

    def init_world(self, world):
        world.grants = []  # (grant id, token)
        world.pool_requests = []  # (pool, request_id)
        world.pools = set()

    def fallbacks(self, world):
        return ["pool.acquire", "pool.ensure"] if world.pools else ["pool.ensure"]

    def ops(self):
        def pool(g: Gen):
            return g.rng.choice(tuple(POOLS)) if g.world.pools or g.rng.random() < 0.8 else "nosuch"

        def ensure(g: Gen):
            name = g.rng.choice(tuple(POOLS))
            total = POOLS[name] if g.rng.random() < 0.92 else POOLS[name] + 1  # maybe a CONFLICT
            return p.PoolEnsure(name=name, units_total=total)

        def acquire(g: Gen):
            run = g.world.pick(g.rng, "scp")
            if run is None or not g.world.pools:
                return None
            return p.PoolAcquire(pool=pool(g), scope_id=run, units=g.rng.choice((1, 1, 2)),
                                 lease_ms=g.rng.choice((5000, 8000, 30000)), wait_ms=g.rng.choice((0, 0, 1000, 5000, 20000)),
                                 request_id=_request_id(g))

        def grant(g: Gen):
            gs = g.world.grants
            if not gs:
                return None
            x = gs[-1 - min(len(gs) - 1, int(g.rng.expovariate(0.6)))] if g.rng.random() < 0.8 else g.rng.choice(gs)
            if g.rng.random() < 0.15:  # a wrong token: another grant's, or never handed out
                other = g.rng.choice(gs)[1]
                x = (x[0], other if other != x[1] else x[1] + 1)
            return x

        def renew(g: Gen):
            x = grant(g)
            return x and p.GrantRenew(grant_id=x[0], token=x[1], lease_ms=g.rng.choice((5000, 30000)))

        def release(g: Gen):
            x = grant(g)
            return x and p.GrantRelease(grant_id=x[0], token=x[1])

        def cancel_wait(g: Gen):
            rq = g.world.pool_requests
            if not rq:
                return None
            name, rid = g.rng.choice(rq)
            return p.PoolCancelWait(pool=name, request_id=rid)

        def get(g: Gen):
            return p.PoolGet(name=pool(g))

        return {"pool.ensure": (0.6, ensure), "pool.acquire": (3.0, acquire), "grant.renew": (0.8, renew),
                "grant.release": (1.5, release), "pool.cancel_wait": (0.4, cancel_wait), "pool.get": (0.3, get)}

    def _grant(self, obs, gv: p.GrantView) -> None:
        obs.world.add(gv.id)
        obs.fact("exists", gv.id)
        if gv.state != "ACTIVE":
            obs.fact("grant_ended", gv.id, gv.state)

    def observe(self, obs, op, reply, err):
        w = obs.world
        if isinstance(reply, p.PoolView):
            w.add(reply.id)
            w.pools.add(reply.name)
            obs.fact("exists", reply.id)
        elif isinstance(reply, p.PoolAcquireView):
            if reply.grant is not None:
                self._grant(obs, reply.grant)
                if reply.grant.token:
                    w.grants.append((reply.grant.id, reply.grant.token))
            if reply.status == "WAITING" and reply.request_id:
                w.pool_requests.append((op.pool, reply.request_id))
        elif isinstance(reply, p.GrantView):
            self._grant(obs, reply)
        elif isinstance(reply, p.ReceiveView):
            for d in reply.deliveries:
                for gv in d.grants or ():
                    self._grant(obs, gv)

    def check_fact(self, coord, fact):
        g = coord.pools.grants.get(fact[1])
        if g is None:
            return f"grant {fact[1]} is missing"
        if g.state != fact[2]:
            return f"grant {g.id} was seen {fact[2]}, is {g.state}"
        return None

    def made(self, chk, coord, op, reply, err):
        if isinstance(op, (p.GrantRenew, p.GrantRelease)):
            if isinstance(op, p.GrantRelease):
                _refused_release(chk, op, err, f"grant.release({op.grant_id})")
            g = coord.pools.grants.get(op.grant_id)
            if err is None and g is not None and g.token != op.token:
                chk.fail("fencing", f"{type(op).__name__} of grant {g.id} with token {op.token} succeeded; the grant's "
                                    f"token is {g.token}")

    def quiescent(self, chk, coord):
        mono = coord.mono_ms()
        pools = coord.pools
        held: dict[str, int] = {}
        tasks = coord.queues.tasks
        for g in pools.grants.values():
            if g.state != "ACTIVE":
                continue
            held[g.pool_id] = held.get(g.pool_id, 0) + g.units
            if g.task_id is not None:
                t = tasks.get(g.task_id)
                if t is None or t.state != "RUNNING":
                    chk.fail("admission", f"grant {g.id} of task {g.task_id} is ACTIVE while the task is "
                                          f"{t.state if t else 'missing'}: a task holds grants only while RUNNING")
            elif g.lease_expires_ms + SLACK_MS < mono:
                chk.fail("timeliness", f"grant {g.id}'s lease ran out {mono - g.lease_expires_ms} ms ago; still ACTIVE")
        for pool in pools.table.values():
            if held.get(pool.id, 0) > pool.units_total:
                chk.fail("pool", f"pool {pool.name!r} has {held[pool.id]} units granted of {pool.units_total}")
            for w in pool.waiters:
                if w.expires_mono_ms + SLACK_MS < mono:
                    chk.fail("timeliness", f"pool {pool.name!r}'s waiter {w.request_id} is past its time limit")
                why = ended(coord, w.scope_id)
                if why:
                    chk.fail("ended-run", f"pool {pool.name!r}'s waiter {w.request_id} is in line under an ended run "
                                          f"({why})")
            if pool.waiters and pool.waiters[0].units <= pool.units_total - held.get(pool.id, 0):
                chk.fail("wakeup", f"pool {pool.name!r} has {pool.units_total - held.get(pool.id, 0)} free unit(s) and "
                                   f"its first waiter wants {pool.waiters[0].units}: nobody served it")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if actor_id.startswith("pol_"):
            return _pure_due(waiters)
        return None

    def monotone(self, coord):
        return {g.id: g.state for g in coord.pools.grants.values()}

    def regressed(self, eid, old, new):
        if old != "ACTIVE" and new != old:
            return f"grant {eid} went from {old} to {new}"
        return None

    def audits(self):
        def granted(chk, m, rec: r.PoolGranted, now, mono):
            pools = m.pools
            if rec.id in pools.grants:
                chk.fail("pool", f"grant {rec.id} was granted twice")
            pool = pools.table.get(rec.pool_id)
            used = sum(g.units for g in pools.grants.values() if g.pool_id == rec.pool_id and g.state == "ACTIVE")
            if pool is not None and used + rec.units > pool.units_total:
                chk.fail("pool", f"pool {pool.name!r} granted {rec.units} unit(s) with {used} of {pool.units_total} "
                                 "already held (over-granted)")
            if rec.task_id is None:
                _acquired_in_ended_run(chk, m, rec, now, f"pool {pool.name if pool else rec.pool_id!r} granted")

        def holder(chk, m, rec, what, mono, lease=True):
            g = m.pools.grants.get(rec.grant_id)
            if g is None or g.state != "ACTIVE" or g.token != rec.token:
                chk.fail("fencing", f"{what} of grant {rec.grant_id} with token {rec.token}, but it is "
                                    f"{g.state if g else 'missing'} with token {g.token if g else '?'}")
                return None
            if lease and g.task_id is None and g.lease_expires_ms + SLACK_MS <= mono:
                chk.fail("fencing", f"{what} of grant {g.id} {mono - g.lease_expires_ms} ms after its lease ran out")
            return g

        def renewed(chk, m, rec, now, mono):
            holder(chk, m, rec, "GrantRenewed", mono)

        def released(chk, m, rec, now, mono):
            holder(chk, m, rec, "GrantReleased", mono, lease=False)

        def expired(chk, m, rec: r.GrantExpired, now, mono):
            g = holder(chk, m, rec, "GrantExpired", mono, lease=False)
            if g is not None and mono + SLACK_MS < g.lease_expires_ms:
                chk.fail("lease", f"grant {g.id}'s lease expired {g.lease_expires_ms - mono} ms early")

        return {r.PoolGranted: granted, r.GrantRenewed: renewed, r.GrantReleased: released, r.GrantExpired: expired}


# ============================================================================ quotas (allowances)
QUOTAS = {"a0": (3, 2000), "a1": (5, 10000)}


class SimQuotas(SimKind):
    """Quotas: at most ``units_limit`` units granted per window; nothing granted during a
    cooldown; grants only to runs that accept requests; waiters served FIFO."""

    name = "quotas"
    facts = ("quota_waiter_ended",)

    def init_world(self, world):
        world.quotas = set()

    def fallbacks(self, world):
        return ["quota.take", "quota.ensure"] if world.quotas else ["quota.ensure"]

    def ops(self):
        def quota(g: Gen):
            return g.rng.choice(tuple(QUOTAS)) if g.world.quotas or g.rng.random() < 0.8 else "nosuch"

        def ensure(g: Gen):
            name = g.rng.choice(tuple(QUOTAS))
            limit, window = QUOTAS[name]
            return p.QuotaEnsure(name=name, units_limit=limit, window_ms=window)

        def take(g: Gen):
            run = g.world.pick(g.rng, "scp")
            if run is None or not g.world.quotas:
                return None
            ttl = g.rng.choice((0, 0, 1000, 5000, 30000))
            return p.QuotaTake(quota=quota(g), scope_id=run, units=g.rng.choice((1, 1, 2)), ttl_ms=ttl,
                               wait_ms=g.wait_ms() if ttl else 0, key=g.rng.choice((None, None, None, "t0")))

        def cooldown(g: Gen):
            return g.world.quotas and p.QuotaCooldown(quota=quota(g), cooldown_ms=g.rng.choice((500, 3000)))

        def waiter(g: Gen):
            return g.world.pick(g.rng, "qwt")

        def wait(g: Gen):
            w = waiter(g)
            return w and p.QuotaWaiterWait(waiter_id=w, wait_ms=g.wait_ms())

        def cancel(g: Gen):
            w = waiter(g)
            return w and p.QuotaWaiterCancel(waiter_id=w)

        def get(g: Gen):
            return g.world.quotas and p.QuotaGet(quota=quota(g))

        return {"quota.ensure": (0.6, ensure), "quota.take": (3.0, take), "quota.cooldown": (0.3, cooldown),
                "quota.waiter_wait": (0.8, wait), "quota.waiter_cancel": (0.5, cancel), "quota.get": (0.3, get)}

    def observe(self, obs, op, reply, err):
        w = obs.world
        if isinstance(reply, p.QuotaView):
            w.add(reply.id)
            w.quotas.add(reply.name)
            obs.fact("exists", reply.id)
        elif isinstance(reply, p.QuotaTakeView):
            w.add(reply.quota_id)
            if reply.waiter_id:
                w.add(reply.waiter_id)
                obs.fact("exists", reply.waiter_id)
                if reply.state != "WAITING":
                    obs.fact("quota_waiter_ended", reply.waiter_id, reply.state)

    def check_fact(self, coord, fact):
        wt = coord.quotas.waiters.get(fact[1])
        if wt is None:
            return f"quota waiter {fact[1]} is missing"
        if wt.state != fact[2]:
            return f"quota waiter {wt.id} was seen {fact[2]}, is {wt.state}"
        return None

    def quiescent(self, chk, coord):
        mono = coord.mono_ms()
        qs = coord.quotas
        for q in qs.table.values():
            if q.used > q.units_limit:
                chk.fail("quota", f"quota {q.name!r} counts {q.used} units in its window, limit {q.units_limit}")
        for wt in qs.waiters.values():
            if wt.state != "WAITING":
                continue
            if wt.expires_mono_ms + SLACK_MS < mono:
                chk.fail("timeliness", f"quota waiter {wt.id} is WAITING {mono - wt.expires_mono_ms} ms past its ttl")
            why = ended(coord, wt.scope_id)
            if why:
                chk.fail("ended-run", f"quota waiter {wt.id} is WAITING under an ended run ({why})")

    def waiter_due(self, coord, actor_id, key, waiters=()):
        if isinstance(key, str) and key.startswith("qwt_"):
            return _pure_due(waiters)
        return None

    def monotone(self, coord):
        return {w.id: w.state for w in coord.quotas.waiters.values()}

    def regressed(self, eid, old, new):
        if old != "WAITING" and new != old:
            return f"quota waiter {eid} went from {old} to {new}"
        return None

    def audits(self):
        def window_grant(chk, m, q, window: int, units: int, now, mono, what, judged=None):
            judged = mono if judged is None else judged
            if q is None:
                chk.fail("audit", f"{what} in an unknown quota")
                return
            if window < q.window_start_mono_ms:
                chk.fail("quota", f"quota {q.name!r} {what} in window {window}, older than its current {q.window_start_mono_ms}")
                return
            used = q.used if window == q.window_start_mono_ms else 0
            if used + units > q.units_limit:
                chk.fail("quota", f"quota {q.name!r} {what}: {units} unit(s) on top of {used} in one window, limit "
                                  f"{q.units_limit}")
            # (a serve that fell due while the node was down is judged at its due instant
            # ``judged``, in the past: the window is the one holding that instant, never
            # in the future, and no cooldown runs at that instant)
            if window > mono + SLACK_MS or not window <= judged + SLACK_MS < window + q.window_ms + 2 * SLACK_MS:
                chk.fail("quota", f"quota {q.name!r} {what} in window [{window}, {window + q.window_ms}), judged at "
                                  f"{judged}, now {mono}")
            if q.cooldown_until_mono_ms > judged + SLACK_MS:
                chk.fail("quota", f"quota {q.name!r} {what} during its cooldown (until {q.cooldown_until_mono_ms}, "
                                  f"judged at {judged})")

        def consumed(chk, m, rec: r.QuotaConsumed, now, mono):
            window_grant(chk, m, m.quotas.table.get(rec.quota_id), rec.window_start_mono_ms, rec.units, now, mono,
                         "granted (take)")
            _acquired_in_ended_run(chk, m, rec, now, "quota units taken")

        def added(chk, m, rec: r.QuotaWaiterAdded, now, mono):
            if rec.consumption_id is not None:
                window_grant(chk, m, m.quotas.table.get(rec.quota_id), rec.window_start_mono_ms, rec.units, now, mono,
                             "granted (waiter)")
            _acquired_in_ended_run(chk, m, rec, now, "quota waiter added")

        def granted(chk, m, rec: r.QuotaWaitersGranted, now, mono):
            qs = m.quotas
            total = 0
            for g in rec.grants:
                wt = qs.waiters.get(g.waiter_id)
                if wt is None or wt.state != "WAITING":
                    chk.fail("quota", f"quota waiter {g.waiter_id} granted while {wt.state if wt else 'missing'}")
                    continue
                total += wt.units
                why = m.runs.inactive_error(wt.scope_id, now)
                if why is not None:
                    chk.fail("ended-run", f"quota waiter {wt.id} granted while its run refuses requests ({why.code})")
            window_grant(chk, m, qs.table.get(rec.quota_id), rec.window_start_mono_ms, total, now, mono,
                         f"granted {len(rec.grants)} waiter(s)", judged=m.clock.wall_to_mono(rec.at_ms))

        return {r.QuotaConsumed: consumed, r.QuotaWaiterAdded: added, r.QuotaWaitersGranted: granted}


# ============================================================================ budgets
BUDGETS = {"b0": 1000}


class SimBudgets(SimKind):
    """Budgets: settled + reserved never exceeds the limit; settled only grows; a
    reservation's remainder is what the budget counts as reserved; reservations only for
    runs that accept requests; voiding is allowed on an ended run."""

    name = "budgets"
    facts = ("reservation_closed",)

    def init_world(self, world):
        world.budgets = set()

    def fallbacks(self, world):
        return ["budget.reserve", "budget.ensure"] if world.budgets else ["budget.ensure"]

    def ops(self):
        def budget(g: Gen):
            return "b0" if g.world.budgets or g.rng.random() < 0.8 else "nosuch"

        def ensure(g: Gen):
            return p.BudgetEnsure(name="b0", limit_minor=BUDGETS["b0"])

        def reserve(g: Gen):
            run = g.world.pick(g.rng, "scp")
            if run is None or not g.world.budgets:
                return None
            return p.BudgetReserve(budget=budget(g), scope_id=run, amount_minor=g.rng.choice((100, 250, 400, 700)),
                                   settle_within_ms=g.rng.choice((None, None, 3000)),
                                   key=g.rng.choice((None, None, "r0")))

        def rsv(g: Gen):
            return g.world.pick(g.rng, "rsv")

        def settle(g: Gen):
            x = rsv(g)
            return x and p.BudgetSettle(reservation_id=x, amount_minor=g.rng.choice((0, 50, 300, 900)),
                                        usage_key=g.rng.choice(("u0", "u1", f"u{g.rng.randrange(99)}")),
                                        final=g.rng.random() < 0.6)

        def void(g: Gen):
            x = rsv(g)
            return x and p.BudgetVoid(reservation_id=x)

        def get(g: Gen):
            return g.world.budgets and p.BudgetGet(budget=budget(g), reservations=g.rng.random() < 0.5)

        return {"budget.ensure": (0.5, ensure), "budget.reserve": (2.5, reserve), "budget.settle": (1.5, settle),
                "budget.void": (0.8, void), "budget.get": (0.3, get)}

    def _rsv(self, obs, rv: p.ReservationView) -> None:
        obs.world.add(rv.id)
        obs.fact("exists", rv.id)
        if rv.state in ("SETTLED", "VOIDED"):
            obs.fact("reservation_closed", rv.id, rv.state, rv.settled_minor)

    def observe(self, obs, op, reply, err):
        if isinstance(reply, p.BudgetView):
            obs.world.add(reply.id)
            obs.world.budgets.add(reply.name)
            obs.fact("exists", reply.id)
            for rv in reply.reservations:
                self._rsv(obs, rv)
        elif isinstance(reply, p.ReservationView):
            self._rsv(obs, reply)
        elif isinstance(reply, p.SettleView):
            self._rsv(obs, reply.reservation)

    def check_fact(self, coord, fact):
        rs = coord.budgets.reservations.get(fact[1])
        if rs is None:
            return f"reservation {fact[1]} is missing"
        if rs.state != fact[2] or rs.settled_minor < fact[3]:
            return f"reservation {rs.id} was seen {fact[2]} with {fact[3]} settled, is {rs.state} with {rs.settled_minor}"
        return None

    def made(self, chk, coord, op, reply, err):
        if isinstance(op, p.BudgetVoid):
            _refused_release(chk, op, err, f"budget.void({op.reservation_id})")

    def quiescent(self, chk, coord):
        bs = coord.budgets
        held: dict[str, int] = {}
        tasks = coord.queues.tasks
        for rs in bs.reservations.values():
            if rs.state in ("ACTIVE", "STALE"):
                held[rs.budget_id] = held.get(rs.budget_id, 0) + rs.remaining_minor
                if rs.task_id is not None:
                    t = tasks.get(rs.task_id)
                    if t is None or t.state != "RUNNING" or t.token != rs.token:
                        chk.fail("admission", f"reservation {rs.id} of task {rs.task_id} (token {rs.token}) is open "
                                              f"while the task is {t.state if t else 'missing'} with token "
                                              f"{t.token if t else '?'}")
        for b in bs.table.values():
            if b.settled_minor + b.reserved_minor > b.limit_minor:
                chk.fail("budget", f"budget {b.name!r}: {b.settled_minor} settled + {b.reserved_minor} reserved "
                                   f"exceed its limit {b.limit_minor}")
            if held.get(b.id, 0) != b.reserved_minor:
                chk.fail("budget", f"budget {b.name!r} counts {b.reserved_minor} reserved, its open reservations hold "
                                   f"{held.get(b.id, 0)}")

    def monotone(self, coord):
        out = {b.id: b.settled_minor for b in coord.budgets.table.values()}
        out.update({rs.id: (rs.state, rs.settled_minor) for rs in coord.budgets.reservations.values()})
        return out

    def regressed(self, eid, old, new):
        if isinstance(old, int):
            return f"budget {eid}'s settled amount went back from {old} to {new}" if new < old else None
        if old[0] in ("SETTLED", "VOIDED") and new[0] != old[0]:
            return f"reservation {eid} went from {old[0]} to {new[0]}"
        if new[1] < old[1]:
            return f"reservation {eid}'s settled amount went back"
        return None

    def audits(self):
        def reserved(chk, m, rec: r.BudgetReserved, now, mono):
            b = m.budgets.table.get(rec.budget_id)
            if b is not None and b.settled_minor + b.reserved_minor + rec.amount_minor > b.limit_minor:
                chk.fail("budget", f"budget {b.name!r} reserved {rec.amount_minor} with {b.settled_minor} settled and "
                                   f"{b.reserved_minor} reserved of {b.limit_minor}")
            if rec.task_id is None:
                _acquired_in_ended_run(chk, m, rec, now, "budget reserved")

        def settled(chk, m, rec: r.BudgetSettled, now, mono):
            rs = m.budgets.reservations.get(rec.reservation_id)
            if rs is None:
                chk.fail("budget", f"unknown reservation {rec.reservation_id} settled")
                return
            b = m.budgets.table[rs.budget_id]
            unreserved = b.limit_minor - b.settled_minor - b.reserved_minor
            held = rs.remaining_minor if rs.state in ("ACTIVE", "STALE") else 0  # a closed one: unreserved only
            if rec.charged_minor > held + unreserved or rec.charged_minor > rec.requested_minor:
                chk.fail("budget", f"reservation {rs.id} charged {rec.charged_minor} (asked {rec.requested_minor}) with "
                                   f"{held} left and {unreserved} unreserved")

        return {r.BudgetReserved: reserved, r.BudgetSettled: settled}


# ============================================================================ messages (INBOX mailboxes)
class SimMessages(SimKind):
    """Plain messages into an INBOX mailbox, received and settled like deliveries (the
    queue kind's checks cover their leases and tokens); a message seen ACKED stays so."""

    name = "messages"
    facts = ("message_state",)

    def init_world(self, world):
        world.inbox = False

    def fallbacks(self, world):
        return ["message.send", "inbox.ensure"] if world.inbox else ["inbox.ensure"]

    def ops(self):
        def ensure(g: Gen):
            # (an INBOX queue's messages carry no requirements: declaring some is
            # VALIDATION_FAILED, an empty declaration is fine)
            reqs = declared_requirements(g) if g.rng.random() < 0.1 else None
            return p.MailboxEnsure(name="i0", mode="INBOX", max_attempts=2, requirements=reqs)

        def send(g: Gen):
            run = g.world.pick(g.rng, "scp")
            if run is None or not g.world.inbox:
                return None
            return p.MessageSend(mailbox="i0", scope_id=run, payload=_raw({"m": g.rng.randrange(10**6)}),
                                 key=g.rng.choice((None, None, "m0")),
                                 deadline=g.iso_in(1, 60) if g.rng.random() < 0.1 else None)

        def receive(g: Gen):
            run = g.world.pick(g.rng, "scp", recent=0.4)
            if run is None or not g.world.inbox:
                return None
            return p.Receive(mailbox="i0", scope_id=run, lease_ms=g.rng.choice((5000, 30000)), wait_ms=g.wait_ms(),
                             max_messages=g.rng.choice((1, 3)))

        def status(g: Gen):
            m = g.world.pick(g.rng, "msg")
            return m and p.MessageStatus(message_id=m)

        return {"inbox.ensure": (0.4, ensure), "message.send": (2.5, send), "message.receive": (2.0, receive),
                "message.status": (0.5, status)}

    def observe(self, obs, op, reply, err):
        if isinstance(reply, p.MailboxView) and reply.mode == "INBOX":
            obs.world.inbox = True
        elif isinstance(reply, p.MessageView):
            obs.world.add(reply.id)
            obs.fact("exists", reply.id)
            if reply.state in TERMINAL or reply.state == "ACKED":
                obs.fact("message_state", reply.id, reply.state)

    def check_fact(self, coord, fact):
        t = coord.queues.tasks.get(fact[1])
        if t is None:
            return f"message {fact[1]} is missing"
        if t.state != fact[2] and not (fact[2] == "ACKED" and t.state == "SUCCEEDED"):
            return f"message {t.id} was seen {fact[2]}, is {t.state}"
        return None


# ============================================================================ schedules
class SimSchedules(SimKind):
    """Schedules: fire-once (no (schedule, time) fired twice, no spec time at or before
    the cursor fired), no-miss (at quiescence nothing due is left undealt with), the
    cursor never moves back, through crashes and time zones."""

    name = "schedules"
    facts = ("sched_actions",)
    _ZONES = ("UTC", "Europe/Berlin", "America/New_York")

    def fallbacks(self, world):
        return ["schedule.create"]

    def ops(self):
        def sch(g: Gen):
            return g.world.pick(g.rng, "sch")

        def create(g: Gen):
            rng = g.rng
            name = f"sim-s{rng.randrange(4)}"
            kw = dict(overlap=rng.choice(("skip", "buffer_one", "buffer_all", "cancel_other", "allow_all")),
                      jitter_ms=rng.choice((0, 0, 300)), catchup_window_ms=rng.choice((1000, 5000, 60000)),
                      remaining_actions=rng.choice((None, None, 3)), timezone=rng.choice(self._ZONES))
            if rng.random() < 0.5:
                return p.ScheduleCreate(name=name, interval_ms=rng.choice((1000, 2000, 5000)), **kw)
            return p.ScheduleCreate(name=name, cron=[rng.choice(("*/2 * * * * *", "*/5 * * * * *"))], **kw)

        def trigger(g: Gen):
            x = sch(g)
            return x and p.ScheduleTrigger(schedule=x)

        def pause(g: Gen):
            x = sch(g)
            return x and p.SchedulePause(schedule=x, paused=g.rng.random() < 0.5, note="sim")

        def backfill(g: Gen):
            x = sch(g)
            return x and p.ScheduleBackfill(schedule=x, start=to_iso(g.now_ms - 20_000), end=to_iso(g.now_ms - 1000),
                                            overlap=g.rng.choice((None, "allow_all")))

        def describe(g: Gen):
            x = sch(g)
            return x and p.ScheduleGet(schedule=x)

        return {"schedule.create": (0.3, create), "schedule.trigger": (0.3, trigger), "schedule.pause": (0.2, pause),
                "schedule.backfill": (0.1, backfill), "schedule.describe": (0.3, describe)}

    def observe(self, obs, op, reply, err):
        if isinstance(reply, p.ScheduleView):
            obs.world.add(reply.id)
            obs.fact("sched_actions", reply.id, reply.actions)

    def check_fact(self, coord, fact):
        sc = coord.schedules.table.get(fact[1])
        if sc is None:
            return f"schedule {fact[1]} is missing"
        if sc.actions < fact[2]:
            return f"schedule {sc.id} was seen with {fact[2]} actions, has {sc.actions}"
        return None

    def quiescent(self, chk, coord):
        from ..actors.schedule import spec_times

        k = coord.schedules
        now = coord.now_ms()
        for sc in k.table.values():
            if sc.paused or sc.remaining == 0:
                continue
            for t in spec_times(sc.config, sc.cursor_ms):
                late = now - k.fire_ms(sc, t)
                if late > SLACK_MS:
                    chk.fail("timeliness", f"schedule {sc.id}: the time {to_iso(t)} is {late} ms past its fire "
                                           "instant and was neither fired nor skipped")
                break

    def monotone(self, coord):
        return {sc.id: sc.cursor_ms for sc in coord.schedules.table.values()}

    def regressed(self, eid, old, new):
        if new < old:
            return f"schedule {eid}'s cursor moved back from {old} to {new}"
        return None

    def audits(self):
        def fired(chk, m, rec: r.ScheduleFired, now, mono):
            k = m.schedules
            sc = k.table.get(rec.schedule_id)
            if sc is None:
                chk.fail("audit", f"schedule {rec.schedule_id} fired while missing")
                return
            if (sc.id, rec.scheduled_ms) in k.by_key:
                chk.fail("fire-once", f"schedule {sc.id} fired {to_iso(rec.scheduled_ms)} a second time")
            if rec.advance:
                if rec.scheduled_ms <= sc.cursor_ms:
                    chk.fail("fire-once", f"schedule {sc.id} fired {to_iso(rec.scheduled_ms)}, at or before its "
                                          f"cursor {to_iso(sc.cursor_ms)}")
                early = k.fire_ms(sc, rec.scheduled_ms) - now
                if early > SLACK_MS:
                    chk.fail("timeliness", f"schedule {sc.id} fired {to_iso(rec.scheduled_ms)} {early} ms early")

        def skipped(chk, m, rec: r.ScheduleSkipped, now, mono):
            sc = m.schedules.table.get(rec.schedule_id)
            if sc is not None and rec.advance and rec.scheduled_ms <= sc.cursor_ms:
                chk.fail("fire-once", f"schedule {sc.id} skipped {to_iso(rec.scheduled_ms)}, at or before its cursor")

        return {r.ScheduleFired: fired, r.ScheduleSkipped: skipped}


#: Every kind the simulator drives, in the order their checks run.
KINDS: list[SimKind] = [SimRuns(), SimQueues(), SimGroups(), SimBarriers(), SimTimers(), SimJoinSets(),
                        SimClaims(), SimPools(), SimQuotas(), SimBudgets(), SimMessages(),
                        SimSchedules()]
