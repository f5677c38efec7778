"""Budgets: money in integer minor units; reserve -> settle (actual cost) or void
(SPEC §8; kernel reference §12, as the published SDK observed it).

**Amounts** are integers of minor units, never floats: a budget has a ``currency``
(3 capital letters) and a ``scale`` (decimal places, 0-9), so at scale 2 the amount 250
is 2.50. ``available`` = ``limit`` - ``settled`` - ``reserved`` (what open reservations
still hold).

**Reserve** ``amount`` for a run: ACTIVE, holding it. Refused with INSUFFICIENT_BUDGET
(``details``: what is left, ``available_minor``, and the budget's figures) when it does
not fit, and with SCOPE_CANCELLED / DEADLINE_EXCEEDED on an inactive run. There is no
waiting: a reservation fits or it does not. ``key``: idempotent per (budget, key).

**Settle** ``amount`` (the actual cost) under a ``usage_key``: idempotent per usage key
(the same key again returns the first settlement and changes nothing; the same key
with another amount or reservation is CONFLICT). The charge is **capped at what is
left**: the reservation's remainder plus what the budget has unreserved, so the
settled total never passes the limit; the excess is recorded as ``overrun``. A
``final`` settlement (the default) closes the reservation (SETTLED) and releases its
remainder; a partial one (``final=False``) keeps holding the rest. A settlement on a
closed reservation is a late charge: capped at what the budget has unreserved.

**Void** closes the reservation (VOIDED) and releases its remainder; what was settled
stays spent. Idempotent.

**Settle-by** (server time): a reservation still ACTIVE then becomes STALE -- marked,
**never refunded**: it holds its remainder until settled or voided.

**Runs.** Reserving needs an active run; settling and voiding never do (money actually
spent must be recordable after a cancel), and a run's end leaves its reservations as
they are. Reading stays possible while the reservation is kept.

**Keys outlive retention.** A usage key is never charged twice and a reservation
``key`` never makes a second reservation, for as long as the budget exists (budgets are
never purged), whatever happens to the run that used them: when retention purges a
closed reservation, what it keyed stays as a :class:`SpentKeysState` (``usg_…``: the
budget, the reservation's id, run, amount, its ``key`` and its ``usage``), indexed like
a live reservation's keys, snapshotted and rebuilt like any entity. A reuse is then
CONFLICT as it was before the purge (``details["reservation_id"]`` names the purged
reservation).

**Reservations held for a delivery** (``task_id`` + ``token``: an admission's budget
requirements, or ``budget.reserve(..., delivery=d)``) close when that delivery ends,
in the same apply as the task record that ends it (:meth:`Budgets.on_delivery_ended`,
called by the work-queue kind): what the worker did not settle is settled in full when
the task SUCCEEDED (or the message was ACKED) -- the reservation was the most it may
cost -- and voided otherwise (failed, retried, lease expired, cancelled, expired).
A worker that knows the real cost settles it (``final``) before completing.

**The admission hook.** Budget requirements of tasks (``submit(...,
requirements={"budgets": {"model-spend": 40}})``) plug into the admission kind's
requirement protocol (``REQUIREMENT_KINDS["budgets"] = "budgets"``), implemented here:
``requirement_prepare`` (at submit: names to ids, at most 2 budgets, each amount 1 to
the budget's limit), ``requirement_fits`` / ``requirement_hold`` (read-only, all or
nothing with the pool units of the same step), ``requirement_records`` (the
``BudgetReserved`` records, held for the delivery the step makes -- token
``task.token + 1`` -- committed in ONE commit with its ``TaskDelivered`` and pool
grants), ``requirement_release`` (the delivery ended: settle or void, as above),
``requirement_track`` / ``requirement_untrack`` (tasks waiting on a budget; when money
comes back -- a void, a release -- the receivers parked for them are woken) and
``requirement_views`` (the delivery's ``reservations``: ids, for the worker to settle).
:meth:`Budgets.prepare_reservations` is the same check for a list of (budget, amount)
in one call. The budget's actor need not run: the admit reads budget state
synchronously and the records' apply changes it inside that one commit (a step across
actors by design).
"""

from __future__ import annotations

import re

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, InsufficientBudgetError, LeaseLostError, NotFoundError, ValidationError
from ..ids import is_id
from ..money import format_minor
from ..protocol import (
    BudgetEnsure,
    BudgetGet,
    BudgetList,
    BudgetListView,
    BudgetReserve,
    BudgetSettle,
    BudgetView,
    BudgetVoid,
    ReservationGet,
    ReservationView,
    SettleView,
)
from ..records import BudgetCreated, BudgetReserved, BudgetSettled, BudgetVoided, ReservationStale
from ..events import emits, ev
from .common import applies, check_key, check_name, check_range, data, did_you_mean, parse_instant, short
from .kind import Kind, Links
from .opmark import ALWAYS, C, R, SPACE, W, by, keyed, op

