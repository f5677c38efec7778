"""Limits per space: what one tenant may hold at once, so it cannot take the node's memory.

Each space (a tenant) has its own *use* of every limit, and every space the same limit
values (``rallypoint serve --limit NAME=VALUE``; :data:`DEFAULTS` otherwise):

=================  ==========================================================  =========
name               what counts (per space)                                      falls when
=================  ==========================================================  =========
``runs``           live runs: root or child, a group's gate run, a task's own   it ends (cancelled, completed,
                   run (``delivery.run()``)                                     its deadline, an ancestor's end)
``tasks``          unfinished tasks and messages (queued, delayed, leased)      it finishes
``timers``         armed timers                                                 it fires or is cancelled
``stored``         runs, tasks, messages and timers kept, live or finished      retention purges it
                                                                                (``--retain-finished``)
``payload_bytes``  bytes of stored payloads: task inputs and messages, task     retention purges the task; a
                   outcomes and errors (once finished), stored HTTP answers     stored answer expires
                   (``Idempotency-Key``)
``watchers``       open event subscriptions (``events.watch``, the HTTP         it ends
                   watch's long poll, the console's live stream)
``connections``    open TCP connections authenticated into the space            it closes
``schedules``      schedules (recurring actions)                                it is deleted
=================  ==========================================================  =========

**Refusals.** An operation that would take a use past its limit is refused, before
anything is applied, with LIMIT_EXCEEDED (:class:`~rallypoint.errors.LimitError`,
HTTP 429) whose ``details`` are ``{"limit": name, "value": the limit, "use": the use
now, "adding": what the operation would add}`` and, where waiting helps (work
finishes, runs end, timers fire, connections close), ``retry_after`` (seconds). A
step that creates several entities (``task.submit_many``, a group with its gate run)
is checked for all of them at once: all or nothing. Results are never refused: a
worker's outcome or error is stored and counted (``payload_bytes`` may so pass its
limit by the results of the tasks already admitted), and a submission is refused
while it is over. A keyed HTTP request is refused at its start (the look-up of its
``Idempotency-Key``) while ``payload_bytes`` is at its limit, never between its effect
and its stored answer.

**Exact across restarts.** The journaled uses (``runs``, ``tasks``, ``timers``,
``stored``, ``payload_bytes``) are derived in the apply functions -- the same live and
in replay -- and recounted from the state after a snapshot is loaded
(:meth:`Limits.rebuild`); decide code only reads them. ``watchers`` and
``connections`` are what this process has open (none after a restart).

**Cost.** A check is a dict lookup and an int compare (two for what also counts as
``stored``); a count is an int add in an apply function.

**A sharded cluster**: each shard counts and limits what it holds, so a space may hold
up to the limit on every shard (per shard per space); the connections limit is per
node.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from .errors import LimitError, ValidationError

__all__ = ["Limits", "SpaceUse", "NAMES", "DERIVED", "DEFAULTS", "DESCRIPTIONS", "parse_limit", "task_bytes"]

#: Every limit's name, in the order they are shown.
NAMES: tuple[str, ...] = ("runs", "tasks", "timers", "stored", "payload_bytes", "watchers", "connections",
                          "schedules")
#: The uses derived from journaled state (the rest are what this process has open).
DERIVED: tuple[str, ...] = ("runs", "tasks", "timers", "stored", "payload_bytes", "schedules")

#: The default limits (per space; per shard in a sharded cluster), sized for a 2-core,
#: 24 GiB node so that ten spaces at every limit at once fit in memory
#: (README "Limits" says how: per-entity memory measured by
#: ``scripts/bench_noisy_tenant.py --memory``).
DEFAULTS: dict[str, int | None] = {
    "runs": 250_000,
    "tasks": 500_000,
    "timers": 250_000,
    "stored": 1_500_000,
    "payload_bytes": 1 << 30,
    "watchers": 256,
    "connections": 256,
    "schedules": 200_000,
}

#: One line per limit (``serve --help``, ``rallypoint status``).
DESCRIPTIONS: dict[str, str] = {
    "runs": "live runs (root, child, group gate, a task's own run)",
    "tasks": "unfinished tasks and messages (queued or leased)",
    "timers": "armed timers",
    "stored": "runs, tasks, messages and timers kept, live or finished, until retention purges them",
    "payload_bytes": "bytes of stored payloads: inputs, messages, outcomes and errors, stored HTTP answers",
    "watchers": "open event subscriptions (events.watch, HTTP watch, console streams)",
    "connections": "open TCP connections of the space",
    "schedules": "schedules (recurring actions)",
}

_RETRY_AFTER: dict[str, float | None] = {
    "runs": 1.0, "tasks": 1.0, "timers": 1.0, "stored": None, "payload_bytes": None, "watchers": None,
    "connections": 1.0, "schedules": None,
}
_HOW: dict[str, str] = {
    "runs": "end some runs, or retry once some have ended",
    "tasks": "retry once some tasks have finished",
    "timers": "retry once some timers have fired, or cancel some",
    "stored": "finished runs and tasks are kept until retention purges them (--retain-finished)",
    "payload_bytes": "payloads are kept until retention purges their finished tasks (--retain-finished) and "
                     "stored HTTP answers expire (--http-idempotency-hours)",
    "watchers": "close a subscription first",
    "connections": "close a connection first",
    "schedules": "delete schedules that are no longer needed",
}

#: No limit (``--limit NAME=none``): larger than any use.
_NONE = 1 << 62
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class SpaceUse:
    """One space's use of every limit (ints). ``payload_bytes`` in bytes."""

    __slots__ = NAMES

    def __init__(self) -> None:
        for n in NAMES:
            setattr(self, n, 0)

    def as_dict(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in NAMES}

    def idle(self) -> bool:
        return not any(getattr(self, n) for n in NAMES)


