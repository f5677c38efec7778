"""How the HTTP API shows a protocol view as runstate's JSON: derived from the view.

A :class:`Shape` renders one reply view (:mod:`rallypoint.protocol`) as a JSON object.
**Every field of the view is shown** unless the shape hides it with a reason, under a
name and value that follow runstate's conventions:

- the name is the field's in camelCase (``lease_expires_at`` -> ``leaseExpiresAt``);
- a payload (``msgspec.Raw``) is its JSON value (:func:`val`); an instant is the view's
  ISO 8601 string as it is;
- money (an ``int`` field named ``*_minor``) is a string of decimal digits (``"250"``);
- an ``int`` ``token`` is a decimal string, null when it is 0 (not handed out);
- a nested view (alone, in a list, or optional) is shown by its default shape
  (:data:`DEFAULT`), or by the one ``items`` names.

What a shape declares is only runstate's difference from that: ``rename`` (another
name), ``also`` (the same value under more names: runstate reads ids under several),
``convert`` (the field's value mapped), ``compute`` (the value from the whole view),
``flatten`` (a nested view's keys merged in), ``hide`` (not shown, and why), ``add``
(keys that are no field of the view), ``drop_none``. A new field of a view therefore
reaches the HTTP JSON with no edit here; ``tests/test_view_drift.py`` checks that every
view has a shape (or is declared not served over HTTP, with a reason) and that every
field is shown or hidden with one.

The shapes below are the whole HTTP API's view of the protocol; ``endpoints.py`` calls
``SHAPE.json(view)``.
"""

from __future__ import annotations

import types as _pytypes
from typing import Annotated, Any, Callable, Iterable, Union, get_args, get_origin

import msgspec

from .. import protocol as p

__all__ = ["Shape", "DEFAULT", "SHAPES", "NOT_SERVED", "val", "camel"]

_mp_decode = msgspec.msgpack.decode

#: view -> the shape a nested field of that view type is shown with
DEFAULT: dict[type, "Shape"] = {}
#: every shape made (the drift test reads it)
SHAPES: list["Shape"] = []


def val(raw: msgspec.Raw | bytes | None) -> Any:
    """A stored payload as a JSON value (None for nil)."""
    if raw is None:
        return None
    b = bytes(raw)
    return None if b in (b"", b"\xc0") else _mp_decode(b)


def camel(name: str) -> str:
    """``lease_expires_at`` -> ``leaseExpiresAt``."""
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def _money(v: int) -> str:
    return str(v)


def _token(v: int) -> str | None:
    return str(v) if v else None


def _strip(tp: Any) -> Any:
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _is_view(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, p._View)


