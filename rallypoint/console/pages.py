"""The console's pages: each a handler ``async (ctx) -> Page`` that reads through
``ctx.call(op)`` (read operations only, as the login's session) and renders HTML.

Every value that reaches the HTML goes through :func:`h` (``html.escape``): run names,
keys, payloads and errors are the users' text. A page is made of *parts*; a live part is
fetched again (``?part=NAME``) when the page's stream says something changed
(``refresh="changed"``) or each second (``refresh="tick"``); the run tree is loaded a
page of children at a time (``/runs/{id}/children``), never whole.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from html import escape
from typing import Any, Awaitable, Callable, NamedTuple
from urllib.parse import quote, urlencode

import msgspec

from .. import protocol as p
from ..errors import RallypointError, ValidationError
from ..money import format_minor
from .clusterview import where_html

__all__ = ["Page", "Part", "routes", "layout", "login_page", "error_page", "queue_rows", "PAGE"]

#: Rows a list shows at a time (runs, tasks, groups, join sets, children in the tree).
PAGE = 50
#: Items of each kind the run page lists.
RUN_ITEMS = 20
#: Characters of a payload shown (the rest is cut, saying so).
MAX_PAYLOAD_CHARS = 4000
#: Children of a join set listed on its page.
MAX_JOINSET_CHILDREN = 500

RUN_STATES = ("ACTIVE", "CANCELLED", "COMPLETED")
TASK_STATES = ("QUEUED", "RUNNING", "SUCCEEDED", "ACKED", "FAILED", "CANCELLED", "EXPIRED")
GROUP_STATES = ("OPEN", "SEALED", "FINALIZED")
NAV = (("runs", "/runs", "Runs"), ("queues", "/queues", "Queues"), ("groups", "/groups", "Groups"),
       ("joinsets", "/joinsets", "Join sets"), ("live", "/live", "Live"), ("resources", "/resources", "Resources"))


class Part(NamedTuple):
    """A part of a page: ``name`` (its ``?part=`` name), ``render`` (-> HTML) and when the
    browser fetches it again: ``"changed"`` (the stream said so), ``"tick"`` (each
    second) or None (never)."""

    name: str
    render: Callable[[], Awaitable[str]]
    refresh: str | None = None


class Page:
    """A page: its ``title``, the ``nav`` entry it belongs to, its ``parts`` and the
    query of the ``/stream`` it listens to (None: none)."""

    __slots__ = ("title", "nav", "parts", "stream")

    def __init__(self, title: str, nav: str, parts: list[Part], stream: str | None = None) -> None:
        self.title = title
        self.nav = nav
        self.parts = parts
        self.stream = stream


# ============================================================================ helpers
def h(v: Any) -> str:
    """``v`` as HTML text (escaped; None is empty)."""
    return "" if v is None else escape(str(v), quote=True)


def url(path: str, **query) -> str:
    q = {k: v for k, v in query.items() if v not in (None, "", False)}
    return path + ("?" + urlencode(q) if q else "")


def run_url(run_id: str) -> str:
    return "/runs/" + quote(run_id, safe="")


def a(href: str, text: Any, cls: str | None = None) -> str:
    return f'<a href="{h(href)}"{f" class={chr(34)}{cls}{chr(34)}" if cls else ""}>{h(text)}</a>'


def badge(state: str | None, extra: str | None = None) -> str:
    if state is None:
        return ""
    return f'<span class="badge s-{h(state.lower())}">{h(state)}{(" · " + h(extra)) if extra else ""}</span>'


def _parse(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def when(iso: str | None) -> str:
    """An instant as ``YYYY-MM-DD HH:MM:SS`` (UTC), full value on hover."""
    if not iso:
        return '<span class="muted">—</span>'
    return f'<time datetime="{h(iso)}" title="{h(iso)}">{h(iso[:19].replace("T", " "))}</time>'


def duration(seconds: float) -> str:
    s = int(abs(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def left(iso: str | None) -> str:
    """Time left until ``iso`` (a deadline), counted down in the browser."""
    if not iso:
        return '<span class="muted">none</span>'
    rest = (_parse(iso) - datetime.now(timezone.utc)).total_seconds()
    text = f"in {duration(rest)}" if rest > 0 else f"passed {duration(rest)} ago"
    return (f'{when(iso)} <span class="left{" passed" if rest <= 0 else ""}" data-deadline="{h(iso)}">'
            f'{h(text)}</span>')


def age(iso: str | None) -> str:
    if not iso:
        return '<span class="muted">—</span>'
    return f'<span title="{h(iso)}">{h(duration((datetime.now(timezone.utc) - _parse(iso)).total_seconds()))}</span>'


def counts(d: dict[str, int] | None) -> str:
    if not d:
        return '<span class="muted">none</span>'
    return " ".join(f'<span class="count s-{h(k.lower())}" title="{h(k)}">{h(k)} {v}</span>'
                    for k, v in sorted(d.items()) if v)


def payload(raw) -> str:
    """A stored payload (msgpack) as indented JSON text, cut after
    :data:`MAX_PAYLOAD_CHARS`; none (absent or msgpack nil) as a muted dash, like every
    other empty field (issue 46: task pages showed ``nil``)."""
    b = bytes(raw) if raw is not None else b""
    if b in (b"", b"\xc0"):
        return '<span class="muted">—</span>'  # (none: msgpack's nil, never the word)
    try:
        text = json.dumps(msgspec.msgpack.decode(b), indent=2, ensure_ascii=False, default=repr)
    except Exception:
        text = f"<{len(b)} bytes that are not JSON>"
    cut = ""
    if len(text) > MAX_PAYLOAD_CHARS:
        cut = f"\n… ({len(text) - MAX_PAYLOAD_CHARS} more characters)"
        text = text[:MAX_PAYLOAD_CHARS]
    return f"<pre>{h(text + cut)}</pre>"


def table(headers: list[str], rows: list[str], empty: str = "none", cls: str = "") -> str:
    if not rows:
        return f'<p class="muted empty">{h(empty)}</p>'
    head = "".join(f"<th>{h(x)}</th>" for x in headers)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def tr(*cells: str, attrs: str = "") -> str:
    return f"<tr{attrs}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def dl(pairs: list[tuple[str, str]]) -> str:
    return '<dl class="facts">' + "".join(f"<dt>{h(k)}</dt><dd>{v}</dd>" for k, v in pairs) + "</dl>"


async def gather(ctx, *ops) -> list:
    """Several reads at once (each answer waits for the journal to be durable: together
    they cost about one such wait); their replies in order, or the first error."""
    import trio

    out: list = [None] * len(ops)
    errors: list = []

    async def one(i, op):
        try:
            out[i] = await ctx.call(op)
        except Exception as e:  # (kept out of the nursery's exception group)
            errors.append(e)

    async with trio.open_nursery() as nursery:
        for i, op in enumerate(ops):
            nursery.start_soon(one, i, op)
    if errors:
        raise errors[0]
    return out


def pager(ctx, rows: list, id_of: Callable[[Any], str], param: str = "before") -> str:
    """Newest / older links for a list shown newest first, ``PAGE`` rows at a time."""
    links = []
    path = ctx.request.scope["path"]
    base = {k: v for k, v in ctx.query.items() if k not in (param, "part")}
    if ctx.query.get(param):
        links.append(a(url(path, **base), "« newest"))
    if len(rows) >= PAGE:
        links.append(a(url(path, **{**base, param: id_of(rows[-1])}), "older »", "older"))
    return f'<p class="pager">{" ".join(links)}</p>' if links else ""


def choice(q: dict, name: str, allowed: tuple[str, ...]) -> str | None:
    v = q.get(name) or None
    if v is not None and v not in allowed:
        raise ValidationError(f"{name} must be one of {', '.join(allowed)} (got {v!r})", details={"field": name})
    return v


def select(name: str, allowed: tuple[str, ...], current: str | None, label: str) -> str:
    opts = [f'<option value="">any {h(label)}</option>']
    opts += [f'<option{" selected" if s == current else ""}>{h(s)}</option>' for s in allowed]
    return f'<label>{h(label)} <select name="{h(name)}">{"".join(opts)}</select></label>'


def run_label(s) -> str:
    return s.name or s.id


def run_state(s) -> str:
    """The run's own state, and why it refuses work when it is ACTIVE but inactive."""
    if s.stored_state == "ACTIVE" and s.effective != "ACTIVE":
        return badge("INACTIVE", s.inactive_reason)
    return badge(s.stored_state)


