"""The ``@op`` mark: each operation declared once, beside the handler that decides it.

Like ``@applies`` (records) and ``@emits`` (events), a kind marks each of its ``op_*``
handlers with everything the rest of the system needs to know about that operation::

    @op(QuotaTake, route=by("quota"), permission=W, resend=keyed("key"), waits=asked("wait_ms"))
    def op_quota_take(self, actor, session, op: QuotaTake): ...

- **request**: the op Struct of :mod:`rallypoint.protocol` (its tag is the op's name);
- **reply**: the reply Struct; by default the handler's return annotation;
- **route**: which actor the command runs on (:class:`Route`: :data:`SPACE`,
  :func:`by_run`, :func:`run_or_space`, :func:`by`, :func:`by_op`);
- **permission**: :data:`R`, :data:`W`, :data:`C`, :data:`A`, :data:`ANY_KEY` (SPEC
  §10), :data:`LOCAL` (no client's: the node's own in-process step) or :data:`NODE`
  (no client's: another node's call between shards);
- **resend**: whether a client may send it again after its connection dropped with it
  in flight (:class:`Resend`: :data:`ALWAYS`, :data:`NEVER`, :func:`keyed`,
  :func:`resend_if`, :func:`fenced` with its reconcile rule); read by
  :func:`rallypoint.client.reconnect.reissue_safe`, which reconciles a fenced op's
  refused second sending by its rule (:data:`RECONCILE_RULES`);
- **shard**: which shard of a sharded cluster it belongs to (:class:`Shard`; derived
  from the route when not given: the slot of the id it routes by, the home shard for
  the space's actor);
- **merge**: for an op every shard answers its part of (``shard=ALL``, or a field that
  may be None with ``if_none="all"``), the name of how the router merges the parts
  into one answer (:data:`rallypoint.client.router.MERGES` holds one merge per name:
  a merge must be declared before such an op can be; tests/test_op_facts.py checks
  every name has one);
- **waits**: whether the request is a server-side wait the client asked for (:class:`Waits`:
  :func:`asked`, :func:`waits_if`; default: never). Such a request is never logged as a
  slow request (:class:`rallypoint.metrics.Metrics`).

:func:`build_table` collects the marks of a set of kind classes into an :class:`OpTable`
(the routing and permission facts, the reply types, the ``Op`` decode union, the re-send
and wait decisions) and raises RuntimeError, naming the op and what to do, when an op
of the protocol has no handler or two, or a mark lacks a route, permission or re-send
rule, or names a field its request does not have. The coordinator builds its table this
way at construction and binds it to its kinds (:meth:`OpTable.bind`); the process-wide
table the client and the HTTP layer read, without a coordinator, is
:data:`rallypoint.actors.api.TABLE` (the same object: built once per set of classes).
"""

from __future__ import annotations

import functools
import typing
from operator import attrgetter
from typing import Any, Callable, NamedTuple, Union

import msgspec

__all__ = [
    "op", "Route", "SPACE", "by_run", "run_or_space", "by", "by_op", "Resend", "ALWAYS", "NEVER", "keyed", "fenced",
    "RECONCILE_RULES",
    "resend_if", "Waits", "asked", "waits_if", "Shard", "HOME", "NEW_ROOT", "ALL", "HERE", "PEER", "in_slot", "in_slots",
    "named",
    "shard_of_route", "OpDecl", "OpTable", "BoundOp", "build_table", "PERMISSIONS",
    "ANY_KEY", "LOCAL", "NODE", "R", "W", "C", "A",
]

#: The permissions a key may hold (SPEC §10): ``resource_config`` (create and configure
#: work queues, groups, barriers...), ``coordination_write`` (submit, receive, settle,
#: cancel, verdicts...), ``coordination_read`` (status, wait, list), ``admin`` (keys of
#: its own space), ``operator`` (keys of every space; granted offline only).
PERMISSIONS = ("resource_config", "coordination_write", "coordination_read", "admin", "operator")

#: Not a permission: any live key may make the op, whatever it holds (no op is marked
#: so today: the HTTP layer's idempotency bookkeeping, which was, is :data:`LOCAL`).
ANY_KEY = "any_key"

#: Not a permission: no client may make the op, whatever its key holds (FORBIDDEN
#: over TCP, from the embedded client, from an open-mode session): only a step the node
#: takes itself in process, under a local session (``Session.local``; the HTTP layer's
#: ``idempotency.*`` bookkeeping: the answers it stores are the node's, never a client's
#: to forge).
LOCAL = "local"

