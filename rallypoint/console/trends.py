"""Queue trends for the console (issue 46): per work queue, depth, in flight,
completions per second and the p50/p99 lifecycle latency (submission to its end:
SUCCEEDED/ACKED or FAILED), over the last hour.

**Where the figures come from.** A small in-memory ring in the console, sampled every
:data:`PERIOD_S` seconds by :meth:`Trends.run` (started by ``serve_console``) -- not
derived from the metrics (they are server-wide, not per queue). Each sample reads, as
every console read, through operations (``Service.call`` under a trusted in-process
read session of the space):

- ``ops.items`` (queues): depth (``queued``), in flight (``running``) and the ``done``
  counter, whose difference between two samples over the time between them is the
  completions per second;
- ``events.list`` from the sampler's cursor, only ``task.submitted``, ``task.completed``
  and ``task.failed``: a submission's instant is kept (at most :data:`MAX_PENDING` per
  space, the oldest forgotten first) until the task's end, whose instant minus it is one
  latency sample of its queue; the period's p50 and p99 are the nearest-rank quantiles
  of its samples (none: no value). At most :data:`MAX_PAGES` pages of 1,000 events are
  read per period: under more load the cursor skips to the newest (the latency is then
  from a prefix of the period's events; ``skipped`` counts the events not read), and a
  cursor the log no longer holds starts again from its newest.

**Spaces**: ``default`` and the space of every live API key (at most
:data:`MAX_SPACES`); a queue gets a series once a sample sees it (at most
:data:`MAX_QUEUES` series in all).

**Memory bound**: a series is six ``array('d')`` columns of :data:`CAPACITY` (360)
samples, 8 bytes each: 17 KB per queue, 8.6 MB for :data:`MAX_QUEUES` (500) queues;
the pending submissions are at most :data:`MAX_PENDING` (50,000) ids per space, about
10 MB per busy space. Nothing is written to disk: a restart starts an empty ring.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from typing import Any, Iterable

import msgspec
import trio

from .. import protocol as p
from ..clock import from_iso
from ..errors import RallypointError
from ..service import Session

__all__ = ["Trends", "Series", "PERIOD_S", "HORIZON_S", "CAPACITY", "MAX_QUEUES", "MAX_PENDING", "FIELDS",
           "quantile"]

log = logging.getLogger("rallypoint.console")

#: Seconds between two samples.
PERIOD_S = 10.0
#: Seconds of history kept.
HORIZON_S = 3600.0
#: Samples a series holds (the last hour at one per 10 s).
CAPACITY = int(HORIZON_S / PERIOD_S)
#: Queue series kept at most (all spaces together).
MAX_QUEUES = 500
#: Spaces sampled at most.
MAX_SPACES = 100
#: Submissions waiting for their end, kept per space at most (oldest forgotten first).
MAX_PENDING = 50_000
#: Pages of events (1,000 each) read per space per sample, at most.
MAX_PAGES = 20
#: A sample's columns: wall time (s), depth, in flight, completions/s, p50 and p99 (ms).
FIELDS = ("t", "depth", "in_flight", "done_per_s", "p50_ms", "p99_ms")
#: The event types read for the latency.
LATENCY_TYPES = ["task.submitted", "task.completed", "task.failed"]

_event = msgspec.msgpack.Decoder(p.EventView).decode
_NAN = float("nan")


def quantile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank quantile ``q`` (0-1) of ``sorted_values`` (None when empty)."""
    if not sorted_values:
        return None
    i = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