_ZERO = SpaceUse()
#: a task's finished states (``queue.TERMINAL``)
_TERMINAL = frozenset({"SUCCEEDED", "ACKED", "FAILED", "CANCELLED", "EXPIRED"})


def task_bytes(t) -> int:
    """The payload bytes a task (or message) counts: its input, and once it finished its
    outcome and error (what it keeps until retention purges it)."""
    n = len(t.input)
    if t.state in _TERMINAL:
        if t.outcome is not None:
            n += len(t.outcome)
        if t.error is not None:
            n += len(t.error)
    return n


def parse_limit(text: str) -> tuple[str, int | None]:
    """``"NAME=VALUE"`` (``--limit``) -> ``(name, value)``; VALUE a positive integer,
    for ``payload_bytes`` optionally with a binary unit (``512MiB``, ``2G``), or
    ``none`` (no limit: value None). Raises VALIDATION_FAILED naming what is wrong."""
    name, sep, value = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep:
        raise ValidationError(f"--limit takes NAME=VALUE (e.g. runs=100000), got {text!r}")
    if name not in DEFAULTS:
        raise ValidationError(f"--limit: no limit named {name!r}; the limits are {', '.join(NAMES)}")
    value = value.strip()
    if value.lower() in ("none", "off", "unlimited"):
        return name, None
    m = _SIZE_RE.match(value)
    unit = (m.group(2) or "").lower()[:1] if m else ""
    if m is None or (unit not in ("", "b") and name != "payload_bytes"):
        raise ValidationError(f"--limit {name}: the value must be a positive integer"
                              + (" of bytes, optionally with a unit (512MiB, 2GiB)" if name == "payload_bytes" else "")
                              + f" or none, got {value!r}")
    n = int(m.group(1)) * _UNITS[unit]
    if n < 1:
        raise ValidationError(f"--limit {name}: the value must be at least 1 (none: no limit), got {value!r}")
    return name, n


