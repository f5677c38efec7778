"""Rate-limited logging: a flood of similar events becomes a few lines and a count.

::

    limited = RateLimitedLogger(logging.getLogger("rallypoint.transport"), window_s=10.0, burst=5)
    limited.log(logging.DEBUG, "peer-reset", "connection from %s closed by the peer: %s", peer, why)

Events are grouped by a *key* (a short string naming the kind of event). Per key, the
first ``burst`` events of a window of ``window_s`` seconds are logged as usual; the rest
are only counted. Once the window is over, one line at the level of the suppressed events
reports them::

    peer-reset: 412 similar events suppressed in the last 10.0 s; the last: connection from ...

The report is written at the next :meth:`RateLimitedLogger.log` call (for any key) after
the window ends, or by :meth:`RateLimitedLogger.flush` (call it when the component stops,
so no count is lost). So a steady flood costs at most ``burst + 1`` lines per window and
key, whatever its rate. An event whose level the logger does not emit costs one
``isEnabledFor`` check and is not counted.

Nothing here awaits or starts a task; the clock is injectable (tests).
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any, Callable

__all__ = ["RateLimitedLogger", "JsonFormatter", "TextFormatter", "printable", "escape_controls"]

#: LogRecord attributes that are not ``extra=`` fields.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


#: Characters a logged value may not carry as they are: C0 and C1 controls and DEL (a
#: newline would start a forged line, ESC a terminal sequence) and the bidirectional
#: formatting characters (which reorder what a reader sees, "Trojan Source").
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1) and bidirectional formatting
    character written as an escape (``\\x0a``, ``\\u202e``); the rest unchanged. One
    logged event is then one line, whatever a client sent."""
    return _CONTROLS.sub(_escape, text) if _CONTROLS.search(text) is not None else text


def printable(value: object, limit: int = 200) -> str:
    """A value a client sent (str, or bytes read as Latin-1), fit for a log line:
    :func:`escape_controls`, and cut to ``limit`` characters (``...(+N)`` says how many
    more there were)."""
    text = value.decode("latin-1") if isinstance(value, (bytes, bytearray)) else str(value)
    if len(text) > limit:
        text = f"{text[:limit]}...(+{len(text) - limit})"
    return escape_controls(text)


class TextFormatter(logging.Formatter):
    """``--log-format text``: ``logging.Formatter`` whose message part is
    :func:`escape_controls` 'd, so no value inside a message can break the line or
    forge another one (a traceback, added after the message, keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """``--log-format json``: one JSON object a line: ``ts`` (ISO 8601 UTC, ms), ``level``,
    ``logger``, ``msg`` (the formatted message), the record's ``extra=`` fields (e.g.
    ``event``: ``startup``, ``recovery``, ``snapshot``, ``key_created``, ``auth_failed``,
    ``slow_request``...), and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime
        import json

        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


class _Window:
    __slots__ = ("start", "logged", "suppressed", "level", "last_msg", "last_args")

    def __init__(self, start: float) -> None:
        self.start = start
        self.logged = 0
        self.suppressed = 0
        self.level = logging.NOTSET
        self.last_msg = ""
        self.last_args: tuple[Any, ...] = ()


class RateLimitedLogger:
    """Log at most ``burst`` events per key per ``window_s`` seconds through ``logger``,
    and report the rest as one "N similar events suppressed in the last T s" line.

    Args:
        logger: where the lines go.
        window_s: length of a window, seconds (> 0).
        burst: events logged per key and window before suppression starts (>= 1).
        clock: monotonic seconds (default :func:`time.monotonic`).

    Raises:
        ValueError: ``window_s <= 0`` or ``burst < 1``.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        window_s: float = 10.0,
        burst: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst!r}")
        self.logger = logger
        self.window_s = float(window_s)
        self.burst = burst
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self._next_due = math.inf  # earliest end of an open window
        #: Events logged, and events suppressed (counted only), since creation.
        self.emitted = 0
        self.suppressed = 0

    def log(self, level: int, key: str, msg: str, *args: Any, exc_info: Any = None, extra: dict | None = None) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` already had ``burst`` events in
        its current window. Returns True if the line was written, False if it was
        suppressed (counted) or the level is disabled (not counted). ``exc_info`` is
        passed to the logger as is (a traceback only for the lines that are written);
        ``extra`` too (structured fields for ``--log-format json``)."""
        logger = self.logger
        if not logger.isEnabledFor(level):
            return False
        now = self.clock()
        if now >= self._next_due:
            self._report(now, due_only=True)
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _Window(now)
            end = now + self.window_s
            if end < self._next_due:
                self._next_due = end
        if w.logged < self.burst:
            w.logged += 1
            self.emitted += 1
            logger.log(level, msg, *args, exc_info=exc_info, stacklevel=2, extra=extra)
            return True
        w.suppressed += 1
        self.suppressed += 1
        if level > w.level:
            w.level = level
        w.last_msg = msg
        w.last_args = args
        return False

    def flush(self) -> None:
        """Report every count not reported yet, now, and start every key afresh."""
        self._report(self.clock(), due_only=False)

    def statistics(self) -> dict[str, int]:
        """``emitted`` and ``suppressed`` event counts, and ``open_windows``."""
        return {"emitted": self.emitted, "suppressed": self.suppressed, "open_windows": len(self._windows)}

    def _report(self, now: float, *, due_only: bool) -> None:
        window_s = self.window_s
        next_due = math.inf
        for key, w in list(self._windows.items()):
            end = w.start + window_s
            if due_only and now < end:
                next_due = min(next_due, end)
                continue
            del self._windows[key]
            if w.suppressed:
                try:
                    last = w.last_msg % w.last_args if w.last_args else w.last_msg
                except Exception:  # a bad format must not break the caller
                    last = f"{w.last_msg!r} {w.last_args!r}"
                self.logger.log(
                    w.level,
                    "%s: %d similar events suppressed in the last %.1f s; the last: %s",
                    key,
                    w.suppressed,
                    now - w.start,
                    last,
                )
        self._next_due = next_due
