"""The endpoints of the runstate HTTP API, each a thin mapping onto protocol operations.

:data:`ROUTES` is the table: ``(method, path template, handler)``, the template relative
to ``/v1/spaces/{spaceId}``. A handler reads its request (``ctx.params``, ``ctx.body``,
``ctx.query``), runs operations with ``await ctx.call(op)`` and returns a JSON-able dict
(200) or :data:`~rallypoint.http.app.NO_CONTENT` (204); a RallypointError it raises (or
an operation answers) becomes the error envelope.

A reply view becomes JSON through its shape (:mod:`rallypoint.http.shapes`: derived from
the view, with only runstate's renames and shape differences declared). Request bodies
(camelCase; see ``docs/http.md`` for the whole list) are read here: instants are ISO 8601 UTC
strings with milliseconds (``2026-01-31T12:00:00.000Z``); durations are integer
``*Seconds`` or ``waitMs``; money is integer minor units as decimal strings
(``"250"``); payloads (``input``, ``payload``, ``outcome``, ``result``) are any JSON
value, stored as msgpack, so the native client reads the same value. Ids are the
server's (path-safe). Tokens are decimal strings.
"""

from __future__ import annotations

import math
from datetime import timezone
from typing import Any

import msgspec
import trio

from .. import protocol as p
from ..errors import ConflictError, CursorExpiredError, NotFoundError, RallypointError, ValidationError
from .app import INT_MAX, INT_MIN, NO_CONTENT, Ctx
from . import shapes as sh
from .shapes import message_json

__all__ = ["ROUTES"]

MAX_WAIT_MS = 60_000
#: A watch or receive without its own wait: held this long (under the 0.2 client's 10 s
#: per-request timeout, which long polls of /watch do not extend).
DEFAULT_WATCH_HOLD_MS = 8_000

_mp_encode = msgspec.msgpack.encode


# ====================================================================== helpers
def raw(value: Any) -> msgspec.Raw:
    """A JSON value as a stored payload."""
    return msgspec.Raw(_mp_encode(value))


def _get(body: dict, name: str, kind, *, required: bool = False, default=None):
    v = body.get(name)
    if v is None:
        if required:
            raise ValidationError(f"{name} is required", details={"field": name})
        return default
    ok = isinstance(v, kind) and not (kind in (int, (int, str)) and isinstance(v, bool))
    if not ok:
        tname = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValidationError(f"{name} must be a {tname} (got {type(v).__name__})", details={"field": name})
    return v


def s_(body, name, *, required=False, default=None) -> str | None:
    return _get(body, name, str, required=required, default=default)


def i_(body, name, *, required=False, default=None) -> int | None:
    return _get(body, name, int, required=required, default=default)


def b_(body, name, default=False) -> bool:
    return _get(body, name, bool, default=default)


def minor(body, name, *, required=False, default=None) -> int | None:
    """Money: a decimal string (or integer) of minor units."""
    v = _get(body, name, (str, int), required=required, default=default)
    if v is None or isinstance(v, int):
        return v
    if not v.isdigit():
        raise ValidationError(f"{name} must be a string of decimal digits (minor units), got {v!r}",
                              details={"field": name})
    n = int(v)
    if n > INT_MAX:
        raise ValidationError(f"{name} is more than the largest amount ({INT_MAX} minor units); send a smaller one",
                              details={"field": name})
    return n


def token(body, name="token", *, required=True) -> int:
    v = _get(body, name, (str, int), required=required)
    try:
        n = v if isinstance(v, int) else int(v)
    except (TypeError, ValueError):
        n = None
    if n is None or not INT_MIN <= n <= INT_MAX:
        raise RallypointError(f"{name} {v!r} is not a token of this server", code="STALE_CLAIM",
                              details={"field": name})
    return n


def _ms_of_seconds(v: float, name: str) -> int:
    """Seconds (a finite number) as whole ms; VALIDATION_FAILED for inf, NaN or more
    than the 64-bit range of ms."""
    if not math.isfinite(v) or abs(v) * 1000 >= INT_MAX:
        raise ValidationError(f"{name} must be a finite number of seconds (got {v!r})", details={"field": name})
    return int(round(v * 1000))


def seconds_ms(body, name, default_s: int | None = None, *, required=False) -> int | None:
    v = _get(body, name, (int, float), required=required, default=default_s)
    return None if v is None else _ms_of_seconds(v, name)


def wait_ms(v, default: int = 0) -> int:
    if v is None or v == "":
        return default
    try:
        ms = int(float(v))
    except (TypeError, ValueError, OverflowError):  # not a number, NaN, inf
        raise ValidationError(f"waitMs must be a number of milliseconds (got {v!r})",
                              details={"field": "waitMs"}) from None
    if ms < 0:
        raise ValidationError("waitMs must be >= 0", details={"field": "waitMs"})
    return min(ms, MAX_WAIT_MS)


def _int_query(q: dict, name: str, default: int) -> int:
    """Query parameter ``name`` as an integer (``default`` when absent or empty);
    VALIDATION_FAILED for anything else, or one outside the 64-bit range (the operation
    checks its own range)."""
    v = q.get(name)
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or not INT_MIN <= n <= INT_MAX:
        raise ValidationError(f"{name} must be an integer (got {v!r})", details={"field": name})
    return n


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


# ====================================================================== runs and scopes
async def put_run(ctx: Ctx):
    """PUT /runs/{name} {deadline?} -> the named root run (joined, or made)."""
    return sh.SCOPE.json(await ctx.call(p.ScopeEnsureNamed(name=ctx.params["name"], deadline=s_(ctx.body, "deadline"))))


async def post_scopes(ctx: Ctx):
    b = ctx.body
    op = p.ScopeCreate(parent_id=s_(b, "parentId"), name=s_(b, "name"), deadline=s_(b, "deadline"),
                       child_limit=i_(b, "childLimit", default=1000))
    return sh.SCOPE.json(await ctx.call(op))


async def get_scope(ctx: Ctx):
    return sh.SCOPE.json(await ctx.call(p.ScopeStatus(scope_id=ctx.params["id"])))


async def cancel_scope(ctx: Ctx):
    return sh.SCOPE.json(await ctx.call(p.ScopeCancel(scope_id=ctx.params["id"], reason=s_(ctx.body, "reason"))))


async def complete_scope(ctx: Ctx):
    return sh.SCOPE.json(await ctx.call(p.ScopeComplete(scope_id=ctx.params["id"], wait_ms=0)))


# ====================================================================== mailboxes, messages
async def list_mailboxes(ctx: Ctx):
    return sh.MAILBOX_LIST.json(await ctx.call(p.MailboxList()))