# ============================================================================ runs
async def runs_list(ctx) -> Page:
    q = ctx.query
    state = choice(q, "state", RUN_STATES)
    name = q.get("name") or None
    all_runs = q.get("all") == "1"
    before = q.get("before") or None

    async def filters() -> str:
        return (f'<form class="filters" method="get" action="/runs">{select("state", RUN_STATES, state, "state")}'
                f'<label>name contains <input name="name" value="{h(name)}" maxlength="256"></label>'
                f'<label><input type="checkbox" name="all" value="1"{" checked" if all_runs else ""}> '
                f'every run (not only roots)</label><button>Filter</button></form>')

    async def rows() -> str:
        v = await ctx.call(p.ScopeList(roots_only=not all_runs, state=state, name=name, before=before, order="desc",
                                       limit=PAGE))
        body = [tr(a(run_url(s.id), run_label(s)) + (f' <span class="muted id">{h(s.id)}</span>' if s.name else "")
                   + where_html(ctx, s.id),
                   run_state(s), counts(s.tasks), h(s.children), when(s.created_at), left(s.deadline),
                   attrs=f' data-run="{h(s.id)}"') for s in v.scopes]
        return (table(["Run", "State", "Tasks by state", "Children", "Created", "Deadline"], body,
                      "no runs match", "runs") + pager(ctx, v.scopes, lambda s: s.id))

    return Page("Runs", "runs", [Part("filters", filters), Part("list", rows, "changed")],
                stream=urlencode({"types": "scope.*,task.*"}))


async def _ancestors(ctx, run) -> list:
    chain = []
    cur = run
    while cur.parent_id is not None and len(chain) < 20:
        cur = await ctx.call(p.ScopeStatus(scope_id=cur.parent_id))
        chain.append(cur)
    return list(reversed(chain))


