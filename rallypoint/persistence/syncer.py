"""Where the journal's ``fdatasync`` runs: the sync helper, a process (default) or a thread.

The journal's flusher is a Trio task on the event loop: it writes what was appended
into the segment (the page cache: microseconds) and asks the *sync helper*
(:mod:`._sync_helper`) to make it durable. The helper is a loop of its own at the
other end of an ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair: it is handed the segment's
descriptor once (``SCM_RIGHTS``), takes sync requests in order, does every request
waiting for it with ONE ``fdatasync`` and answers with the last one's id. The flusher
sends a request after each write without waiting for the previous answer (at most
:data:`MAX_OUTSTANDING` in flight), so the next fdatasync starts the moment the
previous one returns, however busy the event loop is; the loop reads the answers
like any socket's (``wait_readable``).

``kind="process"`` (the default)
    The helper runs as a child process (``python -I -S _sync_helper.py FD``: no site,
    no environment, standard library only), with a GIL of its own. Why not a thread: a
    Python thread needs the GIL back after every blocking call, and on the project's
    2-core VM handing the GIL between a flusher thread and the event loop cost more
    than the fsync (docs/performance.md, "A sync helper process"). The process runs in
    a session of its own (a Ctrl-C or a signal to the daemon's process group does not
    reach it), ignores SIGINT/SIGTERM/SIGHUP once started, and exits when its socket
    closes, so it never outlives the daemon (not even one killed by SIGKILL); a child
    made by a plain ``fork()`` closes its copy of the socket at once, so it does not
    keep the helper alive either.
``kind="thread"``
    The same helper loop in a daemon thread (``sync="thread"``; the fallback when no
    process can be started; and what a :class:`~rallypoint.persistence.journal.Disk`
    that overrides ``fdatasync`` gets under ``"process"``, so that a test's injected
    fault is the call made).
``kind="inline"`` (opt-in)
    No helper: the request's own call does the ``fdatasync`` on the event loop and puts
    the answer in the socket, where the journal reads it in the same step
    (:meth:`Syncer.poll_answer`). What Redis's ``appendfsync always`` does. It saves the
    two wake-ups of another process per sync (on the project's 2-core VM, a median +21 % closed
    loop lifecycles/s with 1 producer and 1 worker, 0.18 ms fdatasyncs; equal when the
    cores are saturated: docs/performance.md, "An inline fdatasync"); the price is that
    the loop stands still for as long as each fdatasync takes: on a slow disk every
    client waits for it, and a disk that stops answering stops the whole node (the
    other kinds keep serving reads and report the stuck fsync while it runs). For disks
    whose fdatasync is reliably fast (NVMe, a controller with a power-loss-protected
    cache).

Errors: an answer with an errno is an ``OSError`` with it; :class:`SyncHelperGone`
(an ``OSError``, EPIPE) when the helper's socket closed or broke, saying how the
process ended (``killed by signal 9 (SIGKILL)``, ``exit status N``; for a closed
socket it waits up to :data:`REAP_WAIT_S` for the reap, which the kernel does just
after closing a dying process's descriptors). The journal treats
both as fail-stop: after a failed or unanswered fsync the kernel may have dropped the
pages, and a retry could report success for data that is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import trio

from . import _sync_helper as _h

__all__ = ["Syncer", "SyncHelperGone", "SYNC_MODES", "MAX_OUTSTANDING"]

log = logging.getLogger("rallypoint.persistence")

#: the values of ``Journal(sync=...)`` / ``rallypoint serve --sync-helper``
SYNC_MODES = ("process", "thread", "inline")
#: sync requests in flight at once: one being done, one waiting (it covers whatever
#: is written before the helper gets to it)
MAX_OUTSTANDING = 2
#: seconds to wait for a helper whose socket closed to be reaped before saying how it
#: ended (it is exiting: reaping follows within microseconds on an idle machine)
REAP_WAIT_S = 1.0


#: the loop's ends of the helpers' sockets in this process: a child made by a plain
#: fork() (multiprocessing's default on Linux) closes its copies at once, or a helper
#: would live on, holding the segment open, until that child exits
_LIVE: "weakref.WeakSet[Syncer]" = weakref.WeakSet()


def _close_in_forked_child() -> None:
    for syncer in list(_LIVE):
        try:
            syncer._sock.close()
        except OSError:
            pass
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


class SyncHelperGone(OSError):
    """The sync helper exited or its socket broke: nothing more can be made durable
    through it. Fail-stop for the journal."""


class _Inline:
    """The helper's side of ``kind="inline"``: each request carried out in the call that
    sends it, on the event loop, its answer put in the socket as the helper would
    (:mod:`._sync_helper`'s protocol and errnos; no coalescing: nothing waits)."""

    def __init__(self, sock: socket.socket, fdatasync: Any) -> None:
        self.sock = sock
        self.fdatasync = fdatasync
        self.fds: dict[int, int] = {}

    def handle(self, rid: int, op: int, key: int, fd: int | None) -> None:
        if op == _h.REGISTER:
            old = self.fds.pop(key, None)
            if old is not None:
                os.close(old)
            self.fds[key] = os.dup(fd)
        elif op == _h.UNREGISTER:
            old = self.fds.pop(key, None)
            if old is not None:
                os.close(old)
        else:
            err = 0
            t0 = time.perf_counter()
            try:
                (os.fsync if op == _h.FULLSYNC else self.fdatasync)(self.fds[key])
            except KeyError:
                err = errno.EBADF
            except OSError as e:
                err = e.errno or errno.EIO
            us = min(int((time.perf_counter() - t0) * 1e6), 0xFFFFFFFF)
            self.sock.send(_h.ANSWER.pack(rid, err, us))  # (non-blocking: the loop reads every answer)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.sock.close()


class Syncer:
    """The loop's end of a sync helper (see the module docstring). Made by
    :meth:`start`; used by one Trio task at a time for sends (they never block; an
    ``inline`` one does the fdatasync) and one for :meth:`next_answer`."""

    def __init__(self, kind: str, sock: socket.socket, proc: trio.Process | None,
                 thread: threading.Thread | None, inline: _Inline | None = None) -> None:
        self.kind = kind
        self._sock = sock
        self._proc = proc
        self._thread = thread
        self._inline = inline
        self._next_id = 1
        self._next_key = 1
        self._broken: SyncHelperGone | None = None
        _LIVE.add(self)

    @classmethod
    async def start(cls, kind: str = "process", fdatasync: Any = None) -> "Syncer":
        """Start a helper of ``kind`` (one of :data:`SYNC_MODES`). ``fdatasync``: the
        call the thread helper (or the inline one) makes (a Disk's; the process always
        calls ``os.fdatasync``). Raises OSError when the process cannot be started (no
        ``sys.executable``, spawn failed), ValueError for an unknown kind."""
        if kind not in SYNC_MODES:
            raise ValueError(f"sync helper kind must be one of {SYNC_MODES}, not {kind!r}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        proc = thread = inline = None
        try:
            if kind == "inline":
                theirs.setblocking(False)
                inline = _Inline(theirs, fdatasync or os.fdatasync)
            elif kind == "process":
                exe = sys.executable
                if not exe:
                    raise OSError(errno.ENOENT, "no Python executable (sys.executable is empty)")
                try:
                    proc = await trio.lowlevel.open_process(
                        [exe, "-I", "-S", _h.__file__, str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        start_new_session=True)  # a Ctrl-C or a signal to the daemon's group misses it
                finally:
                    theirs.close()
            else:
                thread = threading.Thread(target=_h.serve, args=(theirs, fdatasync or os.fdatasync),
                                          name="rallypoint-sync-helper", daemon=True)
                thread.start()
        except BaseException:
            ours.close()
            if thread is None:
                theirs.close()
            raise
        ours.setblocking(False)
        return cls(kind, ours, proc, thread, inline)

    @property
    def pid(self) -> int | None:
        """The helper process's id (None for the thread helper)."""
        return None if self._proc is None else self._proc.pid

    def _send(self, op: int, key: int, fd: int | None = None) -> int:
        if self._broken is not None:
            raise self._gone(self._broken.strerror)
        rid = self._next_id
        self._next_id += 1
        if self._inline is not None:
            try:
                self._inline.handle(rid, op, key, fd)
            except OSError as exc:  # (dup failed: EMFILE; an answer that did not fit)
                self._broken = self._gone(f"a request could not be carried out ({exc})")
                raise self._broken from exc
            return rid
        msg = _h.REQUEST.pack(rid, op, key)
        try:
            if fd is None:
                self._sock.send(msg)
            else:
                socket.send_fds(self._sock, [msg], [fd])
        except OSError as exc:  # BlockingIOError too: a helper that stopped reading
            self._broken = self._gone(f"a request could not be sent ({exc})",
                                      exiting=not isinstance(exc, BlockingIOError))
            raise self._broken from exc
        return rid

    def register(self, fd: int) -> int:
        """Hand ``fd`` (a duplicate) to the helper; returns the key to sync it by."""
        key = self._next_key
        self._next_key += 1
        self._send(_h.REGISTER, key, fd)
        return key

    def unregister(self, key: int) -> None:
        """The helper closes its descriptor under ``key`` (after the requests before)."""
        self._send(_h.UNREGISTER, key)

    def request(self, key: int, *, full: bool = False) -> int:
        """Ask for ``fdatasync`` (``full``: ``fsync``, for a directory) of ``key``'s
        file; returns the request id that :meth:`next_answer` will report. Never
        blocks. Raises SyncHelperGone."""
        return self._send(_h.FULLSYNC if full else _h.DATASYNC, key)

    async def next_answer(self) -> tuple[int, float]:
        """Wait for the helper's next answer: ``(request id, seconds the call took)``;
        every sync request up to that id is done. Raises OSError (the errno the call
        failed with) or SyncHelperGone. Cancellable (an answer not read stays in the
        socket for the next call)."""
        while True:
            await trio.lowlevel.wait_readable(self._sock)
            got = self.poll_answer()
            if got is not None:
                return got

    def poll_answer(self) -> tuple[int, float] | None:
        """The helper's next answer if one is already in the socket, else None; never
        blocks. The journal calls it at the end of every actor batch, so an fsync's end
        is seen between batches instead of after the scheduler's whole round (measured:
        0.54 ms mean from the call's end to the loop seeing it, before). Raises like
        :meth:`next_answer`."""
        try:
            data = self._sock.recv(64)
        except BlockingIOError:
            return None
        except OSError as exc:
            self._broken = self._gone(f"its socket failed ({exc})", exiting=True)
            raise self._broken from exc
        if len(data) < _h.ANSWER.size:
            self._broken = self._gone("it closed its socket" if not data else "it sent a short answer",
                                      exiting=not data)
            raise self._broken
        rid, err, us = _h.ANSWER.unpack_from(data)
        if err:
            raise OSError(err, os.strerror(err))
        return rid, us / 1e6

    def _gone(self, why: str, exiting: bool = False) -> SyncHelperGone:
        """The error for a helper gone, saying how the process ended. ``exiting``: its
        end of the socket is closed, so the process is exiting (the kernel closes a
        dying process's descriptors before it can be reaped): wait for it, at most
        :data:`REAP_WAIT_S` (blocking the loop, on this fail-stop path only), so a
        killed helper is reported as killed, not as "still running"."""
        if self._proc is not None:
            code = self._proc.poll()
            if code is None and exiting:
                deadline = time.monotonic() + REAP_WAIT_S
                while code is None and time.monotonic() < deadline:
                    time.sleep(0.001)
                    code = self._proc.poll()
            if code is None:
                status = "still running"
            elif code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = "?"
                status = f"killed by signal {-code} ({name})"
            else:
                status = f"exit status {code}"
            what = f"the journal's sync helper process (pid {self._proc.pid}, {status})"
        elif self._inline is not None:
            what = "the journal's inline fdatasync"
        else:
            what = "the journal's sync helper thread"
        return SyncHelperGone(errno.EPIPE, f"{what}: {why}")

    async def aclose(self) -> None:
        """Close the socket (the helper ends at EOF) and reap it: a process that has
        not exited within 5 s is killed. Never raises; shielded."""
        with trio.CancelScope(shield=True):
            try:
                self._sock.close()
            except OSError:
                pass
            if self._inline is not None:
                try:
                    self._inline.close()
                except OSError:
                    pass
            if self._proc is None:
                await trio.lowlevel.checkpoint()
                return
            with trio.move_on_after(5):
                await self._proc.wait()
                return
            try:
                self._proc.kill()
                await self._proc.wait()
            except OSError:
                pass
