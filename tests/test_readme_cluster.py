"""The README's cluster set-ups run as written (issue 40: "README commands verbatim"): the
secure two-node shard of "Run two nodes" and the secure 3-shard cluster of "Run a
cluster" -- certificates from ``rallypoint cluster certs``, a TLS etcd that takes only
client certificates of the cluster's CA and passwords (``cluster etcd-auth``), mutual
TLS on every peer link -- each block run by bash in a directory of its own.

The one thing added to the text: ``rallypoint`` is a shell function that tries a read
again (``status``, ``cluster status``) and the etcd set-up steps while the nodes or etcd
are still starting, as a user would type it again; every other line runs as it is.
Then the shard is used through the SDK and its leader killed (-9): the standby takes
over with every acknowledged write; the cluster is used across its shards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import rallypoint

from _etcd import require_etcd

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

pytestmark = [pytest.mark.timeout(300)]

PRELUDE = r'''
rallypoint() {   # (the test's: a read or an etcd set-up step tried again while things start)
  case "$1 $2" in
    "cluster status"|"status "*|"cluster etcd-auth"|"cluster init"|"status ")
      for _ in $(seq 1 300); do command rallypoint "$@" && return 0; sleep 0.2; done; return 1;;
  esac
  command rallypoint "$@"
}
set -e
'''


def block_after(heading: str) -> str:
    """The first ```sh block after ``heading`` in README.md."""
    text = README.read_text()
    at = text.index(heading)
    m = re.search(r"```sh\n(.*?)```", text[at:], re.S)
    assert m, heading
    return m.group(1)


class Session:
    """A README block run by bash in ``cwd``, its background processes in one process
    group (killed at the end)."""

    def __init__(self, cwd: Path, block: str) -> None:
        self.cwd = cwd
        self.log = cwd / "session.log"
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                   PYTHONPATH=str(ROOT))
        for k in list(env):
            if k.startswith("RALLYPOINT_"):
                del env[k]
        script = PRELUDE + block + "\nexport -p > env.out\n"
        (cwd / "block.sh").write_text(script)
        self.log_f = open(self.log, "w")
        self.proc = subprocess.Popen(["bash", "block.sh"], cwd=cwd, env=env, stdout=self.log_f,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 240) -> dict:
        """The block's exit; the environment it exported."""
        rc = self.proc.wait(timeout)
        assert rc == 0, self.log.read_text()[-5000:]
        env = {}
        for line in (self.cwd / "env.out").read_text().splitlines():
            m = re.match(r'declare -x (RALLYPOINT_\w+)="(.*)"$', line)
            if m:
                env[m.group(1)] = m.group(2)
        return env

    def cli(self, env: dict, *args: str) -> subprocess.CompletedProcess:
        full = dict(os.environ, **env, PYTHONPATH=str(ROOT))
        return subprocess.run([sys.executable, "-m", "rallypoint", *args], cwd=self.cwd, env=full,
                              capture_output=True, text=True, timeout=60)

    def pid_of(self, node: str) -> int:
        """The pid of ``serve ... --node NODE`` in this session."""
        pgid = os.getpgid(self.proc.pid) if self.proc.poll() is None else self.proc.pid
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
                if os.getpgid(int(d.name)) != pgid:
                    continue
            except (OSError, ProcessLookupError):
                continue
            if b"serve" in cmd and b"--node" in cmd and cmd[cmd.index(b"--node") + 1].decode() == node:
                return int(d.name)
        raise AssertionError(f"no serve --node {node} running")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.log_f.close()
        # the group's processes are gone once no pid of the group is left
        for _ in range(200):
            alive = False
            for d in Path("/proc").iterdir():
                if d.name.isdigit():
                    try:
                        if os.getpgid(int(d.name)) == self.proc.pid:
                            alive = True
                            break
                    except (OSError, ProcessLookupError):
                        pass
            if not alive:
                return
            import time

            time.sleep(0.05)


@pytest.fixture
def tools():
    require_etcd()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (the README's password files use it)")


async def _wait_status(s: Session, env: dict, pred, what: str, timeout: float = 60) -> dict:
    with trio.fail_after(timeout):
        while True:
            r = await trio.to_thread.run_sync(lambda: s.cli(env, "cluster", "status", "--json"))
            if r.returncode == 0:
                doc = json.loads(r.stdout)
                if pred(doc):
                    return doc
            await trio.sleep(0.2)


async def test_the_secure_two_node_shard_of_the_readme_runs_and_fails_over(tmp_path, tools):
    s = Session(tmp_path, block_after("## Run two nodes"))
    try:
        env = s.wait()
        assert env["RALLYPOINT_CLUSTER"].startswith("https://rallypoint@")
        doc = await _wait_status(s, env, lambda d: sorted(d["shards"][0]["isr"]) == ["a", "b"], "both in sync")
        lead = doc["shards"][0]["leader"]["node"]
        # the peer link is TLS: the standby's log says it follows, nothing was refused
        log = s.log.read_text()
        assert "not authenticated" not in log and "refused a connection" not in log
        async with rallypoint.connect(env["RALLYPOINT_URL"], reconnect=rallypoint.Reconnect(timeout=60)) as rs:
            jobs = await rs.mailboxes.ensure("readme")
            run = await rs.scopes.create(name="readme")
            acked = [(await jobs.submit({"i": i}, key=f"k{i}", scope=run)).id for i in range(20)]
            os.kill(s.pid_of(lead), signal.SIGKILL)
            after = (await jobs.submit({"i": 20}, key="k20", scope=run)).id  # on the new leader
            for tid in acked + [after]:
                assert (await rs.task(tid).status()).state == "QUEUED"
        other = "b" if lead == "a" else "a"
        await _wait_status(s, env, lambda d: (d["shards"][0]["leader"] or {}).get("node") == other, "failover")
    finally:
        s.stop()


async def test_the_secure_three_shard_cluster_of_the_readme_runs(tmp_path, tools):
    block = block_after("## Run a cluster")
    # (its last line adds a fourth shard, whose nodes the text says to start: not here)
    block = "\n".join(ln for ln in block.splitlines() if "cluster add-shard" not in ln) + "\n"
    s = Session(tmp_path, block)
    try:
        env = s.wait()
        doc = await _wait_status(s, env, lambda d: len(d["shards"]) == 3 and all(
            len(x["isr"]) == 2 and x["node"] is not None for x in d["shards"]), "every shard in sync", timeout=120)
        assert [x["shard"] for x in doc["shards"]] == [0, 1, 2]
        log = s.log.read_text()
        assert "not authenticated" not in log and "refused a connection" not in log
        async with rallypoint.connect(env["RALLYPOINT_URL"]) as rs:
            runs = [await rs.scopes.create(name=f"r{i}") for i in range(9)]
            jobs = await rs.mailboxes.ensure("readme")
            for r in runs:
                await jobs.submit({"run": r.id}, scope=r)
            st = await rs.status()
            assert st.runs["ACTIVE"] >= 9
        r = await trio.to_thread.run_sync(lambda: s.cli(env, "status", "--json"))
        assert r.returncode == 0, r.stderr
    finally:
        s.stop()
