"""Helpers for the runstate SDK compatibility suite (tests/test_runstate_*.py).

- :func:`sdk_python`: a virtual environment with the unchanged ``runstate-sdk==VERSION``
  from the package index (plus pytest, pytest-asyncio, anyio for the vendor's own
  tests), one per version so 0.2.0 and 0.3.0 never meet each other or our package.
  Made once and kept under ``$RALLYPOINT_SDK_CACHE`` (default
  ``~/.cache/rallypoint/runstate-sdk``); ``.ci/run`` makes them before the tests.
- :func:`sdk_tests_dir`: the ``tests/`` folder of the version's source distribution
  (the vendor's integration tests), unpacked next to the venv.
- :class:`HttpDaemon`: a ``rallypoint serve --http`` subprocess with an API key of its
  own space (authentication on, like a real deployment).

When the index cannot be reached the fixtures fail with a message saying so (and how to
pre-install), never skip silently.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

VERSIONS = ("0.2.0", "0.3.0")
TEST_DEPS = ["pytest>=8", "pytest-asyncio>=0.23", "anyio>=4", "httpx>=0.27"]
REPO = Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    root = os.environ.get("RALLYPOINT_SDK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rallypoint", "runstate-sdk")
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def _run(cmd: list[str], what: str, timeout: float = 600) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = (r.stdout + r.stderr)[-3000:]
        pytest.fail(
            f"could not {what}: `{' '.join(cmd)}` exited {r.returncode}. The runstate SDK compatibility suite "
            "needs the package index (runstate-sdk==0.2.0 and ==0.3.0 from PyPI); this machine may not reach "
            "it. Pre-install with `python3 tests/sdk_compat.py` where it can, or point RALLYPOINT_SDK_CACHE at a "
            f"prepared cache.\n{tail}",
            pytrace=False,
        )


def _prepare(version: str) -> Path:
    """The venv (and unpacked sdist) for ``version``: made at most once, under a lock."""
    root = cache_root() / version
    root.mkdir(parents=True, exist_ok=True)
    done = root / "READY"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return root
        venv = root / "venv"
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(venv)], f"make a virtual environment for runstate-sdk {version}")
        py = str(venv / "bin" / "python")
        _run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"runstate-sdk=={version}",
              *TEST_DEPS], f"install runstate-sdk=={version} from the package index")
        sdist_dir = root / "sdist"
        shutil.rmtree(sdist_dir, ignore_errors=True)
        sdist_dir.mkdir()
        _run([py, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps", "--no-binary",
              ":all:", "-d", str(sdist_dir), f"runstate-sdk=={version}"],
             f"download the runstate-sdk {version} source distribution (its tests)")
        tgz = next(sdist_dir.glob("*.tar.gz"))
        with tarfile.open(tgz) as tf:
            tf.extractall(sdist_dir, filter="data")
        done.write_text(version)
        return root


def sdk_python(version: str) -> str:
    """The python of the venv holding ``runstate-sdk==version``."""
    return str(_prepare(version) / "venv" / "bin" / "python")


def sdk_tests_dir(version: str) -> Path:
    """The vendor's ``tests/`` folder of the ``version`` sdist (read-only: copy it)."""
    root = _prepare(version) / "sdist"
    return next(root.glob("runstate_sdk-*/tests"))


class HttpDaemon:
    """``rallypoint serve --http 127.0.0.1:0`` on a fresh data dir with one admin key of
    space ``space`` (``secret``); ``base_url`` is the HTTP root, ``tcp_url`` the native
    listener of the same daemon."""

    def __init__(self, data_dir: str, space: str = "compat", durability: str = "interval",
                 extra: list[str] | None = None, open_mode: bool = False, pass_fds: tuple = (),
                 env: dict | None = None) -> None:
        self.data_dir = data_dir
        self.space = space
        self.durability = durability
        self.extra = extra or []
        self.open_mode = open_mode
        self.pass_fds = pass_fds  # listening sockets it inherits (RALLYPOINT_LISTEN_FDS in env)
        self.extra_env = env or {}
        self.secret = ""
        self.proc: subprocess.Popen | None = None
        self.base_url = ""
        self.tcp_url = ""
        self.log = Path(data_dir) / "daemon.log"

    def _env(self) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(self.extra_env)
        return env

    def start(self, timeout: float = 30.0) -> "HttpDaemon":
        os.makedirs(self.data_dir, exist_ok=True)
        if not self.open_mode and not self.secret:
            r = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "create", "--data-dir", self.data_dir,
                                "--space", self.space, "--permission", "admin", "--name", "compat",
                                "--secret-only"], capture_output=True, text=True, env=self._env(), timeout=60)
            assert r.returncode == 0, r.stderr
            self.secret = r.stdout.strip()
        args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                "--data-dir", self.data_dir, "--durability", self.durability, *self.extra]
        self._logf = open(self.log, "a")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._logf, text=True, env=self._env(),
                                     pass_fds=self.pass_fds)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY "):
                self.tcp_url = line.split()[1]
            elif line.startswith("HTTP "):
                self.base_url = line.split()[1]
                return self
            elif not line and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
        raise RuntimeError("daemon did not become ready")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._logf.close()

    def kernel(self) -> dict:
        return {"base_url": self.base_url, "api_key": self.secret or "open-mode", "space_id": self.space}

    def sdk_env(self) -> dict:
        """Environment for a process using the SDK against this daemon."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RUNSTATE_", "PYTHONPATH"))}
        env.update(RUNSTATE_BASE_URL=self.base_url, RUNSTATE_API_KEY=self.secret or "open-mode",
                   RUNSTATE_SPACE_ID=self.space, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        return env


def run_script(python: str, daemon: HttpDaemon, script: str, *, timeout: float = 120, env: dict | None = None):
    """Run ``script`` with the SDK venv's python against ``daemon``; its last stdout line
    is JSON and is returned decoded. A failing script fails the test with its output."""
    e = daemon.sdk_env()
    if env:
        e.update(env)
    r = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=timeout, env=e,
                       cwd=daemon.data_dir)
    if r.returncode != 0:
        pytest.fail(f"SDK script exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}", pytrace=False)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1]) if lines else None


if __name__ == "__main__":  # pre-install the venvs (CI, or a machine that can reach the index)
    for v in VERSIONS:
        print(v, sdk_python(v), sdk_tests_dir(v))
