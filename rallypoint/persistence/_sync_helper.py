"""The journal's sync helper: fdatasync on request, coalesced, answered in order.

A standalone program of the standard library's C modules only: :mod:`.syncer` runs this file as
``python -I -S _sync_helper.py FD`` (the sync helper *process*), or calls :func:`serve`
in a thread of the daemon (the sync helper *thread*). FD is one end of an
``AF_UNIX``/``SOCK_SEQPACKET`` socket pair; every message is one request::

    u64 request id (increasing)   u8 op   u32 key      (little-endian)

``REGISTER`` carries a file descriptor (``SCM_RIGHTS``) kept under ``key`` until
``UNREGISTER``; ``DATASYNC``/``FULLSYNC`` ask for ``fdatasync``/``fsync`` of the file
under ``key``. Requests are carried out in order. Sync requests that are waiting when
the helper gets to them and name the same key are done by ONE call (a sync covers
everything written before it started, so it covers every request sent before it
started), and answered with the last one's id::

    u64 request id   i32 errno (0: done)   u32 microseconds the call took

An answer for id N means every sync request up to N is done (or failed, with that
errno). The helper ignores SIGINT, SIGTERM and SIGHUP (a Ctrl-C or a signal to the
process group must not stop it under a daemon that is draining) and ends when the
socket closes -- when the journal closes it, or when the daemon dies, even by SIGKILL.
"""

# C modules only (no ``socket``, ``os``, ``signal``, ``array``: their Python layers
# import enum and collections): the process is up in ~18 ms instead of ~34 ms.
import _socket
import _struct
import errno
import posix
import sys
import time

REQUEST = _struct.Struct("<QBI")
ANSWER = _struct.Struct("<QiI")
REGISTER, UNREGISTER, DATASYNC, FULLSYNC = 1, 2, 3, 4

_INT = 4  # bytes of a C int, the unit of SCM_RIGHTS data
_FDS_SPACE = _socket.CMSG_SPACE(4 * _INT)


def _receive(sock, flags=0):
    """One message and the descriptors it carries (``socket.recv_fds`` of Python 3.11
    ignores its ``flags``, so MSG_DONTWAIT needs this)."""
    msg, ancdata, _flags, _addr = sock.recvmsg(64, _FDS_SPACE, flags)
    fds = []
    for level, kind, data in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            for i in range(0, len(data) - len(data) % _INT, _INT):
                fds.append(int.from_bytes(data[i:i + _INT], sys.byteorder, signed=True))
    return msg, fds


def serve(sock, fdatasync=posix.fdatasync, fsync=posix.fsync):
    """Answer requests on ``sock`` until it closes. ``fdatasync``/``fsync``: the calls
    (a test's faulty Disk passes its own ``fdatasync``)."""
    fds = {}
    try:
        while True:
            try:
                msg, got = _receive(sock)
            except OSError:
                return
            if not msg:
                return
            batch = [(msg, got)]
            closed = False
            while True:  # everything else already waiting: coalesced below
                try:
                    msg, got = _receive(sock, _socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError:
                    closed = True
                    break
                if not msg:
                    closed = True
                    break
                batch.append((msg, got))
            i = 0
            while i < len(batch):
                rid, op, key = REQUEST.unpack_from(batch[i][0])
                extra = batch[i][1]
                if op == REGISTER:
                    if extra:
                        old = fds.pop(key, None)
                        if old is not None:
                            posix.close(old)
                        fds[key] = extra[0]
                        extra = extra[1:]
                elif op == UNREGISTER:
                    old = fds.pop(key, None)
                    if old is not None:
                        posix.close(old)
                elif op in (DATASYNC, FULLSYNC):
                    full = op == FULLSYNC
                    while i + 1 < len(batch):
                        nrid, nop, nkey = REQUEST.unpack_from(batch[i + 1][0])
                        if nop not in (DATASYNC, FULLSYNC) or nkey != key:
                            break
                        i += 1
                        rid = nrid
                        full = full or nop == FULLSYNC
                        for fd in batch[i][1]:
                            posix.close(fd)
                    err = 0
                    t0 = time.perf_counter()
                    try:
                        fd = fds[key]
                        (fsync if full else fdatasync)(fd)
                    except KeyError:
                        err = errno.EBADF
                    except OSError as e:
                        err = e.errno or errno.EIO
                    us = min(int((time.perf_counter() - t0) * 1e6), 0xFFFFFFFF)
                    try:
                        sock.send(ANSWER.pack(rid, err, us))
                    except OSError:
                        return
                for fd in extra:
                    posix.close(fd)
                i += 1
            if closed:
                return
    finally:
        for fd in fds.values():
            posix.close(fd)
        sock.close()


if __name__ == "__main__":
    import _signal

    for s in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP):
        _signal.signal(s, _signal.SIG_IGN)
    serve(_socket.socket(fileno=int(sys.argv[1])))