async def run_page(ctx) -> Page:
    rid = ctx.params["id"]
    run = await ctx.call(p.ScopeStatus(scope_id=rid))
    chain = await _ancestors(ctx, run)
    tasks_before = ctx.query.get("tasks_before") or None

    async def crumbs() -> str:
        trail = [a("/runs", "Runs")] + [a(run_url(s.id), run_label(s)) for s in chain] + [h(run_label(run))]
        return '<nav class="crumbs">' + " / ".join(trail) + "</nav>"

    async def summary() -> str:
        s, ops = await gather(ctx, p.ScopeStatus(scope_id=rid), p.OpsRun(scope_id=rid))
        facts = [("id", f"<code>{h(s.id)}</code>{where_html(ctx, s.id)}"),
                 ("name", h(s.name) or '<span class="muted">—</span>'),
                 ("state", run_state(s)), ("created", when(s.created_at)), ("ended", when(s.ended_at)),
                 ("deadline", left(s.deadline)), ("tasks", counts(s.tasks)),
                 ("children", f"{s.children} (of at most {s.child_limit}); {ops.runs} runs in its subtree")]
        if s.group_id:
            facts.append(("gate of group", a("/groups/" + quote(s.group_id, safe=""), s.group_id)))
        if s.task_id:
            facts.append(("own run of task", a("/tasks/" + quote(s.task_id, safe=""), s.task_id)))
        holders = [tr(h(w.holder or "—"), h(", ".join(k for k in w.keys if k not in w.tasks)) or "—",
                      ", ".join(a("/tasks/" + quote(t, safe=""), t) for t in w.tasks) or "—",
                      when(w.earliest_lease_expiry), attrs=f' data-holder="{h(w.holder)}"') for w in ops.workers]
        waiting = [tr(h(w.kind), h(w.name), h(w.units), h(w.holder or "—"), a(run_url(w.scope_id), w.scope_id))
                   for w in ops.waiting]
        from .actions import buttons

        acts = buttons(ctx, ("cancel-run", s.id)) if s.stored_state == "ACTIVE" else ""
        return (f'<div class="state-line" data-state="{h(s.stored_state)}" data-effective="{h(s.effective)}">'
                + dl(facts) + "</div>" + acts
                + "<h3>Lease holders in the subtree (claims, onces, deliveries)</h3>"
                + table(["Holder", "Keys", "Leased tasks", "Earliest lease expiry"], holders, "nobody holds a lease")
                + "<h3>Waiting in the subtree (pools, quotas)</h3>"
                + table(["Kind", "Name", "Units", "Holder", "Run"], waiting, "nothing waits"))

    async def tree() -> str:  # (not refreshed: the run as the page was loaded)
        s = run
        kids = await children_html(ctx, rid, None) if s.children else ""
        return (f'<ul class="tree root"><li data-run="{h(s.id)}" class="open"><span class="node">'
                f'<b>{h(run_label(s))}</b> {run_state(s)} {counts(s.tasks)}</span>'
                f'<ul class="tree">{kids}</ul></li></ul>')

    async def items() -> str:
        kinds = ["tasks", "groups", "joinsets", "barriers", "timers", "claims", "grants"]
        v = await ctx.call(p.OpsItems(scope_id=rid, kinds=kinds, limit=RUN_ITEMS, before=tasks_before))
        out = ["<h3>Tasks</h3>", task_table(v.tasks, "no tasks")]
        if len(v.tasks) >= RUN_ITEMS:
            out.append(f'<p class="pager">{a(url(run_url(rid), tasks_before=v.tasks[-1].id), "older tasks »")}</p>')
        out += ["<h3>Groups</h3>", group_table(v.groups)]
        out += ["<h3>Join sets</h3>", joinset_table(v.joinsets)]
        out += ["<h3>Barriers</h3>", table(["Barrier", "State", "Arrivals", "Epoch", "Created", "Released"], [
            tr(h(b.name or b.id), badge(b.state), f"{b.arrivals} / {b.target}", h(b.epoch), when(b.created_at),
               when(b.released_at)) for b in v.barriers], "no barriers")]
        out += ["<h3>Timers</h3>", table(["Timer", "State", "Fires", "Fired", "Acknowledged"], [
            tr(h(t.name or t.id), badge(t.state), left(t.fire_at) if t.state == "ARMED" else when(t.fire_at),
               when(t.fired_at), when(t.acked_at)) for t in v.timers], "no timers")]
        out += ["<h3>Claims held</h3>", table(["Key", "Holder", "Generation", "Lease expires", "Waiting"], [
            tr(h(c.key), h(c.holder or "—"), h(c.generation), left(c.lease_expires_at), h(len(c.waiters)))
            for c in v.claims], "no claims held")]
        out += ["<h3>Pool units held</h3>", grant_table(v.grants)]
        return "".join(out)

    async def timeline() -> str:
        from .timeline import render_timeline

        return await render_timeline(ctx, rid)

    return Page(f"Run {run_label(run)}", "runs", [
        Part("crumbs", crumbs), Part("summary", summary, "changed"), Part("timeline", timeline, "changed"),
        Part("tree", tree), Part("items", items, "changed"),
    ], stream=urlencode({"run": rid}))


async def children_html(ctx, run_id: str, before: str | None) -> str:
    """One page of a run's children, newest first, as tree rows; a row with children of
    its own gets a toggle that loads them; a full page ends with a "more" row."""
    v = await ctx.call(p.ScopeList(parent_id=run_id, order="desc", limit=PAGE, before=before))
    rows = []
    for s in v.scopes:
        if s.children:
            toggle = (f'<button type="button" class="toggle" aria-expanded="false" '
                      f'data-children="{h(run_url(s.id) + "/children")}" title="show its children">▸</button>')
        else:
            toggle = '<span class="toggle-spacer"></span>'
        rows.append(f'<li data-run="{h(s.id)}">{toggle}<span class="node">{a(run_url(s.id), run_label(s))} '
                    f'{run_state(s)} {counts(s.tasks)}{where_html(ctx, s.id)}'
                    f'{f" <span class=muted>{s.children} children</span>" if s.children else ""}</span>'
                    f'<ul class="tree" hidden></ul></li>')
    if len(v.scopes) >= PAGE:
        more = url(run_url(run_id) + "/children", before=v.scopes[-1].id)
        rows.append(f'<li class="more"><button type="button" class="more" data-more="{h(more)}">more…</button></li>')
    return "".join(rows)


