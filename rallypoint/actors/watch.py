"""Watchers: push each space's events to its subscriptions, never holding anyone up.

A subscription (``events.watch``) is a :class:`Watcher`: a filter, a position (the seq
of the last event it was sent or skipped) and the sink it pushes to (a connection, or an
embedded client's buffer). One task (:meth:`Watchers.run`) serves every watcher: woken
when a commit published events, when a sink drained, or when a stall deadline passes,
it waits until the journal is durable past what it is about to send (a watcher is never
told of a change a crash could take back), then pushes each watcher what it has not
seen, in order, in frames of at most :data:`MAX_PUSH_EVENTS` events.

**The cursor a client resumes from** is what the server scanned, not the last event
it matched: every push carries ``cursor`` (``wire.Push``), the seq its watcher has
looked at up to, and a filtered watch whose filter skips what happens is told its
position by a push with no events -- at most one every :data:`PROGRESS_S` seconds per
watcher (the task wakes for it when due). So a ``task.failed`` watch over a busy space
resumes, after a restart, from near the newest event, not from a last match that
retention may have dropped since (CURSOR_EXPIRED).

**Slow watchers.** A sink takes at most ``buffer_bytes`` of unsent pushes (for a
connection: its unsent output); what does not fit stays in the shared event log --
nothing is copied per watcher. A watcher whose sink has had no room while events were
waiting for ``stall_s`` seconds is cut off: its sink gets SLOW_CONSUMER (with the
cursor to resume from) and it is dropped. A watcher whose position falls out of the
log's retention is ended with CURSOR_EXPIRED. Either way the server's cost of a watcher
that never reads is bounded (a buffer, a few seconds), and no other client waits for it.

**A grant that ends** (its key revoked, open mode over: :meth:`Watchers.end_grant`)
ends its watchers: each is marked in the apply that ends the grant, is pushed only what
is durable before that commit (every later event has a later LSN), and is ended with
UNAUTHENTICATED by the first round after that commit is durable -- never told of a
revocation a crash could take back, never sent an event numbered after it.

Cost: a commit with watchers attached adds one wake-up flag; the task then encodes each
event once (cached on the event) and checks each watcher's filter.
"""

from __future__ import annotations

import logging
import math

import trio

from ..clock import to_iso
from ..errors import CursorExpiredError, SlowConsumerError, UnavailableError
from ..events import EventFilter
from ..logutil import RateLimitedLogger
from ..protocol import EventView, encoder

__all__ = ["Watcher", "Watchers", "MAX_PUSH_EVENTS", "PROGRESS_S", "encode_event", "shard_of"]

log = logging.getLogger("rallypoint.watch")

#: Events per Push frame at most (and about 256 KiB).
MAX_PUSH_EVENTS = 512
_MAX_PUSH_BYTES = 256 * 1024
#: A push with no events, only a newer cursor, goes to a watcher at most this often, s.
PROGRESS_S = 0.5

_encode = encoder.encode
_iso_memo = [0, ""]  # the last instant rendered (the events of one commit share theirs)


def _iso(ms: int) -> str:
    memo = _iso_memo
    if memo[0] != ms:
        memo[0], memo[1] = ms, to_iso(ms)
    return memo[1]


def view(e, shard: int | None = None) -> EventView:
    """The wire form of an event (positional: EventView(seq, type, kind, id, at, run,
    data, shard)); ``shard``: the shard that numbered it (None on a single node)."""
    memo = _iso_memo
    ms = e.at_ms
    if memo[0] != ms:
        memo[0], memo[1] = ms, to_iso(ms)
    return EventView(e.seq, e.type, e.kind, e.id, memo[1], e.run, e.data, shard)


def views(entries, shard: int | None = None) -> list:
    """The wire forms of consecutive events (an instant rendered once per run of equal
    ones: the events of a commit share it) of the shard ``shard`` (None: a single node)."""
    out = []
    append = out.append
    last_ms = -1
    iso = ""
    for e in entries:
        ms = e.at_ms
        if ms != last_ms:
            last_ms = ms
            iso = to_iso(ms)
        append(EventView(e.seq, e.type, e.kind, e.id, iso, e.run, e.data, shard))
    return out


def encode_event(e, shard: int | None = None) -> bytes:
    """The wire form of one event (an EventView), made once and cached on the event
    (``shard``: the coordinator's, which never changes; None on a single node)."""
    raw = e.raw
    if raw is None:
        raw = e.raw = _encode(view(e, shard))
    return raw


def shard_of(coord) -> int | None:
    """The shard a coordinator's events carry: its own in a sharded cluster, else None."""
    sharding = coord.sharding
    return None if sharding is None else sharding.shard