class Series:
    """The ring of one queue's samples: :data:`FIELDS` columns of :data:`CAPACITY`
    floats (NaN: no value), the oldest overwritten first."""

    __slots__ = ("cols", "n", "head", "done", "done_t")

    def __init__(self) -> None:
        self.cols = [array("d", [_NAN]) * CAPACITY for _ in FIELDS]
        self.n = 0  # samples held
        self.head = 0  # where the next sample goes
        self.done: int | None = None  # the last ``done`` counter read, and when (s)
        self.done_t = 0.0

    def add(self, values: Iterable[float | None]) -> None:
        """Append one sample (in :data:`FIELDS` order; None is stored as NaN)."""
        for col, v in zip(self.cols, values):
            col[self.head] = _NAN if v is None else float(v)
        self.head = (self.head + 1) % CAPACITY
        self.n = min(CAPACITY, self.n + 1)

    def rows(self, since: float | None = None) -> list[tuple]:
        """The samples held, oldest first, each a tuple in :data:`FIELDS` order (None for
        no value); with ``since``, only those at or after that wall time (s)."""
        start = (self.head - self.n) % CAPACITY
        out = []
        for k in range(self.n):
            i = (start + k) % CAPACITY
            row = tuple(None if math.isnan(c[i]) else c[i] for c in self.cols)
            if since is None or row[0] >= since:
                out.append(row)
        return out

    def columns(self) -> dict[str, list]:
        """The samples as columns (what the chart draws): ``{field: [values]}``."""
        rows = self.rows()
        return {f: [r[k] for r in rows] for k, f in enumerate(FIELDS)}


class _SpaceCursor:
    __slots__ = ("cursor", "pending", "skipped")

    def __init__(self) -> None:
        self.cursor: int | None = None  # None: start from the newest at the first sample
        self.pending: dict[str, tuple[str, int]] = {}  # task id -> (queue name, submitted at ms)
        self.skipped = 0


class Trends:
    """The console's ring of queue trends (see the module's text). ``call(session, op)``
    runs a read (the console's :meth:`ConsoleApp.call`); ``spaces()`` names the spaces
    to sample; ``period_s``: seconds between samples (:meth:`run`; the ring then spans
    ``CAPACITY * period_s``: an hour at the default 10 s)."""

    def __init__(self, call, spaces, period_s: float = PERIOD_S) -> None:
        self.call = call
        #: seconds between two samples (the ring holds CAPACITY of them)
        self.period_s = period_s
        self.spaces = spaces
        self.series: dict[tuple[str, str], Series] = {}  # (space, queue name) -> series
        self.cursors: dict[str, _SpaceCursor] = {}
        self.samples = 0
        self.failures = 0

    def get(self, space: str, queue: str) -> Series | None:
        """The series of ``queue`` in ``space`` (None: not sampled yet)."""
        return self.series.get((space, queue))

    async def run(self) -> None:
        """Sample every :attr:`period_s` seconds until cancelled; a sample that fails is
        logged (an internal error: its first three, counted in ``failures``) and the next
        one tried: the sampler never takes the console down."""
        period_s = self.period_s
        while True:
            try:
                await self.sample()
            except RallypointError as e:
                log.warning("console trends: a sample failed: %s", e)
            except Exception:  # a bug: the console keeps serving, the next sample is tried
                self.failures += 1
                if self.failures <= 3:
                    log.exception("console trends: a sample failed (internal error)")
            await trio.sleep(period_s)

    async def sample(self, now_s: float | None = None) -> None:
        """Take one sample of every queue of every space (``now_s``: its wall time,
        seconds; default now)."""
        now_s = time.time() if now_s is None else now_s
        for space in list(self.spaces())[:MAX_SPACES]:
            session = Session(space=space, peer="console-trends")
            latencies = await self._latencies(space, session)
            v = await self.call(session, p.OpsItems(kinds=["queues"], limit=1000))
            for q in v.queues:
                key = (space, q.name)
                s = self.series.get(key)
                if s is None:
                    if len(self.series) >= MAX_QUEUES:
                        continue
                    s = self.series[key] = Series()
                rate = None
                if s.done is not None and now_s > s.done_t:
                    rate = max(0.0, (q.done - s.done) / (now_s - s.done_t))
                s.done, s.done_t = q.done, now_s
                lat = sorted(latencies.get(q.name, ()))
                s.add((now_s, q.queued, q.running, rate, quantile(lat, 0.5), quantile(lat, 0.99)))
        self.samples += 1

    async def _latencies(self, space: str, session: Session) -> dict[str, list[float]]:
        """Lifecycle latencies (ms) per queue name of the tasks that ended since the last
        sample, from the space's events."""
        cur = self.cursors.get(space)
        if cur is None:
            cur = self.cursors[space] = _SpaceCursor()
        out: dict[str, list[float]] = {}
        if cur.cursor is None:
            head = await self.call(session, p.EventsList(limit=1))
            cur.cursor = head.newest
            return out
        pending = cur.pending
        for _ in range(MAX_PAGES):
            try:
                page = await self.call(session, p.EventsList(cursor=cur.cursor, limit=1000, types=LATENCY_TYPES))
            except RallypointError as e:
                if e.code != "CURSOR_EXPIRED":
                    raise
                head = await self.call(session, p.EventsList(limit=1))
                cur.cursor = head.newest
                return out
            for raw in page.events:
                e = _event(bytes(raw))
                at_ms = from_iso(e.at)
                if e.type == "task.submitted":
                    if len(pending) >= MAX_PENDING:
                        pending.pop(next(iter(pending)))
                    pending[e.id] = ((e.data or {}).get("mailbox"), at_ms)
                else:
                    got = pending.pop(e.id, None)
                    if got is not None and got[0] is not None:
                        out.setdefault(got[0], []).append(max(0.0, at_ms - got[1]))
            cur.cursor = page.next_cursor
            if page.next_cursor >= page.newest:
                return out
        head = await self.call(session, p.EventsList(limit=1))
        cur.skipped += max(0, head.newest - cur.cursor)
        cur.cursor = head.newest
        return out

    def statistics(self) -> dict[str, Any]:
        """``series``, ``samples`` taken, ``pending`` submissions held, events ``skipped``."""
        return {"series": len(self.series), "samples": self.samples,
                "pending": sum(len(c.pending) for c in self.cursors.values()),
                "skipped": sum(c.skipped for c in self.cursors.values())}