async def post_mailboxes(ctx: Ctx):
    """POST /mailboxes {name, mode?, maxAttempts?, backlogLimit?, requirements?}:
    ``mailbox.ensure``; ``requirements`` as for ``PUT /mailboxes/by-name``."""
    b = ctx.body
    op = _mailbox_ensure(s_(b, "name", required=True), b, i_(b, "backlogLimit"))
    return sh.MAILBOX.json(await ctx.call(op))


async def put_mailbox(ctx: Ctx):
    """PUT /mailboxes/by-name/{name} {maxAttempts?, mode?, requirements?}: ``{}`` looks
    the queue up and makes it with the defaults when missing (producers may start
    first); declared ``maxAttempts`` / ``mode`` are checked (CONFLICT when they differ).

    ``requirements`` (runstate 0.3's worker declares its queue's ``slots=`` / ``budget=``
    here at every start): stored as the queue's default requirements, given to every
    task submitted without its own (a producer-only client repeats none of them). Given,
    they replace what the queue held; absent or null, they are left as they are; ``{}``
    (or empty lists) clears them. Without ``maxAttempts`` and ``mode`` the queue's own
    settings are kept (its defaults when it is made here). Quota requirements are
    VALIDATION_FAILED, an unknown pool or budget NOT_FOUND, as on ``POST /tasks``."""
    # a setting left out is not checked (mailbox.ensure's `checked`): one op, no look-up first
    return sh.MAILBOX.json(await ctx.call(_mailbox_ensure(ctx.params["name"], ctx.body, None)))


def _mailbox_ensure(name: str, b: dict, backlog_limit: int | None) -> p.MailboxEnsure:
    """``mailbox.ensure`` for a body's ``mode`` / ``maxAttempts`` / ``backlogLimit``:
    those present are checked against an existing queue, the others only default a new
    one (WORK, 5, none)."""
    mode, attempts = s_(b, "mode"), i_(b, "maxAttempts")
    given = {"mode": mode, "max_attempts": attempts, "backlog_limit": backlog_limit}
    return p.MailboxEnsure(name=name, mode=mode.upper() if mode else "WORK",
                           max_attempts=5 if attempts is None else attempts, backlog_limit=backlog_limit,
                           requirements=mailbox_requirements(b), checked=[k for k, v in given.items() if v is not None])


async def send_message(ctx: Ctx):
    """POST /mailboxes/{id}/messages {scopeId, payload?, workKey?, deadline?}: into an
    INBOX mailbox a message; into a WORK mailbox a task (runstate 0.2 sends plain
    messages to either)."""
    b = ctx.body
    mbx, scope = ctx.params["id"], s_(b, "scopeId", required=True)
    payload, key, deadline = raw(b.get("payload")), s_(b, "workKey"), s_(b, "deadline")
    try:
        return message_json(await ctx.call(p.MessageSend(mailbox=mbx, scope_id=scope, payload=payload, key=key,
                                                         deadline=deadline)))
    except ConflictError as e:
        if (e.details or {}).get("mode") != "WORK":
            raise
    return message_json(await ctx.call(p.TaskSubmit(mailbox=mbx, scope_id=scope, input=payload, key=key,
                                                    deadline=deadline)))


async def list_messages(ctx: Ctx):
    limit = _int_query(ctx.query, "limit", 100)
    v = await ctx.call(p.MailboxMessages(name=ctx.params["id"], limit=limit, before=ctx.query.get("before")))
    return sh.MESSAGE_LIST.json(v)


async def _receive(ctx: Ctx, mailbox: str):
    b = ctx.body
    op = p.Receive(mailbox=mailbox, scope_id=s_(b, "scopeId", required=True),
                   lease_ms=seconds_ms(b, "leaseSeconds", 30), wait_ms=wait_ms(b.get("waitMs")), max_messages=1,
                   holder=s_(b, "holder"))  # runstate's worker id (both SDKs send it); else the session's
    v = await ctx.call(op)
    return v.deliveries[0] if v.deliveries else None


async def recv(ctx: Ctx):
    """POST /mailboxes/{id}/recv: 204, or ``{message: {id, payload, attempt, scopeId}, token}``."""
    d = await _receive(ctx, ctx.params["id"])
    if d is None:
        return NO_CONTENT
    return sh.recv_json(d)


async def renew_message(ctx: Ctx):
    b = ctx.body
    v = await ctx.call(p.DeliveryRenew(task_id=ctx.params["id"], token=token(b),
                                       lease_ms=seconds_ms(b, "leaseSeconds", 30)))
    return sh.LEASE.json(v)


def _outcome(result: Any) -> Any:
    """What a complete records: ``result.payload`` (0.3 wraps the value), else
    ``result`` as given (0.2 passes the caller's dict)."""
    if isinstance(result, dict) and set(result) == {"payload"}:
        return result["payload"]
    return result


async def complete_message(ctx: Ctx):
    b = ctx.body
    v = await ctx.call(p.DeliveryComplete(task_id=ctx.params["id"], token=token(b),
                                          outcome=raw(_outcome(b.get("result")))))
    return sh.TASK.json(v)


async def nack_message(ctx: Ctx):
    """POST /messages/{id}/nack {token, retry, error?}: retry (deliver again while
    attempts remain) or, with ``retry: false``, reject (FAILED now)."""
    b = ctx.body
    err = b.get("error")
    tid, tok = ctx.params["id"], token(b)
    if b_(b, "retry", default=True):
        v = await ctx.call(p.DeliveryRetry(task_id=tid, token=tok, error=raw(err)))
    else:
        v = await ctx.call(p.DeliveryReject(task_id=tid, token=tok, error=raw(err)))
    return sh.TASK.json(v)


# ====================================================================== tasks
async def post_task(ctx: Ctx):
    """POST /tasks {scopeId, mailboxId, taskKey, input?, deadline?}: idempotent per (run,
    mailbox, taskKey): the same key returns the existing task. Extension fields (issue
    44; the runstate SDK neither sends nor reads them): ``priority`` (1 most urgent .. 5),
    ``fairKey``, ``fairWeight`` (1 .. 1000); the task's JSON shows ``priority`` and
    ``fairKey``."""
    b = ctx.body
    scope = s_(b, "scopeId", required=True)
    op = p.TaskSubmit(mailbox=s_(b, "mailboxId", required=True), scope_id=scope,
                      input=raw(b.get("input")), key=s_(b, "taskKey"), deadline=s_(b, "deadline"),
                      requirements=requirements(b), work_limit=s_(b, "workLimit"), priority=i_(b, "priority"),
                      fair_key=s_(b, "fairKey"), fair_weight=i_(b, "fairWeight"))
    v = await ctx.call(op)
    sub = s_(b, "subscriberId")
    if sub is not None:  # the first subscriber (a second call: idempotent)
        v = await ctx.call(p.TaskSubscribe(task_id=v.id, subscriber_id=sub, scope_id=scope))
    return sh.TASK.json(v)


