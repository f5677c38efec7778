"""One fair wait queue: first come, first served, with withdrawal and requeueing.

Modelled on Trio's ``ParkingLot`` ("a fair wait queue with cancellation and
requeueing", one class behind every Trio lock): every durable FIFO line of the server
is a :class:`WaitQueue` -- a claim's waiting acquires, a pool's waiting acquires, a
quota's WAITING waiters. What differs between them is what they hold (a claim waiter,
a pool waiter, a quota waiter entity), what "fits" means when the line is served (the
next lease; units free; units left in the window), and what a waiter that leaves
writes to the journal -- never the order.

A waiter is durable state: it joins and leaves the line only in the apply of a journal
record (``ClaimWaiterQueued`` / ``ClaimAcquired`` / ``ClaimWaiterEnded``,
``PoolWaiterQueued`` / ``PoolGranted`` / ``PoolWaiterEnded``, ``QuotaWaiterAdded`` /
``QuotaWaitersGranted`` / ``QuotaWaiterEnded``), so replay rebuilds the same line. A
parked request that waits on a waiter is not the waiter: its answer is the runtime's
(``runtime.Park``); the line only says who is where.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, TypeVar

__all__ = ["WaitQueue", "WaitQueueStatistics"]

W = TypeVar("W")


@dataclass(frozen=True)
class WaitQueueStatistics:
    """What :meth:`WaitQueue.statistics` returns: ``waiting`` waiters in line and the
    key of the first (``head``, None when the line is empty)."""

    waiting: int
    head: str | None


class WaitQueue(Generic[W]):
    """A FIFO line of waiters, each named by a unique key (a request id, a waiter id).

    Semantics (exact):

    - **Order.** Waiters are served in the order they joined (:meth:`add`), nothing
      else: not by size, not by run, not by time limit.
    - **Requeueing keeps the place.** A request sent again with the same key (a client
      that reconnected, or that re-sends its wait every 60 s) finds its waiter with
      :meth:`get` and waits on it; it never joins again, so it never loses its place.
      :meth:`add` of a key already in line is a bug (``ValueError``).
    - **Leaving.** A waiter leaves by :meth:`remove` (granted, withdrawn, out of time)
      or :meth:`remove_where` (every waiter of a run that ended). Both are idempotent:
      removing a key not in line changes nothing and returns None / nothing.
    - **Serving: no barging.** :meth:`plan` walks the line head first. Waiters that are
      leaving (``gone(w)``: out of time, their run inactive) are passed over and
      returned apart; each other waiter is served while ``fits(w)`` says so, and the
      first that does not fit stops the walk: nobody behind it is served before it,
      however small its request. ``plan`` changes nothing (a decide step reads it,
      commits the records, and the applies move the line).
    - **Durable storage.** For a line stored inside an entity's snapshot Struct (a
      claim's or a pool's ``waiters`` list), ``store`` is that list: it is kept equal to
      the line, in order, so the snapshot format does not change. A line whose waiters
      are entities of their own (quota waiters) has no store and is rebuilt at recovery
      from their order (``seq``).

    Cost: add, get, remove, head, ``in`` and ``len`` are O(1) (an ``OrderedDict`` by key;
    removing from a ``store`` list is O(n)); :meth:`position` and :meth:`plan` are O(n).

    Args:
        key: the waiter's key, ``(waiter) -> str``.
        store: the durable list to mirror (its current items form the line, in order), or
            None.
    """

    __slots__ = ("_key", "_line", "_store")

    def __init__(self, key: Callable[[W], str], store: list[W] | None = None) -> None:
        self._key = key
        self._store = store
        self._line: OrderedDict[str, W] = OrderedDict()
        if store:
            for w in store:
                k = key(w)
                if k in self._line:
                    raise ValueError(f"waiter {k!r} is in line twice")
                self._line[k] = w

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return len(self._line)

    def __bool__(self) -> bool:
        return bool(self._line)

    def __contains__(self, key: object) -> bool:
        return key in self._line

    def __iter__(self) -> Iterator[W]:
        """The waiters, head first (do not join or leave while iterating)."""
        return iter(self._line.values())

    def get(self, key: str) -> W | None:
        """The waiter named ``key``, or None when it is not in line."""
        return self._line.get(key)

    def head(self) -> W | None:
        """The first waiter, or None."""
        for w in self._line.values():
            return w
        return None

    def position(self, key: str) -> int:
        """``key``'s place in line, 1 for the head; 0 when it is not in line."""
        for i, k in enumerate(self._line, 1):
            if k == key:
                return i
        return 0

    def plan(self, gone: Callable[[W], bool], fits: Callable[[W], bool],
             limit: int | None = None) -> tuple[list[W], list[W]]:
        """The serving walk, head first, read-only: ``(leaving, served)``. A waiter for
        which ``gone(w)`` is true is passed over (in ``leaving``); the others are served
        while ``fits(w)`` is true (``fits`` may count what it hands out); the first that
        does not fit ends the walk, and so does the ``limit``-th served (nobody behind it
        is looked at)."""
        leaving: list[W] = []
        served: list[W] = []
        for w in self._line.values():
            if limit is not None and len(served) >= limit:
                break
            if gone(w):
                leaving.append(w)
                continue
            if not fits(w):
                break
            served.append(w)
        return leaving, served

    def statistics(self) -> WaitQueueStatistics:
        """Waiters in line and the head's key (Trio's ``ParkingLot.statistics``)."""
        head = next(iter(self._line), None)
        return WaitQueueStatistics(waiting=len(self._line), head=head)

    # ------------------------------------------------------------------ changes (apply only)
    def add(self, w: W) -> None:
        """``w`` joins at the back. ``ValueError`` if its key is in line already (a
        re-sent request must find its waiter with :meth:`get` instead)."""
        k = self._key(w)
        if k in self._line:
            raise ValueError(f"waiter {k!r} is already in line")
        self._line[k] = w
        if self._store is not None:
            self._store.append(w)

    def remove(self, key: str) -> W | None:
        """The waiter ``key`` leaves the line; returns it (None: it was not in line)."""
        w = self._line.pop(key, None)
        if w is not None and self._store is not None:
            self._store.remove(w)
        return w

    def remove_where(self, pred: Callable[[W], bool]) -> list[W]:
        """Every waiter for which ``pred(w)`` is true leaves; returns them in line order."""
        out = [w for w in self._line.values() if pred(w)]
        if out:
            for w in out:
                del self._line[self._key(w)]
            if self._store is not None:
                self._store[:] = list(self._line.values())
        return out

    def clear(self) -> list[W]:
        """Everyone leaves (a claim completed: each waiter gets the result); returns
        them in line order."""
        out = list(self._line.values())
        self._line.clear()
        if self._store is not None:
            self._store.clear()
        return out