async def run_children(ctx) -> Page:
    rid = ctx.params["id"]
    before = ctx.query.get("before") or None

    async def render() -> str:
        return await children_html(ctx, rid, before)

    return Page("Children", "runs", [Part("children", render)])


def task_table(tasks, empty: str) -> str:
    return table(["Task", "Queue", "State", "Attempt", "Holder", "Created", "Finished"], [
        tr(a("/tasks/" + quote(t.id, safe=""), t.id) + (f' <span class="muted">key {h(t.key)}</span>' if t.key else ""),
           a("/queues/" + quote(t.mailbox, safe=""), t.mailbox),
           badge(t.state, t.outcome_reason) + (' <span class="badge">completing</span>' if t.completing else ""),
           h(t.attempt), h(t.holder) if t.holder else "—", when(t.created_at), when(t.finished_at),
           attrs=f' data-task="{h(t.id)}"') for t in tasks], empty)


def group_table(groups) -> str:
    return table(["Group", "Run", "Condition", "State", "Outcome", "Members", "Accepted", "Created", "Decided"], [
        tr(a("/groups/" + quote(g.id, safe=""), g.id), a(run_url(g.scope_id), g.scope_id), h(g.condition),
           badge(g.state), badge(g.outcome, g.outcome_reason), h(g.members), h(g.accepted), when(g.created_at),
           when(g.finalized_at)) for g in groups], "no groups")


def joinset_table(sets) -> str:
    return table(["Join set", "Run", "State", "Submitted", "Finished", "Consumed", "Steps", "Created"], [
        tr(a("/joinsets/" + quote(j.id, safe=""), j.name or j.id), a(run_url(j.scope_id), j.scope_id), badge(j.state),
           h(j.submitted), h(j.finished), h(j.consumed), h(j.steps), when(j.created_at)) for j in sets],
        "no join sets")


def grant_table(grants) -> str:
    return table(["Pool", "Units", "Holder", "For task", "Lease expires", "Since"], [
        tr(h(g.pool), h(g.units), h(g.holder or "—"),
           a("/tasks/" + quote(g.task_id, safe=""), g.task_id) if g.task_id else "—",
           left(g.lease_expires_at) if g.lease_expires_at else '<span class="muted">while the task runs</span>',
           when(g.created_at)) for g in grants], "no pool units held")


# ============================================================================ tasks and queues
async def task_page(ctx) -> Page:
    tid = ctx.params["id"]
    first = await ctx.call(p.OpsTask(task_id=tid))

    async def detail() -> str:
        v = await ctx.call(p.OpsTask(task_id=tid))
        t = v.task
        facts = [("id", f"<code>{h(t.id)}</code>"), ("queue", a("/queues/" + quote(t.mailbox, safe=""), t.mailbox)),
                 ("run", a(run_url(t.scope_id), t.scope_id)),
                 ("state", badge(t.state, t.outcome_reason) + (' <span class="badge">completing</span>'
                                                               if t.completing else "")),
                 ("attempt", f"{t.attempt} of at most {v.max_attempts}"), ("key", h(t.key) or "—"),
                 ("created", when(t.created_at)), ("finished", when(t.finished_at)), ("deadline", left(t.deadline))]
        if t.group_id:
            facts.append(("group", a("/groups/" + quote(t.group_id, safe=""), t.group_id)))
        if t.run_id:
            facts.append(("its own run", a(run_url(t.run_id), t.run_id)))
        if t.subscribers:
            facts.append(("subscribers", h(", ".join(t.subscribers))))
        if t.holder and (v.delivery is None):
            facts.append(("last holder", f'<span class="holder">{h(t.holder)}</span>'))
        out = [f'<div class="state-line" data-state="{h(t.state)}">' + dl(facts) + "</div>", "<h3>Current delivery</h3>"]
        d = v.delivery
        if d is None:
            out.append('<p class="muted">none (the task holds no lease)</p>')
        else:
            left_s = (v.lease_left_ms or 0) / 1000
            out.append(dl([("delivery", f"<code>{h(d.id)}</code>"), ("fencing token", h(d.token)),
                           ("holder", f'<span class="holder">{h(d.holder)}</span>' if d.holder
                            else '<span class="muted">not recorded</span>'),
                           ("attempt", h(d.attempt)),
                           ("lease expires", when(d.lease_expires_at) + f' <span class="left" data-deadline='
                            f'"{h(d.lease_expires_at)}">in {h(duration(left_s))}</span>'),
                           ("reservations", h(", ".join(d.reservations)) or "—")]))
            if d.grants:
                out.append(grant_table(d.grants))
            from .actions import buttons

            out.append(buttons(ctx, ("retry-task", t.id), ("fail-task", t.id), ("release-lease", t.id)))
        out += ["<h3>Input</h3>", payload(t.input), "<h3>Outcome</h3>", payload(t.outcome),
                "<h3>Last error</h3>", payload(t.error)]
        return "".join(out)

    async def history() -> str:
        evs = await _events_of(ctx, f"task:{tid}", 200)
        rows = [tr(h(e.seq), when(e.at), badge(e.type), h((e.data or {}).get("attempt", "")),
                   h((e.data or {}).get("holder") or ""),
                   h(_brief({k: v for k, v in (e.data or {}).items() if k not in ("attempt", "holder")})),
                   attrs=f' data-event="{h(e.type)}"') for e in evs]
        return ("<h3>Attempts and deliveries (the task's events, while kept)</h3>"
                + table(["#", "At", "Event", "Attempt", "Holder", "Data"], rows, "no events kept for this task"))

    return Page(f"Task {tid}", "queues", [Part("detail", detail, "changed"), Part("history", history, "changed")],
                stream=urlencode({"aggregate": f"task:{tid}", "run": first.task.scope_id}))