async def admit(ctx: Ctx):
    """POST /tasks/admit: 204, or the admitted delivery (``messageId``, ``token``,
    ``taskId``, ``payload``, ``attempt``, ``taskKey``, ``grants``, ``consumptions``,
    ``reservations``). Receives from the run and its descendants."""
    d = await _receive(ctx, s_(ctx.body, "mailboxId", required=True))
    return NO_CONTENT if d is None else sh.DELIVERY.json(d)


async def get_task(ctx: Ctx):
    """GET /tasks/{id}?waitMs=: the task; with ``waitMs`` (at most 60 s), once terminal
    or when the wait is up."""
    w = wait_ms(ctx.query.get("waitMs"))
    tid = ctx.params["id"]
    v = await ctx.call(p.TaskResult(task_id=tid, wait_ms=w) if w else p.TaskStatus(task_id=tid))
    return sh.TASK.json(v)


async def cancel_task(ctx: Ctx):
    return sh.TASK.json(await ctx.call(p.TaskCancel(task_id=ctx.params["id"])))


async def join_task(ctx: Ctx):
    """POST /tasks/{id}/join {subscriberId, scopeId}: an idempotent subscription."""
    b = ctx.body
    return sh.TASK.json(await ctx.call(p.TaskSubscribe(task_id=ctx.params["id"],
                                                    subscriber_id=s_(b, "subscriberId", required=True),
                                                    scope_id=s_(b, "scopeId"))))


async def detach_task(ctx: Ctx):
    """POST /tasks/{id}/detach {subscriberId}: unsubscribe; the task goes on."""
    return sh.TASK.json(await ctx.call(p.TaskDetach(task_id=ctx.params["id"],
                                                 subscriber_id=s_(ctx.body, "subscriberId", required=True))))


# ====================================================================== task groups
async def post_group(ctx: Ctx):
    """POST /task-groups {mailboxId, condition, threshold?, expectedMembers?, deadline?,
    parentScopeId?}: without a parent (0.2 allows it) the group gets a root run of its
    own (named ``task-group``) as its parent."""
    b = ctx.body
    parent = s_(b, "parentScopeId")
    if parent is None:
        parent = (await ctx.call(p.ScopeCreate(name="task-group"))).id
    op = p.GroupCreate(scope_id=parent, mailbox=s_(b, "mailboxId", required=True),
                       condition=s_(b, "condition", required=True), threshold=i_(b, "threshold"),
                       expected_members=i_(b, "expectedMembers"), deadline=s_(b, "deadline"), parent_scope_id=parent)
    return sh.GROUP.json(await ctx.call(op))


async def get_group(ctx: Ctx):
    return sh.GROUP.json(await ctx.call(p.GroupStatus(group_id=ctx.params["id"])))


async def group_submit(ctx: Ctx):
    """POST /task-groups/{g}/tasks {taskKey, input, deadline?, requirements?}: a member
    task; ``requirements`` its own (as on ``POST /tasks``), else its mailbox's."""
    b = ctx.body
    v = await ctx.call(p.GroupSubmit(group_id=ctx.params["id"], input=raw(b.get("input")), key=s_(b, "taskKey"),
                                     deadline=s_(b, "deadline"), requirements=requirements(b)))
    return sh.MEMBER_ADDED.json(v)


async def group_close(ctx: Ctx):
    return sh.GROUP_DECISION.json(await ctx.call(p.GroupClose(group_id=ctx.params["id"])))


async def group_seal(ctx: Ctx):
    """Deprecated close: CONFLICT once the group is FINALIZED."""
    g = await ctx.call(p.GroupStatus(group_id=ctx.params["id"]))
    if g.state == "FINALIZED":
        raise ConflictError(f"group {g.id} is already FINALIZED ({g.outcome} {g.outcome_reason})")
    return sh.GROUP_DECISION.json(await ctx.call(p.GroupClose(group_id=ctx.params["id"])))


def _verdict(verdict: str):
    async def h(ctx: Ctx):
        v = await ctx.call(p.GroupVerdictOp(group_id=ctx.params["id"], task_id=ctx.params["task"], verdict=verdict))
        return sh.VERDICT.json(v)
    return h


async def group_join_task(ctx: Ctx):
    v = await ctx.call(p.GroupJoinTask(group_id=ctx.params["id"], task_id=s_(ctx.body, "taskId", required=True)))
    return sh.MEMBER_ADDED.json(v)