#: Not a permission: only another node of the cluster may make the op (a node session,
#: authenticated by the cluster's node secret, ``Session.node``): a call between shards
#: (``run.link``, ``outbox.deliver``, ``admission.reserve``). A client's key, whatever it
#: holds (``operator`` included), and open mode get FORBIDDEN; a node session may make
#: nothing else (``Service.submit``).
NODE = "node"

R, W, C, A = "coordination_read", "coordination_write", "resource_config", "admin"


# ---------------------------------------------------------------------------- routes

class Route:
    """Which actor an op runs on. ``bind(kind)`` (once, when a coordinator is built)
    returns ``route(coord, session, op) -> actor id``, which raises NOT_FOUND (before
    anything is queued) for an id of another space or of no entity.

    ``fields``: the request fields it reads (checked against the request Struct);
    ``method``: the kind method it calls, if any (checked against the kind class)."""

    __slots__ = ("describe", "fields", "method", "_bind")

    def __init__(self, describe: str, bind: Callable[[Any], Callable], fields: tuple[str, ...] = (),
                 method: str | None = None) -> None:
        self.describe = describe
        self.fields = fields
        self.method = method
        self._bind = bind

    def bind(self, kind: Any) -> Callable[[Any, Any, Any], str]:
        return self._bind(kind)

    def __repr__(self) -> str:
        return f"Route({self.describe})"


def _space(c, s, op) -> str:
    return "spc:" + s.space


#: The session's space actor (``spc:<space>``): root runs, lists, ensures, keys, status.
SPACE = Route("the space", lambda kind: _space)


def by_run(field: str = "scope_id") -> Route:
    """The actor of the run named by ``op.<field>`` (``Runs.route``)."""
    get = attrgetter(field)

    def route(c, s, op) -> str:
        return c.runs.route(s, get(op))

    return Route(f"the run {field}", lambda kind: route, (field,))


def run_or_space(field: str) -> Route:
    """The run named by ``op.<field>``, or the space's actor when it is None."""
    get = attrgetter(field)

    def route(c, s, op) -> str:
        v = get(op)
        return c.runs.route(s, v) if v is not None else "spc:" + s.space

    return Route(f"the run {field}, else the space", lambda kind: route, (field,))


def by(field: str, method: str = "route") -> Route:
    """The actor the handler's own kind names for ``op.<field>``:
    ``kind.<method>(session, op.<field>)`` (by default :meth:`Kind.route`: the entity's
    own actor)."""
    get = attrgetter(field)

    def bind(kind):
        m = getattr(kind, method)
        return lambda c, s, op: m(s, get(op))

    return Route(f"{method}({field})", bind, (field,), method)


def by_op(method: str) -> Route:
    """The actor the handler's own kind names for the whole op: ``kind.<method>(session, op)``."""

    def bind(kind):
        m = getattr(kind, method)
        return lambda c, s, op: m(s, op)

    return Route(f"{method}(op)", bind, (), method)


# ---------------------------------------------------------------------------- re-send

class Resend:
    """Whether applying a request twice has the effect of applying it once, so that a
    client may send it again after its connection dropped with it in flight.

    ``safe``: True, False, or ``fn(op) -> bool``; ``describe``: the rule in words;
    ``advice``: what the client's UNAVAILABLE (``maybe_applied``) says to do when it is
    not safe; ``fields``: the request fields the rule reads."""

    __slots__ = ("describe", "safe", "advice", "fields", "fenced", "reconcile")

    def __init__(self, describe: str, safe: bool | Callable[[Any], bool], advice: str | None = None,
                 fields: tuple[str, ...] = (), *, fenced: bool = False, reconcile: str | None = None) -> None:
        self.describe = describe
        self.safe = safe
        self.advice = advice
        self.fields = fields
        #: a write fenced by a token or a state, whose second sending is refused when
        #: the first was applied (STALE_CLAIM, CONFLICT...): it must name how the client
        #: turns that refusal back into the first one's answer (``reconcile``)
        self.fenced = fenced
        #: the name of that rule (:data:`RECONCILE_RULES`; implemented by
        #: ``rallypoint.client.reconnect.RECONCILERS``), or None
        self.reconcile = reconcile

    def __call__(self, op: Any) -> bool:
        s = self.safe
        return s if s is True or s is False else bool(s(op))

    def __repr__(self) -> str:
        return f"Resend({self.describe})"


