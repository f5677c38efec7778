"""Prometheus metrics: ``rallypoint serve --metrics 127.0.0.1:9411`` serves them at
``http://127.0.0.1:9411/metrics`` in the Prometheus text format, made by the
``prometheus-client`` library (:func:`prometheus_client.generate_latest`).

The hot path stays cheap: a request adds one dict increment and one bucket increment
(plain ints, :meth:`Metrics.observe`), the journal counts fsyncs the same way as the
sync helper's answers arrive, and everything else -- actors, tasks by state,
connections, the event log -- is read from the coordinator when Prometheus scrapes, on
the event loop (so a scrape sees a consistent state and never races the actors). The HTTP endpoint is a small Trio
server in the daemon's nursery.

Metrics (all prefixed ``rallypoint_``; seconds and bytes as Prometheus prefers):

=============================================  =========  =========================================
name                                           type       labels / meaning
=============================================  =========  =========================================
requests_total                                 counter    op, code (OK or the error code)
request_duration_seconds                       histogram  op: receipt of the request to its reply
                                                          leaving (after durability; long waits
                                                          included)
journal_fsync_duration_seconds                 histogram  one fdatasync of the journal
journal_group_commit_records                   histogram  records made durable by one fdatasync
journal_commit_wait_seconds                    histogram  a record's append to the event loop
                                                          learning it is durable (what a reply
                                                          waits; one sample per fsync step)
journal_last_lsn, journal_durable_lsn          gauge
journal_sync_pending_seconds                   gauge      age of the oldest fdatasync not yet
                                                          answered (0: none; a stuck disk
                                                          makes it grow)
snapshot_duration_seconds                      histogram  one snapshot, start to end
snapshot_stall_seconds                         histogram  its one stretch without a yield
snapshots_total                                counter
actors                                         gauge      kind, state (active, passive)
actor_waiters, actor_inbox                     gauge      kind
tasks                                          gauge      state (QUEUED, RUNNING, SUCCEEDED, ...)
ready_tasks                                    gauge      space, mailbox, priority: a work
                                                          queue's ready backlog per priority
ready_fair_keys                                gauge      space, mailbox: fairness keys with
                                                          ready tasks (no key not counted)
ready_tasks_by_fair_key                        gauge      space, mailbox, fair_key, bucket: the
                                                          ready backlog of the queue's
                                                          :data:`METRIC_TOP_KEYS` largest keys
                                                          (bucket "key"), the rest summed
                                                          (bucket "other", fair_key ""), no key
                                                          (bucket "none", fair_key ""): at most
                                                          12 series a queue, whatever the
                                                          tenants (bounded cardinality)
runs                                           gauge      state
entities                                       gauge
connections                                    gauge      open TCP connections
event_loop_lag_seconds                         histogram  how late a 100 ms sleep woke up
events_emitted_total, events_retained          counter / gauge
watchers                                       gauge      open subscriptions
watch_cut_off_total                            counter    SLOW_CONSUMER
retention_purged_entities_total                counter
space_limit                                    gauge      limit: the value of each limit per
                                                          space (README, Limits)
space_limit_use                                gauge      space, limit: a space's use of it
space_limit_refused_total                      counter    limit: operations refused
                                                          LIMIT_EXCEEDED by it
=============================================  =========  =========================================
"""

from __future__ import annotations

import heapq
import logging
import time
from bisect import bisect_left
from typing import Any

import trio

__all__ = ["Metrics", "ClusterMetrics", "serve_metrics", "key_authorizer", "LATENCY_BOUNDS"]

log = logging.getLogger("rallypoint.metrics")

#: request latency buckets, seconds (waits are up to 60 s)
LATENCY_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0, 10.0, 30.0, 60.0)
LAG_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SNAPSHOT_BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
STALL_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


#: the fairness keys per work queue that get their own ``ready_tasks_by_fair_key`` series
#: (the largest backlogs; the rest are summed as bucket "other")
METRIC_TOP_KEYS = 10


