"""The queue kind's ready index: where a receive finds the task to deliver next, and
where priority and fair shares live (issue 44; docs/architecture.md, "Priorities and
fair shares").

Shape: per queue, per run with ready work, a :class:`_RunReady`: its **levels** (one per
priority with ready tasks, 1 = most urgent) and, in each level, its **fairness keys**,
each a heap of ``(seq, gen, task id)`` (first in, first out within a key). A level picks
the key whose turn comes next by *stride scheduling*: each key has a ``pass``; the key
with the lowest pass is served and its pass grows by ``STRIDE / weight``; a key that
comes back (had no ready task, now has one) starts at the level's virtual time (the pass
of the key served last), so a key with one task waits at most one round of the keys
already backlogged, whatever their backlog. Ties go to the key that joined first.

A receive for a run looks at the run's index and its descendants' (the subtree) and
takes, across them, the most urgent level first; between runs at the same level, the
oldest task (``seq``). Fair shares are exact within one run's index (where a queue's
tasks are, when producers submit under the run their workers receive for).

**Aging** (per queue, ``MailboxState.aging_ms``, off when None): a waiting task gains
one level per ``aging_ms`` waited since it was submitted (``created_at_ms``, wall ms),
never past 1. Within a level the oldest task has aged most, so each level keeps one more
heap by ``seq`` (only on an aging queue) and the level whose oldest task is most urgent
(effective priority, then the older task: FIFO among equal effective levels) is served; a task that aged past its level is
served first in line, else the level's stride turn is taken.

**Rate limits** (per queue and fairness key, ``MailboxState.rate_limits``): :meth:`ReadyIndex.pop`
takes ``key_room(key)`` (how many more of the key may be delivered now); a key at 0 is
passed over for the pop -- its turn (and on an aging level its oldest entries, at most
:data:`MAX_PARKED` a pick) set aside and put back at the end, its pass unchanged, so it
keeps its place -- and :attr:`ReadyIndex.rate_blocked` tells the caller to wake the
receivers when the key's window turns.

Entries are dropped lazily: ``members`` maps every ready task to the generation of its
entry (a new one at each :meth:`ReadyIndex.add`: a priority change, a requeue), and an
entry whose generation is not the current one is stale and skipped. Rebuilt after
recovery, never snapshotted (the tasks' priority, key and weight are: they are fields of
:class:`~rallypoint.actors.queue_state.TaskState`).
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable

from .queue_state import MAX_SKIPPED, TaskState

__all__ = ["ReadyIndex", "STRIDE"]

#: the pass a key of weight 1 advances by per delivery (a key of weight w: STRIDE // w)
STRIDE = 1 << 20

_heappush, _heappop, _heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace


class _Level:
    """One priority level of one run's index: the keys with ready tasks and their turns."""

    __slots__ = ("keys", "turns", "passes", "weights", "vtime", "order", "all", "parked")

    def __init__(self, aging: bool) -> None:
        self.keys: dict[str | None, list] = {}  # key -> heap of (seq, gen, task id)
        self.turns: list = []  # heap of (pass, order, key) of the keys with ready tasks
        self.passes: dict[str | None, int] = {}  # key -> its pass (keys in ``turns``)
        self.weights: dict[str | None, int] = {}  # key -> its weight (as last given)
        self.vtime = 0  # the pass of the key served last
        self.order = 0  # tie-break: the order keys joined in
        self.all: list | None = [] if aging else None  # aging: heap of (seq, gen, task id)
        self.parked = 0  # turns / aging entries set aside by the pop under way (rate-limited keys)


class _RunReady:
    __slots__ = ("levels", "prios")

    def __init__(self) -> None:
        self.levels: dict[int, _Level] = {}
        self.prios: list[int] = []  # heap of the levels' priorities (a level may be empty: lazy)