#: Always safe to send again: a read, a server-side wait, or an idempotent or fenced write.
ALWAYS = Resend("always", True)
#: Never sent again: the client answers UNAVAILABLE with ``maybe_applied``.
NEVER = Resend("never", False)


#: How a client reconciles a fenced op it sent again (after a dropped connection) whose
#: second sending was refused because the first was applied: name -> what it does. The
#: client implements each (``rallypoint.client.reconnect.RECONCILERS``; tests/test_op_facts.py
#: checks both sides agree).
RECONCILE_RULES: dict[str, str] = {
    "task_settled": "refused STALE_CLAIM (the task SUCCEEDED) or the run inactive: the task's status, if it "
                    "SUCCEEDED with this outcome",
    "tasks_settled": "per item of a batch, as task_settled",
    "task_requeued": "refused STALE_CLAIM with the task QUEUED again: the task's status",
    "task_settled_next": "the settle half as task_settled (complete) or task_requeued (retry); when the first "
                         "sending was applied, the receive half is made alone (delivery.receive) and both "
                         "answered together",
    "run_completed": "refused CONFLICT: the run's status, if it is COMPLETED",
}


def fenced(reconcile: str, describe: str = "fenced") -> Resend:
    """Always safe to send again (a token or a state fences it), and a second sending
    refused because the first was applied is reconciled by the rule ``reconcile`` (a
    name of :data:`RECONCILE_RULES`).

    Raises:
        ValueError: ``reconcile`` is not a rule of :data:`RECONCILE_RULES`.
    """
    if reconcile not in RECONCILE_RULES:
        raise ValueError(f"no reconcile rule {reconcile!r}: one of {sorted(RECONCILE_RULES)} (add a rule there and "
                         "its implementation in rallypoint/client/reconnect.py RECONCILERS)")
    return Resend(f"{describe}, reconciled by {reconcile}", True, fenced=True, reconcile=reconcile)


def keyed(field: str = "key", advice: str | None = None) -> Resend:
    """Safe when ``op.<field>`` is set: the server finds the first one by it (an
    idempotency key, a request id, a name unique in its run)."""
    get = attrgetter(field)
    return Resend(f"with {field}", lambda op: get(op) is not None, advice, (field,))


def resend_if(pred: Callable[[Any], bool], describe: str, advice: str | None = None,
              fields: tuple[str, ...] = ()) -> Resend:
    """Safe when ``pred(op)`` (``describe`` says when, in words)."""
    return Resend(describe, pred, advice, fields)


# ---------------------------------------------------------------------------- waits

class Waits:
    """Whether a request is a server-side wait the client asked for (it may park up to
    the time it gave). ``waits``: False, or ``fn(op) -> bool``."""

    __slots__ = ("describe", "waits", "fields")

    def __init__(self, describe: str, waits: bool | Callable[[Any], bool], fields: tuple[str, ...] = ()) -> None:
        self.describe = describe
        self.waits = waits
        self.fields = fields

    def __call__(self, op: Any) -> bool:
        w = self.waits
        return w if w is True or w is False else bool(w(op))

    def __repr__(self) -> str:
        return f"Waits({self.describe})"


_NO_WAIT = Waits("never", False)


def asked(field: str = "wait_ms") -> Waits:
    """A wait when ``op.<field>`` (ms) is more than 0."""
    get = attrgetter(field)
    return Waits(f"{field} > 0", lambda op: get(op) > 0, (field,))


def waits_if(pred: Callable[[Any], bool], describe: str, fields: tuple[str, ...] = ()) -> Waits:
    """A wait when ``pred(op)`` (``describe`` says when, in words)."""
    return Waits(describe, pred, fields)


# ---------------------------------------------------------------------------- shards