def top_fair_keys(by_key: dict[str | None, int], n: int = METRIC_TOP_KEYS) -> list[tuple[str, str, int]]:
    """A queue's ready backlog per fairness key (``key -> tasks``; None: no key) as at
    most ``n + 2`` ``(bucket, fair_key, tasks)`` rows: the ``n`` largest keys (ties by
    name) as ``("key", key, tasks)``, then the other keys summed as ``("other", "",
    tasks)`` and the tasks without a key as ``("none", "", tasks)`` (each only when
    not 0). The rows' tasks add up to the queue's ready tasks."""
    keyed = [(k, c) for k, c in by_key.items() if k is not None]
    top = heapq.nsmallest(n, keyed, key=lambda kc: (-kc[1], kc[0]))
    out = [("key", k, c) for k, c in top]
    rest = sum(c for _k, c in keyed) - sum(c for _k, c in top)
    if rest:
        out.append(("other", "", rest))
    if by_key.get(None):
        out.append(("none", "", by_key[None]))
    return out


class _Hist:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v


def _buckets(bounds, counts) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, +Inf last, as HistogramMetricFamily wants them."""
    out, acc = [], 0
    for b, c in zip(bounds, counts):
        acc += c
        out.append((repr(float(b)), acc))
    acc += counts[-1]
    out.append(("+Inf", acc))
    return out


class Metrics:
    """What the daemon counts for Prometheus. ``observe`` is called by the transport for
    every reply; the rest is read at scrape time.

    Args:
        coord: the coordinator.
        server: the TCP server (connections), or None.
        snapshotter: the node's Snapshotter (snapshot durations), or None.
        slow_s: requests slower than this (seconds) are logged (rate-limited) as
            ``slow_request``; 0: never. A server-side wait the client asked for (a
            result, an acquire or a receive with ``wait_ms``...: the op's ``@op``
            mark says, :meth:`~rallypoint.actors.opmark.OpTable.asked_wait`) is never
            slow, however long it took.
    """

    def __init__(self, coord, server=None, snapshotter=None, slow_s: float = 1.0) -> None:
        self.coord = coord
        self.server = server
        #: the HTTP listener (``rallypoint.http.server.HttpListener``: connections), or None
        self.http: Any = None
        self.errors: dict[tuple[str, str], int] = {}  # (op, code) -> requests answered with that error
        self.latency: dict[str, _Hist] = {}  # op -> every request's latency (its count: all requests)
        self.lag = _Hist(LAG_BOUNDS)
        self.snapshot_seconds = _Hist(SNAPSHOT_BOUNDS)
        self.snapshot_stall = _Hist(STALL_BOUNDS)
        self.snapshots = 0
        self.slow_s = slow_s or None
        #: replies faster than this can skip the slow-request check (the transport inlines them)
        self.fast_s = self.slow_s if self.slow_s is not None else float("inf")
        self._slow_log = None
        if snapshotter is not None:
            snapshotter.on_snapshot.append(self._on_snapshot)

    # ------------------------------------------------------------------ hot path
    def observe(self, op: str, code: str, seconds: float, peer: str = "", request: Any = None) -> None:
        """One request answered: ``op`` its tag, ``code`` OK or the error code,
        ``seconds`` from its receipt to its reply leaving, ``request`` its op Struct
        (None: unknown; then it may be logged as slow whatever it was)."""
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = _Hist(LATENCY_BOUNDS)
        h.counts[bisect_left(LATENCY_BOUNDS, seconds)] += 1
        h.sum += seconds
        if code != "OK":
            key = (op, code)
            self.errors[key] = self.errors.get(key, 0) + 1
        slow = self.slow_s
        if slow is not None and seconds >= slow and not (
                request is not None and self.coord.op_table.asked_wait(request)):
            self._slow(op, code, seconds, peer)

    def _slow(self, op: str, code: str, seconds: float, peer: str) -> None:
        if self._slow_log is None:
            from .logutil import RateLimitedLogger

            self._slow_log = RateLimitedLogger(log, window_s=10.0, burst=5)
        self._slow_log.log(logging.WARNING, "slow-request", "slow request: %s took %.1f ms (%s) from %s",
                           op, seconds * 1000, code, peer or "?",
                           extra={"event": "slow_request", "op": op, "code": code, "ms": round(seconds * 1000, 3),
                                  "peer": peer})

    def _on_snapshot(self, stats: dict) -> None:
        self.snapshots += 1
        self.snapshot_seconds.observe(stats.get("total_s", 0.0))
        self.snapshot_stall.observe(stats.get("stall_s", 0.0))

    async def lag_probe(self, interval: float = 0.1, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """How late a sleep of ``interval`` wakes up: the event loop's lag."""
        task_status.started()
        while True:
            t0 = time.perf_counter()
            await trio.sleep(interval)
            self.lag.observe(max(0.0, time.perf_counter() - t0 - interval))

    # ------------------------------------------------------------------ scrape
    def collect(self):
        """The prometheus_client Collector protocol: every metric family, read now."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        coord = self.coord
        p = "rallypoint_"
        c = CounterMetricFamily(p + "requests", "Requests answered, by operation and code", labels=["op", "code"])
        errors: dict[str, int] = {}
        for (op, code), n in sorted(self.errors.items()):
            c.add_metric([op, code], n)
            errors[op] = errors.get(op, 0) + n
        for op, hist in sorted(self.latency.items()):
            ok = sum(hist.counts) - errors.get(op, 0)
            if ok:
                c.add_metric([op, "OK"], ok)
        yield c
        h = HistogramMetricFamily(p + "request_duration_seconds",
                                  "Request receipt to reply sent (after durability), by operation", labels=["op"])
        for op, hist in sorted(self.latency.items()):
            h.add_metric([op], _buckets(hist.bounds, hist.counts), hist.sum)
        yield h

        journal = coord.journal
        fs = getattr(journal, "fsync_seconds", None)
        if fs is not None:
            h = HistogramMetricFamily(p + "journal_fsync_duration_seconds", "One fdatasync of the journal")
            h.add_metric([], _buckets(fs.bounds, fs.counts), fs.sum)
            yield h
            cr = journal.commit_records
            h = HistogramMetricFamily(p + "journal_group_commit_records", "Records made durable by one fdatasync")
            h.add_metric([], _buckets(cr.bounds, cr.counts), cr.sum)
            yield h
            cw = journal.commit_wait_seconds
            h = HistogramMetricFamily(p + "journal_commit_wait_seconds",
                                      "A record's append to the event loop learning it is durable (sampled)")
            h.add_metric([], _buckets(cw.bounds, cw.counts), cw.sum)
            yield h
        pending = getattr(journal, "sync_pending_s", None)
        if pending is not None:
            g = GaugeMetricFamily(p + "journal_sync_pending_seconds",
                                  "Age of the oldest fdatasync request not yet answered (0: none)")
            g.add_metric([], pending)
            yield g
        sch = getattr(coord, "schedules", None)
        if sch is not None:
            from .actors.schedule import LAG_BOUNDS_S

            h = HistogramMetricFamily(p + "schedule_fire_lag_seconds",
                                      "A schedule's fire: the real instant its group commit was journaled minus the time it was due")
            h.add_metric([], _buckets(LAG_BOUNDS_S, sch.lag_counts), sch.lag_sum_s)
            yield h
        g = GaugeMetricFamily(p + "journal_last_lsn", "The journal's last LSN")
        g.add_metric([], journal.last_lsn)
        yield g
        g = GaugeMetricFamily(p + "journal_durable_lsn", "The journal's durable LSN")
        g.add_metric([], journal.durable_lsn)
        yield g

        h = HistogramMetricFamily(p + "snapshot_duration_seconds", "One snapshot, start to end")
        h.add_metric([], _buckets(self.snapshot_seconds.bounds, self.snapshot_seconds.counts), self.snapshot_seconds.sum)
        yield h
        h = HistogramMetricFamily(p + "snapshot_stall_seconds", "A snapshot's longest stretch without a yield")
        h.add_metric([], _buckets(self.snapshot_stall.bounds, self.snapshot_stall.counts), self.snapshot_stall.sum)
        yield h
        c = CounterMetricFamily(p + "snapshots", "Snapshots written")
        c.add_metric([], self.snapshots)
        yield c

        actors = coord.actor_statistics()
        g = GaugeMetricFamily(p + "actors", "Actors by kind: active (a task) or passive", labels=["kind", "state"])
        gw = GaugeMetricFamily(p + "actor_waiters", "Parked server-side waits, by kind", labels=["kind"])
        gi = GaugeMetricFamily(p + "actor_inbox", "Commands queued in actors' inboxes, by kind", labels=["kind"])
        for kind, st in sorted(actors.items()):
            g.add_metric([kind, "active"], st["active"])
            g.add_metric([kind, "passive"], st["passive"])
            gw.add_metric([kind], st["waiters"])
            gi.add_metric([kind], st["inbox"])
        yield g
        yield gw
        yield gi

        tasks: dict[str, int] = {}
        for counts in coord.queues.space_counts.values():
            for state, n in counts.items():
                tasks[state] = tasks.get(state, 0) + n
        g = GaugeMetricFamily(p + "tasks", "Tasks by state", labels=["state"])
        for state in ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"):
            g.add_metric([state], tasks.get(state, 0))
        yield g
        # issue 44: each work queue's ready backlog per priority, how many fairness keys
        # have ready tasks, and the backlog of its METRIC_TOP_KEYS largest keys with the
        # rest summed (a series per key would be one per tenant: unbounded)
        qs = coord.queues
        g = GaugeMetricFamily(p + "ready_tasks", "Ready tasks per work queue and priority (1 most urgent)",
                              labels=["space", "mailbox", "priority"])
        gk = GaugeMetricFamily(p + "ready_fair_keys", "Fairness keys with ready tasks per work queue",
                               labels=["space", "mailbox"])
        gt = GaugeMetricFamily(p + "ready_tasks_by_fair_key",
                               f"Ready tasks of a work queue's {METRIC_TOP_KEYS} largest fairness keys "
                               "(bucket key), the other keys summed (bucket other) and no key (bucket none)",
                               labels=["space", "mailbox", "fair_key", "bucket"])
        for qid in sorted(qs.ready_index.by_prio):
            q = qs.table.get(qid)
            if q is None:
                continue
            by_prio, by_key = qs.ready_index.backlog(qid)
            for prio, n in sorted(by_prio.items()):
                g.add_metric([q.space, q.name, str(prio)], n)
            gk.add_metric([q.space, q.name], sum(1 for k in by_key if k is not None))
            for bucket, key, n in top_fair_keys(by_key):
                gt.add_metric([q.space, q.name, key, bucket], n)
        yield g
        yield gk
        yield gt
        runs: dict[str, int] = {}
        for counts in coord.runs.counts.values():
            for state, n in counts.items():
                runs[state] = runs.get(state, 0) + n
        g = GaugeMetricFamily(p + "runs", "Runs by stored state", labels=["state"])
        for state in ("ACTIVE", "CANCELLED", "COMPLETED"):
            g.add_metric([state], runs.get(state, 0))
        yield g
        g = GaugeMetricFamily(p + "entities", "Entities held (what snapshots store)")
        g.add_metric([], coord.entity_count())
        yield g
        g = GaugeMetricFamily(p + "connections", "Open TCP connections")
        g.add_metric([], len(self.server._conns) if self.server is not None else coord.connection_count())
        yield g
        if self.http is not None:
            hs = self.http.statistics()
            g = GaugeMetricFamily(p + "http_connections", "Open HTTP connections")
            g.add_metric([], hs["connections"])
            yield g
            c = CounterMetricFamily(p + "http_rejected_connections", "HTTP connections refused (--max-connections)")
            c.add_metric([], hs["rejected_connections"])
            yield c
            c = CounterMetricFamily(p + "http_accept_errors", "Failed accepts of the HTTP listener (e.g. EMFILE)")
            c.add_metric([], hs["accept_errors"])
            yield c
        h = HistogramMetricFamily(p + "event_loop_lag_seconds", "How late a 100 ms sleep of the event loop woke up")
        h.add_metric([], _buckets(self.lag.bounds, self.lag.counts), self.lag.sum)
        yield h

        ev = coord.events.statistics()
        c = CounterMetricFamily(p + "events_emitted", "Events derived from the journal since start")
        c.add_metric([], ev["emitted"])
        yield c
        g = GaugeMetricFamily(p + "events_retained", "Events kept (all spaces)")
        g.add_metric([], ev["events"])
        yield g
        w = coord.watchers.statistics()
        g = GaugeMetricFamily(p + "watchers", "Open event subscriptions")
        g.add_metric([], w["watchers"])
        yield g
        c = CounterMetricFamily(p + "watch_cut_off", "Subscriptions cut off as too slow (SLOW_CONSUMER)")
        c.add_metric([], w["cut_off"])
        yield c
        c = CounterMetricFamily(p + "retention_purged_entities", "Entities deleted by --retain-finished")
        c.add_metric([], coord.retention.purged["entities"])
        yield c
        yield from self._limit_metrics(GaugeMetricFamily, CounterMetricFamily)

    def _limit_metrics(self, GaugeMetricFamily, CounterMetricFamily):
        """The limits per space (``rallypoint/limits.py``): each limit's value, every
        space's use of each (spaces with no use left out), refusals by limit."""
        from .limits import NAMES

        p = "rallypoint_"
        limits = self.coord.limits
        g = GaugeMetricFamily(p + "space_limit", "The limit per space, by limit (absent: no limit)", labels=["limit"])
        for n in NAMES:
            v = limits.values[n]
            if v is not None:
                g.add_metric([n], v)
        yield g
        g = GaugeMetricFamily(p + "space_limit_use", "A space's use of a limit", labels=["space", "limit"])
        for space, u in limits.use.items():
            if u.idle():
                continue
            for n in NAMES:
                g.add_metric([space, n], getattr(u, n))
        yield g
        c = CounterMetricFamily(p + "space_limit_refused", "Operations refused LIMIT_EXCEEDED by a limit per space",
                                labels=["limit"])
        for n in NAMES:
            c.add_metric([n], limits.refused[n])
        yield c

    def registry(self):
        from prometheus_client import CollectorRegistry

        reg = CollectorRegistry(auto_describe=False)
        reg.register(self)
        return reg