class Limits:
    """The limit values and every space's use (``coord.limits``).

    Args:
        values: name -> limit (None: no limit) for the names to change from
            :data:`DEFAULTS`. VALIDATION_FAILED for an unknown name or a value that is
            not a positive integer (or None).

    Decide code calls the ``check_*`` methods (they raise LIMIT_EXCEEDED, read-only);
    apply code calls the counting methods. ``use[space]`` is a :class:`SpaceUse`.
    """

    def __init__(self, values: Mapping[str, int | None] | None = None) -> None:
        self.use: dict[str, SpaceUse] = {}
        self.refused: dict[str, int] = {n: 0 for n in NAMES}  # refusals since start, per limit
        self.configure(values or {})

    def configure(self, values: Mapping[str, int | None]) -> None:
        """Set the limits named in ``values`` (the others keep their defaults). A lower
        limit than a space's use refuses that space's next creation; nothing held is
        taken away."""
        merged = dict(DEFAULTS)
        for name, v in values.items():
            if name not in DEFAULTS:
                raise ValidationError(f"no limit named {name!r}; the limits are {', '.join(NAMES)}")
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValidationError(f"limit {name} must be a positive integer or None (no limit), got {v!r}")
            merged[name] = v
        self.values: dict[str, int | None] = merged
        for name in NAMES:
            v = merged[name]
            setattr(self, "max_" + name, _NONE if v is None else v)

    def of(self, space: str) -> SpaceUse:
        """The use of ``space`` (made on first use)."""
        u = self.use.get(space)
        if u is None:
            u = self.use[space] = SpaceUse()
        return u

    # ------------------------------------------------------------------ decide (read-only)
    def refuse(self, space: str, name: str, use: int, adding: int) -> LimitError:
        """The LIMIT_EXCEEDED for ``adding`` more of ``name`` in ``space`` at ``use``."""
        self.refused[name] += 1
        value = self.values[name]
        what = DESCRIPTIONS[name].split(" (")[0].split(":")[0]
        return LimitError(
            f"space {space!r} would pass its limit of {value:,} {what} ({name}: {use:,} in use, this adds "
            f"{adding:,}); {_HOW[name]} (the operator sets the limit: rallypoint serve --limit {name}=N)",
            retry_after=_RETRY_AFTER[name],
            details={"limit": name, "value": value, "use": use, "adding": adding},
        )

    def check_runs(self, space: str, adding: int = 1) -> None:
        """LIMIT_EXCEEDED unless ``adding`` more runs fit (``runs`` and ``stored``)."""
        u = self.use.get(space) or _ZERO
        if u.runs + adding > self.max_runs:
            raise self.refuse(space, "runs", u.runs, adding)
        if u.stored + adding > self.max_stored:
            raise self.refuse(space, "stored", u.stored, adding)

    def check_tasks(self, space: str, adding: int, adding_bytes: int) -> None:
        """LIMIT_EXCEEDED unless ``adding`` more tasks (or messages) with
        ``adding_bytes`` of input fit (``tasks``, ``stored``, ``payload_bytes``)."""
        u = self.use.get(space) or _ZERO
        if u.tasks + adding > self.max_tasks:
            raise self.refuse(space, "tasks", u.tasks, adding)
        if u.stored + adding > self.max_stored:
            raise self.refuse(space, "stored", u.stored, adding)
        if u.payload_bytes + adding_bytes > self.max_payload_bytes:
            raise self.refuse(space, "payload_bytes", u.payload_bytes, adding_bytes)

    def check_timers(self, space: str, adding: int = 1) -> None:
        """LIMIT_EXCEEDED unless ``adding`` more timers fit (``timers``, ``stored``)."""
        u = self.use.get(space) or _ZERO
        if u.timers + adding > self.max_timers:
            raise self.refuse(space, "timers", u.timers, adding)
        if u.stored + adding > self.max_stored:
            raise self.refuse(space, "stored", u.stored, adding)

    def check_schedules(self, space: str, adding: int = 1) -> None:
        """LIMIT_EXCEEDED unless ``adding`` more schedules fit (``schedules``)."""
        u = self.use.get(space) or _ZERO
        if u.schedules + adding > self.max_schedules:
            raise self.refuse(space, "schedules", u.schedules, adding)

    def check_payload(self, space: str, adding_bytes: int) -> None:
        """LIMIT_EXCEEDED unless ``adding_bytes`` more stored payload bytes fit."""
        u = self.use.get(space) or _ZERO
        if u.payload_bytes + adding_bytes > self.max_payload_bytes:
            raise self.refuse(space, "payload_bytes", u.payload_bytes, adding_bytes)

    def check_watchers(self, space: str) -> None:
        """LIMIT_EXCEEDED unless one more subscription fits."""
        u = self.use.get(space) or _ZERO
        if u.watchers >= self.max_watchers:
            raise self.refuse(space, "watchers", u.watchers, 1)

    # ------------------------------------------------------------------ apply (counts)
    def run_added(self, space: str) -> None:
        u = self.of(space)
        u.runs += 1
        u.stored += 1

    def runs_ended(self, space: str, n: int) -> None:
        self.of(space).runs -= n

    def run_purged(self, space: str) -> None:
        self.of(space).stored -= 1

    def task_added(self, t) -> None:
        u = self.of(t.space)
        u.tasks += 1
        u.stored += 1
        u.payload_bytes += len(t.input)

    def task_finished(self, t) -> None:
        u = self.of(t.space)
        u.tasks -= 1
        if t.outcome is not None:
            u.payload_bytes += len(t.outcome)
        if t.error is not None:
            u.payload_bytes += len(t.error)

    def task_purged(self, t) -> None:
        u = self.of(t.space)
        u.stored -= 1
        u.payload_bytes -= task_bytes(t)

    def timer_added(self, space: str) -> None:
        u = self.of(space)
        u.timers += 1
        u.stored += 1

    def schedule_added(self, space: str) -> None:
        self.of(space).schedules += 1

    def schedule_removed(self, space: str) -> None:
        self.of(space).schedules -= 1

    def timer_ended(self, space: str) -> None:
        self.of(space).timers -= 1

    def timers_purged(self, space: str, n: int) -> None:
        self.of(space).stored -= n

    def bytes_changed(self, space: str, delta: int) -> None:
        if delta:
            self.of(space).payload_bytes += delta

    # ------------------------------------------------------------------ what this process holds open
    def watcher_added(self, space: str) -> None:
        self.of(space).watchers += 1

    def watcher_removed(self, space: str) -> None:
        self.of(space).watchers -= 1

    def connection_opened(self, space: str) -> None:
        """Count one more TCP connection of ``space``; LIMIT_EXCEEDED (nothing counted)
        when the space has ``connections`` open already."""
        u = self.of(space)
        if u.connections >= self.max_connections:
            raise self.refuse(space, "connections", u.connections, 1)
        u.connections += 1

    def connection_closed(self, space: str) -> None:
        self.of(space).connections -= 1

    # ------------------------------------------------------------------ derived, from the state
    @staticmethod
    def recount(coord) -> dict[str, dict[str, int]]:
        """space -> the :data:`DERIVED` uses, counted from the coordinator's tables (the
        definition the apply functions keep up incrementally; the simulator compares
        the two). O(entities)."""
        out: dict[str, dict[str, int]] = {}

        def u(space: str) -> dict[str, int]:
            d = out.get(space)
            if d is None:
                d = out[space] = dict.fromkeys(DERIVED, 0)
            return d

        runs = coord.runs
        for s in runs.table.values():
            if s.remote_shard is not None:
                continue
            d = u(s.space)
            d["stored"] += 1
            if runs.live(s.id):
                d["runs"] += 1
        for t in coord.queues.tasks.values():
            d = u(t.space)
            d["stored"] += 1
            d["payload_bytes"] += task_bytes(t)
            if t.state not in _TERMINAL:
                d["tasks"] += 1
        for tm in coord.timers.table.values():
            d = u(tm.space)
            d["stored"] += 1
            if tm.state == "ARMED":
                d["timers"] += 1
        for e in coord.idempotency.table.values():
            u(e.space)["payload_bytes"] += entry_bytes(e)
        schedules = getattr(coord, "schedules", None)
        if schedules is not None:
            for sc in schedules.table.values():
                u(sc.space)["schedules"] += 1
        return out

    def derived(self) -> dict[str, dict[str, int]]:
        """space -> the :data:`DERIVED` uses as counted (spaces with none left out)."""
        out = {}
        for space, u in self.use.items():
            d = {n: getattr(u, n) for n in DERIVED}
            if any(d.values()):
                out[space] = d
        return out

    def rebuild(self, coord) -> None:
        """After a snapshot was loaded: the derived uses from the state (the open ones --
        watchers, connections -- are kept)."""
        counted = self.recount(coord)
        for space, u in self.use.items():
            if space not in counted:
                for n in DERIVED:
                    setattr(u, n, 0)
        for space, d in counted.items():
            u = self.of(space)
            for n, v in d.items():
                setattr(u, n, v)

    # ------------------------------------------------------------------ reading
    def report(self, spaces: Iterable[str] | None = None, most: int = 100) -> dict[str, dict[str, int]]:
        """space -> name -> use, for ``spaces`` (default: every space with any use, the
        ``most`` nearest to a limit first)."""
        if spaces is None:
            items = [(s, u) for s, u in self.use.items() if not u.idle()]
            items.sort(key=lambda su: -self.fraction(su[1]))
            items = items[:most]
        else:
            items = [(s, self.use.get(s) or _ZERO) for s in spaces]
        return {s: u.as_dict() for s, u in items}

    def fraction(self, u: SpaceUse) -> float:
        """The largest use / limit of ``u`` (0 with no limits set)."""
        best = 0.0
        for n in NAMES:
            v = self.values[n]
            if v:
                best = max(best, getattr(u, n) / v)
        return best

    def wire_values(self) -> dict[str, int]:
        """name -> limit, 0 for no limit (the server status's form)."""
        return {n: (v or 0) for n, v in self.values.items()}

    def statistics(self) -> dict[str, Any]:
        return {"values": dict(self.values), "spaces": len(self.use), "refused": dict(self.refused)}


def entry_bytes(e) -> int:
    """The payload bytes a stored HTTP answer counts (its body and its steps' answers)."""
    return len(e.body) + sum(len(b) for b in e.steps.values())