def _nested(tp: Any, shape: "Shape | None", where: str) -> Callable[[Any], Any] | None:
    """The converter for a field holding views (alone, a list, or optional), or None
    when ``tp`` holds none. ``shape``: the one to use (None: the view's default, looked
    up when first used, so shapes may be declared in any order)."""
    tp = _strip(tp)
    origin, args = get_origin(tp), get_args(tp)
    if _is_view(tp):
        shape = shape or DEFAULT.get(tp)
        if shape is not None:
            return shape.json
        return lambda x, _t=tp: DEFAULT[_t].json(x)
    if origin is list and args and _is_view(_strip(args[0])):
        one = _nested(args[0], shape, where)
        return lambda xs: [one(x) for x in xs]
    if origin in (Union, _pytypes.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            one = _nested(inner[0], shape, where)
            if one is not None:
                return lambda x: None if x is None else one(x)
    return None


def _default_convert(name: str, tp: Any, shape: "Shape | None", where: str) -> Callable[[Any], Any] | None:
    """runstate's conventions for a field (see the module docstring); None: as it is."""
    nested = _nested(tp, shape, where)
    if nested is not None:
        return nested
    base = _strip(tp)
    if base is msgspec.Raw:
        return val
    if get_origin(base) is list and get_args(base) and get_args(base)[0] is msgspec.Raw:
        return lambda xs: [val(x) for x in xs]
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        raise TypeError(f"{where}: {base.__name__} has no JSON form; give the field a convert=")
    if base is int and name.endswith("_minor"):
        return _money
    if base is int and name == "token":
        return _token
    return None


class Shape:
    """runstate's JSON for the reply view ``view`` (see the module docstring).

    Arguments (each keyed by field name unless said otherwise; TypeError at
    construction for a name that is not a field, a hidden field without a reason, or
    two keys of the same name):

    - ``rename``: the JSON name instead of the camelCase one;
    - ``also``: more JSON names that carry the same value;
    - ``convert``: ``f(value) -> json`` instead of the convention;
    - ``compute``: ``f(view) -> json`` (the value needs other fields);
    - ``items``: the shape of a nested view field (instead of its default);
    - ``flatten``: field -> shape: that nested view's keys merged into this object;
    - ``hide``: field -> why it is not shown;
    - ``add``: JSON name -> ``f(view) -> json``: keys that are no field;
    - ``drop_none``: leave out keys whose value is None, except ``keep_none``;
    - ``default``: this is the shape nested fields of ``view`` are shown with.
    """

    def __init__(self, view: type, *, rename: dict[str, str] | None = None,
                 also: dict[str, Iterable[str]] | None = None,
                 convert: dict[str, Callable[[Any], Any]] | None = None,
                 compute: dict[str, Callable[[Any], Any]] | None = None,
                 items: dict[str, "Shape"] | None = None,
                 flatten: dict[str, "Shape"] | None = None,
                 hide: dict[str, str] | None = None,
                 add: dict[str, Callable[[Any], Any]] | None = None,
                 drop_none: bool = False, keep_none: Iterable[str] = (), default: bool = False) -> None:
        if not _is_view(view):
            raise TypeError(f"Shape: {view!r} is not a reply view of rallypoint.protocol")
        self.view = view
        rename, also, convert, compute = rename or {}, also or {}, convert or {}, compute or {}
        items, flatten, hide, add = items or {}, flatten or {}, hide or {}, add or {}
        fields = msgspec.structs.fields(view)
        names = {f.name for f in fields}
        for what, d in (("rename", rename), ("also", also), ("convert", convert), ("compute", compute),
                        ("items", items), ("flatten", flatten), ("hide", hide)):
            unknown = set(d) - names
            if unknown:
                raise TypeError(f"Shape({view.__name__}): {what} names {sorted(unknown)}, not fields of the view")
        for f, why in hide.items():
            if not (isinstance(why, str) and why.strip()):
                raise TypeError(f"Shape({view.__name__}): hiding {f!r} needs a reason")
        #: field -> the JSON names it is shown under ([] for a flattened field)
        self.shown: dict[str, list[str]] = {}
        #: field -> why it is not shown
        self.hidden: dict[str, str] = dict(hide)
        #: the JSON keys, in order (before ``drop_none``)
        self.keys: list[str] = []
        steps: list[tuple] = []
        for f in fields:
            name = f.name
            if name in hide:
                continue
            where = f"{view.__name__}.{name}"
            if name in flatten:
                sub = flatten[name]
                steps.append((None, name, sub.json))
                self.shown[name] = []
                self.keys += sub.keys
                continue
            out = [rename.get(name, camel(name)), *also.get(name, ())]
            self.shown[name] = out
            self.keys += out
            if name in compute:
                steps.append((tuple(out), None, compute[name]))
            else:
                conv = convert.get(name) or _default_convert(name, f.type, items.get(name), where)
                steps.append((tuple(out), name, conv))
        self.added = list(add)
        self.keys += self.added
        dup = {k for k in self.keys if self.keys.count(k) > 1}
        if dup:
            raise TypeError(f"Shape({view.__name__}): the JSON key(s) {sorted(dup)} appear twice")
        self._steps = steps
        self._add = list(add.items())
        self._drop_none = drop_none
        self._keep_none = frozenset(keep_none)
        if default:
            if view in DEFAULT:
                raise TypeError(f"Shape({view.__name__}): a second default shape")
            DEFAULT[view] = self
        SHAPES.append(self)

    def json(self, v: Any) -> dict[str, Any]:
        """The view ``v`` as a JSON-able dict."""
        return self._render(v)

    def _render(self, v: Any) -> dict[str, Any]:
        # compiled on first use (every shape exists by then): one dict display, as a
        # hand-written mapping would be -- the HTTP answers' hot path
        self._render = self._compile()
        return self._render(v)

    def _compile(self) -> Callable[[Any], dict[str, Any]]:
        """``render(v)``: the shape's steps as one function returning one dict display
        (``{"id": v.id, "taskId": x0, ..., **f3(v.reservation), ...}``)."""
        env: dict[str, Any] = {}
        parts, pre = [], []
        for i, (names, attr, fn) in enumerate(self._steps):
            f = f"f{i}"
            env[f] = fn
            if names is None:  # flatten
                parts.append(f"**{f}(v.{attr})")
                continue
            expr = f"{f}(v)" if attr is None else (f"v.{attr}" if fn is None else f"{f}(v.{attr})")
            if len(names) > 1:
                pre.append(f"    x{i} = {expr}")
                expr = f"x{i}"
            parts += [f"{n!r}: {expr}" for n in names]
        for j, (n, fn) in enumerate(self._add):
            env[f"a{j}"] = fn
            parts.append(f"{n!r}: a{j}(v)")
        body = "{" + ", ".join(parts) + "}"
        if self._drop_none:
            env["keep"] = self._keep_none
            body = f"{{k: x for k, x in {body}.items() if x is not None or k in keep}}"
        src = "def render(v):\n" + "\n".join(pre + [f"    return {body}"]) + "\n"
        exec(compile(src, f"<shape {self.view.__name__}>", "exec"), env)
        return env["render"]

    def __repr__(self) -> str:
        return f"Shape({self.view.__name__})"


# ============================================================================ runs


SCOPE = Shape(p.ScopeView, also={"id": ["scopeId"]}, default=True)


# ============================================================================ mailboxes, tasks, messages


def requirements_json(r: p.Requirements | None) -> dict | None:
    """:class:`protocol.Requirements` (by name) in runstate's JSON form, ``{pools: [{name,
    units}], budgets: [{name, reserveMinor}]}`` (reserveMinor: minor units as a decimal
    string; both lists always present); None for None."""
    if r is None:
        return None
    return {"pools": [{"name": n, "units": u} for n, u in r.pools.items()],
            "budgets": [{"name": n, "reserveMinor": str(m)} for n, m in r.budgets.items()]}


#: ``requirements``: its stored default requirements in runstate's form (null: none)
MAILBOX = Shape(p.MailboxView, also={"id": ["mailboxId"]}, convert={"requirements": requirements_json},
                default=True)
MAILBOX_LIST = Shape(p.MailboxListView, default=True)


def task_reason(v: p.TaskView) -> str | None:
    """A failed task's reason as runstate reads it: ``handler_error: <error>`` when the
    worker gave an error (retry / nack), else the server's reason."""
    if v.state == "FAILED":
        err = val(v.error)
        if err is not None:
            return "handler_error: " + (err if isinstance(err, str) else msgspec.json.encode(err).decode())
    return v.outcome_reason


TASK = Shape(
    p.TaskView,
    also={"id": ["taskId", "messageId"]},
    rename={"mailbox": "mailboxId", "key": "taskKey"},
    compute={"outcome_reason": task_reason},
    hide={"completing": "runstate has no completing step: such a task is RUNNING, as its state says"},
    default=True,
)

#: A task as a mailbox message (0.2's message view): a completed one is ACKED.
TASK_AS_MESSAGE = Shape(
    p.TaskView,
    also={"id": ["messageId", "taskId"]},
    rename={"mailbox": "mailboxId", "key": "workKey", "input": "payload", "outcome": "result"},
    convert={"state": lambda s: "ACKED" if s == "SUCCEEDED" else s},
    compute={"outcome_reason": task_reason},
    hide=dict.fromkeys(("group_id", "run_id", "completing", "subscribers"),
                       "0.2's message view has only the message's own fields"),
)

MESSAGE = Shape(p.MessageView, also={"id": ["messageId"]}, rename={"mailbox": "mailboxId", "key": "workKey"},
                default=True)

#: ``GET /mailboxes/{id}/messages``: the queue's tasks as messages
MESSAGE_LIST = Shape(
    p.TaskListView, rename={"tasks": "messages"}, items={"tasks": TASK_AS_MESSAGE},
    hide=dict.fromkeys(("ids", "outcomes"), "only the brief forms of submit_many / results fill it"),
)


def message_json(v: p.MessageView | p.TaskView) -> dict:
    """A message, or a task shown as one (:data:`TASK_AS_MESSAGE`)."""
    return (MESSAGE if isinstance(v, p.MessageView) else TASK_AS_MESSAGE).json(v)


#: A pool grant (``grantId``: runstate's name; ``id`` too).
GRANT = Shape(
    p.GrantView,
    rename={"id": "grantId", "pool_id": "permitId", "pool": "permit"}, also={"id": ["id"]},
    hide=dict.fromkeys(("created_at", "ended_at", "end_reason"), "runstate's grant is its lease: no history"),
    default=True,
)

#: ``POST /tasks/admit``: a delivery as runstate's worker reads it.
DELIVERY = Shape(
    p.DeliveryView,
    rename={"task_id": "messageId", "key": "taskKey", "input": "payload", "mailbox": "mailboxId"},
    also={"task_id": ["taskId"]},
    hide={"id": "runstate names a delivery by its task (messageId, taskId) and token",
          "run_id": "a worker asks for its task's own run (delivery.run) over TCP only"},
    add={"consumptions": lambda v: []},  # quota units taken at admission: never (this server)
    default=True,
)

#: ``POST /messages/{id}/renew``
LEASE = Shape(p.LeaseView, rename={"task_id": "messageId"}, default=True)


def recv_json(d: p.DeliveryView) -> dict:
    """``POST /mailboxes/{id}/recv`` (0.2's envelope): the delivered message (its id,
    payload, attempt, run, key) with the lease's ``token`` and expiry beside it; the
    values are :data:`DELIVERY`'s."""
    j = DELIVERY.json(d)
    return {"message": {"id": j["taskId"], "payload": j["payload"], "attempt": j["attempt"],
                        "scopeId": j["scopeId"], "taskKey": j["taskKey"]},
            "token": j["token"], "leaseExpiresAt": j["leaseExpiresAt"]}


# ============================================================================ groups


GROUP_MEMBER = Shape(p.GroupMemberView, rename={"task_state": "state", "key": "taskKey"}, default=True)
GROUP = Shape(p.GroupView, also={"id": ["groupId"]}, rename={"mailbox": "mailboxId"}, default=True)
GROUP_DECISION = Shape(p.GroupDecisionView, default=True)
VERDICT = Shape(p.VerdictView, default=True)
#: a member task added: the task's keys and ``groupState``
MEMBER_ADDED = Shape(p.GroupMemberAddedView, flatten={"task": TASK}, default=True)


# ============================================================================ allowances (quotas)


QUOTA_TAKE = Shape(
    p.QuotaTakeView, rename={"quota_id": "allowanceId"},
    hide={"quota": "runstate names the allowance by its id (allowanceId)"}, default=True,
)
QUOTA = Shape(
    p.QuotaView, rename={"window_ms": "windowSeconds"}, convert={"window_ms": lambda ms: ms // 1000},
    hide={"waiters": "runstate lists no allowance waiters (GET /allowance-waiters/{id} shows one)"},
    default=True,
)
QUOTA_LIST = Shape(p.QuotaListView, rename={"quotas": "allowances"}, default=True)


# ============================================================================ schedules (rallypoint's own)


SCHEDULE_ACTION = Shape(p.ScheduleActionView, default=True)
SCHEDULE = Shape(p.ScheduleView, default=True)
SCHEDULE_LIST = Shape(p.ScheduleListView, default=True)


# ============================================================================ budgets


RESERVATION = Shape(
    p.ReservationView, also={"id": ["reservationId"]}, rename={"remaining_minor": "reservedMinor"},
    hide={"budget": "runstate names the budget by its id (budgetId)",
          "key": "runstate's reservations have no key of their own (the settle's workKey is)",
          "task_id": "a reservation held for a delivery is the native client's (delivery=)"},
    default=True,
)
BUDGET = Shape(p.BudgetView, default=True)
BUDGET_LIST = Shape(p.BudgetListView, default=True)
#: a settlement: the reservation's keys, what was charged, and ``workKey``
SETTLE = Shape(p.SettleView, flatten={"reservation": RESERVATION}, rename={"usage_key": "workKey"}, default=True)


# ============================================================================ barriers, timers, once


BARRIER = Shape(p.BarrierView, also={"id": ["barrierId"]}, default=True)
#: ``now`` is the server's clock, so ``fireAt - now`` is the time left
TIMER = Shape(p.TimerView, also={"id": ["timerId"]}, default=True)
TIMER_LIST = Shape(p.TimerListView, default=True)
#: only what is set (``result`` always: null until DONE); ``token`` only to the acquirer
ONCE = Shape(p.OnceView, convert={"id": lambda i: i or None}, drop_none=True, keep_none=("result",),
             default=True)


# ============================================================================ claims, permits, work limits


_CLAIM_HIDDEN = "runstate's claim answer is its lease: no history or queue"
#: a claim, as its lease answers show it (``claimId``)
CLAIM = Shape(
    p.ClaimView, rename={"id": "claimId"},
    hide=dict.fromkeys(("acquired_at", "completed_at", "created_at", "waiters"), _CLAIM_HIDDEN), default=True,
)
#: ``POST /claims``, ``/claims/{key}/renew``: the claim's keys with ``status`` and ``token``
CLAIM_LEASE = Shape(
    p.ClaimLeaseView, flatten={"claim": CLAIM},
    hide={"request_id": "runstate's acquire does not wait on the server (it retries CLAIM_HELD)",
          "position": "runstate's acquire does not wait on the server (it retries CLAIM_HELD)"},
    default=True,
)
#: ``POST /claims/{key}/release``: 0.3 reads nothing of it; the claim's key, state and generation
CLAIM_RELEASED = Shape(
    p.ClaimView,
    hide=dict.fromkeys(("id", "scope_id", "holder", "lease_expires_at", "acquired_at", "observation", "result",
                        "completed_at", "created_at", "waiters"), "the release answer carries key, state, "
                                                                  "generation only"),
)

POOL = Shape(
    p.PoolView, rename={"units_total": "units"}, also={"units_total": ["unitsTotal"]},
    hide=dict.fromkeys(("waiters", "grants"), "runstate lists no permit waiters or grants"), default=True,
)
POOL_LIST = Shape(p.PoolListView, rename={"pools": "permits"}, default=True)
#: ``POST /permit-waiters/{id}/cancel`` (with ``waiterId`` from the path)
CANCEL_WAIT = Shape(p.CancelWaitView, add={"state": lambda v: "CANCELLED"}, default=True)

WORK_LIMIT = Shape(p.WorkLimitView, default=True)
WORK_LIMIT_LIST = Shape(p.WorkLimitListView, default=True)


# ============================================================================ diagnostics


OPS_WORKER = Shape(p.OpsWorkerView, default=True)
OPS_WAIT = Shape(p.OpsWaitView, default=True)
OPS_WAITS = Shape(p.OpsWaitsView, default=True)
_SPLIT = "GET /ops/runs/{id} splits the waits by kind: waiting (permits), allowanceWaiting (allowances)"
PERMIT_WAIT = Shape(p.OpsWaitView, rename={"name": "permit"}, hide={"kind": _SPLIT})
ALLOWANCE_WAIT = Shape(p.OpsWaitView, rename={"name": "allowance"}, hide={"kind": _SPLIT})
OPS_RUN = Shape(
    p.OpsRunView,
    compute={"waiting": lambda v: [PERMIT_WAIT.json(w) for w in v.waiting if w.kind == "permit"]},
    add={"allowanceWaiting": lambda v: [ALLOWANCE_WAIT.json(w) for w in v.waiting if w.kind == "quota"]},
    default=True,
)


# ============================================================================ events


#: An event as runstate reads it: ``eventId`` (the de-duplication key: the space-wide
#: sequence number, as a string), ``type``, ``createdAt``, ``payload``; plus its aggregate
#: (``aggregateType``, ``aggregateId``), ``scopeId`` (the run it happened in) and ``seq``.
EVENT = Shape(
    p.EventView,
    rename={"at": "createdAt", "kind": "aggregateType", "id": "aggregateId", "run": "scopeId", "data": "payload"},
    convert={"data": lambda d: d or {}},
    # a sharded cluster's events are numbered per shard: the id names the shard too
    add={"eventId": lambda v: str(v.seq) if v.shard is None else f"{v.shard}:{v.seq}"},
    hide={"shard": "runstate's events have no shard: a sharded cluster's node merges every shard's events "
                   "(eventId and the cursors name the shard; docs/http.md)"},
    default=True,
)
_event_decode = msgspec.msgpack.Decoder(p.EventView).decode
#: a page of events (each encoded on the wire); ``nextCursor`` a string
EVENT_PAGE = Shape(
    p.EventPageView,
    convert={"events": lambda raws: [EVENT.json(_event_decode(bytes(r))) for r in raws], "next_cursor": str},
    default=True,
)


#: Views the HTTP API does not show, and why (every other view has a shape above).
NOT_SERVED: dict[type, str] = {
    p.ServerStatusView: "server status is the operator's (TCP, rallypoint status, /metrics)",
    p.OperatorActedView: "the console's audit of its own actions (a node-local op, LOCAL permission)",
    p.ClusterView: "part of the server status (rallypoint status, rallypoint cluster status)",
    p.ClusterMapView: "the native SDK's router reads the slot map (HTTP routes inside the node)",
    p.ShardView: "the native SDK's router reads the slot map (HTTP routes inside the node)",
    p.SlotsReleasedView: "rallypoint cluster add-shard's (an operator step over TCP)",
    p.RunLinkView: "between the shards of a cluster (their own TCP calls)",
    p.OutboxDeliverView: "between the shards of a cluster (their own TCP calls)",
    p.AdmissionReserveView: "between the shards of a cluster (their own TCP calls)",
    p.StandbyView: "part of the server status (rallypoint status, rallypoint cluster status)",
    p.ScopeListView: "runstate lists no runs",
    p.TaskOutcomeView: "the brief task.results form is the native client's",
    p.ReceiveView: "recv / admit answer its one delivery (DELIVERY, recv_json) or 204",
    p.ItemError: "batch settles (delivery.complete_many) are the native client's",
    p.SettledView: "batch settles (delivery.complete_many) are the native client's",
    p.SettledListView: "batch settles (delivery.complete_many) are the native client's",
    p.CompleteNextView: "complete-and-next (delivery.complete_next) is the native client's: runstate's HTTP "
                        "complete and receive stay two calls",
    p.JoinSetChildView: "join sets are the native client's",
    p.JoinSetView: "join sets are the native client's",
    p.JoinSetChildAdded: "join sets are the native client's",
    p.JoinNextView: "join sets are the native client's",
    p.KeyView: "API keys are managed with the CLI (rallypoint keys)",
    p.KeyListView: "API keys are managed with the CLI (rallypoint keys)",
    p.WatchView: "GET /watch is a long poll of event pages (EVENT_PAGE), not a subscription",
    p.OverviewRun: "the overview is rallypoint top's (TCP)",
    p.OverviewQueue: "the overview is rallypoint top's (TCP)",
    p.OverviewGroup: "the overview is rallypoint top's (TCP)",
    p.OverviewView: "the overview is rallypoint top's (TCP)",
    p.ClaimWaiterView: "runstate's claims do not queue on the server (CLAIM hides waiters)",
    p.ClaimListView: "runstate lists no claims",
    p.PoolWaiterView: "runstate lists no permit waiters (POOL hides them)",
    p.PoolAcquireView: "permit acquire answers its grant (GRANT); a waiter answers its own state",
    p.IdempotencyView: "the HTTP layer's own store of answers, never an answer itself",
    p.OpsItemsView: "the web console's lists (rallypoint serve --console), not runstate's /ops",
    p.OpsGroupRow: "the web console's lists (rallypoint serve --console), not runstate's /ops",
    p.OpsTaskRow: "the web console's lists (rallypoint serve --console), not runstate's /ops",
    p.OpsQueueView: "the web console's lists (rallypoint serve --console), not runstate's /ops",
    p.OpsTaskView: "the web console's task page (rallypoint serve --console), not runstate's /ops",
    p.OpsJoinSetView: "the web console's join set page (rallypoint serve --console); join sets are the native client's",
    p.OpsJoinRecordView: "the web console's join set page (rallypoint serve --console); join sets are the native client's",
    p.OpsJoinStepView: "the web console's join set page (rallypoint serve --console); join sets are the native client's",
}