# ---------------------------------------------------------------------------- the page's part
def _cell(v: float | None, digits: int = 1) -> str:
    return '<span class="muted">—</span>' if v is None else f"{v:.{digits}f}"


def render_queue_trend(ctx, queue: str) -> str:
    """The queue page's trend: a figure whose ``data-trend`` holds the last hour's
    samples as JSON columns (drawn by ``console.js`` with uPlot) and, inside it, the
    same figures as a table (newest first: what a page without JavaScript shows)."""
    import json

    from .pages import h

    trends = ctx.app.trends
    s = trends.get(ctx.session.space, queue)
    every = f"a sample every {trends.period_s:g} s, kept for {CAPACITY * trends.period_s / 60:g} minutes"
    if s is None or not s.n:
        return f'<h2>Trend</h2><p class="muted empty">no sample yet ({every})</p>'

    rows = s.rows()
    cols = {f: [r[k] for r in rows] for k, f in enumerate(FIELDS)}
    body = "".join(
        f"<tr><td>{h(time.strftime('%H:%M:%S', time.gmtime(r[0])))}</td><td>{_cell(r[1], 0)}</td>"
        f"<td>{_cell(r[2], 0)}</td><td>{_cell(r[3])}</td><td>{_cell(r[4])}</td><td>{_cell(r[5])}</td></tr>"
        for r in reversed(rows))
    table = ("<table class=\"trend-table\"><thead><tr><th>At (UTC)</th><th>Depth</th><th>In flight</th>"
             "<th>Done / s</th><th>p50 ms</th><th>p99 ms</th></tr></thead><tbody>" + body + "</tbody></table>")
    return (f'<h2>Trend ({every})</h2>'
            f'<figure class="trend" data-trend="{h(json.dumps(cols, allow_nan=False))}">'
            '<div class="trend-charts"></div>'
            f'<details open><summary>The figures ({len(rows)} samples, newest first)</summary>{table}</details>'
            "</figure>")
