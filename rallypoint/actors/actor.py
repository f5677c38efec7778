"""The actor contract, and the small machinery every actor kind shares.

An *actor* here is an entity (a run, a mailbox, a task, a group...) whose state is a
msgspec Struct, together with its kind's two pure functions:

- ``decide(command) -> records | error``: validates against the entity's state (and may
  read other entities, e.g. whether a run is effectively active), returns journal
  records, mutates nothing;
- ``apply(record)``: mutates state, synchronously, with no clock reads; the same code
  runs live and in replay.

Commands reach an actor on the event-loop thread and ``decide``/commit/``apply`` run
without an ``await`` in between, so every actor handles one command at a time and a
commit that touches several actors is atomic (nothing can observe half of it). See
docs/architecture.md for why this replaces a memory channel per actor.

Activities (deadlines, lease expiries, retry delays, timers) live in ONE
:class:`TimerHeap` per coordinator: one sleeping task for all of them, never a task per
timer. Waiters park on a :class:`Notifier` keyed by entity id.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable

import trio

__all__ = ["TimerHeap", "Notifier"]


class TimerHeap:
    """One heap of due times for every activity of the coordinator.

    Entries are ``(due_ms, seq, kind, entity_id, arg)``; ``fire(kind, entity_id, arg,
    due_ms)`` is called for each once it is due. Entries are never removed when they
    become irrelevant (a lease renewed, a task finished): the callback re-checks the
    entity and ignores stale entries, which keeps arming O(log n) and cancellation free.
    """

    __slots__ = ("_heap", "_seq", "_wakeup", "_fire", "_clock", "fired")

    def __init__(self, clock, fire: Callable[[str, str, Any, int], None]) -> None:
        self._heap: list[tuple[int, int, str, str, Any]] = []
        self._seq = 0
        self._wakeup: trio.Event | None = None
        self._fire = fire
        self._clock = clock
        self.fired = 0

    def __len__(self) -> int:
        return len(self._heap)

    def arm(self, due_ms: int, kind: str, entity_id: str, arg: Any = None) -> None:
        """Schedule ``kind`` for ``entity_id`` at wall instant ``due_ms`` (ms)."""
        self._seq += 1
        entry = (due_ms, self._seq, kind, entity_id, arg)
        heapq.heappush(self._heap, entry)
        if self._heap[0] is entry and self._wakeup is not None:
            self._wakeup.set()

    def clear(self) -> None:
        self._heap.clear()

    def next_due_ms(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def fire_due(self) -> int:
        """Fire every entry that is due now; returns how many fired."""
        n = 0
        heap = self._heap
        clock = self._clock
        now_t = trio.current_time()
        while heap and clock.trio_time_at(heap[0][0]) <= now_t:
            due_ms, _, kind, entity_id, arg = heapq.heappop(heap)
            self._fire(kind, entity_id, arg, due_ms)
            n += 1
        self.fired += n
        return n

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The single sleeping task: wakes at the earliest due time (or when an earlier
        entry is armed), fires what is due, sleeps again."""
        task_status.started()
        while True:
            self.fire_due()
            deadline = self._clock.trio_time_at(self._heap[0][0]) if self._heap else math.inf
            self._wakeup = trio.Event()
            with trio.move_on_at(deadline):
                await self._wakeup.wait()
            self._wakeup = None


class Notifier:
    """Per-key wake-ups for server-side waits.

    ``event(key)`` returns the trio.Event a waiter parks on; ``notify(key)`` sets it and
    forgets it, so the next waiter gets a fresh one. Waiters re-check state after waking.
    Cost: one dict entry per key that currently has waiters.
    """

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: dict[Any, trio.Event] = {}

    def event(self, key: Any) -> trio.Event:
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = trio.Event()
        return ev

    def notify(self, key: Any) -> None:
        ev = self._events.pop(key, None)
        if ev is not None:
            ev.set()

    def has_waiters(self, key: Any) -> bool:
        return key in self._events

    def keys(self):
        return list(self._events)

    def notify_all(self) -> None:
        evs = list(self._events.values())
        self._events.clear()
        for ev in evs:
            ev.set()

    def __len__(self) -> int:
        return len(self._events)
