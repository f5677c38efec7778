"""The console's actions (issue 46): cancel a run (with its subtree), retry or fail a
task, release a task's lease, close a join set, pause or unpause a schedule.

Each action is the operation a client would send over TCP or HTTP (``scope.cancel``,
``delivery.retry``, ``delivery.reject``, ``delivery.release``, ``joinset.close``,
``schedule.pause``), run through ``Service.call`` under the login's own key -- its
space, its permissions, checked there as for any request (FORBIDDEN for a key that
lacks ``coordination_write``; UNAUTHENTICATED once it is revoked) -- never under the
read-only session the pages read with.

- **Plain HTML forms, two steps.** A page shows a button only to a login whose key
  holds the operation's permission (:func:`allowed`); the button is a GET form to
  ``/actions/<name>?target=ID`` -- the *confirmation* page, which says what will happen
  and holds a POST form back to the same path with the CSRF token and ``confirm=yes``.
  The POST does it and answers a page saying what was done. No JavaScript needed.
- **CSRF.** The token is ``HMAC-SHA256(app secret, the login)``: per session (the
  digest of its cookie) for a key's login, per server process in open mode; compared in
  constant time (``hmac.compare_digest``). A POST without it, with another, or from
  another origin (``Origin`` / ``Sec-Fetch-Site``) is refused: 403 FORBIDDEN, nothing
  done. The cookie is ``SameSite=Strict`` besides.
- **Audit.** Once the operation succeeded, the console records it with
  ``console.acted`` (``rallypoint/actors/operator_log.py``) under ``Session.as_local``
  of the acting session: the event ``console.action`` names the action, the target and
  the key id that did it (``key`` None in open mode), beside the operation's own events.
- **Fenced.** A task action carries the delivery's fencing token the confirmation page
  showed: if another worker took the task over meanwhile, the operation is refused
  (STALE_CLAIM), never applied to a delivery the operator did not see.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any, Awaitable, Callable, NamedTuple
from urllib.parse import parse_qsl, quote

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .. import protocol as p
from ..actors.api import OPS, REPLY_TYPES
from ..errors import ForbiddenError, NotFoundError, RallypointError, ValidationError
from ..service import Session
from . import pages
from .pages import Page, Part, a, badge, dl, h, run_url

__all__ = ["ACTIONS", "Action", "csrf_token", "check_csrf", "allowed", "action_session", "button", "handle",
           "MAX_NOTE", "MAX_FORM"]

#: Longest note (a run's cancel reason, a schedule's pause note), characters.
MAX_NOTE = 200
#: Largest action form body, bytes.
MAX_FORM = 4096


class Action(NamedTuple):
    """One console action: ``name`` (its path ``/actions/<name>``), ``label`` (its
    button), ``op`` (the operation's request type: its permission is the action's),
    ``noun`` (what ``target`` names), ``describe(ctx, target) -> (html, hidden fields)``
    (the confirmation page's text and the form fields it fixes, e.g. a delivery's
    token), ``build(ctx, target, form) -> (op, run id, back url, summary)`` and whether
    it takes a ``note``."""

    name: str
    label: str
    op: type
    noun: str
    describe: Callable[[Any, str], Awaitable[tuple[str, dict]]]
    build: Callable[[Any, str, dict], Awaitable[tuple[msgspec.Struct, str | None, str, str]]]
    note: str | None = None  # the note's label, None: no note


def task_url(task_id: str) -> str:
    return "/tasks/" + quote(task_id, safe="")


def _who(ctx) -> str:
    login = ctx.login
    return f"key {login.key_id}" if login.key_id is not None else "open mode"


def _reason(ctx, verb: str, form: dict) -> dict:
    """The error payload a task action records: why (the note), who."""
    return {"reason": f"{verb} from the console by {_who(ctx)}", **({"note": form["note"]} if form.get("note") else {})}


# ---------------------------------------------------------------------------- runs
async def _describe_cancel(ctx, target):
    s, ops = await pages.gather(ctx, p.ScopeStatus(scope_id=target), p.OpsRun(scope_id=target))
    if s.stored_state != "ACTIVE":
        raise RallypointError(f"the run {target} is {s.stored_state} already", code="CONFLICT")
    return (f"<p>Cancel the run {a(run_url(s.id), pages.run_label(s))} {pages.run_state(s)} and its whole subtree "
            f"({h(ops.runs)} runs): its unfinished tasks are CANCELLED, open groups fail, barriers and timers are "
            "cancelled, leases end. This cannot be undone.</p>", {})


async def _build_cancel(ctx, target, form):
    reason = form.get("note") or f"cancelled from the console by {_who(ctx)}"
    return p.ScopeCancel(scope_id=target, reason=reason), target, run_url(target), f"Run {target} cancelled"


# ---------------------------------------------------------------------------- tasks
async def _delivery(ctx, target):
    v = await ctx.call(p.OpsTask(task_id=target))
    if v.delivery is None:
        raise RallypointError(f"the task {target} is {v.task.state}: it holds no lease (nothing to act on)",
                              code="CONFLICT", details={"state": v.task.state})
    return v


def _describe_task(what: str):
    async def describe(ctx, target):
        v = await _delivery(ctx, target)
        d = v.delivery
        facts = dl([("task", a(task_url(target), target)), ("state", badge(v.task.state)),
                    ("attempt", f"{v.task.attempt} of at most {v.max_attempts}"),
                    ("holder", h(d.holder or "—")), ("fencing token", h(d.token)),
                    ("lease expires", pages.when(d.lease_expires_at))])
        return (f"<p>{what}</p>{facts}<p class=\"muted\">The action is fenced by this delivery's token: if another "
                "worker took the task over meanwhile, it is refused.</p>", {"token": str(d.token)})
    return describe


def _token(form: dict) -> int:
    try:
        return int(form.get("token") or "")
    except ValueError:
        raise ValidationError("the form lacks the delivery's token", details={"field": "token"}) from None


async def _build_retry(ctx, target, form):
    op = p.DeliveryRetry(task_id=target, token=_token(form),
                         error=msgspec.Raw(msgspec.msgpack.encode(_reason(ctx, "retried", form))))
    return op, await _task_run(ctx, target), task_url(target), f"Task {target} sent back to its queue (retried)"


async def _build_fail(ctx, target, form):
    op = p.DeliveryReject(task_id=target, token=_token(form),
                          error=msgspec.Raw(msgspec.msgpack.encode(_reason(ctx, "failed", form))))
    return op, await _task_run(ctx, target), task_url(target), f"Task {target} failed"


async def _build_release(ctx, target, form):
    op = p.DeliveryRelease(task_id=target, token=_token(form))
    return op, await _task_run(ctx, target), task_url(target), f"The lease on task {target} released"


async def _task_run(ctx, target) -> str:
    return (await ctx.call(p.OpsTask(task_id=target))).task.scope_id


# ---------------------------------------------------------------------------- join sets
async def _describe_close(ctx, target):
    v = await ctx.call(p.OpsJoinSet(joinset_id=target))
    j = v.joinset
    if j.state != "OPEN":
        raise RallypointError(f"the join set {target} is {j.state} already", code="CONFLICT")
    return (f"<p>Close the join set {a('/joinsets/' + quote(j.id, safe=''), j.name or j.id)} of run "
            f"{a(run_url(j.scope_id), j.scope_id)}: it takes no more children ({h(j.submitted)} submitted, "
            f"{h(j.finished)} finished); its cancellable children still running are cancelled.</p>", {})


async def _build_close(ctx, target, form):
    v = await ctx.call(p.OpsJoinSet(joinset_id=target))
    return (p.JoinSetClose(joinset_id=target), v.joinset.scope_id, "/joinsets/" + quote(target, safe=""),
            f"Join set {target} closed")


# ---------------------------------------------------------------------------- schedules
def _describe_pause(paused: bool):
    async def describe(ctx, target):
        d = await ctx.call(p.ScheduleGet(schedule=target, next_n=3, recent=0))
        if d.paused == paused:
            raise RallypointError(f"the schedule {d.name} is {'paused' if paused else 'not paused'} already",
                                  code="CONFLICT")
        what = ("Pause the schedule: nothing fires until it is unpaused (the times that fall due meanwhile are "
                "recorded as skipped)" if paused else "Unpause the schedule: it fires again from now")
        return f"<p>{h(what)}.</p>" + dl([("schedule", h(d.name)), ("id", f"<code>{h(d.id)}</code>")]), {}
    return describe


def _build_pause(paused: bool):
    async def build(ctx, target, form):
        note = form.get("note") or f"{'paused' if paused else 'unpaused'} from the console by {_who(ctx)}"
        return (p.SchedulePause(schedule=target, paused=paused, note=note), None, "/resources",
                f"Schedule {target} {'paused' if paused else 'unpaused'}")
    return build


#: The actions, by name.
ACTIONS: dict[str, Action] = {x.name: x for x in (
    Action("cancel-run", "Cancel run…", p.ScopeCancel, "run", _describe_cancel, _build_cancel, "reason"),
    Action("retry-task", "Retry…", p.DeliveryRetry, "task",
           _describe_task("Send the task back to its queue now, counting this attempt (FAILED instead when it was "
                          "its last): its worker's lease ends."), _build_retry, "note"),
    Action("fail-task", "Fail…", p.DeliveryReject, "task",
           _describe_task("Fail the task for good (FAILED, no retry): its worker's lease ends."), _build_fail, "note"),
    Action("release-lease", "Release lease…", p.DeliveryRelease, "task",
           _describe_task("Release the worker's lease: the task is QUEUED again at once, the attempt not counted."),
           _build_release),
    Action("close-joinset", "Close…", p.JoinSetClose, "join set", _describe_close, _build_close),
    Action("pause-schedule", "Pause…", p.SchedulePause, "schedule", _describe_pause(True), _build_pause(True),
           "note"),
    Action("unpause-schedule", "Unpause…", p.SchedulePause, "schedule", _describe_pause(False), _build_pause(False),
           "note"),
)}


# ---------------------------------------------------------------------------- rights and tokens
def allowed(permissions: frozenset[str] | None, permission: str) -> bool:
    """Whether a key holding ``permissions`` (None: every one -- open mode) may make an
    operation that needs ``permission``: the rule ``Service.submit`` applies (the
    permission itself, or ``admin`` or ``operator``)."""
    if permissions is None:
        return True
    return permission in permissions or "admin" in permissions or "operator" in permissions


def action_session(ctx) -> Session:
    """The session an action runs under: the login's key with the permissions it holds
    (open mode's: every one, refused once the first key exists), not the console's
    read-only session."""
    login = ctx.login
    s = ctx.session
    return Session(space=s.space, permissions=login.permissions if login.key_id is not None else None, peer=s.peer,
                   key_id=login.key_id, client="console", open=login.key_id is None)


def _identity(app, request) -> bytes:
    """What a CSRF token is bound to: the login's session (its cookie's digest), or
    open mode."""
    if app.coordinator.keys.open_mode:
        return b"open"
    token = request.cookies.get(app.cookie_name) or ""
    return b"login:" + hashlib.sha256(token.encode()).hexdigest().encode()


def csrf_token(app, request) -> str:
    """The CSRF token of the request's login: ``HMAC-SHA256(app.csrf_secret, login)``,
    URL-safe base64 (43 characters)."""
    mac = hmac.new(app.csrf_secret, _identity(app, request), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def check_csrf(app, request, form: dict) -> None:
    """FORBIDDEN unless ``form["csrf"]`` is the login's token (constant-time compare)."""
    got = form.get("csrf") or ""
    if not hmac.compare_digest(got.encode(), csrf_token(app, request).encode()):
        raise ForbiddenError("the form's CSRF token is missing or wrong: open the action from the console's page again")