class Watcher:
    """One subscription. ``cursor``: the last seq pushed or skipped (filtered out);
    ``told``: the last cursor its sink was sent, at ``told_at`` (Trio time, s);
    ``who``: the grant of the session that opened it (a key id, ``keys.OPEN_MODE``,
    None); ``ending``: ``(lsn, error)`` once its grant ended in the commit of that LSN."""

    __slots__ = ("space", "filter", "cursor", "sink", "rid", "stalled_since", "closed", "pushed", "hub", "told",
                 "told_at", "who", "ending")

    def __init__(self, space: str, flt: EventFilter, cursor: int, sink, rid: int, who: str | None = None) -> None:
        self.space = space
        self.filter = flt
        self.cursor = cursor
        self.sink = sink
        self.rid = rid
        self.stalled_since: float | None = None
        self.closed = False
        self.pushed = 0
        self.hub: "Watchers | None" = None
        self.told = cursor  # (the subscription's Ok says where it starts)
        self.told_at = -math.inf
        self.who = who
        self.ending: tuple[int, Exception] | None = None

    def cancel(self) -> None:
        """The client ended it (Cancel frame, connection closed)."""
        if not self.closed and self.hub is not None:
            self.hub._drop(self)
        self.closed = True


class Watchers:
    """Every watcher of a coordinator and the task that serves them.

    Args:
        coord: the coordinator (its ``events`` log, ``journal``, ``runs``).
        buffer_bytes: unsent pushes a sink may hold before the watcher waits.
        stall_s: seconds a watcher may wait for room with events pending before it is
            cut off (SLOW_CONSUMER).
        progress_s: seconds between two pushes that only move a watcher's cursor.
    """

    def __init__(self, coord, *, buffer_bytes: int = 1 << 20, stall_s: float = 10.0,
                 progress_s: float = PROGRESS_S) -> None:
        self.coord = coord
        self.buffer_bytes = buffer_bytes
        self.stall_s = stall_s
        self.progress_s = progress_s
        self.watchers: list[Watcher] = []
        self._wake = trio.Event()
        self._woken = False
        # statistics
        self.cut_off = 0
        #: the cut-off WARNINGs: at most 5 per 10 s, then a count (a flood of slow
        #: watchers cannot flood the log)
        self.log_limiter = RateLimitedLogger(log, window_s=10.0, burst=5)
        self.expired = 0
        self.ended_by_grant = 0
        self.pushed_events = 0
        self.push_frames = 0

    def __len__(self) -> int:
        return len(self.watchers)

    def wake(self) -> None:
        """New events, or a sink has room again."""
        if not self._woken:
            self._woken = True
            self._wake.set()

    def add(self, w: Watcher) -> None:
        """Serve ``w`` from now on; it counts against its space's ``watchers`` limit
        until it is dropped (``rallypoint/limits.py``; the decide checked it)."""
        w.hub = self
        self.watchers.append(w)
        self.coord.limits.watcher_added(w.space)
        self.coord.events.on_publish = self.wake
        self.wake()

    def _drop(self, w: Watcher) -> None:
        w.closed = True
        try:
            self.watchers.remove(w)
        except ValueError:
            pass
        else:
            self.coord.limits.watcher_removed(w.space)
        if not self.watchers:
            self.coord.events.on_publish = None

    def end_grant(self, who: str, error: Exception, lsn: int) -> int:
        """Grant ``who`` ended in the commit of LSN ``lsn`` (being applied): each of its
        watchers is pushed nothing from that commit on and is ended with ``error`` once
        the journal is durable past ``lsn``. Returns how many."""
        n = 0
        for w in self.watchers:
            if w.who == who and w.ending is None and not w.closed:
                w.ending = (lsn, error)
                n += 1
        if n:
            self.ended_by_grant += n
            self.wake()
        return n

    def end_all(self, error: Exception) -> None:
        """Shutting down: every watcher is ended with ``error`` (and the cut-offs not
        logged yet are reported)."""
        self.log_limiter.flush()
        for w in list(self.watchers):
            if not w.closed:
                w.sink.end_stream(w.rid, error)
            self._drop(w)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        coord = self.coord
        journal = coord.journal
        try:
            while True:
                deadline = self._next_deadline()
                if not self._woken:
                    with trio.move_on_at(deadline):
                        await self._wake.wait()
                self._woken = False
                self._wake = trio.Event()
                if not self.watchers:
                    continue
                journal = coord.journal  # (recovery swaps it)
                target = journal.last_lsn
                if journal.durable_lsn < target:
                    try:
                        await journal.wait_durable(target)
                    except Exception as exc:  # the journal failed: the node stops; tell the watchers now
                        log.error("the journal failed; ending every watch: %s", exc)
                        self.end_all(UnavailableError("the server's journal failed; resume the watch from your "
                                                      "cursor once it restarted", retry_after=1.0))
                        continue
                self.serve(journal.durable_lsn, trio.current_time())
        finally:
            self.end_all(UnavailableError("the server is shutting down; resume the watch from your cursor "
                                          "once it is back", retry_after=1.0))

    def _next_deadline(self) -> float:
        """The earliest of: a stalled watcher's cut-off, a cursor-only push falling due."""
        due = math.inf
        stall_s, progress_s = self.stall_s, self.progress_s
        for w in self.watchers:
            if w.stalled_since is not None:
                due = min(due, w.stalled_since + stall_s)
            elif w.cursor > w.told and w.sink.push_room(w.rid) > 0:  # (no room: its drain wakes us)
                due = min(due, w.told_at + progress_s)
        return due

    def serve(self, durable_lsn: int, now: float) -> None:
        """Push every watcher what is durable and new for it (as much as its sink takes)."""
        streams = self.coord.events.streams
        share = len(self.watchers) > 1
        shard = shard_of(self.coord)
        for w in list(self.watchers):
            if w.closed:
                self._drop(w)
                continue
            ending = w.ending
            if ending is not None and durable_lsn >= ending[0]:
                # its grant's end is durable: what is durable now may be after it
                w.sink.end_stream(w.rid, ending[1])
                self._drop(w)
                continue
            s = streams.get(w.space)
            if s is None:
                continue
            self._serve_one(w, s, durable_lsn, now, share, shard)

    def _serve_one(self, w: Watcher, s, durable_lsn: int, now: float, share: bool = True,
                   shard: int | None = None) -> None:
        if w.cursor < s.first_seq - 1:
            self.expired += 1
            w.sink.end_stream(w.rid, CursorExpiredError(
                f"this watch fell behind the events kept (its cursor {w.cursor}, the oldest kept "
                f"{s.first_seq}): events were dropped before it read them; start again from cursor=None "
                "or from now", details={"cursor": w.cursor, "oldest": s.first_seq, "newest": s.last_seq}))
            self._drop(w)
            return
        upto = durable_upto(s, durable_lsn)
        while w.cursor < upto:
            room = w.sink.push_room(w.rid)
            if room <= 0:
                if w.stalled_since is None:
                    w.stalled_since = now
                elif now - w.stalled_since >= self.stall_s:
                    self._cut_off(w, now)
                return
            budget = min(room, _MAX_PUSH_BYTES)
            entries = s.entries
            i = s.index_after(w.cursor)
            end = s.start + (upto - s.first_seq + 1)
            # about 150 bytes an event: take what fits the room, then encode the batch in one go
            most = min(MAX_PUSH_EVENTS, max(1, budget // 150))
            if w.filter.everything:
                picked = entries[i: min(end, i + most)]
                cursor = picked[-1].seq
            else:
                match = w.filter.match
                cursor = w.cursor
                picked = []
                while i < end:
                    e = entries[i]
                    i += 1
                    cursor = e.seq
                    if match(e):
                        picked.append(e)
                        if len(picked) >= most:
                            break
            w.cursor = cursor
            if picked:
                if share:  # several watchers: each event encoded once, kept on it
                    w.sink.push(w.rid, [e.raw or encode_event(e, shard) for e in picked], cursor)
                else:
                    w.sink.push_encoded(w.rid, len(picked), _encode(views(picked, shard)), cursor)
                w.told, w.told_at = cursor, now
                w.pushed += len(picked)
                self.pushed_events += len(picked)
                self.push_frames += 1
        w.stalled_since = None
        if w.cursor > w.told and now - w.told_at >= self.progress_s and w.sink.push_room(w.rid) > 0:
            # the filter skipped what came: tell the client how far it has been scanned
            w.sink.push(w.rid, [], w.cursor)
            w.told, w.told_at = w.cursor, now
            self.push_frames += 1

    def _cut_off(self, w: Watcher, now: float) -> None:
        self.cut_off += 1
        stalled = now - (w.stalled_since or now)
        self.log_limiter.log(logging.WARNING, "watch-cut-off",
                             "a watch of space %s was cut off: it took no events for %.1f s (cursor %d)",
                             w.space, stalled, w.cursor,
                             extra={"event": "watch_cut_off", "space": w.space, "cursor": w.cursor})
        w.sink.end_stream(w.rid, SlowConsumerError(
            f"this watch was cut off: it could take no events for {stalled:.1f} s while more were waiting "
            f"(its buffer holds {self.buffer_bytes} bytes); resume with watch(cursor={w.cursor})",
            details={"cursor": w.cursor, "stalled_s": round(stalled, 3)}))
        self._drop(w)

    def statistics(self) -> dict:
        return {"watchers": len(self.watchers), "cut_off": self.cut_off, "expired": self.expired,
                "ended_by_grant": self.ended_by_grant,
                "pushed_events": self.pushed_events, "push_frames": self.push_frames}


def durable_upto(s, durable_lsn: int) -> int:
    """The last seq of stream ``s`` whose commit is durable (journal LSN <= durable_lsn)."""
    entries = s.entries
    i = len(entries) - 1
    start = s.start
    while i >= start and entries[i].lsn > durable_lsn:
        i -= 1
    return s.first_seq + (i - start)