class Shard:
    """Which shard of a sharded cluster an op belongs to: the client's router sends it
    there, and a node refuses one that is not its own (WRONG_SHARD). Derived from the
    route when not given (:func:`shard_of_route`).

    ``kind``:
    - ``"slot"``: the slot of ``op.<field>`` -- an id names its slot
      (:func:`rallypoint.ids.slot_of`), a name (a work queue's, a pool's...) its space's
      home slot; when the field is None, ``if_none`` (``"home"``, ``"all"`` or
      ``"new_root"``) decides;
    - ``"slots"``: ``op.<field>`` is a list of ids (or of items with ``task_id``): the
      router splits it by shard, a node takes only its own;
    - ``"home"``: the space's home slot; ``"named"``: the slot ``op.<field>`` (a root
      run's name) hashes to; ``"new_root"``: any shard (the router spreads new root runs);
      ``"all"``: every shard (the router merges the answers, as the op's ``merge=``
      names); ``"here"``: whichever shard the request reaches (a store each shard keeps
      of its own: the HTTP layer's idempotency answers, which live on the shard that
      applied the request); ``"peer"``: a call between shards, sent by a node point to
      point to the shard it chose (the outbox, cross-shard admission, adopted runs and
      keys): accepted by the shard it reaches, never fanned out, nothing to merge."""

    __slots__ = ("describe", "kind", "field", "if_none", "fields")

    def __init__(self, kind: str, field: str | None = None, if_none: str = "home") -> None:
        if kind not in ("slot", "slots", "home", "named", "new_root", "all", "here", "peer"):
            raise ValueError(f"unknown shard kind {kind!r}")
        self.kind = kind
        self.field = field
        self.if_none = if_none
        self.fields = (field,) if field else ()
        self.describe = kind if field is None else f"{kind}({field})"

    def __repr__(self) -> str:
        return f"Shard({self.describe})"


#: The space's home shard (its space-wide entities).
HOME = Shard("home")
#: Any shard: a new root run (the router spreads them over the shards).
NEW_ROOT = Shard("new_root")
#: Every shard: the answers are merged (lists, status, events).
ALL = Shard("all")
#: The shard the request reaches: a per-shard store (the HTTP idempotency answers).
HERE = Shard("here")
#: A call between shards: the node that makes it sends it to the shard it chose.
PEER = Shard("peer")


def fans_out(shard: Shard) -> bool:
    """Whether an op of this shard fact may be answered by every shard (merged)."""
    return shard.kind == "all" or (shard.kind == "slot" and shard.if_none == "all")


def in_slot(field: str, if_none: str = "home") -> Shard:
    """The shard of ``op.<field>``'s slot (an id's; a name's: the home slot)."""
    return Shard("slot", field, if_none)


def in_slots(field: str) -> Shard:
    """``op.<field>`` lists ids (or items with ``task_id``): split by shard."""
    return Shard("slots", field)


def named(field: str = "name") -> Shard:
    """The slot a root run named ``op.<field>`` hashes to."""
    return Shard("named", field)


def shard_of_route(route: "Route") -> Shard:
    """The default shard fact of a route: the slot of the field it routes by (an id's
    slot, a name's home slot), the home shard for the space's actor."""
    if route.fields:
        return in_slot(route.fields[0], "home")
    return HOME


# ---------------------------------------------------------------------------- the mark

class _Mark(NamedTuple):
    request: type
    reply: type | None
    route: Route | None
    permission: str | None
    resend: Resend | None
    waits: Waits
    shard: Shard | None
    merge: str | None


def op(request: type, *, route: Route | None = None, permission: str | None = None, resend: Resend | None = None,
       waits: Waits | None = None, reply: type | None = None, shard: Shard | None = None,
       merge: str | None = None) -> Callable:
    """Mark a kind's method as THE handler of the operation ``request`` (see the module
    docstring for what each argument declares). Nothing is checked here: a mark that is
    incomplete, or a second handler for the same op, stops :func:`build_table` (and so
    the coordinator's construction) with RuntimeError."""
    mark = _Mark(request, reply, route, permission, resend, waits if waits is not None else _NO_WAIT, shard, merge)

    def deco(fn):
        fn._op = mark
        return fn

    return deco


# ---------------------------------------------------------------------------- the table

class OpDecl(NamedTuple):
    """One operation, as its mark declares it (class level: no coordinator)."""

    request: type
    tag: str
    reply: type
    kind: type  # the Kind class holding the handler
    handler: str  # the handler's method name
    route: Route
    permission: str
    resend: Resend
    waits: Waits
    shard: Shard
    merge: str | None  # how every shard's part merges (fan-out ops only)


class BoundOp(NamedTuple):
    """One operation bound to a coordinator's kind object: what ``Service.submit`` uses."""

    handler: Callable[[Any, Any, Any], Any]  # (actor, session, op)
    route: Callable[[Any, Any, Any], str]  # (coordinator, session, op) -> actor id
    permission: str
    tag: str
    decl: OpDecl