def button(ctx, name: str, target: str) -> str:
    """The button of action ``name`` on ``target`` (a GET form to its confirmation page),
    or "" when the login's key lacks the operation's permission."""
    act = ACTIONS[name]
    login = ctx.login
    if not allowed(login.permissions if login.key_id is not None else None, OPS[act.op].permission):
        return ""
    return (f'<form class="action" method="get" action="/actions/{h(name)}">'
            f'<input type="hidden" name="target" value="{h(target)}">'
            f'<button class="act act-{h(name)}" data-action="{h(name)}">{h(act.label)}</button></form>')


def buttons(ctx, *pairs: tuple[str, str]) -> str:
    """Several :func:`button` s in a row (empty when the key may do none)."""
    out = "".join(button(ctx, n, t) for n, t in pairs)
    return f'<div class="actions">{out}</div>' if out else ""


# ---------------------------------------------------------------------------- the requests
async def _read_form(request: Request) -> dict:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            raise ValidationError(f"the action form is larger than {MAX_FORM} bytes")
    return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))


async def handle(app, request: Request, raw_path: str) -> Response:
    """``GET /actions/<name>?target=ID``: the confirmation page; ``POST`` (the form's
    fields ``target``, ``csrf``, ``confirm=yes``, ``token``, ``note``): the action, then
    a page saying what was done. Raises RallypointError (the console's error page:
    NOT_FOUND for an unknown action, FORBIDDEN for a bad token, another origin or a key
    without the permission, VALIDATION_FAILED for a bad form; the operation's own
    errors) and UnauthenticatedError (to the sign-in form)."""
    name = raw_path[len("/actions/"):]
    act = ACTIONS.get(name)
    if act is None:
        raise NotFoundError(f"no console action {name[:64]!r}")
    method = request.method
    if method == "POST":
        app._check_origin(request)
        form = await _read_form(request)
        ctx = app._ctx(request, {})  # (signed in first: a stale session goes to the sign-in form)
        check_csrf(app, request, form)
        if form.get("confirm") != "yes":
            raise ValidationError("the action was not confirmed", details={"field": "confirm"})
        return await _perform(app, ctx, act, form)
    if method not in ("GET", "HEAD"):
        return Response("GET or POST only", status_code=405, media_type="text/plain; charset=utf-8")
    ctx = app._ctx(request, {})
    target = ctx.query.get("target") or ""
    if not target:
        raise ValidationError("which one? (target)", details={"field": "target"})
    return _html(await _confirm_page(app, ctx, act, target))