class ClusterMetrics:
    """The metrics of a node of a replicated shard (``serve --cluster``): its role and
    epoch and the replication figures of that role (the leader's standby: state,
    acknowledged LSN, lag; frames and bytes sent, in-sync set changes, snapshot copies;
    a standby's applied LSN and records received), plus, while it leads, everything
    :class:`Metrics` reports for its coordinator (``leader_metrics``)."""

    ROLES = ("starting", "standby", "leader", "stopping", "stopped")

    def __init__(self, member) -> None:
        self.member = member
        self.leader_metrics: Metrics | None = None
        #: the node's :class:`~rallypoint.cluster.forward.ClusterHttpApp` (``--http``), if any
        self.http_app: Any = None

    def registry(self):
        from prometheus_client import CollectorRegistry

        reg = CollectorRegistry(auto_describe=False)
        reg.register(self)
        return reg

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.member
        p = "rallypoint_cluster_"
        g = GaugeMetricFamily(p + "role", "1 for this node's current role in its shard", labels=["role"])
        for role in self.ROLES:
            g.add_metric([role], 1.0 if m.role == role else 0.0)
        yield g
        yield GaugeMetricFamily(p + "epoch", "This node's epoch while it leads, else the newest it has seen",
                                value=float(m.epoch or m.last_epoch_seen))
        yield GaugeMetricFamily(p + "role_changes", "Role changes since start", value=float(m.changes))
        repl = m.replication
        if repl is not None:
            st = repl.statistics()
            yield GaugeMetricFamily(p + "isr_size", "Nodes in the shard's in-sync set (leader)", value=float(len(st["isr"])))
            sb = st["standby"]
            yield GaugeMetricFamily(p + "standby_in_sync", "1 while the standby is in the in-sync set (leader)",
                                    value=1.0 if sb is not None and sb["state"] == "in_sync" else 0.0)
            yield GaugeMetricFamily(p + "standby_lag_records", "Records the standby has not acknowledged (leader)",
                                    value=float(sb["lag_records"]) if sb is not None else 0.0)
            yield GaugeMetricFamily(p + "standby_acked_lsn", "The last LSN durable on the standby (leader)",
                                    value=float(sb["acked_lsn"]) if sb is not None else 0.0)
            for name, key, doc in (("frames_sent", "frames_sent", "Journal records sent to the standby"),
                                   ("bytes_sent", "bytes_sent", "Bytes of records sent to the standby"),
                                   ("isr_shrinks", "isr_shrinks", "Standbys dropped from the in-sync set"),
                                   ("isr_expands", "isr_expands", "Standbys added to the in-sync set"),
                                   ("snapshots_sent", "snapshots_sent", "Snapshot copies sent to a standby")):
                yield CounterMetricFamily(p + name, doc, value=float(st[key]))
        sb = m.standby
        if sb is not None:
            yield GaugeMetricFamily(p + "applied_lsn", "The last LSN this standby applied", value=float(sb.applied_lsn))
            yield CounterMetricFamily(p + "records_received", "Journal records this standby received",
                                      value=float(sb.records))
        app = self.http_app
        if app is not None:
            c = CounterMetricFamily(p + "http_routed", "HTTP requests forwarded to another shard's leader, and "
                                    "operations sent there natively, by this node (a sharded cluster)", labels=["how"])
            r = app.routed()
            c.add_metric(["forwarded"], float(r["forwarded"]))
            c.add_metric(["native"], float(r["native"]))
            yield c
            yield CounterMetricFamily(p + "http_route_connections", "Native connections opened to other shards' "
                                      "leaders for routed HTTP operations", value=float(r["connections"]))
        if self.leader_metrics is not None and m.role == "leader":
            yield from self.leader_metrics.collect()


