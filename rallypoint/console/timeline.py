"""A run's timeline for the console (issue 46; Temporal's timeline, Dask's task stream):
its tasks, join sets (with their steps), groups and child runs as bars over time.

Built from the run's events (``events.list`` of the run and its subtree, while kept:
at most :data:`MAX_EVENTS`), so it is what happened as it was told, never a read of
state: a task's lane is *queued* from ``task.submitted`` (or a retry, a lease expiry, a
release) to ``task.delivered``, then *running* to its next event; it ends at
``task.completed`` / ``failed`` / ``cancelled`` / ``expired``; a join set's lane runs
from ``joinset.created`` to ``joinset.closed`` with a tick at each step (a completion
record taken, a child done); a group's from ``group.created`` to ``group.finalized``,
ticked at each verdict (its members are task lanes labelled with the group); a child
run's from ``scope.created`` to its end. A lane still open runs to now.

Drawn on the server as SVG (bars with a ``<title>`` each, lanes linked to their
pages): no script needed, and it obeys the console's Content-Security-Policy (no inline
style: presentation attributes only). At most :data:`MAX_LANES` lanes (the first to
start), saying how many more.
"""

from __future__ import annotations

import time
from typing import NamedTuple
from urllib.parse import quote

import msgspec

from .. import protocol as p
from ..clock import from_iso

__all__ = ["Lane", "Segment", "lanes_of", "render_timeline", "MAX_EVENTS", "MAX_LANES"]

#: Events of the run read at most (pages of 1,000).
MAX_EVENTS = 5000
#: Lanes drawn at most.
MAX_LANES = 120

_event = msgspec.msgpack.Decoder(p.EventView).decode

#: segment kind -> fill colour
COLOURS = {"queued": "#c4cbd4", "running": "#2457c5", "succeeded": "#1f7a3d", "failed": "#b42318",
           "cancelled": "#8a929c", "open": "#7a5cc2", "group": "#9a6700", "run": "#5b6470"}
_END = {"task.completed": "succeeded", "task.failed": "failed", "task.cancelled": "cancelled",
        "task.expired": "cancelled"}
_REQUEUE = ("task.retried", "task.lease_expired", "task.released")


class Segment(NamedTuple):
    """A stretch of a lane: ``kind`` (a key of :data:`COLOURS`), from ``start_ms`` to
    ``end_ms`` (wall ms; None: still open), ``note`` (its hover text)."""

    kind: str
    start_ms: int
    end_ms: int | None
    note: str


class Lane:
    """One entity's row: ``kind`` (task, joinset, group, run), ``id``, ``label``, its
    ``segments`` and ``ticks`` (``(at_ms, note)``), and ``outcome`` (its end, if any)."""

    __slots__ = ("kind", "id", "label", "segments", "ticks", "outcome", "start_ms")

    def __init__(self, kind: str, id: str, label: str, start_ms: int) -> None:
        self.kind, self.id, self.label, self.start_ms = kind, id, label, start_ms
        self.segments: list[Segment] = []
        self.ticks: list[tuple[int, str]] = []
        self.outcome: str | None = None

    def open(self, kind: str, at_ms: int, note: str) -> None:
        self.close(at_ms)
        self.segments.append(Segment(kind, at_ms, None, note))

    def close(self, at_ms: int) -> None:
        if self.segments and self.segments[-1].end_ms is None:
            s = self.segments[-1]
            self.segments[-1] = s._replace(end_ms=at_ms)


def lanes_of(events: list, run_id: str) -> list[Lane]:
    """The lanes told by ``events`` (EventViews, oldest first) of the run ``run_id`` and
    its subtree, in order of their start."""
    lanes: dict[str, Lane] = {}

    def lane(kind: str, id: str, label: str, at: int) -> Lane:
        got = lanes.get(id)
        if got is None:
            got = lanes[id] = Lane(kind, id, label, at)
        return got

    for e in events:
        at = from_iso(e.at)
        d = e.data or {}
        t = e.type
        if e.kind == "task":
            if t == "task.submitted":
                label = f"task {e.id[-6:]} · {d.get('mailbox') or ''}" + (" · group" if d.get("group") else "")
                lane("task", e.id, label, at).open("queued", at, "queued")
                continue
            ln = lanes.get(e.id)
            if ln is None:
                continue  # submitted before the kept events began
            if t == "task.delivered":
                ln.open("running", at, f"attempt {d.get('attempt')} · {d.get('holder') or ''}")
            elif t in _REQUEUE:
                ln.open("queued", at, f"{t.split('.')[1]} (attempt {d.get('attempt')})")
            elif t in _END:
                ln.close(at)
                ln.outcome = _END[t]
                ln.segments.append(Segment(_END[t], at, at, t + (f" ({d['reason']})" if d.get("reason") else "")))
        elif e.kind == "joinset":
            if t == "joinset.created":
                lane("joinset", e.id, f"join set {d.get('name') or e.id[-6:]}", at).open("open", at, "open")
                continue
            ln = lanes.get(e.id)
            if ln is None:
                continue
            if t in ("joinset.consumed", "joinset.child_done"):
                ln.ticks.append((at, t.split(".")[1] + (f" #{d['index']}" if "index" in d else "")))
            elif t == "joinset.closing":
                ln.ticks.append((at, "closing"))
            elif t == "joinset.closed":
                ln.close(at)
                ln.outcome = "closed"
        elif e.kind == "group":
            if t == "group.created":
                lane("group", e.id, f"group {e.id[-6:]} · {d.get('condition') or ''}", at).open("group", at,
                                                                                                 "deciding")
                continue
            ln = lanes.get(e.id)
            if ln is None:
                continue
            if t == "group.verdict":
                late = " (late)" if d.get("late") else ""
                ln.ticks.append((at, f"{d.get('verdict')} {d.get('task') or ''}{late}"))
            elif t == "group.finalized":
                ln.close(at)
                ln.outcome = str(d.get("outcome") or "decided")
        elif e.kind == "scope" and e.id != run_id:
            if t == "scope.created":
                lane("run", e.id, f"run {d.get('name') or e.id[-6:]}", at).open("run", at, "active")
                continue
            ln = lanes.get(e.id)
            if ln is not None and t in ("scope.cancelled", "scope.completed", "scope.deadline"):
                ln.close(at)
                ln.outcome = t.split(".")[1]
    return sorted(lanes.values(), key=lambda x: x.start_ms)