async def _confirm_page(app, ctx, act: Action, target: str) -> str:
    if not allowed(ctx.login.permissions if ctx.login.key_id is not None else None, OPS[act.op].permission):
        raise ForbiddenError(f"this key lacks the permission {OPS[act.op].permission!r} this action needs")
    text, fixed = await act.describe(ctx, target)
    fields = {"target": target, "csrf": csrf_token(app, ctx.request), "confirm": "yes", **fixed}
    hidden = "".join(f'<input type="hidden" name="{h(k)}" value="{h(v)}">' for k, v in fields.items())
    note = (f'<label>{h(act.note)} (optional) <input name="note" maxlength="{MAX_NOTE}" size="48"></label>'
            if act.note else "")
    form = (f'<form class="confirm" method="post" action="/actions/{h(act.name)}">{hidden}{note}'
            f'<button class="danger" id="confirm">Yes, {h(act.label.rstrip("…").lower())}</button> '
            f'{a(_page_of(act, target), "No, go back", "cancel")}</form>')

    async def render() -> str:
        return text + form

    page = Page(f"{act.label.rstrip('…')}: {target}", "runs", [Part("confirm", render)])
    return pages.layout(page, ctx, [await render()])


def _page_of(act: Action, target: str) -> str:
    """The console page of an action's target."""
    return {"run": run_url(target), "task": task_url(target), "join set": "/joinsets/" + quote(target, safe=""),
            "schedule": "/resources"}[act.noun]