class ReadyIndex:
    """The ready tasks of every queue (``queue id -> run id -> _RunReady``).

    ``members``: task id -> ``(gen, queue id, run id, priority, key)`` of its current entry
    (``in`` tells whether a task is ready). ``backlog(queue_id)`` gives the counts per
    priority and per key. ``weight_of(task)`` (given by the kind) is a task's key's
    weight: the queue's weight for the key, else the task's own, else 1."""

    def __init__(self, tasks: dict[str, TaskState], weight_of: Callable[[TaskState], int],
                 aging_of: Callable[[str], int | None]) -> None:
        self.tasks = tasks
        self.weight_of = weight_of
        self.aging_of = aging_of  # queue id -> aging_ms (None: off)
        self.members: dict[str, tuple] = {}
        self.queues: dict[str, dict[str, _RunReady]] = {}
        self.by_prio: dict[str, dict[int, int]] = {}  # queue -> priority -> ready tasks
        self.by_key: dict[str, dict[str | None, int]] = {}  # queue -> key -> ready tasks
        self.gen = 0
        self.aside: set[str] = set()  # tasks set aside by the pop under way (see pop)
        # the pop under way: whether a key is rate-limited now (None: no limits), and what
        # it set aside for them: (level, turn) / (level, aging entry) / (run index, priority)
        self._blocked: Callable[[str | None], bool] | None = None
        self._parked_turns: list = []
        self._parked_all: list = []
        self._parked_prios: list = []
        #: the last pop skipped a ready key because of its rate limit
        self.rate_blocked = False

    # ------------------------------------------------------------------ membership
    def __contains__(self, task_id: str) -> bool:
        # (a task set aside by the receive under way is still ready: admission's lines
        # keep its place while the receive looks at the younger ones)
        return task_id in self.members or task_id in self.aside

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self):
        """The ready tasks' ids."""
        return iter(self.members)

    def add(self, t: TaskState) -> bool:
        """Index ``t`` (QUEUED, due) at its priority and key; a task already there with the
        same priority and key stays where it is (False), else it moves (its old entry goes
        stale) and True."""
        prio, key = t.priority, t.fair_key
        m = self.members.get(t.id)
        if m is not None:
            if m[3] == prio and m[4] == key:
                return False
            self._uncount(m)
        self.gen += 1
        gen = self.gen
        qid, rid = t.mailbox_id, t.scope_id
        self.members[t.id] = (gen, qid, rid, prio, key)
        bp = self.by_prio.setdefault(qid, {})
        bp[prio] = bp.get(prio, 0) + 1
        bk = self.by_key.setdefault(qid, {})
        bk[key] = bk.get(key, 0) + 1
        per_run = self.queues.get(qid)
        if per_run is None:
            per_run = self.queues[qid] = {}
        rr = per_run.get(rid)
        if rr is None:
            rr = per_run[rid] = _RunReady()
        lv = rr.levels.get(prio)
        if lv is None:
            lv = rr.levels[prio] = _Level(self.aging_of(qid) is not None)
            _heappush(rr.prios, prio)
        entry = (t.seq, gen, t.id)
        h = lv.keys.get(key)
        lv.weights[key] = self.weight_of(t)
        if h is None:
            lv.keys[key] = [entry]
        else:
            _heappush(h, entry)
        if key not in lv.passes:  # the key (re)joins the turns at the level's virtual time
            lv.passes[key] = lv.vtime
            lv.order += 1
            _heappush(lv.turns, (lv.vtime, lv.order, key))
        if lv.all is not None:
            _heappush(lv.all, entry)
        return True

    def discard(self, task_id: str) -> None:
        """``task_id`` is no longer ready (delivered, finished, purged); its entry goes stale."""
        m = self.members.pop(task_id, None)
        if m is not None:
            self._uncount(m)

    def _uncount(self, m: tuple) -> None:
        _gen, qid, _rid, prio, key = m
        bp = self.by_prio[qid]
        bp[prio] -= 1
        if not bp[prio]:
            del bp[prio]
        bk = self.by_key[qid]
        bk[key] -= 1
        if not bk[key]:
            del bk[key]

    def drop_run(self, run_id: str) -> None:
        """Forget the run's (empty: its tasks are all finished) indexes."""
        for per_run in self.queues.values():
            per_run.pop(run_id, None)

    def reindex_queue(self, queue_id: str) -> None:
        """Build the queue's indexes again from its ready tasks (its aging setting changed)."""
        ids = sorted((tid for tid, m in self.members.items() if m[1] == queue_id),
                     key=lambda tid: self.tasks[tid].seq)
        for tid in ids:
            self.discard(tid)
        self.queues.pop(queue_id, None)
        for tid in ids:
            self.add(self.tasks[tid])

    def backlog(self, queue_id: str) -> tuple[dict[int, int], dict[str | None, int]]:
        """The queue's ready tasks per priority and per fairness key (None: no key)."""
        return dict(self.by_prio.get(queue_id, {})), dict(self.by_key.get(queue_id, {}))

    def oldest(self, queue_id: str) -> TaskState | None:
        """The queue's oldest ready task (lowest ``seq``), None when none is ready."""
        best = None
        for rr in self.queues.get(queue_id, {}).values():
            for lv in rr.levels.values():
                for h in lv.keys.values():
                    e = self._head(h)
                    if e is not None and (best is None or e < best):
                        best = e
        return self.tasks[best[2]] if best is not None else None

    # ------------------------------------------------------------------ picking
    def _head(self, h: list):
        """The valid head of a key's heap (stale entries popped), None when empty."""
        members = self.members
        while h:
            e = h[0]
            m = members.get(e[2])
            if m is not None and m[0] == e[1]:
                return e
            _heappop(h)
        return None

    def _level_pick(self, lv: _Level):
        """``(entry, key, from_all)`` of the level's next task by stride turn, None when
        the level has no ready task (emptied keys leave the turns)."""
        turns = lv.turns
        blocked = self._blocked
        while turns:
            _pass, _order, key = turns[0]
            h = lv.keys.get(key)
            e = self._head(h) if h is not None else None
            if e is not None:
                if blocked is not None and blocked(key):  # rate-limited: its turn waits
                    self._parked_turns.append((lv, _heappop(turns)))
                    lv.parked += 1
                    continue
                return e, key
            _heappop(turns)
            lv.passes.pop(key, None)
            lv.keys.pop(key, None)
        return None

    def _oldest_free(self, lv: _Level):
        """An aging level's oldest entry whose key is not rate-limited now (the limited
        ones before it set aside for this pop), None when there is none, ``_CAPPED`` when
        more than :data:`MAX_PARKED` had to be set aside (the level is then served by
        its turns alone in this pop)."""
        h = lv.all
        blocked = self._blocked
        n = 0
        while True:
            e = self._head(h)
            if e is None or blocked is None or not blocked(self.members[e[2]][4]):
                return e
            if n >= MAX_PARKED:
                return _CAPPED
            self._parked_all.append((lv, _heappop(h)))
            lv.parked += 1
            n += 1

    def _run_pick(self, rr: _RunReady, queue_id: str, now_ms: int):
        """The run's next task: ``(rank, entry, level priority, key or _OLDEST)``, None
        when it has none. ``rank``: ``(effective priority, seq)``."""
        prios = rr.prios
        aging = self.aging_of(queue_id)
        if aging is None:
            while prios:
                p = prios[0]
                lv = rr.levels[p]
                got = self._level_pick(lv)
                if got is not None:
                    return (p, got[0][0]), got[0], p, got[1]
                _heappop(prios)
                if lv.parked:  # only rate-limited keys left: back after this pop
                    self._parked_prios.append((rr, p))
                else:
                    del rr.levels[p]
            return None
        best = None
        empty = []
        for p in prios:
            lv = rr.levels[p]
            oldest = self._oldest_free(lv)
            if oldest is _CAPPED:  # (too many rate-limited ahead: its turns, no aging, this pop)
                got = self._level_pick(lv)
                if got is not None and (best is None or (p, got[0][0]) < best[0]):
                    best = ((p, got[0][0]), lv, None, p)
                continue
            if oldest is None:
                if not lv.parked:
                    empty.append(p)
                continue
            age = max(0, now_ms - self.tasks[oldest[2]].created_at_ms)
            eff = max(1, p - age // aging)
            if best is None or (eff, oldest[0]) < best[0]:  # (equal effective levels: the older first)
                best = ((eff, oldest[0]), lv, oldest, p)
        if empty:
            for p in empty:
                del rr.levels[p]
            rr.prios[:] = [p for p in prios if p in rr.levels]
            heapq.heapify(rr.prios)
        if best is None:
            return None
        (eff, _seq), lv, oldest, p = best
        if oldest is not None and eff < p:  # aged past its level: first in line
            return (eff, oldest[0]), oldest, p, _OLDEST
        got = self._level_pick(lv)
        if got is None:  # (its free keys were all rate-limited: the level waits this pop)
            return None
        return (eff, got[0][0]), got[0], p, got[1]

    def _take(self, rr: _RunReady, entry, p: int, key, served: bool = True) -> None:
        """Remove the picked entry from its heaps; ``served``: advance its key's turn by
        its stride (a task set aside is not served: its key keeps its turn)."""
        lv = rr.levels[p]
        if key is _OLDEST:
            _heappop(lv.all)  # (its key's entry goes stale: the task leaves ``members``)
            return
        h = lv.keys[key]
        _heappop(h)
        more = self._head(h) is not None
        if not served and more:
            return
        turns = lv.turns
        pass_, order, _k = turns[0]
        if served:
            lv.vtime = pass_
        if more:  # (one sift: the key's next turn replaces this one)
            new = pass_ + STRIDE // max(1, lv.weights.get(key, 1))
            lv.passes[key] = new
            _heapreplace(turns, (new, order, key))
        else:
            _heappop(turns)
            del lv.keys[key]
            del lv.passes[key]

    def pop(self, queue_id: str, cands: Iterable[tuple[str, _RunReady]], n: int, now_ms: int,
            eligible: Callable[[TaskState], bool], room: int | None = None,
            size: Callable[[TaskState], int] | None = None,
            key_room: Callable[[str | None], int | None] | None = None) -> list[TaskState]:
        """Take up to ``n`` ready tasks of the runs ``cands`` (``(run id, _RunReady)``),
        most urgent first (see the module's docstring). ``eligible(task)`` False: the
        task is set aside for this call and put back where it was (at most
        :data:`MAX_SKIPPED` of them). With ``room`` (bytes) and ``size(task)``, taking
        stops before the first task that would not fit (the first is always taken).
        ``now_ms``: the wall instant aging is judged at (ms). ``key_room(key)``: how
        many more tasks of a fairness key may be delivered now (its rate limit; None: no
        limit); a key at 0 is passed over -- its turn and its place kept -- and
        :attr:`rate_blocked` tells the caller one was (to wake receivers when the
        key's window turns)."""
        cands = list(cands)
        out: list[TaskState] = []
        tasks = self.tasks
        skipped: list = []  # (task) set aside: re-added at the end
        rooms: dict = {}
        self.rate_blocked = False
        if key_room is not None:
            def blocked(key) -> bool:
                r = rooms[key] if key in rooms else rooms.setdefault(key, key_room(key))
                if r is not None and r <= 0:
                    self.rate_blocked = True
                    return True
                return False

            self._blocked = blocked
        try:
            self._pop_loop(queue_id, cands, n, now_ms, eligible, room, size, out, skipped, rooms)
        finally:
            self._blocked = None
            self._unpark()
        self.aside.clear()
        for t in skipped:  # back first in line (same seq: the same FIFO place)
            self.add(t)
        per_run = self.queues.get(queue_id)
        if per_run is not None:
            for rid, rr in cands:
                if not rr.prios:
                    per_run.pop(rid, None)
        return out

    def _unpark(self) -> None:
        """Put back what the pop set aside for rate-limited keys (their turns, their
        aging entries, the levels they alone kept)."""
        for lv, turn in self._parked_turns:
            _heappush(lv.turns, turn)
            lv.parked -= 1
        for lv, e in self._parked_all:
            _heappush(lv.all, e)
            lv.parked -= 1
        for rr, p in self._parked_prios:
            _heappush(rr.prios, p)
        self._parked_turns.clear()
        self._parked_all.clear()
        self._parked_prios.clear()

    def _pop_loop(self, queue_id, cands, n, now_ms, eligible, room, size, out, skipped, rooms) -> None:
        tasks = self.tasks
        while len(out) < n:
            best = None
            for _rid, rr in cands:
                got = self._run_pick(rr, queue_id, now_ms)
                if got is not None and (best is None or got[0] < best[0]):
                    best = (got[0], rr, got[1], got[2], got[3])
            if best is None:
                break
            _rank, rr, entry, p, key = best
            t = tasks[entry[2]]
            if room is not None:
                need = size(t)
                if need > room and out:  # the reply is full: it stays first in line
                    break
            if not eligible(t):
                self._take(rr, entry, p, key, served=False)
                skipped.append(t)
                self.discard(t.id)
                self.aside.add(t.id)
                if len(skipped) >= MAX_SKIPPED:
                    break
                continue
            self._take(rr, entry, p, key)
            self.discard(t.id)
            out.append(t)
            left = rooms.get(t.fair_key)
            if left is not None:
                rooms[t.fair_key] = left - 1
            if room is not None:
                room -= need

    def entries(self) -> dict[str, dict[str, list[str]]]:
        """queue id -> run id -> the task ids of the current (not stale) entries of its
        keys' heaps (a diagnostic and the tests' view: each ready task once)."""
        members = self.members
        out: dict[str, dict[str, list[str]]] = {}
        for qid, per_run in self.queues.items():
            for rid, rr in per_run.items():
                ids = [e[2] for lv in rr.levels.values() for h in lv.keys.values() for e in h
                       if members.get(e[2], (0,))[0] == e[1]]
                out.setdefault(qid, {})[rid] = ids
        return out

    def runs(self, queue_id: str) -> dict[str, _RunReady]:
        """The queue's runs with ready work (run id -> its index)."""
        return self.queues.get(queue_id) or {}


_OLDEST = object()  # a pick from a level's aging heap (not a key's turn)
_CAPPED = object()  # an aging level with more than MAX_PARKED rate-limited entries ahead

#: how many aging entries of rate-limited keys one pop sets aside per level at most
MAX_PARKED = 256
