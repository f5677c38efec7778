"""Run a command on a small, real filesystem that can be filled and emptied on demand.

No root needed where unprivileged user namespaces are enabled: the script re-executes
itself under ``unshare --user --map-root-user --mount``, mounts a tmpfs of ``--size`` on
``--mount`` (visible only inside that namespace), and starts the command there (e.g. a
``rallypoint serve --data-dir MOUNT/data``). Used by tests/test_persistence_diskfull_fs.py
and scripts/soak_diskfull.py.

Protocol: stdout lines ``MOUNTED <dir> <free bytes>``, then ``OUT <line>`` for each line
the command prints on stdout; the command's stderr goes to ``--log``. Commands on stdin,
each answered by one line:

    fill N        fill the filesystem until at most N bytes are free  -> FILLED <free>
    free          delete the filler                                    -> FREED <free>
    df            free bytes                                           -> DF <free>
    signal NAME   send SIGNAME to the command                          -> SIGNALLED
    wait          wait for the command to exit                         -> EXITED <code>
    restart       start the command again (after it exited)           -> RESTARTED
    rss           resident set size of the command, bytes              -> RSS <bytes>

Usage (from Python, see :class:`SmallFs`), or by hand:
``python3 scripts/smallfs.py --size 16m --mount /tmp/x --log /tmp/x.log -- CMD ARGS``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

_INSIDE = "RALLYPOINT_SMALLFS_INSIDE"


def available() -> bool:
    """Can this machine run the harness (unshare + tmpfs in a user namespace)?"""
    if shutil.which("unshare") is None:
        return False
    try:
        r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs \"$d\" && umount \"$d\"; rmdir \"$d\""],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _inside(args) -> int:
    os.makedirs(args.mount, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.size}", "tmpfs", args.mount], check=True)
    out_lock = threading.Lock()

    def say(line: str) -> None:
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    say(f"MOUNTED {args.mount} {_free(args.mount)}")
    log = open(args.log, "ab")

    def spawn() -> subprocess.Popen:
        p = subprocess.Popen(args.cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True)

        def relay() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                say("OUT " + line.rstrip("\n"))

        threading.Thread(target=relay, daemon=True).start()
        return p

    proc = spawn()
    filler = os.path.join(args.mount, "FILLER")
    for raw in sys.stdin:
        cmd, _, arg = raw.strip().partition(" ")
        if cmd == "fill":
            leave = int(arg or 0)
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                while True:
                    room = _free(args.mount) - leave
                    if room <= 0:
                        break
                    try:
                        os.write(fd, b"\0" * min(room, 1 << 20))
                    except OSError:
                        break
            finally:
                os.close(fd)
            say(f"FILLED {_free(args.mount)}")
        elif cmd == "free":
            try:
                os.unlink(filler)
            except FileNotFoundError:
                pass
            say(f"FREED {_free(args.mount)}")
        elif cmd == "df":
            say(f"DF {_free(args.mount)}")
        elif cmd == "signal":
            proc.send_signal(getattr(signal, "SIG" + arg))
            say("SIGNALLED")
        elif cmd == "wait":
            say(f"EXITED {proc.wait()}")
        elif cmd == "restart":
            if proc.poll() is None:
                say("ERROR the command is still running")
            else:
                proc = spawn()
                say("RESTARTED")
        elif cmd == "rss":
            rss = 0
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            rss = int(line.split()[1]) * 1024
            except OSError:
                pass
            say(f"RSS {rss}")
        else:
            say(f"ERROR unknown command {cmd!r}")
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    return 0


class SmallFs:
    """Drive the harness from Python: ``SmallFs(mount, log, cmd, size="16m")``; the
    command's ``OUT`` lines are collected in :attr:`out` (``ready()`` waits for the
    ``READY url`` line ``rallypoint serve`` prints)."""

    def __init__(self, mount, log, cmd: list[str], *, size: str = "16m", env: dict | None = None) -> None:
        self.mount = str(mount)
        self.log = str(log)
        self.out: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--size", size, "--mount", self.mount,
             "--log", self.log, "--", *cmd],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        first = self._line(timeout=20)
        if not first.startswith("MOUNTED "):
            raise RuntimeError(f"smallfs harness did not start: {first!r}")
        self.size = int(first.split()[2])

    def _line(self, timeout: float = 30) -> str:
        assert self.proc.stdout is not None
        result: list[str] = []
        t = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not result:
            raise TimeoutError("smallfs harness did not answer")
        return result[0].rstrip("\n")

    def _ask(self, command: str, answer: str, timeout: float = 60) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(max(0.1, deadline - time.monotonic()))
            if line.startswith("OUT "):
                self.out.append(line[4:])
                continue
            if line == "":
                raise RuntimeError(f"smallfs harness ended while waiting for {answer}")
            if not line.startswith(answer):
                raise RuntimeError(f"smallfs harness answered {line!r} to {command!r}")
            return line[len(answer):].strip()

    def ready(self, timeout: float = 30) -> str:
        """Wait for the command's ``READY <url>`` line; returns the url."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(max(0.1, deadline - time.monotonic()))
            if line.startswith("OUT "):
                self.out.append(line[4:])
                if line.startswith("OUT READY "):
                    return line.split()[2]
            elif line == "":
                raise RuntimeError("the command exited before READY; see " + self.log)

    def fill(self, leave: int = 0) -> int:
        return int(self._ask(f"fill {leave}", "FILLED"))

    def free(self) -> int:
        return int(self._ask("free", "FREED"))

    def df(self) -> int:
        return int(self._ask("df", "DF"))

    def rss(self) -> int:
        return int(self._ask("rss", "RSS"))

    def stop(self, sig: str = "TERM", timeout: float = 60, *, close: bool = True) -> int:
        """Signal the command, wait for it (and end the harness unless ``close`` is
        False: :meth:`restart` can then run it again); returns the exit code."""
        self._ask(f"signal {sig}", "SIGNALLED")
        code = int(self._ask("wait", "EXITED", timeout=timeout))
        if close:
            self.close()
        return code

    def restart(self) -> str:
        """Start the command again on the same filesystem; returns its READY url."""
        self._ask("restart", "RESTARTED")
        return self.ready()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="16m", help="tmpfs size (mount -o size=...)")
    ap.add_argument("--mount", required=True, help="directory to mount the tmpfs on (created)")
    ap.add_argument("--log", required=True, help="file for the command's stderr")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    args = ap.parse_args(argv)
    if args.cmd and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    if not args.cmd:
        ap.error("give the command after --")
    if os.environ.get(_INSIDE) == "1":
        return _inside(args)
    env = dict(os.environ, **{_INSIDE: "1"})
    os.makedirs(args.mount, exist_ok=True)
    return subprocess.call(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                            os.path.abspath(__file__), *sys.argv[1:]], env=env)


if __name__ == "__main__":
    sys.exit(main())
