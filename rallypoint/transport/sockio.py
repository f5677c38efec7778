"""Reading a plain TCP socket under Trio without a failed read per request.

``trio.SocketStream.receive_some`` (and anyio's ``receive`` on Trio) *tries* a read
first and waits for readability only when it finds nothing. A peer that answers
requests one at a time has, by the time its reader looks again, never sent anything
yet: every request costs a ``recv`` syscall that fails with EAGAIN, a raised
BlockingIOError and two context managers around it. :func:`receive_plain` waits first
instead (measured: ``run.status()`` over 16 connections went from 38 to 30 us of daemon
CPU per request; docs/performance.md, issue 18's seventh pass). Used by the server's
connection reader and, under Trio, the client's.
"""

from __future__ import annotations

import os

import trio

__all__ = ["receive_plain"]

_wait_readable = trio.lowlevel.wait_readable
_checkpoint = trio.lowlevel.checkpoint


async def receive_plain(fd: int, max_bytes: int, *, ready: bool = False) -> bytes:
    """Read up to ``max_bytes`` bytes from the non-blocking plain socket ``fd`` (Trio
    keeps its sockets non-blocking) on the running Trio loop.

    Returns what was read, ``b""`` at EOF or after ``shutdown(SHUT_RD)``. Raises the
    ``OSError`` of the read (e.g. ConnectionResetError; callers translate it), and
    ``trio.ClosedResourceError`` if the socket is closed by Trio while waiting.

    Unless ``ready`` it waits for readability BEFORE reading; with ``ready`` (the
    caller's previous read filled its buffer: more is likely waiting) it reads first
    and waits only if that found nothing. Either way it is a checkpoint: a
    cancellation point that yields to other tasks.

    A negative ``fd`` (what ``socket.fileno()`` returns once the socket is closed, e.g.
    by another task during the previous call's checkpoint) raises
    ``trio.ClosedResourceError``, as a close during the wait does.
    """
    if fd < 0:
        raise trio.ClosedResourceError("the socket was closed")
    if ready:
        try:
            data = os.read(fd, max_bytes)
        except BlockingIOError:
            pass
        else:
            await _checkpoint()
            return data
    while True:
        await _wait_readable(fd)
        try:
            return os.read(fd, max_bytes)
        except BlockingIOError:
            continue
