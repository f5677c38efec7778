"""What the SDK returns: typed, read-only views decoded straight from reply frames.

Every type here is **generated from its protocol view** (:mod:`rallypoint.protocol`, the
``*View`` Structs): the same fields, in the same order, with the same defaults, so a field
added to a view reaches SDK users with no edit here. Generation changes only how values
look in Python:

- an instant (a field typed :data:`rallypoint.protocol.Instant`, an ISO 8601 string on
  the wire) is an aware ``datetime`` (UTC);
- a payload (``msgspec.Raw``: input, outcome, error, result, ...) is the Python value the
  sender encoded;
- a nested view is its own generated type (``DeliveryInfo.grants`` holds ``GrantInfo``).

A class below adds only what the view cannot say: its public name, its docstring, the
properties the SDK offers on top (``TaskInfo.finished``, ``RunStatus.state``, ...), and --
declared in its body -- the SDK type of a field whose wire type does not say it (a view
field is never dropped: ``tests/test_view_drift.py`` checks it). Each type supports
attribute access, ``info["field"]`` and ``info.to_dict()``.

:func:`sdk_type` returns the type for any view (generating a private one on first use).
"""

from __future__ import annotations

import types as _pytypes
from datetime import datetime
from typing import Annotated, Any, Union, get_args, get_origin

import msgspec

from .. import protocol as p

__all__ = [
    "RunStatus",
    "MailboxInfo",
    "TaskInfo",
    "TaskOutcome",
    "DeliveryInfo",
    "GroupStatus",
    "GroupMember",
    "GroupDecision",
    "VerdictResult",
    "ServerInfo",
    "Event",
    "EventPage",
    "Overview",
    "MessageInfo",
    "QuotaInfo",
    "QuotaTakeInfo",
    "BudgetInfo",
    "ReservationInfo",
    "SettleResult",
    "ClaimInfo",
    "PoolInfo",
    "GrantInfo",
    "WorkLimitInfo",
    "ScheduleInfo",
    "ScheduleActionInfo",
    "sdk_type",
    "SDK_TYPES",
]

#: protocol view -> its SDK type (every view of :mod:`rallypoint.protocol`, once this
#: module is imported)
SDK_TYPES: dict[type, type] = {}

#: the terminal states of a task (and of a message)
_TASK_FINISHED = frozenset(("SUCCEEDED", "ACKED", "FAILED", "CANCELLED", "EXPIRED"))


