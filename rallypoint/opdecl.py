"""The declarations of an operation that both sides need, server and client: its re-send
rule (:class:`Resend`) and its shard (:class:`Shard`).

An op's ``@op`` mark (:mod:`rallypoint.actors.opmark`) declares them beside its handler,
built with the names of this module; the client, which imports no server module, reads
the same facts from :mod:`rallypoint.opfacts` (generated from the marks, with these
names, and checked against them by ``tests/test_client_imports.py``). This module imports
nothing of the server's.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, NamedTuple

__all__ = [
    "Resend", "ALWAYS", "NEVER", "RECONCILE_RULES", "fenced", "keyed", "resend_if", "every_item_keyed",
    "at_explicit_index_or_step", "Shard", "HOME", "NEW_ROOT", "ALL", "HERE", "PEER", "fans_out", "in_slot",
    "in_slots", "named", "OpFacts", "FactTable",
]


class Resend:
    """Whether applying a request twice has the effect of applying it once, so that a
    client may send it again after its connection dropped with it in flight.

    ``safe``: True, False, or ``fn(op) -> bool``; ``describe``: the rule in words;
    ``advice``: what the client's UNAVAILABLE (``maybe_applied``) says to do when it is
    not safe; ``fields``: the request fields the rule reads."""

    __slots__ = ("describe", "safe", "advice", "fields", "fenced", "reconcile", "expr")

    def __init__(self, describe: str, safe: bool | Callable[[Any], bool], advice: str | None = None,
                 fields: tuple[str, ...] = (), *, fenced: bool = False, reconcile: str | None = None,
                 expr: str | None = None) -> None:
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
        #: the expression of this module's names that makes the rule again (what
        #: :mod:`rallypoint.opfacts` is generated with); None: it cannot be made again
        #: outside the server (a rule built by hand)
        self.expr = expr

    def __call__(self, op: Any) -> bool:
        s = self.safe
        return s if s is True or s is False else bool(s(op))

    def __repr__(self) -> str:
        return f"Resend({self.describe})"


#: Always safe to send again: a read, a server-side wait, or an idempotent or fenced write.
ALWAYS = Resend("always", True, expr="ALWAYS")
#: Never sent again: the client answers UNAVAILABLE with ``maybe_applied``.
NEVER = Resend("never", False, expr="NEVER")


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
    return Resend(f"{describe}, reconciled by {reconcile}", True, fenced=True, reconcile=reconcile,
                  expr=f"fenced({reconcile!r}, {describe!r})")


def keyed(field: str = "key", advice: str | None = None) -> Resend:
    """Safe when ``op.<field>`` is set: the server finds the first one by it (an
    idempotency key, a request id, a name unique in its run)."""
    get = attrgetter(field)
    return Resend(f"with {field}", lambda op: get(op) is not None, advice, (field,),
                  expr=f"keyed({field!r}, {advice!r})")


def resend_if(pred: Callable[[Any], bool], describe: str, advice: str | None = None,
              fields: tuple[str, ...] = ()) -> Resend:
    """Safe when ``pred(op)`` (``describe`` says when, in words). ``pred`` is a function
    of this module (the client, which imports no server module, has it too).

    Raises:
        ValueError: ``pred`` is not a named function of this module (a lambda, say).
    """
    if getattr(pred, "__module__", None) != __name__ or globals().get(getattr(pred, "__name__", "")) is not pred:
        raise ValueError(f"resend_if({pred!r}, ...): the predicate must be a named function of {__name__} "
                         "(the client decides re-sends with it and imports no server module): define it there")
    return Resend(describe, pred, advice, fields, expr=f"resend_if({pred.__name__}, {describe!r}, {advice!r}, {fields!r})")


def every_item_keyed(op: Any) -> bool:
    """``task.submit_many``: every item has a ``key`` (each is found again by it)."""
    return all(i.key is not None for i in op.items)


def at_explicit_index_or_step(op: Any) -> bool:
    """``joinset.join_next``: an explicit ``index`` or ``step`` (the same answer again)."""
    return op.index is not None or op.step is not None


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

    @property
    def expr(self) -> str:
        """The expression that makes this fact again (:mod:`rallypoint.opfacts`)."""
        return f"Shard({self.kind!r}, {self.field!r}, {self.if_none!r})"

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


# ---------------------------------------------------------------------------- the facts of every op

class OpFacts(NamedTuple):
    """What the client needs of one op: its ``shard``, its ``merge`` (how every
    shard's answers merge, fan-out ops only; None otherwise) and its ``resend`` rule."""

    shard: Shard
    merge: str | None
    resend: Resend


class FactTable:
    """The client's facts of every op (request Struct -> :class:`OpFacts`):
    :data:`rallypoint.opfacts.TABLE` on the client; the server's
    :class:`~rallypoint.actors.opmark.OpTable` is one too, built from the marks."""

    def __init__(self, facts: dict[type, OpFacts]) -> None:
        self.facts = facts
        self._resend: dict[type, Resend] = {t: f.resend for t, f in facts.items()}
        #: request Struct -> its :class:`Shard`
        self.shards: dict[type, Shard] = {t: f.shard for t, f in facts.items()}
        #: request Struct -> its merge's name (None: not a fan-out op)
        self.merges: dict[type, str | None] = {t: f.merge for t, f in facts.items()}

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