__all__ = ["BudgetState", "ReservationState", "SpentKeysState", "Budgets", "MAX_MINOR", "OPEN"]

#: Largest amount (minor units) anywhere: 10^18 (fits msgpack's int64 with room).
MAX_MINOR = 10**18
MAX_SETTLE_WITHIN_MS = 30 * 86_400_000
#: Budgets a task may require (runstate: 2).
MAX_BUDGETS_PER_TASK = 2
OPEN = frozenset({"ACTIVE", "STALE"})
#: How many open reservations ``budget.get(reservations=True)`` lists.
LIST_RESERVATIONS = 1000
_CURRENCY_RE = re.compile(r"^[A-Z]{3}$")
_SUCCESS = frozenset({"SUCCEEDED", "ACKED"})


class BudgetState(msgspec.Struct, gc=False, omit_defaults=True):
    """A budget (what a snapshot stores); amounts in minor units."""

    id: str
    space: str
    name: str
    currency: str
    scale: int
    limit_minor: int
    created_at_ms: int
    settled_minor: int = 0
    reserved_minor: int = 0
    overrun_minor: int = 0


class ReservationState(msgspec.Struct, gc=False, omit_defaults=True):
    """A reservation: ACTIVE -> SETTLED | VOIDED, or ACTIVE -> STALE (settle-by passed)
    -> SETTLED | VOIDED. ``remaining_minor`` is still held; ``usage``: usage key ->
    [requested, charged] of each settlement. ``settle_by_mono_ms`` is server time."""

    id: str
    space: str
    budget_id: str
    scope_id: str
    amount_minor: int
    remaining_minor: int
    created_at_ms: int
    state: str = "ACTIVE"
    settled_minor: int = 0
    overrun_minor: int = 0
    settle_by_mono_ms: int | None = None
    key: str | None = None
    holder: str | None = None
    task_id: str | None = None
    token: int = 0
    usage: dict[str, list[int]] = msgspec.field(default_factory=dict)
    closed_at_ms: int | None = None
    close_reason: str | None = None


class SpentKeysState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a purged reservation leaves: the keys it used, kept for as long as its budget
    (see the module docstring, "Keys outlive retention"). ``id`` is ``usg_`` and the
    body of ``reservation_id``; ``key``: its reserve key; ``usage``: usage key ->
    [requested, charged] of each settlement, as the reservation held them."""

    id: str
    space: str
    budget_id: str
    reservation_id: str
    scope_id: str
    amount_minor: int
    key: str | None = None
    usage: dict[str, list[int]] = msgspec.field(default_factory=dict)


def spent_keys_id(reservation_id: str) -> str:
    """The id of the keys a purged reservation leaves (``rsv_X`` -> ``usg_X``)."""
    return "usg" + reservation_id[3:]


def check_amount(field: str, value, lo: int = 0) -> int:
    """An amount of minor units: an int from ``lo`` to 10^18. VALIDATION_FAILED naming
    ``field`` otherwise (floats included: amounts are never floats)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_MINOR:
        raise ValidationError(
            f"{field} must be an integer number of minor units from {lo} to {MAX_MINOR} (got {value!r}); "
            "at scale 2, 250 means 2.50",
            details={"field": field},
        )
    return value