async def _events_of(ctx, aggregate: str, limit: int) -> list:
    """The kept events of one aggregate, oldest first (at most ``limit``; a few pages
    of the log are looked at)."""
    out = []
    cursor = None
    for _ in range(5):
        page = await ctx.call(p.EventsList(cursor=cursor, limit=min(1000, limit), aggregate=aggregate))
        out += [msgspec.msgpack.decode(bytes(r), type=p.EventView) for r in page.events]
        if len(out) >= limit or page.next_cursor >= page.newest:
            break
        cursor = page.next_cursor
    return out[:limit]


def _brief(data: dict | None) -> str:
    if not data:
        return ""
    return ", ".join(f"{k}={v}" for k, v in data.items() if v is not None)


async def queue_rows(ctx) -> list[tuple[Any, float | None]]:
    """The space's work queues with their rate of tasks done per second (None until a
    second read), read through ``ops.items``."""
    v = await ctx.call(p.OpsItems(kinds=["queues"], limit=1000))
    now = time.monotonic()
    rates = ctx.app.rates
    return [(q, rates.note(ctx.session.space, q.id, q.done, now)) for q in v.queues]


async def queues_page(ctx) -> Page:
    async def render() -> str:
        rows = []
        for q, rate in await queue_rows(ctx):
            rows.append(tr(a("/queues/" + quote(q.name, safe=""), q.name), h(q.mode), h(q.queued), h(q.running),
                           f'<span class="rate">{rate:.1f}</span>' if rate is not None
                           else '<span class="muted" title="needs a second read">…</span>',
                           age(q.oldest_ready_at), h(q.backlog_limit or "—"), attrs=f' data-queue="{h(q.name)}"'))
        return table(["Queue", "Mode", "Depth (queued)", "In flight", "Done / s", "Oldest waiting", "Backlog limit"],
                     rows, "no work queues", "queues")

    return Page("Queues", "queues", [Part("queues", render, "tick")],
                stream=urlencode({"types": "mailbox.*", "stats": "1"}))


#: the largest fairness keys a queue's page lists in its ready backlog
BACKLOG_KEYS = 20


async def queue_page(ctx) -> Page:
    """A work queue: its definition, its ready backlog (per priority, then its
    :data:`BACKLOG_KEYS` largest fairness keys with their weights on the queue), its
    tasks (filtered by state, paged)."""
    name = ctx.params["name"]
    q = await ctx.call(p.MailboxGet(name=name))
    state = choice(ctx.query, "state", TASK_STATES)
    before = ctx.query.get("before") or None

    async def head() -> str:
        req = ""
        if q.requirements is not None and (q.requirements.pools or q.requirements.budgets):
            req = h(", ".join([f"pool {k}: {v}" for k, v in q.requirements.pools.items()]
                              + [f"budget {k}: {v}" for k, v in q.requirements.budgets.items()]))
        return (dl([("id", f"<code>{h(q.id)}</code>"), ("mode", h(q.mode)), ("max attempts", h(q.max_attempts)),
                    ("backlog limit", h(q.backlog_limit or "—")), ("default requirements", req or "—"),
                    ("created", when(q.created_at))])
                + f'<form class="filters" method="get">{select("state", TASK_STATES, state, "state")}'
                  f'<button>Filter</button></form>')

    async def backlog() -> str:  # issue 44: the ready tasks per priority and per fairness key
        v = await ctx.call(p.MailboxGet(name=name))
        rows = [tr(h(f"priority {k}"), h(n), "") for k, n in sorted(v.ready_by_priority.items(), key=lambda kv: int(kv[0]))]
        rows += [tr(h(f"key {k}") if k else "no key", h(n), h(v.weights.get(k, "")) if k else "")
                 for k, n in list(v.ready_by_key.items())[:BACKLOG_KEYS]]
        return table(["Ready", "Tasks", "Weight"], rows, "no task ready", "backlog")

    async def tasks() -> str:
        v = await ctx.call(p.OpsItems(kinds=["tasks"], mailbox=name, state=state, before=before, limit=PAGE))
        return task_table(v.tasks, "no tasks match") + pager(ctx, v.tasks, lambda t: t.id)

    async def trend() -> str:
        from .trends import render_queue_trend

        return render_queue_trend(ctx, name)

    return Page(f"Queue {name}", "queues", [Part("head", head), Part("trend", trend, "changed"),
                                            Part("backlog", backlog, "changed"),
                                            Part("tasks", tasks, "changed")],
                stream=urlencode({"types": "task.*"}))


# ============================================================================ groups
async def groups_list(ctx) -> Page:
    state = choice(ctx.query, "state", GROUP_STATES)
    before = ctx.query.get("before") or None

    async def filters() -> str:
        return (f'<form class="filters" method="get">{select("state", GROUP_STATES, state, "state")}'
                f'<button>Filter</button></form>')

    async def rows() -> str:
        v = await ctx.call(p.OpsItems(kinds=["groups"], state=state, before=before, limit=PAGE))
        return group_table(v.groups) + pager(ctx, v.groups, lambda g: g.id)

    return Page("Groups", "groups", [Part("filters", filters), Part("list", rows, "changed")],
                stream=urlencode({"types": "group.*"}))