async def read_events(ctx, run_id: str) -> tuple[list, bool]:
    """The kept events of the run and its subtree, oldest first (at most
    :data:`MAX_EVENTS`), and whether there were more."""
    out: list = []
    cursor = None
    while len(out) < MAX_EVENTS:
        page = await ctx.call(p.EventsList(cursor=cursor, limit=1000, scope_id=run_id))
        out += [_event(bytes(r)) for r in page.events]
        if page.next_cursor >= page.newest:
            return out, False
        cursor = page.next_cursor
    return out[:MAX_EVENTS], True


def _span(ms: float) -> str:
    s = ms / 1000
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


async def render_timeline(ctx, run_id: str) -> str:
    """The run page's timeline part: an SVG of the run's lanes, with a legend."""
    from .pages import h

    events, more = await read_events(ctx, run_id)
    lanes = lanes_of(events, run_id)
    if not lanes:
        return '<h3>Timeline</h3><p class="muted empty">no task, join set, group or child run in the kept events</p>'
    now = int(time.time() * 1000)
    shown = lanes[:MAX_LANES]
    t0 = min(x.start_ms for x in shown)
    t1 = max([t0 + 1] + [s.end_ms if s.end_ms is not None else now for x in shown for s in x.segments]
             + [a for x in shown for a, _ in x.ticks])
    label_w, width, row = 260, 1000, 18
    plot = width - label_w - 10
    height = 24 + row * len(shown)

    def x(ms: float) -> float:
        return label_w + (ms - t0) / (t1 - t0) * plot

    hrefs = {"task": "/tasks/", "joinset": "/joinsets/", "group": "/groups/", "run": "/runs/"}
    parts = [f'<svg class="timeline" viewBox="0 0 {width} {height}" width="100%" role="img" '
             f'aria-label="timeline of the run">']
    for k in range(5):  # the time axis: 0 .. the whole span
        ms = t0 + (t1 - t0) * k / 4
        parts.append(f'<line x1="{x(ms):.1f}" y1="14" x2="{x(ms):.1f}" y2="{height}" stroke="#dfe3e8"/>'
                     f'<text x="{x(ms):.1f}" y="11" font-size="10" fill="#6b7480" '
                     f'text-anchor="{("start", "middle", "middle", "middle", "end")[k]}">+{h(_span(ms - t0))}</text>')
    for i, ln in enumerate(shown):
        y = 20 + i * row
        href = hrefs[ln.kind] + quote(ln.id, safe="")
        parts.append(f'<g class="lane lane-{h(ln.kind)}" data-id="{h(ln.id)}" data-outcome="{h(ln.outcome or "")}">'
                     f'<a href="{h(href)}"><text x="4" y="{y + 11}" font-size="11" fill="#2457c5">'
                     f'{h(ln.label[:42])}</text></a>')
        for s in ln.segments:
            end = s.end_ms if s.end_ms is not None else now
            w = max(2.0, x(end) - x(s.start_ms))
            parts.append(f'<rect class="seg seg-{h(s.kind)}" x="{x(s.start_ms):.1f}" y="{y + 2}" width="{w:.1f}" '
                         f'height="{row - 5}" rx="2" fill="{COLOURS[s.kind]}"><title>{h(ln.label)}: {h(s.note)}, '
                         f'{h(_span(end - s.start_ms))}{" (still open)" if s.end_ms is None else ""}</title></rect>')
        for at, note in ln.ticks:
            parts.append(f'<rect class="tick" x="{x(at) - 1:.1f}" y="{y}" width="2" height="{row - 1}" '
                         f'fill="#15202e"><title>{h(note)} at +{h(_span(at - t0))}</title></rect>')
        parts.append("</g>")
    parts.append("</svg>")
    legend = " ".join(f'<span class="k-{k}">■</span> {h(k)}' for k in ("queued", "running", "succeeded", "failed",
                                                                        "cancelled", "open", "group", "run"))
    notes = []
    if len(lanes) > MAX_LANES:
        notes.append(f"the first {MAX_LANES} of {len(lanes)} lanes")
    if more:
        notes.append(f"from the first {MAX_EVENTS} events kept")
    note = f' <span class="muted">({h("; ".join(notes))})</span>' if notes else ""
    return (f'<h3>Timeline <span class="muted">{h(_span(t1 - t0))} from the first event shown</span>{note}</h3>'
            + "".join(parts) + f'<p class="legend muted">{legend} · ticks: join-set steps, verdicts</p>')