async def _perform(app, ctx, act: Action, form: dict) -> Response:
    target = form.get("target") or ""
    if not target or len(target) > 256:
        raise ValidationError("which one? (target)", details={"field": "target"})
    note = form.get("note") or None
    if note is not None and len(note) > MAX_NOTE:
        raise ValidationError(f"the note is longer than {MAX_NOTE} characters", details={"field": "note"})
    op, run, back, summary = await act.build(ctx, target, form)
    session = action_session(ctx)
    await app.service.call(session, op)  # the permission checked there, as over the wire
    done = msgspec.msgpack.decode(await app.service.call(session.as_local(), p.OperatorActed(
        action=act.name, target=target, run=run, note=note)), type=REPLY_TYPES[p.OperatorActed])

    async def render() -> str:
        return (f'<p class="done" role="status" data-action="{h(act.name)}">{h(summary)}.</p>'
                + dl([("by", h(_who(ctx))), ("at", pages.when(done.at)),
                      ("recorded as", "the event <code>console.action</code>")])
                + f"<p>{a(back, 'Back')}</p>")

    page = Page("Done", "runs", [Part("done", render)])
    return _html(pages.layout(page, ctx, [await render()]))


def _html(text: str) -> Response:
    return Response(text, status_code=200, media_type="text/html; charset=utf-8")