#: The metrics listener's own limits: connections open at once, and per peer address
#: (a scraper needs one at a time); seconds and bytes a request's head may take.
METRICS_MAX_CONNECTIONS = 64
METRICS_MAX_PER_PEER = 8
METRICS_HEAD_S = 5.0
METRICS_HEAD_BYTES = 16384


def key_authorizer(keys, permission: str = "operator"):
    """``authorize`` for :func:`serve_metrics` from the daemon's key table (``coord.keys``):
    a scrape must send ``Authorization: Bearer <secret>`` of a live key holding
    ``permission`` (``operator``: the figures are server-wide). Returns ``(header) ->
    None`` (allowed) or the reason it is refused (a str)."""

    def authorize(header: str | None) -> str | None:
        from .errors import RallypointError

        if keys.open_mode:
            return "this metrics address needs an operator API key and none exists yet"
        scheme, _, secret = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            return "send the API key of an operator as `Authorization: Bearer <secret>`"
        try:
            key = keys.authenticate(secret.strip())
        except RallypointError as e:
            return e.message
        if key is None or permission not in key.permissions:
            return f"this API key lacks the {permission} permission the server-wide metrics need"
        return None

    return authorize


async def serve_metrics(metrics: "Metrics | ClusterMetrics", host: str, port: int, *,
                        authorize=None, max_connections: int = METRICS_MAX_CONNECTIONS,
                        max_connections_per_peer: int = METRICS_MAX_PER_PEER, head_s: float = METRICS_HEAD_S,
                        listeners: list | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``GET /metrics`` (Prometheus text) on ``host:port`` until cancelled; the
    bound port is passed to ``task_status.started``. One request per connection; a
    request line and headers of at most :data:`METRICS_HEAD_BYTES` within ``head_s``
    seconds (else the connection is closed). At most ``max_connections`` connections
    (one more is answered 503 and closed) and ``max_connections_per_peer`` from one
    address (503 too). ``authorize``: ``(Authorization header or None) -> None`` to
    serve, or a reason for ``401`` (see :func:`key_authorizer`); None serves everyone.
    An ``accept`` that fails (EMFILE...) backs off and is logged once per 10 s with a
    count (:class:`~rallypoint.transport.guard.AcceptFailures`), never a traceback.
    ``listeners``: ``trio.SocketListener``s already bound (None: bind here; OSError if
    the address cannot be bound, before ``started``)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from .logutil import RateLimitedLogger
    from .transport.guard import AcceptFailures, PeerSlots, peer_address

    registry = metrics.registry()
    limited = RateLimitedLogger(log, window_s=10.0, burst=5)
    failures = AcceptFailures(log, "metrics listener")
    slots = PeerSlots(max_connections_per_peer)
    open_now = [0]

    def answer(status: str, body: bytes, ctype: str = "text/plain; charset=utf-8", extra: str = "") -> bytes:
        return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n{extra}Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode() + body

    async def handle(stream: trio.SocketStream, addr: str) -> None:
        try:
            data = b""
            with trio.move_on_after(head_s):
                while b"\r\n\r\n" not in data and len(data) < METRICS_HEAD_BYTES:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    data += chunk
            if b"\r\n\r\n" not in data:
                return  # no complete head in time (or too long): close, answer nothing
            head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1", "replace").split("\r\n")
            line = head[0].split()
            auth = None
            for h in head[1:]:
                name, _, value = h.partition(":")
                if name.strip().lower() == "authorization":
                    auth = value.strip()
            if len(line) >= 2 and line[0] == "GET" and line[1].split("?")[0] == "/metrics":
                refused = authorize(auth) if authorize is not None else None
                if refused is not None:
                    limited.log(logging.WARNING, "metrics-auth", "metrics scrape from %s refused: %s", addr, refused,
                                extra={"event": "auth_failed", "peer": addr, "listener": "metrics"})
                    out = answer("401 Unauthorized", f"unauthorized: {refused}\n".encode(),
                                 extra='WWW-Authenticate: Bearer realm="rallypoint metrics"\r\n')
                else:
                    out = answer("200 OK", generate_latest(registry), CONTENT_TYPE_LATEST)
            elif len(line) >= 2 and line[0] == "GET" and line[1] == "/":
                out = answer("200 OK", b"rallypoint metrics: GET /metrics\n")
            else:
                out = answer("404 Not Found", b"not found: GET /metrics\n")
            with trio.move_on_after(10):
                await stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:  # never let a scrape take the daemon down
            limited.log(logging.ERROR, "metrics-failed", "metrics request failed", exc_info=True)
        finally:
            open_now[0] -= 1
            slots.give(addr)
            await trio.aclose_forcefully(stream)

    async def refuse(stream: trio.SocketStream, why: str) -> None:
        try:
            with trio.move_on_after(1.0):
                await stream.send_all(answer("503 Service Unavailable", f"{why}\n".encode(), extra="Retry-After: 1\r\n"))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def accept_loop(listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE & co: back off, one line per window
                await failures.failed(exc)
                continue
            failures.succeeded()
            addr = peer_address(stream.socket)
            if open_now[0] >= max_connections:
                limited.log(logging.WARNING, "metrics-limit", "metrics listener: %d connections open; refused one",
                            open_now[0])
                nursery.start_soon(refuse, stream, f"more than {max_connections} metrics connections are open")
                continue
            if not slots.take(addr):
                limited.log(logging.WARNING, "metrics-peer-limit", "metrics listener: %s has %d connections open; "
                            "refused one", addr, max_connections_per_peer)
                nursery.start_soon(refuse, stream, f"this address has {max_connections_per_peer} metrics "
                                                   "connections open")
                continue
            open_now[0] += 1
            nursery.start_soon(handle, stream, addr)

    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host)
    try:
        async with trio.open_nursery() as nursery:
            for ln in listeners:
                nursery.start_soon(accept_loop, ln, nursery)
            task_status.started(listeners[0].socket.getsockname()[1])
    finally:
        limited.flush()
        failures.flush()
        for ln in listeners:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(ln)


def observe_hook(metrics: Metrics | None) -> Any:
    return None if metrics is None else metrics.observe