class Budgets(Kind):
    """Budgets and their reservations: ensure, reserve, settle, void, settle-by;
    the admission hook (:meth:`prepare_reservations`, :meth:`on_delivery_ended`)."""

    prefix = "bdg"
    name = "budgets"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, BudgetState] = {}
        self.reservations: dict[str, ReservationState] = {}
        self.spent: dict[str, SpentKeysState] = {}  # usg_ id -> the keys of a purged reservation
        self._init_indexes()

    def _init_indexes(self) -> None:
        self.by_name: dict[tuple[str, str], str] = {}
        # (budget id, key) -> reservation id; (budget id, usage key) -> reservation id (a
        # purged one's keys are in ``spent``: :meth:`_keyed`)
        self.keys: dict[tuple[str, str], str] = {}
        self.usage: dict[tuple[str, str], str] = {}
        self.open: dict[str, dict[str, None]] = {}  # budget id -> open reservation ids, oldest first
        self.by_delivery: dict[str, list[str]] = {}  # task id -> open reservations held for a delivery
        self.needs: dict[str, set[str]] = {}  # budget id -> unfinished tasks that require it
        self.links = Links()  # retention: run (or the task a delivery held it for) -> reservation ids

    def entity_tables(self):
        return {"bdg": (self.table, BudgetState), "rsv": (self.reservations, ReservationState),
                "usg": (self.spent, SpentKeysState)}

    def statistics(self) -> dict:
        return {"budgets": len(self.table), "reservations": len(self.reservations),
                "open": sum(len(v) for v in self.open.values()), "purged_with_keys": len(self.spent)}

    def _keyed(self, rid: str) -> "ReservationState | SpentKeysState":
        """The reservation a key index entry names, or the keys it left when purged."""
        r = self.reservations.get(rid)
        return r if r is not None else self.spent[spent_keys_id(rid)]

    # ================================================================ lookups
    def get(self, space: str, name_or_id) -> BudgetState:
        """A budget by name or id; NOT_FOUND (saying how to create it) otherwise."""
        if not isinstance(name_or_id, str):
            raise ValidationError("budget must be a name or an id", details={"field": "budget"})
        bid = name_or_id if is_id(name_or_id, "bdg") else self.by_name.get((space, name_or_id))
        b = self.table.get(bid) if bid else None
        if b is None or b.space != space:
            hint = did_you_mean(name_or_id, (n for (sp, n) in self.by_name if sp == space))
            raise NotFoundError(f"no budget {short(name_or_id)}{hint}; create it with budgets.ensure()",
                                details={"budget": name_or_id})
        return b

    def route(self, session, name_or_id) -> str:
        return self.get(session.space, name_or_id).id

    def get_reservation(self, space: str, reservation_id) -> ReservationState:
        r = self.reservations.get(reservation_id) if isinstance(reservation_id, str) else None
        if r is None or r.space != space:
            raise NotFoundError(f"no budget reservation {short(reservation_id)} in this space",
                                details={"reservation_id": reservation_id})
        return r

    def route_reservation(self, session, reservation_id) -> str:
        """The actor of a command about a reservation: its budget's."""
        return self.get_reservation(session.space, reservation_id).budget_id

    @staticmethod
    def available(b: BudgetState) -> int:
        """What the budget can still reserve or charge: limit - settled - reserved."""
        return b.limit_minor - b.settled_minor - b.reserved_minor

    # ================================================================ ensure, get, list
    @op(BudgetEnsure, route=SPACE, permission=C, resend=ALWAYS)
    def op_budget_ensure(self, actor, session, op: BudgetEnsure) -> BudgetView:
        """Create the budget, or check it exists with these settings (CONFLICT naming
        the first that differs: limit_minor, currency, scale). VALIDATION_FAILED: name,
        ``limit_minor`` (1 to 10^18), ``currency`` (3 capital letters), ``scale`` (0-9).
        Runs on the space's actor."""
        check_name("name", op.name)
        check_amount("limit_minor", op.limit_minor, 1)
        if not isinstance(op.currency, str) or not _CURRENCY_RE.match(op.currency):
            raise ValidationError(f"currency must be 3 capital letters such as USD (got {short(op.currency)})",
                                  details={"field": "currency"})
        check_range("scale", op.scale, 0, 9)
        bid = self.by_name.get((session.space, op.name))
        if bid is not None:
            b = self.table[bid]
            for field in ("limit_minor", "currency", "scale"):
                have, want = getattr(b, field), getattr(op, field)
                if have != want:
                    raise ConflictError(
                        f"budget {short(op.name)} exists with {field}={have!r}, not {want!r}",
                        details={"field": field, "existing": have},
                    )
            return self.view(b)
        rec = BudgetCreated(id=self.coord.new_id("bdg", space=session.space), space=session.space, name=op.name, currency=op.currency,
                            scale=op.scale, limit_minor=op.limit_minor, at_ms=self.coord.now_ms())
        self.coord.commit([rec])
        return self.view(self.table[rec.id])

    @op(BudgetGet, route=by("budget"), permission=R, resend=ALWAYS)
    def op_budget_get(self, actor, session, op: BudgetGet) -> BudgetView:
        return self.view(self.get(session.space, op.budget), reservations=op.reservations)

    @op(BudgetList, route=SPACE, permission=R, resend=ALWAYS)
    def op_budget_list(self, actor, session, op: BudgetList) -> BudgetListView:
        return BudgetListView(budgets=[self.view(b) for b in self.table.values() if b.space == session.space])

    @op(ReservationGet, route=by("reservation_id", "route_reservation"), permission=R, resend=ALWAYS)
    def op_reservation_get(self, actor, session, op: ReservationGet) -> ReservationView:
        return self.reservation_view(self.get_reservation(session.space, op.reservation_id))

    # ================================================================ reserve
    @op(BudgetReserve, route=by("budget"), permission=W,
        resend=keyed("key", "give the reservation a `key` to make it safe to retry"))
    def op_budget_reserve(self, actor, session, op: BudgetReserve) -> ReservationView:
        """Hold ``amount_minor`` (>= 1) of the budget for run ``scope_id``.

        Errors: VALIDATION_FAILED (amount, settle_by in the past or both settle_by and
        settle_within_ms, key, holder), NOT_FOUND (budget, run, task), CONFLICT (a
        ``key`` reused with another amount or run), SCOPE_CANCELLED /
        DEADLINE_EXCEEDED (the run is inactive), INSUFFICIENT_BUDGET (it does not fit;
        ``details["available_minor"]`` says what is left), STALE_CLAIM (``task_id`` /
        ``token`` is not that task's live lease)."""
        coord = self.coord
        b = self.get(session.space, op.budget)
        run = coord.runs.get(session.space, op.scope_id)
        check_amount("amount_minor", op.amount_minor, 1)
        check_key("key", op.key)
        check_key("holder", op.holder)
        if op.key is not None:
            rid = self.keys.get((b.id, op.key))
            if rid is not None:
                r = self._keyed(rid)
                if r.amount_minor != op.amount_minor or r.scope_id != run.id or type(r) is SpentKeysState:
                    raise ConflictError(
                        f"key {op.key!r} was already used on budget {b.name!r} for a reservation of "
                        f"{r.amount_minor} in run {r.scope_id}; use a new key for another reservation",
                        details={"field": "key", "reservation_id": rid},
                    )
                return self.reservation_view(r)
        settle_by = self._settle_by(op.settle_by, op.settle_within_ms)
        token = 0
        if op.task_id is not None:
            sh = coord.sharding
            if sh is not None and op.task_id not in coord.queues.tasks:
                # a delivery of another shard's task: VALIDATION_FAILED (details.cross_shard)
                sh.cross_shard(op.task_id, "task")
            t = coord.queues.get_task(session.space, op.task_id)
            if t.token != op.token or op.token <= 0 or t.state != "RUNNING" or t.lease_expires_ms <= coord.mono_ms():
                raise LeaseLostError(
                    f"token {op.token} is not a live lease on task {t.id}: a reservation held for a delivery "
                    "needs the delivery's current lease", details={"task_id": t.id, "token": t.token},
                )
            token = op.token
        (rec,) = self.prepare_reservations(
            session.space, run.id, [(b.id, op.amount_minor)], holder=op.holder, task_id=op.task_id, token=token,
            settle_by_mono_ms=settle_by, key=op.key,
        )
        coord.commit([rec])
        return self.reservation_view(self.reservations[rec.id])

    def _settle_by(self, settle_by: str | None, within_ms: int | None) -> int | None:
        """Settle-by as server time: an instant (converted when the reservation is made)
        or a duration from now."""
        if settle_by is not None and within_ms is not None:
            raise ValidationError("give at most one of settle_by and settle_within_seconds",
                                  details={"field": "settle_by"})
        coord = self.coord
        if settle_by is not None:
            at = parse_instant("settle_by", settle_by)
            if at <= coord.now_ms():
                raise ValidationError(f"settle_by {settle_by} is in the past", details={"field": "settle_by"})
            return coord.clock.wall_to_mono(at)
        if within_ms is not None:
            check_range("settle_within_ms", within_ms, 1_000, MAX_SETTLE_WITHIN_MS, " ms")
            return coord.mono_ms() + within_ms
        return None

    def prepare_reservations(
        self,
        space: str,
        run_id: str,
        items: list[tuple[str, int]],
        *,
        holder: str | None = None,
        task_id: str | None = None,
        token: int = 0,
        settle_by_mono_ms: int | None = None,
        key: str | None = None,
    ) -> list[BudgetReserved]:
        """The admission hook: validate ``items`` -- ``(budget name or id, amount_minor)``
        -- all or nothing, and return one ``BudgetReserved`` record per item, for the
        caller to commit (with whatever else its step takes) in ONE commit. Nothing is
        reserved until then; the caller's decide runs to its commit with no ``await``,
        so what was checked still holds.

        Amounts on the same budget are summed before the check. ``task_id`` / ``token``:
        the reservations are held for that delivery (the token the commit's
        ``TaskDelivered`` gives it) and close when it ends (:meth:`on_delivery_ended`).

        Raises NOT_FOUND (a budget), VALIDATION_FAILED (an amount), SCOPE_CANCELLED /
        DEADLINE_EXCEEDED (the run is inactive), INSUFFICIENT_BUDGET for the first
        budget that cannot hold its total, with what it has left."""
        coord = self.coord
        coord.runs.require_active(run_id)
        want: dict[str, int] = {}
        budgets: list[BudgetState] = []
        for i, (name_or_id, amount) in enumerate(items):
            b = self.get(space, name_or_id)
            check_amount("amount_minor" if len(items) == 1 else f"budgets[{i}].amount_minor", amount, 1)
            if b.id not in want:
                budgets.append(b)
            want[b.id] = want.get(b.id, 0) + amount
        for b in budgets:
            if want[b.id] > self.available(b):
                raise self.insufficient(b, want[b.id])
        now = coord.now_ms()
        return [
            BudgetReserved(
                id=coord.new_id("rsv", space=space), budget_id=self.get(space, name_or_id).id, space=space, scope_id=run_id,
                amount_minor=amount, at_ms=now, settle_by_mono_ms=settle_by_mono_ms, key=key, holder=holder,
                task_id=task_id, token=token,
            )
            for name_or_id, amount in items
        ]

    # ================================================================ admission requirements
    requirement_max_names = MAX_BUDGETS_PER_TASK

    def requirement_prepare(self, space: str, value) -> dict[str, int]:
        """At submission: ``{budget name or id: amount_minor}`` -> ``{budget id:
        amount_minor}``. VALIDATION_FAILED: more than 2 budgets, an amount not an integer
        from 1 to the budget's limit (it could never be reserved); NOT_FOUND: a budget."""
        if not isinstance(value, dict) or len(value) > MAX_BUDGETS_PER_TASK:
            raise ValidationError(f"requirements.budgets must map at most {MAX_BUDGETS_PER_TASK} budget names to "
                                  "amounts in minor units", details={"field": "requirements.budgets"})
        out: dict[str, int] = {}
        for name, amount in value.items():
            b = self.get(space, name)
            field = f"requirements.budgets[{name}]"
            check_amount(field, amount, 1)
            out[b.id] = out.get(b.id, 0) + amount
            if out[b.id] > b.limit_minor:
                raise ValidationError(f"{field} asks {out[b.id]}, more than budget {b.name!r} could ever hold "
                                      f"(limit {b.limit_minor})", details={"field": field})
        return out

    def requirement_fits(self, value: dict[str, int], pending: dict, task=None) -> bool:
        """Read-only: can every amount be reserved now, on top of what this step already
        took (``pending``: budget id -> minor units)? (``task``: unused.)"""
        table = self.table
        return all(self.available(table[bid]) - pending.get(bid, 0) >= amount for bid, amount in value.items())

    def requirement_hold(self, value: dict[str, int], pending: dict) -> None:
        for bid, amount in value.items():
            pending[bid] = pending.get(bid, 0) + amount

    def requirement_records(self, task, value: dict[str, int], at_ms: int) -> list[BudgetReserved]:
        """The reservations, held for the delivery this step makes (its token is the
        task's next one), to commit with its ``TaskDelivered``."""
        new_id = self.coord.new_id
        return [
            BudgetReserved(id=new_id("rsv", space=task.space), budget_id=bid, space=task.space, scope_id=task.scope_id,
                           amount_minor=amount, at_ms=at_ms, holder="admission", task_id=task.id,
                           token=task.token + 1)
            for bid, amount in value.items()
        ]

    def requirement_release(self, task, value: dict[str, int], at_ms: int | None, new_state: str) -> None:
        """Apply: the delivery ended (RUNNING -> ``new_state``): settle or void."""
        self.on_delivery_ended(task.id, task.token, new_state, at_ms)

    def requirement_track(self, task, value: dict[str, int]) -> None:
        for bid in value:
            self.needs.setdefault(bid, set()).add(task.id)

    def requirement_untrack(self, task, value: dict[str, int]) -> None:
        for bid in value:
            s = self.needs.get(bid)
            if s is not None:
                s.discard(task.id)
                if not s:
                    del self.needs[bid]

    def requirement_views(self, task) -> dict:
        """The delivery's ``reservations``: the ids of what it holds, to settle."""
        return {"reservations": [rid for rid in self.by_delivery.get(task.id, ())
                                 if self.reservations[rid].token == task.token]}

    def requirement_describe(self, value: dict[str, int]) -> dict[str, int]:
        """Stored (budget id -> minor units) back to the wire form (budget name -> minor
        units): a mailbox's default requirements in its view. Budgets are never purged."""
        table = self.table
        return {table[bid].name: amount for bid, amount in value.items()}

    def _money_back(self, b: BudgetState) -> None:
        """Apply: money came back to ``b``: wake the receivers parked for ready tasks
        that require it (each on its run's actor and its ancestors'). Not in replay."""
        tids = self.needs.get(b.id)
        if not tids or self.coord.replaying:
            return
        coord = self.coord
        tasks, runs = coord.queues.tasks, coord.runs.table
        for tid in tids:
            t = tasks.get(tid)
            if t is None or t.state != "QUEUED":
                continue
            key = ("recv", t.mailbox_id)
            s = runs.get(t.scope_id)
            while s is not None:
                coord.notify(s.id, key)
                s = runs.get(s.parent_id) if s.parent_id else None

    def insufficient(self, b: BudgetState, requested: int) -> InsufficientBudgetError:
        avail = self.available(b)
        return InsufficientBudgetError(
            f"budget {b.name!r} has {format_minor(avail, b.scale)} {b.currency} left "
            f"({avail} minor units: limit {b.limit_minor}, settled {b.settled_minor}, reserved {b.reserved_minor}); "
            f"{requested} asked. Settle or void open reservations, or ensure a larger budget under a new name",
            details={"budget": b.name, "requested_minor": requested, "available_minor": avail,
                     "limit_minor": b.limit_minor, "settled_minor": b.settled_minor,
                     "reserved_minor": b.reserved_minor, "currency": b.currency, "scale": b.scale},
        )

    # ================================================================ settle, void
    @op(BudgetSettle, route=by("reservation_id", "route_reservation"), permission=W, resend=ALWAYS)
    def op_budget_settle(self, actor, session, op: BudgetSettle) -> SettleView:
        """Charge ``amount_minor`` (>= 0) under ``usage_key`` (see the module docstring:
        idempotent per usage key, capped at what is left, ``final`` closes). Allowed
        whatever the run's state. CONFLICT: the usage key was used with another amount
        or reservation."""
        coord = self.coord
        r = self.get_reservation(session.space, op.reservation_id)
        check_amount("amount_minor", op.amount_minor, 0)
        if not isinstance(op.usage_key, str) or not 1 <= len(op.usage_key) <= 256:
            raise ValidationError("usage_key must be 1 to 256 characters", details={"field": "usage_key"})
        b = self.table[r.budget_id]
        seen = self.usage.get((b.id, op.usage_key))
        if seen is not None:
            requested, charged = self._keyed(seen).usage[op.usage_key]
            if seen != r.id or requested != op.amount_minor:
                raise ConflictError(
                    f"usage key {op.usage_key!r} already settled {requested} on reservation {seen}; "
                    "use a new usage key for another charge",
                    details={"field": "usage_key", "reservation_id": seen, "requested_minor": requested},
                )
            return SettleView(reservation=self.reservation_view(r), usage_key=op.usage_key,
                              requested_minor=requested, charged_minor=charged, available_minor=self.available(b),
                              replayed=True)
        is_open = r.state in OPEN
        held = r.remaining_minor if is_open else 0
        charged = min(op.amount_minor, held + self.available(b))
        from_reserved = min(charged, held)
        closes = is_open and (op.final or from_reserved == held)
        released = held - from_reserved if closes else 0
        coord.commit([BudgetSettled(
            reservation_id=r.id, usage_key=op.usage_key, requested_minor=op.amount_minor, charged_minor=charged,
            from_reserved_minor=from_reserved, released_minor=released, at_ms=coord.now_ms(), closes=closes,
        )])
        return SettleView(reservation=self.reservation_view(r), usage_key=op.usage_key,
                          requested_minor=op.amount_minor, charged_minor=charged, available_minor=self.available(b),
                          replayed=False)

    @op(BudgetVoid, route=by("reservation_id", "route_reservation"), permission=W, resend=ALWAYS)
    def op_budget_void(self, actor, session, op: BudgetVoid) -> ReservationView:
        """Close an open reservation, releasing its remainder (VOIDED); a closed one is
        returned as it is. Allowed whatever the run's state."""
        r = self.get_reservation(session.space, op.reservation_id)
        if r.state in OPEN:
            self.coord.commit([BudgetVoided(reservation_id=r.id, released_minor=r.remaining_minor,
                                            at_ms=self.coord.now_ms())])
        return self.reservation_view(r)

    # ================================================================ apply
    @applies(BudgetCreated)
    def _apply_created(self, r: BudgetCreated) -> None:
        b = BudgetState(id=r.id, space=r.space, name=r.name, currency=r.currency, scale=r.scale,
                        limit_minor=r.limit_minor, created_at_ms=r.at_ms)
        self.table[b.id] = b
        self.by_name[(b.space, b.name)] = b.id
        self.coord.touch(b.id)

    @applies(BudgetReserved)
    def _apply_reserved(self, rec: BudgetReserved) -> None:
        b = self.table[rec.budget_id]
        r = ReservationState(
            id=rec.id, space=rec.space, budget_id=b.id, scope_id=rec.scope_id, amount_minor=rec.amount_minor,
            remaining_minor=rec.amount_minor, created_at_ms=rec.at_ms, settle_by_mono_ms=rec.settle_by_mono_ms,
            key=rec.key, holder=rec.holder, task_id=rec.task_id, token=rec.token,
        )
        self.reservations[r.id] = r
        b.reserved_minor += r.amount_minor
        self._index(r)
        self.coord.touch(b.id)
        self.coord.touch(r.id)
        if r.settle_by_mono_ms is not None:
            self.coord.arm_mono(r.settle_by_mono_ms, self._on_settle_by, (r.id, r.settle_by_mono_ms))

    def _index(self, r: ReservationState) -> None:
        self.links.add(r.task_id or r.scope_id, r.id)
        if r.key is not None:
            self.keys[(r.budget_id, r.key)] = r.id
        for k in r.usage:
            self.usage[(r.budget_id, k)] = r.id
        if r.state in OPEN:
            self.open.setdefault(r.budget_id, {})[r.id] = None
            if r.task_id is not None:
                self.by_delivery.setdefault(r.task_id, []).append(r.id)

    def _close(self, r: ReservationState, state: str, at_ms: int | None, reason: str) -> None:
        r.state = state
        r.closed_at_ms = at_ms
        r.close_reason = reason
        o = self.open.get(r.budget_id)
        if o is not None:
            o.pop(r.id, None)
            if not o:
                del self.open[r.budget_id]
        if r.task_id is not None:
            lst = self.by_delivery.get(r.task_id)
            if lst is not None:
                if r.id in lst:
                    lst.remove(r.id)
                if not lst:
                    del self.by_delivery[r.task_id]

    def _charge(self, r: ReservationState, b: BudgetState, usage_key: str, requested: int, charged: int,
                from_reserved: int, released: int) -> None:
        r.remaining_minor -= from_reserved + released
        b.reserved_minor -= from_reserved + released
        r.settled_minor += charged
        b.settled_minor += charged
        r.overrun_minor += requested - charged
        b.overrun_minor += requested - charged
        r.usage[usage_key] = [requested, charged]
        self.usage[(b.id, usage_key)] = r.id

    @applies(BudgetSettled)
    def _apply_settled(self, rec: BudgetSettled) -> None:
        r = self.reservations[rec.reservation_id]
        b = self.table[r.budget_id]
        self._charge(r, b, rec.usage_key, rec.requested_minor, rec.charged_minor, rec.from_reserved_minor,
                     rec.released_minor)
        if rec.closes:
            self._close(r, "SETTLED", rec.at_ms, "settled")
        self.coord.touch(r.id)
        self.coord.touch(b.id)
        if rec.released_minor:
            self._money_back(b)

    @applies(BudgetVoided)
    def _apply_voided(self, rec: BudgetVoided) -> None:
        r = self.reservations[rec.reservation_id]
        b = self.table[r.budget_id]
        r.remaining_minor -= rec.released_minor
        b.reserved_minor -= rec.released_minor
        self._close(r, "VOIDED", rec.at_ms, "voided")
        self.coord.touch(r.id)
        self.coord.touch(b.id)
        if rec.released_minor:
            self._money_back(b)

    @applies(ReservationStale)
    def _apply_stale(self, rec: ReservationStale) -> None:
        r = self.reservations[rec.reservation_id]
        r.state = "STALE"
        self.coord.touch(r.id)

    def on_delivery_ended(self, task_id: str, token: int, new_state: str, at_ms: int | None) -> None:
        """A delivery of ``task_id`` (lease ``token``) ended, inside the apply of the
        task record that ended it: the open reservations held for it close -- settled
        in full (usage key ``delivery:<task id>:<token>``) when the task SUCCEEDED or
        the message was ACKED, voided otherwise. Synchronous; the same live and in
        replay."""
        rids = self.by_delivery.get(task_id)
        if not rids:
            return
        for rid in list(rids):
            r = self.reservations[rid]
            if r.token != token or r.state not in OPEN:
                continue
            b = self.table[r.budget_id]
            held = r.remaining_minor
            ev_at = at_ms if at_ms is not None else self.coord.events.instant(self.coord.now_ms())
            if new_state in _SUCCESS:
                usage_key = f"delivery:{task_id}:{token}"
                self._charge(r, b, usage_key, held, held, held, 0)
                self._close(r, "SETTLED", at_ms, "task_succeeded")
                self.coord.implied(BudgetSettled(reservation_id=rid, usage_key=usage_key, requested_minor=held,
                                                 charged_minor=held, from_reserved_minor=held, released_minor=0,
                                                 at_ms=ev_at))
            else:
                r.remaining_minor = 0
                b.reserved_minor -= held
                self._close(r, "VOIDED", at_ms, "delivery_" + new_state.lower())
                self.coord.implied(BudgetVoided(reservation_id=rid, released_minor=held, at_ms=ev_at))
                if held:
                    self._money_back(b)
            self.coord.touch(r.id)
            self.coord.touch(b.id)

    # ================================================================ activities
    def _on_settle_by(self, arg) -> None:
        rid, due = arg
        r = self.reservations.get(rid)
        if r is None or r.state != "ACTIVE" or r.settle_by_mono_ms != due:
            return
        self.coord.commit([ReservationStale(reservation_id=rid, at_ms=self.coord.clock.mono_to_wall(due))])

    # ================================================================ views
    def view(self, b: BudgetState, reservations: bool = False) -> BudgetView:
        listed = []
        if reservations:
            for rid in self.open.get(b.id, ()):
                listed.append(self.reservation_view(self.reservations[rid]))
                if len(listed) >= LIST_RESERVATIONS:
                    break
        return BudgetView(
            id=b.id, name=b.name, currency=b.currency, scale=b.scale, limit_minor=b.limit_minor,
            settled_minor=b.settled_minor, reserved_minor=b.reserved_minor, available_minor=self.available(b),
            overrun_minor=b.overrun_minor, open_reservations=len(self.open.get(b.id, ())),
            created_at=to_iso(b.created_at_ms), reservations=listed,
        )

    def reservation_view(self, r: ReservationState) -> ReservationView:
        b = self.table[r.budget_id]
        settle_by = None
        if r.settle_by_mono_ms is not None:
            settle_by = to_iso(self.coord.clock.mono_to_wall(r.settle_by_mono_ms))
        return ReservationView(
            id=r.id, budget_id=b.id, budget=b.name, scope_id=r.scope_id, state=r.state,
            amount_minor=r.amount_minor, remaining_minor=r.remaining_minor, settled_minor=r.settled_minor,
            overrun_minor=r.overrun_minor, currency=b.currency, scale=b.scale, settle_by=settle_by,
            created_at=to_iso(r.created_at_ms), closed_at=to_iso(r.closed_at_ms), close_reason=r.close_reason,
            holder=r.holder, key=r.key, task_id=r.task_id,
        )

    # ================================================================ recovery
    def rebuild_indexes(self) -> None:
        self._init_indexes()
        for b in self.table.values():
            self.by_name[(b.space, b.name)] = b.id
        for k in self.spent.values():
            self._index_spent(k)
        for r in self.reservations.values():
            self._index(r)

    def _index_spent(self, k: SpentKeysState) -> None:
        if k.key is not None:
            self.keys.setdefault((k.budget_id, k.key), k.reservation_id)
        for u in k.usage:
            self.usage.setdefault((k.budget_id, u), k.reservation_id)

    def rearm(self) -> None:
        for r in self.reservations.values():
            if r.state == "ACTIVE" and r.settle_by_mono_ms is not None:
                self.coord.arm_mono(r.settle_by_mono_ms, self._on_settle_by, (r.id, r.settle_by_mono_ms))

    # ================================================================ retention
    def _reservation_done(self, rid: str) -> bool:
        r = self.reservations.get(rid)
        return r is None or r.state not in OPEN

    def _drop(self, rid: str) -> None:
        """Purge reservation ``rid``; the keys it used stay (``SpentKeysState``), indexed
        as they were, so neither is ever used twice on its budget."""
        r = self.reservations.pop(rid, None)
        if r is None:
            return
        self.coord.touch(rid)
        if r.key is None and not r.usage:
            return
        k = SpentKeysState(id=spent_keys_id(rid), space=r.space, budget_id=r.budget_id, reservation_id=rid,
                           scope_id=r.scope_id, amount_minor=r.amount_minor, key=r.key, usage=r.usage)
        self.spent[k.id] = k
        self.coord.touch(k.id)

    def purge_run(self, run_id: str) -> int:
        """The run's closed reservations (SETTLED, VOIDED; their amounts stay counted in
        the budget). An open one stays until it closes. The keys a purged one used stay
        (:meth:`_drop`). Budgets themselves are named, space-wide entities: never
        purged."""
        return self.links.purge(run_id, self._reservation_done, self._drop)

    def purge_task_links(self, task_id: str) -> int:
        """The closed reservations held for the task's deliveries."""
        return self.links.purge(task_id, self._reservation_done, self._drop)

    # ================================================================ events
    @emits(BudgetCreated)
    def _ev_created(self, r: BudgetCreated):
        return ev(r.space, "budget.created", "budget", r.id, None, r.at_ms,
                  {"name": r.name, "currency": r.currency, "scale": r.scale, "limit_minor": r.limit_minor})

    @emits(BudgetReserved)
    def _ev_reserved(self, rec: BudgetReserved):
        return ev(rec.space, "budget.reserved", "budget", rec.budget_id, rec.scope_id, rec.at_ms,
                  data(reservation=rec.id, amount_minor=rec.amount_minor, task=rec.task_id, holder=rec.holder))

    @emits(BudgetSettled)
    def _ev_settled(self, rec: BudgetSettled):
        r = self.reservations[rec.reservation_id]
        return ev(r.space, "budget.settled", "budget", r.budget_id, r.scope_id, rec.at_ms,
                  {"reservation": r.id, "usage_key": rec.usage_key, "requested_minor": rec.requested_minor,
                   "charged_minor": rec.charged_minor, "closes": rec.closes})

    @emits(BudgetVoided)
    def _ev_voided(self, rec: BudgetVoided):
        r = self.reservations[rec.reservation_id]
        return ev(r.space, "budget.voided", "budget", r.budget_id, r.scope_id, rec.at_ms,
                  {"reservation": r.id, "released_minor": rec.released_minor})

    @emits(ReservationStale)
    def _ev_stale(self, rec: ReservationStale):
        r = self.reservations[rec.reservation_id]
        return ev(r.space, "budget.reservation_stale", "budget", r.budget_id, r.scope_id, rec.at_ms,
                  {"reservation": r.id, "remaining_minor": r.remaining_minor})