# ====================================================================== schedules (rallypoint's own)
def _schedule_fields(b: dict, update: bool) -> dict:
    """The settings of a schedule from a JSON body (camelCase; durations in seconds,
    ``everySeconds`` etc.; instants ISO 8601). ``update``: only the keys given."""
    out: dict = {}
    cron = b.get("cron")
    if cron is not None:
        if isinstance(cron, str):
            cron = [cron]
        if not isinstance(cron, list) or not all(isinstance(c, str) for c in cron):
            raise ValidationError("cron must be a string or a list of strings", details={"field": "cron"})
        out["cron"] = cron
    for key, field in (("everySeconds", "interval_ms"), ("offsetSeconds", "offset_ms"),
                       ("jitterSeconds", "jitter_ms"), ("runDeadlineSeconds", "run_deadline_ms"),
                       ("catchupWindowSeconds", "catchup_window_ms")):
        v = seconds_ms(b, key)
        if v is not None:
            out[field] = v
    for key, field in (("timezone", "timezone"), ("start", "start"), ("end", "end"), ("runName", "run_name"),
                       ("mailbox", "mailbox"), ("overlap", "overlap")):
        v = s_(b, key)
        if v is not None:
            out[field] = v
    md = b.get("metadata")
    if md is not None:
        if not isinstance(md, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
            raise ValidationError("metadata must be an object of strings", details={"field": "metadata"})
        out["metadata"] = md
    if "input" in b:
        out["input"] = raw(b["input"])
    if b.get("pauseOnFailure") is not None:
        out["pause_on_failure"] = b_(b, "pauseOnFailure")
    if b.get("remainingActions") is not None:
        out["remaining_actions"] = i_(b, "remainingActions")
    return out


async def post_schedule(ctx: Ctx):
    """POST /schedules: ``{name, cron | everySeconds, ...}`` (see docs/http.md)."""
    b = ctx.body
    op = p.ScheduleCreate(name=s_(b, "name", required=True), paused=b_(b, "paused"), note=s_(b, "note"),
                          **_schedule_fields(b, False))
    return sh.SCHEDULE.json(await ctx.call(op))


async def list_schedules(ctx: Ctx):
    return sh.SCHEDULE_LIST.json(await ctx.call(p.ScheduleList()))


async def get_schedule(ctx: Ctx):
    """GET /schedules/{id}?nextN=5&recent=10 (by id or name)."""
    op = p.ScheduleGet(schedule=ctx.params["id"], next_n=_int_query(ctx.query, "nextN", 5),
                       recent=_int_query(ctx.query, "recent", 10))
    return sh.SCHEDULE.json(await ctx.call(op))


async def update_schedule(ctx: Ctx):
    return sh.SCHEDULE.json(await ctx.call(p.ScheduleUpdate(schedule=ctx.params["id"],
                                                            **_schedule_fields(ctx.body, True))))


def _pause(paused: bool):
    async def handler(ctx: Ctx):
        op = p.SchedulePause(schedule=ctx.params["id"], paused=paused, note=s_(ctx.body, "note"))
        return sh.SCHEDULE.json(await ctx.call(op))

    return handler


async def trigger_schedule(ctx: Ctx):
    op = p.ScheduleTrigger(schedule=ctx.params["id"], overlap=s_(ctx.body, "overlap"))
    return sh.SCHEDULE.json(await ctx.call(op))


async def backfill_schedule(ctx: Ctx):
    b = ctx.body
    op = p.ScheduleBackfill(schedule=ctx.params["id"], start=s_(b, "start", required=True),
                            end=s_(b, "end", required=True), overlap=s_(b, "overlap"))
    return sh.SCHEDULE.json(await ctx.call(op))


async def delete_schedule(ctx: Ctx):
    return sh.SCHEDULE.json(await ctx.call(p.ScheduleDelete(schedule=ctx.params["id"])))


# ====================================================================== allowances (quotas)
async def post_allowance(ctx: Ctx):
    b = ctx.body
    op = p.QuotaEnsure(name=s_(b, "name", required=True), units_limit=i_(b, "unitsLimit", required=True),
                       window_ms=seconds_ms(b, "windowSeconds", required=True))
    return sh.QUOTA.json(await ctx.call(op))


async def list_allowances(ctx: Ctx):
    return sh.QUOTA_LIST.json(await ctx.call(p.QuotaList()))


async def put_allowance(ctx: Ctx):
    """PUT /allowances/by-name/{name}: ``{}`` looks it up (NOT_FOUND when missing);
    ``{unitsLimit, windowSeconds}`` makes it or checks it (CONFLICT)."""
    b, name = ctx.body, ctx.params["name"]
    if b.get("unitsLimit") is None and b.get("windowSeconds") is None:
        return sh.QUOTA.json(await ctx.call(p.QuotaGet(quota=name)))
    op = p.QuotaEnsure(name=name, units_limit=i_(b, "unitsLimit", required=True),
                       window_ms=seconds_ms(b, "windowSeconds", required=True))
    return sh.QUOTA.json(await ctx.call(op))


async def get_allowance(ctx: Ctx):
    return sh.QUOTA.json(await ctx.call(p.QuotaGet(quota=ctx.params["id"])))


async def consume_allowance(ctx: Ctx):
    """Take now or ALLOWANCE_EXHAUSTED / ALLOWANCE_COOLDOWN (429, Retry-After)."""
    b = ctx.body
    op = p.QuotaTake(quota=ctx.params["id"], scope_id=s_(b, "scopeId", required=True),
                     units=i_(b, "units", default=1), holder=s_(b, "holder"))
    return sh.QUOTA_TAKE.json(await ctx.call(op))


async def wait_allowance(ctx: Ctx):
    """A durable FIFO waiter for ``ttlSeconds`` (5-3600): GRANTED at once (with its
    ``consumptionId``) or WAITING (``waiterId``)."""
    b = ctx.body
    op = p.QuotaTake(quota=ctx.params["id"], scope_id=s_(b, "scopeId", required=True),
                     units=i_(b, "units", default=1), holder=s_(b, "holder"),
                     ttl_ms=seconds_ms(b, "ttlSeconds", 60))
    return sh.QUOTA_TAKE.json(await ctx.call(op))


async def cooldown_allowance(ctx: Ctx):
    b = ctx.body
    op = p.QuotaCooldown(quota=ctx.params["id"], cooldown_ms=seconds_ms(b, "seconds", required=True),
                         reason=s_(b, "reason"))
    return sh.QUOTA.json(await ctx.call(op))


async def get_allowance_waiter(ctx: Ctx):
    return sh.QUOTA_TAKE.json(await ctx.call(p.QuotaWaiterWait(waiter_id=ctx.params["id"])))


async def cancel_allowance_waiter(ctx: Ctx):
    return sh.QUOTA_TAKE.json(await ctx.call(p.QuotaWaiterCancel(waiter_id=ctx.params["id"])))


# ====================================================================== budgets
def _budget_ensure(name: str, b: dict) -> p.BudgetEnsure:
    return p.BudgetEnsure(name=name, limit_minor=minor(b, "limitMinor", required=True),
                          currency=s_(b, "currency", default="USD"), scale=i_(b, "scale", default=2))


async def post_budget(ctx: Ctx):
    return sh.BUDGET.json(await ctx.call(_budget_ensure(s_(ctx.body, "name", required=True), ctx.body)))


async def list_budgets(ctx: Ctx):
    return sh.BUDGET_LIST.json(await ctx.call(p.BudgetList()))


async def put_budget(ctx: Ctx):
    b, name = ctx.body, ctx.params["name"]
    if b.get("limitMinor") is None:
        return sh.BUDGET.json(await ctx.call(p.BudgetGet(budget=name)))
    return sh.BUDGET.json(await ctx.call(_budget_ensure(name, b)))


async def get_budget(ctx: Ctx):
    return sh.BUDGET.json(await ctx.call(p.BudgetGet(budget=ctx.params["id"], reservations=True)))


async def reserve_budget(ctx: Ctx):
    """{scopeId, holder, amountMinor, settleBy?} -> the reservation
    (``reservationId``, ``reservedMinor``, ``state``). INSUFFICIENT_BUDGET (409)."""
    b = ctx.body
    op = p.BudgetReserve(budget=ctx.params["id"], scope_id=s_(b, "scopeId", required=True),
                         amount_minor=minor(b, "amountMinor", required=True), settle_by=s_(b, "settleBy"),
                         holder=s_(b, "holder"))
    return sh.RESERVATION.json(await ctx.call(op))


async def settle_budget(ctx: Ctx):
    """{reservationId, amountMinor, workKey, allowOverrun?}: charged once per
    ``workKey``, capped at the reservation plus what the budget has left; the rest is
    released (state SETTLED). CONFLICT once the reservation was voided."""
    b = ctx.body
    v = await ctx.call(p.BudgetSettle(reservation_id=s_(b, "reservationId", required=True),
                                      amount_minor=minor(b, "amountMinor", required=True),
                                      usage_key=s_(b, "workKey", required=True), final=True))
    return sh.SETTLE.json(v)


async def void_budget(ctx: Ctx):
    return sh.RESERVATION.json(await ctx.call(p.BudgetVoid(reservation_id=s_(ctx.body, "reservationId",
                                                                          required=True))))


# ====================================================================== barriers
async def post_barrier(ctx: Ctx):
    b = ctx.body
    op = p.BarrierCreate(scope_id=s_(b, "scopeId", required=True), target=i_(b, "target", required=True))
    return sh.BARRIER.json(await ctx.call(op))


async def put_barrier(ctx: Ctx):
    b = ctx.body
    op = p.BarrierCreate(scope_id=s_(b, "scopeId", required=True), target=i_(b, "target", required=True),
                         name=ctx.params["name"])
    return sh.BARRIER.json(await ctx.call(op))


async def arrive_barrier(ctx: Ctx):
    key = s_(ctx.body, "arrivalKey", required=True)
    return sh.BARRIER.json(await ctx.call(p.BarrierArrive(barrier_id=ctx.params["id"], key=key)))


async def get_barrier(ctx: Ctx):
    return sh.BARRIER.json(await ctx.call(p.BarrierStatus(barrier_id=ctx.params["id"])))


# ====================================================================== timers
def _timer_create(ctx: Ctx, name: str | None) -> p.TimerCreate:
    b = ctx.body
    after = b.get("afterSeconds")
    if after is not None and (not isinstance(after, (int, float)) or isinstance(after, bool)):
        raise ValidationError("afterSeconds must be a number", details={"field": "afterSeconds"})
    return p.TimerCreate(scope_id=s_(b, "scopeId", required=True), at=s_(b, "at"),
                         after_ms=None if after is None else _ms_of_seconds(after, "afterSeconds"), name=name)


async def post_timer(ctx: Ctx):
    return sh.TIMER.json(await ctx.call(_timer_create(ctx, None)))


async def put_timer(ctx: Ctx):
    """Get or create the run's timer ``name`` (never re-armed); ``now`` is the server's
    clock, so ``fireAt - now`` is the time left."""
    return sh.TIMER.json(await ctx.call(_timer_create(ctx, ctx.params["name"])))


async def poll_timers(ctx: Ctx):
    v = await ctx.call(p.TimerPoll(scope_id=s_(ctx.body, "scopeId", required=True)))
    return sh.TIMER_LIST.json(v)


async def ack_timer(ctx: Ctx):
    tok = ctx.body.get("token")
    return sh.TIMER.json(await ctx.call(p.TimerAck(timer_id=ctx.params["id"], token=None if tok is None else str(tok))))


async def cancel_timer(ctx: Ctx):
    return sh.TIMER.json(await ctx.call(p.TimerCancel(timer_id=ctx.params["id"])))


# ====================================================================== once
async def once_acquire(ctx: Ctx):
    b = ctx.body
    op = p.OnceAcquire(scope_id=s_(b, "scopeId", required=True), key=s_(b, "key", required=True),
                       lease_ms=seconds_ms(b, "leaseSeconds", 30), holder=s_(b, "holder"),
                       holder_session=s_(b, "holderSession"))
    return sh.ONCE.json(await ctx.call(op))


async def once_get(ctx: Ctx):
    q = ctx.query
    scope, key = q.get("scopeId"), q.get("key")
    if not scope or not key:
        raise ValidationError("scopeId and key are required", details={"field": "scopeId" if not scope else "key"})
    return sh.ONCE.json(await ctx.call(p.OnceGet(scope_id=scope, key=key, wait_ms=wait_ms(q.get("waitMs")))))


async def once_renew(ctx: Ctx):
    b = ctx.body
    op = p.OnceRenew(scope_id=s_(b, "scopeId", required=True), key=s_(b, "key", required=True), token=token(b),
                     lease_ms=seconds_ms(b, "leaseSeconds", 30))
    return sh.ONCE.json(await ctx.call(op))


async def once_complete(ctx: Ctx):
    b = ctx.body
    op = p.OnceComplete(scope_id=s_(b, "scopeId", required=True), key=s_(b, "key", required=True), token=token(b),
                        result=raw(b.get("result")))
    return sh.ONCE.json(await ctx.call(op))


async def once_fail(ctx: Ctx):
    b = ctx.body
    op = p.OnceFail(scope_id=s_(b, "scopeId", required=True), key=s_(b, "key", required=True), token=token(b),
                    error=s_(b, "error", default=""), max_attempts=i_(b, "maxAttempts", default=3))
    return sh.ONCE.json(await ctx.call(op))


# ====================================================================== requirements
def requirements(body: dict) -> p.Requirements | None:
    """runstate's ``requirements`` ``{pools: [{name, units}], budgets: [{name,
    reserveMinor}], quotas: [...]}`` as the admission's :class:`protocol.Requirements`
    (pools held as grants while a delivery runs, budgets reserved for it), None when
    absent or empty (a task without requirements of its own: its mailbox's defaults
    apply). Quota requirements are not taken at admission by this server:
    VALIDATION_FAILED."""
    req = mailbox_requirements(body)
    return req if req is not None and (req.pools or req.budgets) else None


def mailbox_requirements(body: dict) -> p.Requirements | None:
    """``requirements`` as :func:`requirements` parses them, except that an empty
    object (or empty lists) is an empty ``Requirements()`` -- on a mailbox, "clear its
    default requirements" -- and only absent or null is None ("leave them").
    VALIDATION_FAILED: not an object, non-empty ``quotas``, a pool or budget item that
    is not an object or lacks its name, ``units`` not an integer (default 1),
    ``reserveMinor`` missing or not a digit string. (Names and sizes are checked by the
    operation: NOT_FOUND / VALIDATION_FAILED.)"""
    req = body.get("requirements")
    if req is None:
        return None
    if not isinstance(req, dict):
        raise ValidationError("requirements must be an object", details={"field": "requirements"})
    if req.get("quotas"):
        raise ValidationError("quota requirements are not supported (take quota units in the handler)",
                              details={"field": "requirements.quotas"})
    pools, budgets = {}, {}
    for item in req.get("pools") or ():
        if not isinstance(item, dict):
            raise ValidationError("requirements.pools holds {name, units} objects", details={"field": "requirements"})
        pools[s_(item, "name", required=True)] = i_(item, "units", default=1)
    for item in req.get("budgets") or ():
        if not isinstance(item, dict):
            raise ValidationError("requirements.budgets holds {name, reserveMinor} objects",
                                  details={"field": "requirements"})
        budgets[s_(item, "name", required=True)] = minor(item, "reserveMinor", required=True)
    return p.Requirements(pools=pools, budgets=budgets)


# ====================================================================== claims
async def claim_acquire(ctx: Ctx):
    """POST /claims {key, scopeId, holder, holderSession, leaseSeconds}: a fenced lease
    (``generation``, ``token``, ``leaseExpiresAt``); CLAIM_HELD (409) while another lease
    is live."""
    b = ctx.body
    v = await ctx.call(p.ClaimAcquire(scope_id=s_(b, "scopeId", required=True), key=s_(b, "key", required=True),
                                      lease_ms=seconds_ms(b, "leaseSeconds", 30), holder=s_(b, "holder")))
    return sh.CLAIM_LEASE.json(v)


async def claim_renew(ctx: Ctx):
    b = ctx.body
    v = await ctx.call(p.ClaimRenew(key=ctx.params["key"], token=token(b), lease_ms=seconds_ms(b, "leaseSeconds", 30)))
    return sh.CLAIM_LEASE.json(v)


async def claim_release(ctx: Ctx):
    b = ctx.body
    c = await ctx.call(p.ClaimRelease(key=ctx.params["key"], token=token(b), observation=raw(b.get("observation"))))
    return sh.CLAIM_RELEASED.json(c)


# ====================================================================== permits (pools)
async def post_permit(ctx: Ctx):
    b = ctx.body
    return sh.POOL.json(await ctx.call(p.PoolEnsure(name=s_(b, "name", required=True),
                                                 units_total=i_(b, "units", required=True))))


async def list_permits(ctx: Ctx):
    return sh.POOL_LIST.json(await ctx.call(p.PoolList()))


async def put_permit(ctx: Ctx):
    """``{}`` looks the pool up (NOT_FOUND when missing); ``{units}`` makes or checks it."""
    b, name = ctx.body, ctx.params["name"]
    if b.get("units") is None:
        return sh.POOL.json(await ctx.call(p.PoolGet(name=name)))
    return sh.POOL.json(await ctx.call(p.PoolEnsure(name=name, units_total=i_(b, "units", required=True))))


#: A permit waiter (0.3's POST /permits/{id}/wait, which carries no time limit) stays in
#: line this long unless it is granted, withdrawn or its run ends.
PERMIT_WAITER_MS = 120_000
#: How long the wait and waiter-status calls let the pool answer before they report the
#: waiter still WAITING (the parked wait is then dropped; the waiter stays in line).
_PEEK_S = 0.05


def _waiter_id(pool_id: str, scope_id: str, units: int, rid: str) -> str:
    """A permit waiter's id names its pool, run, units and request id (what re-finding
    it with ``pool.acquire`` needs): ``<pool>--<run>--<units>--<request>``."""
    return f"{pool_id}--{scope_id}--{units}--{rid}"


def _split_waiter(wid: str) -> tuple[str, str, int, str]:
    parts = wid.split("--")
    if len(parts) != 4 or not parts[2].isdigit() or int(parts[2]) > INT_MAX:
        raise NotFoundError(f"no permit waiter {wid!r}", details={"waiter_id": wid})
    return parts[0], parts[1], int(parts[2]), parts[3]


async def _peek_acquire(ctx: Ctx, op: p.PoolAcquire) -> p.PoolAcquireView | None:
    """Queue (or re-find) the waiter ``op.request_id`` and give the pool a moment to
    answer: its grant, or None while it waits (the waiter stays in line, durable)."""
    import trio

    with trio.move_on_after(_PEEK_S):
        return await ctx.call(op)
    return None


async def permit_acquire(ctx: Ctx):
    """POST /permits/{id}/acquire {scopeId, units, holder, holderSession, leaseSeconds,
    waiterId?}: a grant (``grantId``, ``token``, ``leaseExpiresAt``) or
    CAPACITY_UNAVAILABLE (409); with ``waiterId``, the grant that waiter was given."""
    b = ctx.body
    pool, units = ctx.params["id"], i_(b, "units", default=1)
    wid = s_(b, "waiterId")
    if wid is not None:
        pool_id, scope_id, units, rid = _split_waiter(wid)
        v = await _peek_acquire(ctx, p.PoolAcquire(pool=pool_id, scope_id=scope_id,
                                                   units=units, lease_ms=seconds_ms(b, "leaseSeconds", 30),
                                                   wait_ms=PERMIT_WAITER_MS, holder=s_(b, "holder"),
                                                   request_id=rid))
        if v is None or v.grant is None:
            raise RallypointError("the waiter's turn has not come yet", code="CAPACITY_UNAVAILABLE",
                                  retry_after=0.25)
        return sh.GRANT.json(v.grant)
    v = await ctx.call(p.PoolAcquire(pool=pool, scope_id=s_(b, "scopeId", required=True), units=units,
                                     lease_ms=seconds_ms(b, "leaseSeconds", 30), holder=s_(b, "holder")))
    return sh.GRANT.json(v.grant)


async def permit_wait(ctx: Ctx):
    """POST /permits/{id}/wait {scopeId, units, holder}: a durable FIFO waiter
    (``waiterId``); SIGNALED once it was granted (acquire with ``waiterId`` to get it)."""
    import hashlib
    import secrets

    b = ctx.body
    pool = await ctx.call(p.PoolGet(name=ctx.params["id"]))
    if ctx.idempotency is not None:  # a retry of this request re-finds its waiter, not a second one
        rid = "pw" + hashlib.sha256("\0".join(ctx.idempotency).encode()).hexdigest()[:16]
    else:
        rid = "pw" + secrets.token_hex(8)
    scope, units = s_(b, "scopeId", required=True), i_(b, "units", default=1)
    v = await _peek_acquire(ctx, p.PoolAcquire(pool=pool.id, scope_id=scope, units=units, lease_ms=30_000,
                                               wait_ms=PERMIT_WAITER_MS, holder=s_(b, "holder"), request_id=rid))
    return {"waiterId": _waiter_id(pool.id, scope, units, rid),
            "state": "SIGNALED" if v is not None and v.grant else "WAITING"}


async def permit_waiter(ctx: Ctx):
    """GET /permit-waiters/{id}: WAITING, SIGNALED (granted: acquire with the
    ``waiterId``), EXPIRED (its time ran out or it was withdrawn) or CANCELLED (its run
    ended)."""
    wid = ctx.params["id"]
    pool_id, scope_id, units, rid = _split_waiter(wid)
    try:
        v = await _peek_acquire(ctx, p.PoolAcquire(pool=pool_id, scope_id=scope_id, units=units,
                                                   wait_ms=PERMIT_WAITER_MS, request_id=rid))
    except RallypointError as e:
        if e.code in ("SCOPE_CANCELLED", "DEADLINE_EXCEEDED"):
            return {"waiterId": wid, "state": "CANCELLED"}
        if e.code in ("TIMEOUT", "CONFLICT"):  # its time ran out, or it was withdrawn
            return {"waiterId": wid, "state": "EXPIRED"}
        raise
    return {"waiterId": wid, "state": "SIGNALED" if v is not None and v.grant is not None else "WAITING"}


async def cancel_permit_waiter(ctx: Ctx):
    pool_id, _scope, _units, rid = _split_waiter(ctx.params["id"])
    v = await ctx.call(p.PoolCancelWait(pool=pool_id, request_id=rid))
    return {"waiterId": ctx.params["id"]} | sh.CANCEL_WAIT.json(v)


async def grant_renew(ctx: Ctx):
    b = ctx.body
    return sh.GRANT.json(await ctx.call(p.GrantRenew(grant_id=ctx.params["id"], token=token(b),
                                                  lease_ms=seconds_ms(b, "leaseSeconds", 30))))


async def grant_release(ctx: Ctx):
    b = ctx.body
    return sh.GRANT.json(await ctx.call(p.GrantRelease(grant_id=ctx.params["id"], token=token(b),
                                                    observation=raw(b.get("observation")))))


# ====================================================================== work limits
async def post_work_limit(ctx: Ctx):
    b = ctx.body
    return sh.WORK_LIMIT.json(await ctx.call(p.WorkLimitEnsure(scope_id=s_(b, "scopeId", required=True),
                                                            name=s_(b, "name", required=True),
                                                            max_outstanding=i_(b, "maxOutstanding", required=True))))


async def list_work_limits(ctx: Ctx):
    return sh.WORK_LIMIT_LIST.json(await ctx.call(p.WorkLimitList()))


# ====================================================================== diagnostics
async def ops_run(ctx: Ctx):
    """GET /ops/runs/{id}: ``workers[]`` (holder, keys held, earliestLeaseExpiry),
    ``waiting[]`` (pool waiters: permit, units), ``allowanceWaiting[]``."""
    v = await ctx.call(p.OpsRun(scope_id=ctx.params["id"]))
    return sh.OPS_RUN.json(v)


async def ops_waits(ctx: Ctx):
    return sh.OPS_WAITS.json(await ctx.call(p.OpsWaits()))


# ====================================================================== events and watch
#: Events a page holds at most (``limit``).
MAX_EVENTS_PAGE = 1000
_event_decode = msgspec.msgpack.Decoder(p.EventView).decode


def _cursor(q: dict) -> int | None:
    """``cursor``: absent or empty for the oldest kept event; else a cursor this server
    gave (a decimal seq). Anything else is CURSOR_EXPIRED (the client drops it)."""
    c = q.get("cursor")
    if c is None or c == "":
        return None
    if not c.isdigit() or int(c) > INT_MAX:
        raise CursorExpiredError(f"cursor {c!r} is not a cursor of this server; start again without one",
                                 details={"cursor": c})
    return int(c)


def _limit(q: dict, default: int = 100) -> int:
    v = q.get("limit")
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValidationError(f"limit must be an integer (got {v!r})", details={"field": "limit"}) from None
    if not 1 <= n <= MAX_EVENTS_PAGE:
        raise ValidationError(f"limit must be 1-{MAX_EVENTS_PAGE} (got {n})", details={"field": "limit"})
    return n


def _filters(q: dict) -> dict:
    types = [t.strip() for t in (q.get("types") or "").split(",") if t.strip()] or None
    return {"types": types, "scope_id": q.get("scopeId") or None, "aggregate": q.get("aggregate") or None}


async def list_events(ctx: Ctx):
    """GET /events?cursor=&limit=: a page of the space's events after ``cursor``
    (absent: from the oldest kept), oldest first; ``types`` (comma-separated, ``prefix.*``
    allowed), ``scopeId`` (the run and its subtree) and ``aggregate`` (``type:id``)
    filter it. ``nextCursor`` continues after every event examined. 410 CURSOR_EXPIRED
    for a cursor older than what is kept."""
    q = ctx.query
    if _merged(ctx, q):
        from ..cluster.httproute import events_page

        op = p.EventsList(limit=_limit(q), **_filters(q))
        page = await events_page(ctx.api.router, ctx.secret, ctx.session.space, op, q.get("cursor") or None)
        return _merged_json(page.events, page.next_cursor, page.oldest, page.newest)
    v = await ctx.call(p.EventsList(cursor=_cursor(q), limit=_limit(q), **_filters(q)))
    return sh.EVENT_PAGE.json(v)


def _merged(ctx: Ctx, q: dict) -> bool:
    """A space-wide event read of a sharded cluster: every shard's events, merged
    (a read of one run's events goes to the run's shard as any op)."""
    router = ctx.api.router
    return router is not None and router.sharded and not q.get("scopeId")


def _iso(at) -> str:
    """An SDK event's instant (an aware datetime) as the wire writes it
    (``2026-01-31T12:00:00.000Z``)."""
    if isinstance(at, str):
        return at
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _merged_json(events: list, next_cursor: str, oldest: str, newest: str) -> dict:
    """A merged page (SDK Event values, vector cursors) as GET /events answers it."""
    raws = [msgspec.Raw(p.encoder.encode(p.EventView(**{**msgspec.structs.asdict(e), "at": _iso(e.at)})))
            for e in events]
    return sh.EVENT_PAGE.json(p.EventPageView(events=raws, next_cursor=next_cursor, oldest=oldest, newest=newest))


def watch_hold_ms(q: dict) -> int:
    """How long an empty watch is held: ``waitSeconds`` (at most 60 s; 0 answers at
    once), else :data:`DEFAULT_WATCH_HOLD_MS` -- under the 0.2 client's 10 s timeout,
    which it does not extend for /watch."""
    v = q.get("waitSeconds")
    if v is None or v == "":
        return DEFAULT_WATCH_HOLD_MS
    try:
        s = float(v)
    except ValueError:
        raise ValidationError(f"waitSeconds must be a number (got {v!r})", details={"field": "waitSeconds"}) from None
    if not s >= 0 or not math.isfinite(s):
        raise ValidationError("waitSeconds must be a number >= 0", details={"field": "waitSeconds"})
    return min(int(s * 1000), MAX_WAIT_MS)


async def watch_events(ctx: Ctx):
    """GET /watch: like GET /events (same filters, ``limit``), but an empty page is held
    on the server until a matching event happens or ``waitSeconds`` pass (see
    :func:`watch_hold_ms`), so runstate's loop -- which polls again at once -- never
    spins. The hold is an in-process subscription (``events.watch``: the events are
    pushed as their commits become durable), ended early by a client disconnect.
    Answers ``events`` and ``nextCursor`` (the seq of the last event returned, or past
    every event examined)."""
    q = ctx.query
    limit = _limit(q)
    flt = _filters(q)
    hold_ms = watch_hold_ms(q)
    if _merged(ctx, q):
        from ..cluster.httproute import events_watch

        got = await ctx.api.until_disconnect(ctx.request, events_watch(
            ctx.api.router, ctx.secret, ctx.session.space, p.EventsList(limit=limit, **flt), q.get("cursor") or None,
            hold_ms / 1000))
        return _merged_json(*got)
    v = await ctx.call(p.EventsList(cursor=_cursor(q), limit=limit, **flt))
    if v.events or hold_ms == 0 or v.next_cursor < v.newest:  # something, or more to scan: at once
        return sh.EVENT_PAGE.json(v)
    service = ctx.api.service
    sink = await service.subscribe(ctx.session, p.EventsWatch(cursor=v.next_cursor, **flt),
                                   max_bytes=max(64 * 1024, limit * 1024))
    raws: list = []
    try:
        with trio.move_on_after(hold_ms / 1000):
            while not raws:  # (a batch may be empty: only the scanned position moved)
                raws = await ctx.api.until_disconnect(ctx.request, sink.next_batch())
    finally:
        sink.close()
    scanned = max(v.next_cursor, sink.scanned or 0)  # past what the filter skipped meanwhile
    if len(raws) > limit:
        raws = raws[:limit]
        nxt = _event_decode(bytes(raws[-1])).seq
    else:
        nxt = max(_event_decode(bytes(raws[-1])).seq, scanned) if raws else scanned
    return sh.EVENT_PAGE.json(p.EventPageView(events=raws, next_cursor=nxt, oldest=v.oldest,
                                              newest=max(v.newest, nxt)))


# ====================================================================== the table
ROUTES: list[tuple[str, str, Any]] = [
    # runs and scopes
    ("PUT", "runs/{name}", put_run),
    ("POST", "scopes", post_scopes),
    ("GET", "scopes/{id}", get_scope),
    ("POST", "scopes/{id}/cancel", cancel_scope),
    ("POST", "scopes/{id}/complete", complete_scope),
    # mailboxes and messages
    ("GET", "mailboxes", list_mailboxes),
    ("POST", "mailboxes", post_mailboxes),
    ("PUT", "mailboxes/by-name/{name}", put_mailbox),
    ("POST", "mailboxes/{id}/messages", send_message),
    ("GET", "mailboxes/{id}/messages", list_messages),
    ("POST", "mailboxes/{id}/recv", recv),
    ("POST", "messages/{id}/renew", renew_message),
    ("POST", "messages/{id}/complete", complete_message),
    ("POST", "messages/{id}/nack", nack_message),
    # tasks
    ("POST", "tasks", post_task),
    ("POST", "tasks/admit", admit),
    ("GET", "tasks/{id}", get_task),
    ("POST", "tasks/{id}/cancel", cancel_task),
    ("POST", "tasks/{id}/join", join_task),
    ("POST", "tasks/{id}/detach", detach_task),
    # task groups
    ("POST", "task-groups", post_group),
    ("GET", "task-groups/{id}", get_group),
    ("POST", "task-groups/{id}/tasks", group_submit),
    ("POST", "task-groups/{id}/close", group_close),
    ("POST", "task-groups/{id}/seal", group_seal),
    ("POST", "task-groups/{id}/tasks/{task}/accept", _verdict("ACCEPTED")),
    ("POST", "task-groups/{id}/tasks/{task}/reject", _verdict("REJECTED")),
    ("POST", "task-groups/{id}/join-task", group_join_task),
    # schedules (rallypoint's own)
    ("POST", "schedules", post_schedule),
    ("GET", "schedules", list_schedules),
    ("GET", "schedules/{id}", get_schedule),
    ("POST", "schedules/{id}/update", update_schedule),
    ("POST", "schedules/{id}/pause", _pause(True)),
    ("POST", "schedules/{id}/unpause", _pause(False)),
    ("POST", "schedules/{id}/trigger", trigger_schedule),
    ("POST", "schedules/{id}/backfill", backfill_schedule),
    ("POST", "schedules/{id}/delete", delete_schedule),
    # allowances (quotas)
    ("POST", "allowances", post_allowance),
    ("GET", "allowances", list_allowances),
    ("PUT", "allowances/by-name/{name}", put_allowance),
    ("GET", "allowances/{id}", get_allowance),
    ("POST", "allowances/{id}/consume", consume_allowance),
    ("POST", "allowances/{id}/wait", wait_allowance),
    ("POST", "allowances/{id}/cooldown", cooldown_allowance),
    ("GET", "allowance-waiters/{id}", get_allowance_waiter),
    ("POST", "allowance-waiters/{id}/cancel", cancel_allowance_waiter),
    # budgets
    ("POST", "budgets", post_budget),
    ("GET", "budgets", list_budgets),
    ("PUT", "budgets/by-name/{name}", put_budget),
    ("GET", "budgets/{id}", get_budget),
    ("POST", "budgets/{id}/reserve", reserve_budget),
    ("POST", "budgets/{id}/settle", settle_budget),
    ("POST", "budgets/{id}/void", void_budget),
    # barriers
    ("POST", "barriers", post_barrier),
    ("PUT", "barriers/by-name/{name}", put_barrier),
    ("POST", "barriers/{id}/arrive", arrive_barrier),
    ("GET", "barriers/{id}", get_barrier),
    # timers
    ("POST", "timers", post_timer),
    ("PUT", "timers/by-name/{name}", put_timer),
    ("POST", "timers/poll", poll_timers),
    ("POST", "timers/{id}/ack", ack_timer),
    ("POST", "timers/{id}/cancel", cancel_timer),
    # once
    ("POST", "once/acquire", once_acquire),
    ("GET", "once", once_get),
    ("POST", "once/renew", once_renew),
    ("POST", "once/complete", once_complete),
    ("POST", "once/fail", once_fail),
    # diagnostics
    # claims
    ("POST", "claims", claim_acquire),
    ("POST", "claims/{key}/renew", claim_renew),
    ("POST", "claims/{key}/release", claim_release),
    # permits (pools), their waiters and grants
    ("POST", "permits", post_permit),
    ("GET", "permits", list_permits),
    ("PUT", "permits/by-name/{name}", put_permit),
    ("POST", "permits/{id}/acquire", permit_acquire),
    ("POST", "permits/{id}/wait", permit_wait),
    ("GET", "permit-waiters/{id}", permit_waiter),
    ("POST", "permit-waiters/{id}/cancel", cancel_permit_waiter),
    ("POST", "grants/{id}/renew", grant_renew),
    ("POST", "grants/{id}/release", grant_release),
    # work limits
    ("POST", "work-limits", post_work_limit),
    ("GET", "work-limits", list_work_limits),
    ("GET", "ops/runs/{id}", ops_run),
    ("GET", "ops/waits", ops_waits),
    # events (the journal's derived stream) and the long poll over it
    ("GET", "events", list_events),
    ("GET", "watch", watch_events),
]