def _sdk_field_type(tp: Any, where: str) -> Any:
    """The SDK's type for a view field's wire type ``tp`` (see the module docstring).
    TypeError for a Struct that is not a view: its SDK type must be declared in the
    class body (``MailboxInfo.requirements``)."""
    if tp is msgspec.Raw:
        return Any
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        if any(isinstance(m, p.InstantMark) for m in meta):
            return datetime
        return _sdk_field_type(base, where)
    if isinstance(tp, type) and issubclass(tp, p._View):
        return sdk_type(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        raise TypeError(f"{where}: {tp.__name__} is not a reply view; declare the field's SDK type in the "
                        "SDK class body (as MailboxInfo declares requirements)")
    args = get_args(tp)
    if origin in (Union, _pytypes.UnionType):
        return Union[tuple(_sdk_field_type(a, where) for a in args)]
    if origin is not None and args:
        return origin[tuple(_sdk_field_type(a, where) for a in args)]
    return tp


class _FromView(type(msgspec.Struct)):
    """The metaclass of the SDK types: ``class X(_Info, view=p.SomeView)`` gets every field
    of ``SomeView`` (see the module docstring). An annotation in the class body replaces
    the generated type of that field (TypeError for a name the view does not have); the
    view's ``array_like`` and ``gc`` carry over (they shape the wire)."""

    def __new__(mcls, name, bases, ns, view: type | None = None, **kw):
        if view is None:
            return super().__new__(mcls, name, bases, ns, **kw)
        if not (isinstance(view, type) and issubclass(view, p._View)):
            raise TypeError(f"{name}: view= must be a reply view of rallypoint.protocol, got {view!r}")
        if view in SDK_TYPES:
            raise TypeError(f"{name}: {view.__name__} already has the SDK type {SDK_TYPES[view].__name__} "
                            "(declare a type before the types that nest it)")
        own = dict(ns.get("__annotations__", {}))
        fields = msgspec.structs.fields(view)
        unknown = set(own) - {f.name for f in fields}
        if unknown:
            raise TypeError(f"{name}: {sorted(unknown)} are not fields of {view.__name__}")
        ns = dict(ns)
        ann: dict[str, Any] = {}
        for f in fields:
            ann[f.name] = own[f.name] if f.name in own else _sdk_field_type(f.type, f"{view.__name__}.{f.name}")
            if f.name in ns:
                continue  # the class body gives its own default
            if f.default is not msgspec.NODEFAULT:
                ns[f.name] = f.default
            elif f.default_factory is not msgspec.NODEFAULT:
                ns[f.name] = msgspec.field(default_factory=f.default_factory)
        ns["__annotations__"] = ann
        ns["__view__"] = view
        cfg = view.__struct_config__
        kw.setdefault("array_like", cfg.array_like)
        kw.setdefault("gc", cfg.gc)
        cls = super().__new__(mcls, name, bases, ns, **kw)
        SDK_TYPES[view] = cls
        return cls


class _Info(msgspec.Struct, frozen=True, metaclass=_FromView):
    """The base of the SDK types: read-only, ``info["field"]``, ``info.to_dict()``."""

    #: the protocol view this type is generated from (a class attribute, set per type)
    __view__ = None

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, nested SDK types as dicts too (lists and dicts of them
        included); other values (datetimes, ...) as they are."""
        return _plain(self)


def _plain(v: Any) -> Any:
    if isinstance(v, msgspec.Struct):
        return {k: _plain(x) for k, x in msgspec.structs.asdict(v).items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def sdk_type(view: type, name: str | None = None) -> type:
    """The SDK type of the protocol view ``view``: the one declared below, else a private
    type generated now (named ``name`` or after the view) and kept in :data:`SDK_TYPES`."""
    t = SDK_TYPES.get(view)
    if t is None:
        name = name or "_" + view.__name__.removesuffix("View") + "Info"
        t = _FromView(name, (_Info,), {"__module__": __name__, "__qualname__": name}, view=view)
    return t


# ============================================================================ system


class ServerInfo(_Info, view=p.ServerStatusView):
    """``rs.status()``: the server's version, uptime, durability, counts; ``actors``
    per kind (``active``, ``passive``, ``inbox`` depth, parked ``waiters``),
    ``tree_depth``, where fdatasync runs (``sync_helper``) and how often (``fsyncs``,
    ``fsync_seconds``)."""


# ============================================================================ runs


class RunStatus(_Info, view=p.ScopeView):
    """A run: ``stored_state`` (ACTIVE/CANCELLED/COMPLETED, its own) and ``effective``
    (ACTIVE/INACTIVE, including ancestors and deadlines; ``inactive_reason`` says why:
    ``cancelled``, ``completed``, ``deadline``, or ``ancestor_<reason>``). ``task_id``: a
    task's own run (``delivery.run()``): that task; the run ends with it."""

    @property
    def state(self) -> str:
        """One word, as every status has one: CANCELLED or COMPLETED once the run itself
        ended (``stored_state``); otherwise ACTIVE while it accepts work and INACTIVE when
        it refuses it -- past its deadline or under an ended ancestor (``effective``;
        ``inactive_reason`` says which)."""
        stored = self.stored_state
        return self.effective if stored == "ACTIVE" else stored


_RunList = sdk_type(p.ScopeListView, "_RunList")


# ============================================================================ mailboxes


class MailboxInfo(_Info, view=p.MailboxView):
    """A mailbox. ``requirements``: its default requirements by name, as given to
    ``mailboxes.ensure`` (``{"pools": {"gpu": 1}, "budgets": {"spend": 40}}``, empty
    kinds left out), None when it has none."""

    requirements: dict[str, dict[str, int]] | None = None


_MailboxList = sdk_type(p.MailboxListView, "_MailboxList")


# ============================================================================ tasks


class TaskInfo(_Info, view=p.TaskView):
    """A task's state; ``outcome`` is the completing worker's value, ``error`` the last
    retry/reject error payload; ``key`` its idempotency key; ``run_id`` the task's own
    run (made by its worker with ``delivery.run()``), or None; ``completing``: its
    worker completed it and its run's join sets are closing (the task is SUCCEEDED, with
    that outcome, once the last awaited child finished); ``subscribers``: the ids
    subscribed to it (``task.subscribe``, HTTP ``subscriberId``); ``holder``: who
    received its latest delivery (None: never delivered)."""

    @property
    def finished(self) -> bool:
        return self.state in _TASK_FINISHED


class TaskOutcome(_Info, view=p.TaskOutcomeView):
    """What ``rs.results(..., details=False)`` returns per task: its id, state, attempt,
    ``outcome`` (the completing worker's value; None unless SUCCEEDED), outcome reason
    and last retry/reject ``error`` -- without the input echoed back or the instants."""

    @property
    def finished(self) -> bool:
        return self.state in _TASK_FINISHED


#: ``task.submit_many`` / ``task.results`` answers: ``tasks``, or (brief) ``ids`` or ``outcomes``
_TaskList = sdk_type(p.TaskListView, "_TaskList")
_TaskIds = _TaskOutcomes = _TaskList


class GrantInfo(_Info, view=p.GrantView):
    """A pool grant: ``units`` of pool ``pool``, ACTIVE, RELEASED or EXPIRED.
    ``lease_expires_at`` is None for a grant held by a task's delivery (``task_id``);
    ``token`` is only in the replies that hand the grant out (else 0)."""


class DeliveryInfo(_Info, view=p.DeliveryView):
    """A delivery (what a receive hands out): the task's id, input, attempt, lease
    ``token`` and ``lease_expires_at``; ``key`` the task's idempotency key (None without
    one); ``run_id`` its own run, if an earlier attempt made it; ``grants`` and
    ``reservations`` taken for the task's requirements; ``holder`` who received it (the
    receive's ``holder``, else the connection's ``client_name@host:port``)."""


_ReceiveReply = sdk_type(p.ReceiveView, "_ReceiveReply")
_LeaseReply = sdk_type(p.LeaseView, "_LeaseReply")
_ItemError = sdk_type(p.ItemError, "_ItemError")
_Settled = sdk_type(p.SettledView, "_Settled")
_SettledList = sdk_type(p.SettledListView, "_SettledList")
_CompleteNext = sdk_type(p.CompleteNextView, "_CompleteNext")


class MessageInfo(_Info, view=p.MessageView):
    """A message of an INBOX mailbox: ``state`` QUEUED, RUNNING (leased), ACKED
    (completed), FAILED, CANCELLED or EXPIRED; ``result`` is what its receiver completed
    it with."""

    @property
    def finished(self) -> bool:
        return self.state in ("ACKED", "FAILED", "CANCELLED", "EXPIRED")


# ============================================================================ groups


class GroupMember(_Info, view=p.GroupMemberView):
    """A member of a group: its task, the task's state, the verdict given (None yet),
    ``late`` (given after the group was decided) and the task's key."""


class GroupStatus(_Info, view=p.GroupView):
    """A task group: ``scope_id`` is its gate run (workers receive from it)."""


class GroupDecision(_Info, view=p.GroupDecisionView):
    """What closing a group answers: its state, outcome and outcome reason."""


class VerdictResult(_Info, view=p.VerdictView):
    """An accept or reject: the verdict, ``late``, and the group's state after it."""


_MemberAdded = sdk_type(p.GroupMemberAddedView, "_MemberAdded")


# ============================================================================ barriers, timers, join sets


class BarrierStatus(_Info, view=p.BarrierView):
    """A barrier: WAITING, RELEASED or CANCELLED; ``arrivals`` of ``target`` in ``epoch``."""


class TimerStatus(_Info, view=p.TimerView):
    """A timer: ARMED, FIRED, ACKED or CANCELLED. ``token``: the fencing token of its
    fire (once FIRED); ``now``: the server's clock when the status was made."""


class JoinSetChild(_Info, view=p.JoinSetChildView):
    """A child of a join set: a task or a delay."""


class JoinSetStatus(_Info, view=p.JoinSetView):
    """A join set: OPEN, CLOSING or CLOSED; counts of children submitted, finished
    (completion records) and consumed; ``steps``: answers of join_next / join_next_try
    journaled so far."""


_ChildAdded = sdk_type(p.JoinSetChildAdded, "_ChildAdded")
_JoinNextReply = sdk_type(p.JoinNextView, "_JoinNextReply")


# ============================================================================ quotas


class QuotaTakeInfo(_Info, view=p.QuotaTakeView):
    """A quota take: ``state`` GRANTED (``consumption_id``: the units are taken, once),
    WAITING (a durable waiter, ``waiter_id``), EXPIRED or CANCELLED (``end_reason``).
    ``remaining``: units left in the current window now; ``window_start`` /
    ``window_end``: the window the grant counted in."""

    @property
    def granted(self) -> bool:
        return self.state == "GRANTED"


class QuotaInfo(_Info, view=p.QuotaView):
    """A quota now: ``used`` / ``remaining`` of ``units_limit`` in the current window
    [``window_start``, ``window_end``), ``waiting`` waiters, a running cooldown."""

    @property
    def window_seconds(self) -> float:
        return self.window_ms / 1000


_QuotaList = sdk_type(p.QuotaListView, "_QuotaList")


# ============================================================================ schedules


class ScheduleActionInfo(_Info, view=p.ScheduleActionView):
    """One action of a schedule, keyed by its ``scheduled_at``: when it ``fired_at``,
    why (``origin``: scheduled, catchup, buffered, trigger, backfill), its run and task,
    ``state`` RUNNING or ENDED with ``outcome`` (succeeded, failed, cancelled, timed_out)."""

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"


class ScheduleInfo(_Info, view=p.ScheduleView):
    """A schedule: its spec, action and policies (durations in ms on the view),
    ``paused`` and ``note``, ``next_fires`` (datetimes, jitter included), ``buffered``
    times, the ``recent`` actions (``ScheduleActionInfo``, newest first), ``actions``
    taken and ``skipped`` times."""


_ScheduleList = sdk_type(p.ScheduleListView, "_ScheduleList")


# ============================================================================ budgets


class ReservationInfo(_Info, view=p.ReservationView):
    """A budget reservation (amounts in integer minor units): ``state`` ACTIVE, STALE
    (past settle-by, still holding), SETTLED or VOIDED."""


class BudgetInfo(_Info, view=p.BudgetView):
    """A budget (amounts in integer minor units at ``scale``):
    ``available_minor`` = ``limit_minor`` - ``settled_minor`` - ``reserved_minor``."""


_BudgetList = sdk_type(p.BudgetListView, "_BudgetList")


class SettleResult(_Info, view=p.SettleView):
    """One settlement: ``charged_minor`` of ``requested_minor`` (capped at what was
    left), the budget's ``available_minor`` after it; ``replayed``: this usage key had
    been settled before and nothing changed."""


# ============================================================================ claims, pools, work limits


class ClaimWaiterInfo(_Info, view=p.ClaimWaiterView):
    """A waiter in a claim's FIFO queue."""


class ClaimInfo(_Info, view=p.ClaimView):
    """A claim: HELD, FREE or COMPLETED. ``generation`` counts its leases (the fencing
    number); ``observation`` is what the last release left, ``result`` what complete
    recorded; ``waiters`` the FIFO queue (first 100)."""


_ClaimLeaseReply = sdk_type(p.ClaimLeaseView, "_ClaimLeaseReply")
_ClaimList = sdk_type(p.ClaimListView, "_ClaimList")


class PoolWaiterInfo(_Info, view=p.PoolWaiterView):
    """A waiter in a pool's FIFO queue."""


class PoolInfo(_Info, view=p.PoolView):
    """A pool: ``units_used`` of ``units_total`` granted; ``waiters`` in FIFO order and
    active ``grants`` (first 100 of each)."""


_PoolList = sdk_type(p.PoolListView, "_PoolList")
_PoolAcquireReply = sdk_type(p.PoolAcquireView, "_PoolAcquireReply")
_CancelWaitReply = sdk_type(p.CancelWaitView, "_CancelWaitReply")


class WorkLimitInfo(_Info, view=p.WorkLimitView):
    """A work limit: at most ``max_outstanding`` unfinished tasks name it;
    ``outstanding`` now."""


_WorkLimitList = sdk_type(p.WorkLimitListView, "_WorkLimitList")


# ============================================================================ events, overview


class Event(_Info, view=p.EventView):
    """One event (see docs/events.md): ``seq`` is the space-wide sequence number -- the
    cursor to resume after it --, ``type`` e.g. ``task.completed``, ``kind``/``id`` the
    entity it is about (the *aggregate*), ``run`` the run it happened in, ``at`` the
    instant of the change, ``data`` a small payload, ``shard`` the shard that numbered
    it in a cluster of several (``seq`` is then that shard's; None on a single node)."""

    @property
    def cursor(self) -> int:
        return self.seq

    @property
    def aggregate(self) -> str:
        return f"{self.kind}:{self.id}"


class EventPage(_Info, view=p.EventPageView):
    """A page of ``events.list``: ``next_cursor`` continues after every event examined;
    ``oldest``/``newest``: the seqs the server keeps. Over several shards the three are
    vector strings, one position per shard (``"0:120,1:45"``;
    :mod:`rallypoint.client.shardevents`)."""

    #: the wire carries each event as an encoded EventView
    events: list[Event]
    next_cursor: int | str
    oldest: int | str
    newest: int | str


class WatchStart(_Info, view=p.WatchView):
    """Where a subscription starts: events with ``seq > cursor`` follow."""


class OverviewRun(_Info, view=p.OverviewRun):
    """A run in the overview."""


class OverviewQueue(_Info, view=p.OverviewQueue):
    """A work queue in the overview; ``done``: tasks finished since the server started;
    ``ready_by_priority``, ``ready_keys``, ``ready_top_keys``: its ready backlog (issue 44)."""


class OverviewGroup(_Info, view=p.OverviewGroup):
    """An open group in the overview."""


class Overview(_Info, view=p.OverviewView):
    """``rs.overview()``: what ``rallypoint top`` shows (read-only, for humans)."""


def _generate_the_rest() -> None:
    """Every other view of the protocol gets its (private) SDK type now, so
    :data:`SDK_TYPES` covers the whole protocol."""
    for v in vars(p).values():
        if isinstance(v, type) and issubclass(v, p._View) and v is not p._View:
            sdk_type(v)


_generate_the_rest()