async def group_page(ctx) -> Page:
    gid = ctx.params["id"]
    first = await ctx.call(p.GroupStatus(group_id=gid))

    async def render() -> str:
        g = await ctx.call(p.GroupStatus(group_id=gid))
        facts = [("id", f"<code>{h(g.id)}</code>"), ("condition", h(g.condition)),
                 ("threshold", h(g.threshold if g.threshold is not None else "—")),
                 ("expected members", h(g.expected_members if g.expected_members is not None else "—")),
                 ("state", badge(g.state)), ("outcome", badge(g.outcome) or '<span class="muted">undecided</span>'),
                 ("reason", h(g.outcome_reason) or "—"), ("decided", when(g.finalized_at)),
                 ("deadline", left(g.deadline)), ("created", when(g.created_at)),
                 ("queue", a("/queues/" + quote(g.mailbox, safe=""), g.mailbox)),
                 ("run", a(run_url(g.parent_scope_id), g.parent_scope_id)),
                 ("gate run", a(run_url(g.scope_id), g.scope_id)), ("members by state", counts(g.counts))]
        members = [tr(a("/tasks/" + quote(m.task_id, safe=""), m.task_id), badge(m.task_state),
                      badge(m.verdict) if m.verdict else '<span class="muted">none</span>',
                      '<span class="badge s-late">late</span>' if m.late else "", h(m.key or "—"),
                      attrs=' class="late"' if m.late else "")
                   for m in g.members]
        return (f'<div class="state-line" data-state="{h(g.state)}">' + dl(facts) + "</div><h3>Members</h3>"
                + table(["Task", "Task state", "Verdict", "", "Key"], members, "no members yet")
                + '<p class="muted">A late verdict came after the group decided (or its deadline): it is kept, '
                  "and changes nothing.</p>")

    return Page(f"Group {gid}", "groups", [Part("group", render, "changed")],
                stream=urlencode({"types": "group.*,task.*", "run": first.parent_scope_id}))


# ============================================================================ join sets
async def joinsets_list(ctx) -> Page:
    before = ctx.query.get("before") or None

    async def rows() -> str:
        v = await ctx.call(p.OpsItems(kinds=["joinsets"], before=before, limit=PAGE))
        return joinset_table(v.joinsets) + pager(ctx, v.joinsets, lambda j: j.id)

    return Page("Join sets", "joinsets", [Part("list", rows, "changed")], stream=urlencode({"types": "joinset.*"}))


async def joinset_page(ctx) -> Page:
    jid = ctx.params["id"]
    first = await ctx.call(p.OpsJoinSet(joinset_id=jid))

    async def render() -> str:
        v = await ctx.call(p.OpsJoinSet(joinset_id=jid))
        j = v.joinset
        facts = [("id", f"<code>{h(j.id)}</code>"), ("name", h(j.name) or "—"), ("run", a(run_url(j.scope_id), j.scope_id)),
                 ("state", badge(j.state)), ("children", f"{j.submitted} submitted, {j.finished} finished, "
                                                          f"{j.consumed} consumed"),
                 ("steps", f"{j.steps} answers journaled"), ("created", when(j.created_at)),
                 ("closed", when(v.closed_at))]
        records = []
        for r in v.records:
            child = a("/tasks/" + quote(r.child_id, safe=""), r.child_id) if r.kind == "task" else h(r.child_id)
            how = ('<span class="badge s-closing">closing consume</span>' if r.closing else
                   badge("CONSUMED") if r.consumed else '<span class="muted">not consumed</span>')
            records.append(tr(h(r.index), child, h(r.kind), badge("OK") if r.ok else badge("FAILED", r.failure_kind),
                              how))
        steps = [tr(h(s.step) if s.n == 1 else f"{s.step}–{s.step + s.n - 1}",
                    h("join_next" if s.op == "next" else "join_next_try") + (f" (mailbox {h(s.mailbox)})"
                                                                            if s.mailbox else ""),
                    h(s.outcome) + (f" #{s.index}" if s.outcome == "record" else ""), h(s.n)) for s in v.steps]
        kids = [tr(a("/tasks/" + quote(c.child_id, safe=""), c.child_id) if c.kind == "task" else h(c.child_id),
                   h(c.kind), "yes" if c.cancellable else "no", badge("FINISHED") if c.finished else badge("PENDING"))
                for c in j.children[:MAX_JOINSET_CHILDREN]]
        more = (f'<p class="muted">… and {len(j.children) - MAX_JOINSET_CHILDREN} more children</p>'
                if len(j.children) > MAX_JOINSET_CHILDREN else "")
        from .actions import buttons

        acts = buttons(ctx, ("close-joinset", j.id)) if j.state == "OPEN" else ""
        return (f'<div class="state-line" data-state="{h(j.state)}">' + dl(facts) + "</div>" + acts
                + "<h3>Completion records (completion order: what join_next returns)</h3>"
                + table(["#", "Child", "Kind", "Result", "Consumed"], records, "no child finished yet")
                + "<h3>Steps (the journaled answers a replaying client follows)</h3>"
                + table(["Step", "Operation", "Answer", "Repeated"], steps, "no answer given yet")
                + "<h3>Children (submission order)</h3>"
                + table(["Child", "Kind", "Cancellable", "Finished"], kids, "no children") + more)

    return Page(f"Join set {first.joinset.name or jid}", "joinsets", [Part("joinset", render, "changed")],
                stream=urlencode({"types": "joinset.*,task.*", "run": first.joinset.scope_id}))