class OpTable:
    """Every operation's declaration, built from the ``@op`` marks (:func:`build_table`).

    Attributes:
        decls: request Struct -> :class:`OpDecl`, in the protocol's order.
        reply_types: request Struct -> reply Struct.
        union: the tagged union of every request Struct (``Op``: what a request body
            is decoded against).
        decoder: a msgpack decoder of ``union``.
    """

    def __init__(self, decls: dict[type, OpDecl]) -> None:
        self.decls = decls
        self.reply_types: dict[type, type] = {t: d.reply for t, d in decls.items()}
        self.union = Union[tuple(decls)]  # type: ignore[valid-type]
        self.decoder = msgspec.msgpack.Decoder(self.union)
        self._resend = {t: d.resend for t, d in decls.items()}
        self._waits = {t: d.waits for t, d in decls.items()}
        self.shards: dict[type, Shard] = {t: d.shard for t, d in decls.items()}
        self.merges: dict[type, str | None] = {t: d.merge for t, d in decls.items()}

    def resend_safe(self, op: Any) -> bool:
        """Whether ``op`` may be sent again after a dropped connection (False for
        anything that is not a request Struct of the table, e.g. pre-encoded bytes)."""
        r = self._resend.get(type(op))
        return False if r is None else r(op)

    def reconcile_rule(self, op: Any) -> str | None:
        """The reconcile rule of a fenced op (:func:`fenced`), or None."""
        r = self._resend.get(type(op))
        return None if r is None else r.reconcile

    def resend_advice(self, op: Any) -> str | None:
        """What to do instead, when ``op`` may not be sent again (None: no advice)."""
        r = self._resend.get(type(op))
        return None if r is None else r.advice

    def asked_wait(self, op: Any) -> bool:
        """Whether ``op`` is a server-side wait its client asked for."""
        w = self._waits.get(type(op))
        return False if w is None else w(op)

    def bind(self, kinds) -> dict[type, BoundOp]:
        """Request Struct -> :class:`BoundOp` over the kind objects ``kinds`` (one per
        kind class of the table). RuntimeError when a class has no object."""
        by_class = {type(k): k for k in kinds}
        out: dict[type, BoundOp] = {}
        for t, d in self.decls.items():
            k = by_class.get(d.kind)
            if k is None:
                raise RuntimeError(f"op {d.tag!r} is handled by {d.kind.__name__}, which this coordinator does not hold")
            out[t] = BoundOp(getattr(k, d.handler), d.route.bind(k), d.permission, d.tag, d)
        return out


def _where(cls: type, name: str) -> str:
    return f"{cls.__name__}.{name}"


def _hints(fn) -> dict:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: check what can be
        return {}


def _check_fields(tag: str, where: str, what: str, fields: tuple[str, ...], request: type) -> None:
    for f in fields:
        if f not in request.__struct_fields__:
            raise RuntimeError(f"op {tag!r} ({where}): its {what} reads the field {f!r}, which "
                               f"{request.__name__} does not have")


