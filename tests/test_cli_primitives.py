"""``rallypoint claims ls|show`` and ``rallypoint pools ls|show`` for operators: readable
columns, ``--json``, one line (never a traceback) for a missing claim or pool, and no
token ever printed."""

from __future__ import annotations

import json
import subprocess
import sys

import rallypoint


def rp(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rallypoint", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_claims_ls_and_show(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create(name="cli-claims")
        held = run.claims.acquire("cli/held", lease_seconds=300, holder="worker-7")
        done = run.claims.acquire("cli/done")
        done.complete({"rows": 12})
        free = run.claims.acquire("cli/free")
        free.release({"stopped at": 3})
        ls = rp("claims", "ls", "--connect", daemon.url)
        assert ls.returncode == 0, ls.stderr
        lines = {line.split()[0]: line.split() for line in ls.stdout.splitlines()[1:]}
        assert lines["cli/held"][1:3] == ["HELD", "1"] and lines["cli/held"][-1] == "worker-7"
        assert lines["cli/done"][1] == "COMPLETED" and lines["cli/free"][1] == "FREE"
        only = rp("claims", "ls", "--state", "HELD", "--json", "--connect", daemon.url)
        assert [c["key"] for c in json.loads(only.stdout) if c["key"].startswith("cli/")] == ["cli/held"]
        show = rp("claims", "show", "cli/done", "--connect", daemon.url)
        assert show.returncode == 0 and "COMPLETED" in show.stdout and '{"rows":12}' in show.stdout
        shown = json.loads(rp("claims", "show", "cli/free", "--json", "--connect", daemon.url).stdout)
        assert shown["observation"] == {"stopped at": 3} and shown["generation"] == 1
        for out in (ls.stdout, show.stdout, only.stdout):
            assert str(held.token) not in out  # tokens are secrets
        missing = rp("claims", "show", "cli/never", "--connect", daemon.url)
        assert missing.returncode == 1 and missing.stderr.startswith("rallypoint: NOT_FOUND")
        assert "Traceback" not in missing.stderr
        held.release()


def test_pools_ls_and_show(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create(name="cli-pools")
        pool = rs.pools.ensure("cli-gpu", 4)
        g = pool.acquire(3, scope=run, lease_seconds=300, holder="trainer")
        ls = rp("pools", "ls", "--connect", daemon.url)
        assert ls.returncode == 0, ls.stderr
        row = next(line.split() for line in ls.stdout.splitlines() if line.startswith("cli-gpu "))
        assert row[1:] == ["4", "3", "1", "0", "1"]  # total used free waiting grants
        show = rp("pools", "show", "cli-gpu", "--connect", daemon.url)
        assert show.returncode == 0 and "3 used of 4 (1 free)" in show.stdout and g.id in show.stdout
        assert "trainer" in show.stdout and str(g.token) not in show.stdout
        data = json.loads(rp("pools", "show", "cli-gpu", "--json", "--connect", daemon.url).stdout)
        assert data["units_used"] == 3 and data["grants"][0]["token"] == 0
        missing = rp("pools", "show", "no-such-pool", "--connect", daemon.url)
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr and "pools.ensure" in missing.stderr
        g.release()