# ============================================================================ live
async def live_page(ctx) -> Page:
    q = ctx.query
    types = q.get("types") or ""
    run = q.get("run") or ""
    flt = {"types": [t.strip() for t in types.split(",") if t.strip()] or None, "scope_id": run or None}

    async def filters() -> str:
        return (f'<form class="filters" method="get" action="/live"><label>types <input name="types" value="{h(types)}"'
                f' placeholder="task.failed,scope.*" size="32"></label><label>run (and its subtree) <input name="run" '
                f'value="{h(run)}" placeholder="scp_…" size="28"></label><button>Filter</button>'
                f'<button type="button" id="pause">Pause</button></form>')

    async def chart() -> str:
        return ('<div class="charts"><figure><figcaption>Throughput (per second): '
                '<span class="k done">tasks done</span> <span class="k rps">requests (server)</span> '
                '<span class="k evs">events shown</span></figcaption>'
                '<svg id="chart-rate" class="chart" viewBox="0 0 600 120" preserveAspectRatio="none" role="img" '
                'aria-label="throughput"></svg><output id="rate-now"></output></figure>'
                '<figure><figcaption>Request latency, ms (server, requests that do not wait): '
                '<span class="k p50">p50</span> <span class="k p99">p99</span></figcaption>'
                '<svg id="chart-latency" class="chart" viewBox="0 0 600 120" preserveAspectRatio="none" role="img" '
                'aria-label="latency"></svg><output id="latency-now"></output></figure></div>')

    async def events() -> str:
        recent = await _recent_events(ctx, flt, 50)
        rows = [tr(h(e.seq if e.shard is None else f"{e.shard}:{e.seq}"), when(e.at), badge(e.type),
                   h(f"{e.kind}:{e.id}"), _run_cell(e.run), h(_brief(e.data)),
                   attrs=f' data-id="{h(e.seq if e.shard is None else f"{e.shard}:{e.seq}")}"')
                for e in reversed(recent)]
        return ('<table class="events"><thead><tr><th>#</th><th>At</th><th>Event</th><th>About</th><th>Run</th>'
                f'<th>Data</th></tr></thead><tbody id="events">{"".join(rows)}</tbody></table>')

    return Page("Live", "live", [Part("filters", filters), Part("chart", chart), Part("events", events)],
                stream=urlencode({k: v for k, v in {"mode": "events", "stats": "1", "types": types, "run": run}.items()
                                  if v}))


def _run_cell(run: str | None) -> str:
    return a(run_url(run), run) if run else '<span class="muted">—</span>'


async def _recent_events(ctx, flt: dict, n: int) -> list:
    """The last events of the space that match (among the last 2,000 kept; on a
    cluster, each shard's, merged: ``ClusterConsoleService.recent_events``)."""
    merged = getattr(ctx.app.service, "recent_events", None)
    if merged is not None:
        return await merged(ctx.session, flt, n)
    head = await ctx.call(p.EventsList(limit=1, cursor=None))
    start = max(head.oldest - 1, head.newest - 2000, 0)
    page = await ctx.call(p.EventsList(cursor=start, limit=2000, **flt))
    evs = [msgspec.msgpack.decode(bytes(r), type=p.EventView) for r in page.events]
    return evs[-n:]