@functools.lru_cache(maxsize=None)
def build_table(kind_classes: tuple[type, ...], requests: tuple[type, ...] | None = None) -> OpTable:
    """The :class:`OpTable` of the ``@op`` marks on ``kind_classes`` (cached per tuple of
    classes: the marks are class-level and do not change).

    ``requests``: every request Struct the table must cover (default: every op Struct of
    :mod:`rallypoint.protocol`, ``protocol.ALL_OPS``).

    Raises RuntimeError (naming the op and the handler) when a request has no handler or
    two, a mark lacks a route, a permission or a re-send rule, an op every shard answers
    declares no merge (or one answered by one shard declares one), its permission is not
    one of :data:`PERMISSIONS` / :data:`ANY_KEY` / :data:`LOCAL`, its reply type is unknown, its route
    calls a method its kind does not have, or a rule reads a field the request does not
    have."""
    if requests is None:
        from ..protocol import ALL_OPS

        requests = ALL_OPS
    found: dict[type, list[tuple[type, str, _Mark]]] = {}
    for cls in kind_classes:
        for name in dir(cls):
            mark = getattr(getattr(cls, name, None), "_op", None)
            if isinstance(mark, _Mark):
                found.setdefault(mark.request, []).append((cls, name, mark))
    known = set(requests)
    stray = [t for t in found if t not in known]
    if stray:
        names = ", ".join(f"{_where(c, n)} (@op({t.__name__}))" for t in stray for c, n, _ in found[t])
        raise RuntimeError(f"handlers marked for a request that is not an op of the protocol: {names}; "
                           "mark them with an op Struct of rallypoint.protocol")
    missing = [t for t in requests if t not in found]
    if missing:
        raise RuntimeError(
            "ops without a handler: " + ", ".join(f"{t.__struct_config__.tag!r} ({t.__name__})" for t in missing)
            + "; mark the kind's op_* method that decides it with @op(...)")
    decls: dict[type, OpDecl] = {}
    for t in requests:
        tag = t.__struct_config__.tag
        marks = found[t]
        if len(marks) > 1:
            raise RuntimeError(f"op {tag!r} has two handlers: "
                               + " and ".join(_where(c, n) for c, n, _ in marks) + "; keep one @op mark")
        cls, name, m = marks[0]
        where = _where(cls, name)
        if m.route is None:
            raise RuntimeError(f"op {tag!r} ({where}) has no route: give its @op a route= "
                               "(SPACE, by_run(field), run_or_space(field), by(field), by_op(method))")
        if m.permission is None:
            raise RuntimeError(f"op {tag!r} ({where}) has no permission: give its @op a permission= (R, W, C, A, "
                               "ANY_KEY or LOCAL)")
        if m.permission not in PERMISSIONS and m.permission not in (ANY_KEY, LOCAL, NODE):
            raise RuntimeError(f"op {tag!r} ({where}): unknown permission {m.permission!r}")
        if m.resend is None:
            raise RuntimeError(f"op {tag!r} ({where}) has no re-send rule: give its @op a resend= (ALWAYS, NEVER, "
                               "keyed(field) or resend_if(...)); a client re-sends it after a dropped connection "
                               "only if applying it twice is the same as once")
        if m.route.method is not None and not callable(getattr(cls, m.route.method, None)):
            raise RuntimeError(f"op {tag!r} ({where}): its route calls {cls.__name__}.{m.route.method}, "
                               "which does not exist")
        _check_fields(tag, where, "route", m.route.fields, t)
        _check_fields(tag, where, "re-send rule", m.resend.fields, t)
        if m.resend.fenced and m.resend.reconcile not in RECONCILE_RULES:
            raise RuntimeError(f"op {tag!r} ({where}) is re-sent fenced but names no reconcile rule "
                               f"({m.resend.reconcile!r}): declare resend=fenced(rule), rule one of "
                               f"{sorted(RECONCILE_RULES)}; a client re-sending it after a dropped connection must "
                               "turn a refusal of the second sending (the first applied) into the first's answer")
        _check_fields(tag, where, "wait rule", m.waits.fields, t)
        hints = _hints(getattr(cls, name))
        arg = hints.get("op")
        if arg is not None and arg is not t:
            raise RuntimeError(f"op {tag!r} ({where}): the handler's op argument is annotated "
                               f"{getattr(arg, '__name__', arg)}, not {t.__name__}")
        reply = m.reply
        if reply is None:
            ret = hints.get("return")
            if isinstance(ret, type) and issubclass(ret, msgspec.Struct) and ret is not t:
                reply = ret
        if reply is None:
            raise RuntimeError(f"op {tag!r} ({where}) has no reply type: annotate the handler's return with the "
                               "reply Struct or give its @op a reply=")
        shard = m.shard if m.shard is not None else shard_of_route(m.route)
        if m.shard is None and m.route.method is not None and not m.route.fields:
            raise RuntimeError(f"op {tag!r} ({where}): its route reads the whole op, so its shard cannot be "
                               "derived: give its @op a shard= (in_slot(field), in_slots(field), HOME, ALL...)")
        _check_fields(tag, where, "shard", shard.fields, t)
        if m.permission == NODE and shard.kind not in ("peer", "slot"):
            raise RuntimeError(f"op {tag!r} ({where}) is a node's call ({NODE}) but is declared {shard!r}: a call "
                               "between shards is sent to one shard (PEER, or the slot of the run it names)")
        if shard.kind == "peer" and m.permission not in (NODE, LOCAL):
            raise RuntimeError(f"op {tag!r} ({where}) is declared PEER (a call between shards) but a client may "
                               f"make it (permission {m.permission!r}): give it permission=NODE (another node "
                               "sends it) or LOCAL (the node's own step)")
        if fans_out(shard) and not m.merge:
            raise RuntimeError(f"op {tag!r} ({where}) is answered by every shard ({shard!r}) but declares no merge: "
                               "give its @op a merge= naming how the parts merge (rallypoint/client/router.py "
                               "MERGES), or a shard= it belongs to (PEER for a call between shards)")
        if m.merge and not fans_out(shard):
            raise RuntimeError(f"op {tag!r} ({where}) declares merge={m.merge!r} but one shard answers it "
                               f"({shard!r}): drop the merge")
        decls[t] = OpDecl(t, tag, reply, cls, name, m.route, m.permission, m.resend, m.waits, shard, m.merge)
    return OpTable(decls)