# ============================================================================ resources
async def resources_page(ctx) -> Page:
    async def quotas() -> str:
        v = await ctx.call(p.QuotaList())
        rows = [tr(h(x.name), f'<meter min="0" max="{x.units_limit}" value="{x.used}"></meter> {x.used} / '
                              f'{x.units_limit}', h(duration(x.window_ms / 1000)), age(x.window_start) + " ago",
                   h(x.waiting), left(x.cooldown_until) + (f" ({h(x.cooldown_reason)})" if x.cooldown_reason else "")
                   if x.cooldown_until else "—", h(x.consumed_total)) for x in v.quotas]
        return "<h2>Quotas</h2>" + table(["Quota", "Used this window", "Window", "Window started", "Waiting",
                                          "Cooldown", "Consumed in all"], rows, "no quotas")

    async def pools() -> str:
        v = await ctx.call(p.PoolList())
        rows = [tr(h(x.name), f'<meter min="0" max="{x.units_total}" value="{x.units_used}"></meter> {x.units_used} / '
                              f'{x.units_total}', h(x.units_free), h(x.active_grants), h(x.waiting)) for x in v.pools]
        return "<h2>Pools</h2>" + table(["Pool", "Units held", "Free", "Grants", "Waiters"], rows, "no pools")

    async def budgets() -> str:
        v = await ctx.call(p.BudgetList())

        def m(x, n):
            return h(f"{format_minor(n, x.scale)} {x.currency}")

        rows = [tr(h(x.name), f'<meter min="0" max="{x.limit_minor}" value="{x.settled_minor + x.reserved_minor}">'
                              f'</meter>', m(x, x.settled_minor), m(x, x.reserved_minor), m(x, x.available_minor),
                   m(x, x.limit_minor), m(x, x.overrun_minor), h(x.open_reservations)) for x in v.budgets]
        return "<h2>Budgets</h2>" + table(["Budget", "Spent + held", "Settled", "Reserved", "Available", "Limit",
                                           "Overrun", "Open reservations"], rows, "no budgets")

    async def schedules() -> str:
        v = await ctx.call(p.ScheduleList())
        out = []
        for x in v.schedules[:50]:  # (each a describe: the first 50 by name)
            d = await ctx.call(p.ScheduleGet(schedule=x.id, next_n=3, recent=5))
            spec = " + ".join([f"cron {c}" for c in d.cron] + ([f"every {duration(d.interval_ms / 1000)}"]
                                                              if d.interval_ms else []))
            state = badge("PAUSED", d.note) if d.paused else badge("ACTIVE")
            nxt = "<br>".join(left(f) for f in d.next_fires) or "—"
            recent = "<br>".join(f"{when(r.scheduled_at)} {h(r.origin)} {_run_cell(r.run_id)} "
                                 f"{badge(r.state if r.outcome is None else r.outcome.upper())}" for r in d.recent) or "—"
            from .actions import button

            act = button(ctx, "unpause-schedule" if d.paused else "pause-schedule", d.id)
            out.append(tr(h(d.name), h(f"{spec} ({d.timezone})"), state + act, h(d.overlap), h(d.actions),
                          h(d.skipped), nxt, recent, attrs=f' data-schedule="{h(d.name)}"'))
        more = f'<p class="muted">the first 50 of {len(v.schedules)}</p>' if len(v.schedules) > 50 else ""
        return "<h2>Schedules</h2>" + more + table(["Schedule", "Spec", "State", "Overlap", "Actions", "Skipped",
                                             "Next fires", "Recent actions (run, outcome)"], out, "no schedules")

    return Page("Resources", "resources", [Part("quotas", quotas, "tick"), Part("pools", pools, "tick"),
                                           Part("budgets", budgets, "tick"), Part("schedules", schedules, "tick")],
                stream=urlencode({"types": "quota.created,pool.created,budget.created,schedule.fired,schedule.skipped",
                                  "stats": "1"}))


# ============================================================================ layout
def routes() -> list[tuple[tuple[str, ...], Callable]]:
    return [
        (("runs",), runs_list), (("runs", "{id}"), run_page), (("runs", "{id}", "children"), run_children),
        (("tasks", "{id}"), task_page), (("queues",), queues_page), (("queues", "{name}"), queue_page),
        (("groups",), groups_list), (("groups", "{id}"), group_page),
        (("joinsets",), joinsets_list), (("joinsets", "{id}"), joinset_page),
        (("live",), live_page), (("resources",), resources_page),
    ]


def _head(title: str) -> str:
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{h(title)} · rallypoint</title><link rel="stylesheet" href="/static/console.css">'
            '<script src="/static/console.js" defer></script></head>')


def _header(nav: str | None, login, more: tuple = ()) -> str:
    links = "".join(f'<a href="{href}"{" aria-current=page" if key == nav else ""}>{h(text)}</a>'
                    for key, href, text in NAV + tuple(more))
    who = ""
    if login is not None:
        who = f'<span class="space">space <b>{h(login.space)}</b></span>'
        if login.key_id is not None:
            who += (f'<form method="post" action="/logout" class="logout"><button title="key '
                    f'{h(login.key_name or login.key_id)}">Sign out</button></form>')
        else:
            who += '<span class="muted">open mode</span>'
    return (f'<header><a class="brand" href="/runs">rallypoint</a><nav>{links}</nav>{who}'
            '<span id="live-status" class="off" title="live updates">live</span></header>')


def layout(page: Page, ctx, rendered: list[str]) -> str:
    """The whole page around the rendered parts."""
    path = ctx.request.scope["path"]
    base = {k: v for k, v in ctx.query.items() if k != "part"}
    sections = []
    for part, html in zip(page.parts, rendered):
        src = url(path, **{**base, "part": part.name})
        refresh = f' data-refresh="{part.refresh}"' if part.refresh else ""
        sections.append(f'<section class="part part-{h(part.name)}" data-part="{h(part.name)}" data-src="{h(src)}"'
                        f'{refresh}>{html}</section>')
    stream = f' data-stream="/stream?{h(page.stream)}"' if page.stream is not None else ""
    return (_head(page.title) + f'<body data-page="{h(page.nav)}"{stream}>'
            + _header(page.nav, ctx.login, getattr(ctx.app.service, "nav", ()))
            + f'<main><h1>{h(page.title)}</h1>{"".join(sections)}</main></body></html>')


def login_page(nxt: str, error: str | None) -> str:
    err = f'<p class="error" role="alert">{h(error)}</p>' if error else ""
    return (_head("Sign in") + '<body data-page="login">' + _header(None, None)
            + '<main class="login"><h1>Sign in</h1>'
            + '<p>Paste an API key of this server (<code>rallypoint keys create</code>). The console shows its '
              "space only, and only reads. The key is sent once, in this form; the browser keeps an opaque "
              "session cookie.</p>" + err
            + f'<form method="post" action="/login"><input type="hidden" name="next" value="{h(nxt)}">'
              '<label>API key <input type="password" name="key" autocomplete="current-password" required '
              'autofocus size="48"></label><button>Sign in</button></form></main></body></html>')


def error_page(e: RallypointError, login) -> str:
    return (_head(e.code) + '<body data-page="error">' + _header(None, login)
            + f'<main><h1>{h(e.code)}</h1><p class="error">{h(e.message or str(e))}</p>'
              '<p><a href="/runs">Back to the runs</a></p></main></body></html>')
