"""The command line, second pass (issue 12, item 13): newest-first paged ``runs ls``,
a readable ``runs show``, no traceback into a closed pipe (``| head``), the README's
keys walkthrough as written, no silent switch out of open mode, and error lines that
tell an operator (not a Python programmer) what to do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import trio

import rallypoint

from conftest import Daemon

README = Path(__file__).resolve().parent.parent / "README.md"


def rp(*args, timeout=60, stdout=subprocess.PIPE, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rallypoint", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def make_runs(url: str, n: int, parent: bool = False) -> tuple[str | None, list[str]]:
    """``n`` runs named r0.. (children of a fresh parent run if ``parent``), oldest first."""

    async def main():
        async with rallypoint.connect(url) as rs:
            top = await rs.scopes.create(name="cli-parent") if parent else None
            ids = []
            for i in range(n):
                run = await (top.child(name=f"r{i}") if top else rs.scopes.create(name=f"r{i}"))
                ids.append(run.id)
            return (top.id if top else None), ids

    return trio.run(main)


def listed_ids(stdout: str) -> list[str]:
    return [ln.split()[0] for ln in stdout.splitlines()[1:]]


# ------------------------------------------------------------------------- runs ls / show


def test_runs_ls_lists_newest_first_and_says_how_to_get_the_next_page(daemon):
    parent, ids = make_runs(daemon.url, 5, parent=True)
    newest_first = ids[::-1]
    r = rp("runs", "ls", "--connect", daemon.url, "--parent", parent, "--limit", "2")
    assert r.returncode == 0, r.stderr
    assert listed_ids(r.stdout) == newest_first[:2]
    hint = one_line(r.stderr)
    cmd = re.search(r"rallypoint (runs ls .*)$", hint).group(1).split()
    assert "--before" in cmd and newest_first[1] in cmd
    r2 = rp(*cmd, "--connect", daemon.url)
    assert listed_ids(r2.stdout) == newest_first[2:4]
    r3 = rp(*re.search(r"rallypoint (runs ls .*)$", r2.stderr.strip()).group(1).split(), "--connect", daemon.url)
    assert listed_ids(r3.stdout) == newest_first[4:] and r3.stderr == ""  # the last page: no hint
    # the roots too: the runs made last come first
    _, roots = make_runs(daemon.url, 3)
    top = rp("runs", "ls", "--connect", daemon.url, "--limit", "3", "--json")
    assert [x["id"] for x in json.loads(top.stdout)] == roots[::-1]


def test_runs_show_is_readable_and_json_on_request(daemon):
    _, (rid,) = make_runs(daemon.url, 1)
    r = rp("runs", "show", rid, "--connect", daemon.url)
    assert r.returncode == 0, r.stderr
    assert not r.stdout.lstrip().startswith("{")
    fields = dict(re.split(r"\s{2,}", ln.strip(), maxsplit=1) for ln in r.stdout.strip().splitlines())
    assert fields["run"] == rid and fields["name"] == "r0"
    assert fields["state"].startswith("ACTIVE")
    j = rp("runs", "show", rid, "--json", "--connect", daemon.url)
    assert json.loads(j.stdout)["id"] == rid


def test_runs_show_of_a_name_with_several_runs_says_so_and_lists_them(daemon):
    # issue 42: `runs show NAME` silently picked the newest of two runs with that name
    import uuid

    name = f"twice-{uuid.uuid4().hex[:6]}"

    async def make():
        async with rallypoint.connect(daemon.url) as rs:
            return [(await rs.scopes.create(name=name)).id for _ in range(2)]

    older, newer = trio.run(make)
    r = rp("runs", "show", name, "--connect", daemon.url)
    assert r.returncode == 0, r.stderr
    assert f"2 root runs are named {name!r}" in r.stderr and newer in r.stderr and older in r.stderr
    assert newer in r.stdout


def test_output_into_a_closed_pipe_prints_no_traceback(daemon):
    """``rallypoint ... | head``: the reader is gone before we write."""
    make_runs(daemon.url, 3)
    _, (rid,) = make_runs(daemon.url, 1)
    for args in (["runs", "ls", "--all"], ["runs", "show", rid], ["status"], ["runs", "ls", "--json"],
                 ["watch", "--from-start", "--count", "2"], ["watch", "--from-start", "--count", "2", "--json"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            r = rp(*args, "--connect", daemon.url, stdout=write_end)
        finally:
            os.close(write_end)
        assert r.stderr == "", (args, r.stderr)
        assert r.returncode == 141, (args, r.returncode)  # as a process killed by SIGPIPE


# ------------------------------------------------------------------------- keys


def readme_block(after: str) -> str:
    """The first ```sh block of README.md after the line containing ``after``."""
    text = README.read_text()
    start = text.index(after)
    m = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    return m.group(1)


def run_sh(script: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """Run README shell lines in bash, with ``rallypoint`` meaning this interpreter's and
    this checkout's package (whatever is installed, from any working directory)."""
    prelude = f'rallypoint() {{ "{sys.executable}" -m rallypoint "$@"; }}\nset -e\n'
    env = dict(env, PYTHONPATH=str(README.parent) + os.pathsep + env.get("PYTHONPATH", ""))
    return subprocess.run(["bash", "-c", prelude + script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_readme_keys_walkthrough_works_as_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALLYPOINT_")}
    first = readme_block("## API keys")
    second = readme_block("On the running daemon")
    # 1. daemon stopped: the first key (operator), its secret kept in the environment
    r = run_sh(first + '\necho "KEY=$RALLYPOINT_API_KEY"\n', tmp_path, env)
    assert r.returncode == 0, r.stderr
    secret = re.search(r"^KEY=(\S+)$", r.stdout, re.M).group(1)
    assert secret.startswith("rpk_") and secret not in r.stderr
    # 2. the daemon, on the README's data dir (a free port instead of 7411)
    d = Daemon(str(tmp_path / "rallypoint-data"), "fsync").start()
    try:
        script = second.replace("tcp://127.0.0.1:7411", d.url)
        r = run_sh(script, tmp_path, dict(env, RALLYPOINT_API_KEY=secret))
        assert r.returncode == 0, r.stderr
        assert "space=team-a" in r.stdout and "space=default" in r.stdout and "operator" in r.stdout
    finally:
        assert d.stop() == 0


def test_readme_client_commands_work_as_written(daemon, tmp_path):
    _, (rid,) = make_runs(daemon.url, 1)
    block = readme_block("On a running server").replace("RUN_ID", rid)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALLYPOINT_")}
    r = run_sh(block, tmp_path, dict(env, RALLYPOINT_URL=daemon.url))
    assert r.returncode == 0, r.stderr
    assert f"run         {rid}" in r.stdout and f"{rid} CANCELLED" in r.stdout


def test_first_key_on_a_running_open_mode_daemon_needs_force_and_errors_say_what_to_do():
    d = Daemon(None, "memory").start()
    try:
        create = ["keys", "create", "--connect", d.url, "--space", "default", "--permission", "admin"]
        refused = rp(*create)
        line = one_line(refused.stderr)
        assert refused.returncode == 2 and "open mode" in line and "--force" in line, line
        assert rp("status", "--connect", d.url).returncode == 0  # still open
        forced = rp(*create, "--force", "--secret-only")
        assert forced.returncode == 0, forced.stderr
        secret = forced.stdout.strip()
        assert secret.startswith("rpk_")
        # now a key is required: the error names the CLI's options, not Python's
        no_key = rp("status", "--connect", d.url)
        line = one_line(no_key.stderr)
        assert no_key.returncode == 1 and "UNAUTHENTICATED" in line, line
        assert "--api-key" in line and "RALLYPOINT_API_KEY" in line and "api_key=" not in line, line
        bad_key = rp("runs", "ls", "--connect", d.url, "--api-key", "rp_wrong")
        line = one_line(bad_key.stderr)
        assert "unknown or revoked" in line and "--api-key" in line and "api_key=" not in line, line
        assert rp("status", "--connect", d.url, "--api-key", secret).returncode == 0
        # with keys in place, more keys need no --force (in the key's own space) ...
        more = rp("keys", "create", "--connect", d.url, "--api-key", secret, "--space", "default",
                  "--permission", "coordination_read")
        assert more.returncode == 0, more.stderr
        # ... and an admin key acts in its own space only (issue 12.1)
        other = rp("keys", "create", "--connect", d.url, "--api-key", secret, "--space", "b",
                   "--permission", "admin")
        line = one_line(other.stderr)
        assert other.returncode == 1 and "FORBIDDEN" in line and "'b'" in line, line
    finally:
        assert d.stop() == 0


# ------------------------------------------------------------------------- the server op behind runs ls


async def test_scope_list_orders_and_bounds(rs):
    """``scope.list`` (what ``runs ls`` pages with): ``order`` asc/desc by creation,
    ``after``/``before`` exclusive bounds with either order; another order is refused."""
    import pytest

    from rallypoint import protocol as p
    from rallypoint.client import types as t
    from rallypoint.errors import ValidationError

    top = await rs.scopes.create(name="order")
    ids = [(await top.child(name=f"k{i}")).id for i in range(5)]

    async def page(**kw):
        return [r.id for r in (await rs._call(p.ScopeList(parent_id=top.id, **kw), t._RunList)).scopes]

    assert await page() == ids
    assert await page(order="desc") == ids[::-1]
    assert await page(order="desc", before=ids[3], limit=2) == [ids[2], ids[1]]
    assert await page(after=ids[0], before=ids[4]) == ids[1:4]
    assert await page(order="desc", after=ids[2]) == [ids[4], ids[3]]
    with pytest.raises(ValidationError) as ei:
        await page(order="sideways")
    assert ei.value.details == {"field": "order"}


# ---------------------------------------------------------------- input checks (new-user findings)
def test_watch_and_bench_refuse_bad_arguments_before_connecting(tmp_path, capsys):
    from rallypoint.cli import main

    url = "tcp://127.0.0.1:1"  # nothing listens: each refusal happens before connecting
    assert main(["watch", "--connect", url, "--types", "task.completed,bogus.type"]) == 2
    assert "unknown event type 'bogus.type'" in capsys.readouterr().err
    assert main(["watch", "--connect", url, "--types", ""]) == 2
    assert main(["watch", "--connect", url, "--aggregate", "task:"]) == 2
    assert "--aggregate is KIND:ID" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["watch", "--connect", url, "--cursor", str(2**64)])
    assert ei.value.code == 2 and "must be <=" in capsys.readouterr().err
    for bad, says in ((["--batch", "0"], "--batch must be 1 to 1000"), (["--batch", "5000"], "--batch must be 1 to 1000"),
                      (["--rate", "-5"], "--rate and --coalesce-ms must be >= 0"),
                      (["--json", str(tmp_path / "no" / "x.json")], "no directory"),
                      (["--sync-helper", "inline"], "--sync-helper is the spawned daemon's")):
        assert main(["bench", "--connect", url, "--duration", "1", *bad]) == 2
        assert says in capsys.readouterr().err


def test_a_live_watch_that_falls_behind_goes_on_from_now(monkeypatch, capsys):
    """No --cursor and no --from-start: a live view. When the events it had not read yet
    are no longer kept (CURSOR_EXPIRED), it says so on stderr and goes on from now; with
    --cursor (every event wanted) it fails instead."""
    import contextlib
    import datetime

    import rallypoint
    from rallypoint.cli import main
    from rallypoint.errors import CursorExpiredError

    calls = []

    def event(seq):
        return types.SimpleNamespace(seq=seq, type="scope.created", kind="run", id=f"scp_{seq}", run=f"scp_{seq}",
                                     at=datetime.datetime(2026, 11, 30, tzinfo=datetime.timezone.utc), data=None,
                                     shard=None)

    class Stream:
        def __init__(self, first):
            self.first = first

        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            if self.first:
                yield event(1)
                raise CursorExpiredError("the oldest kept is 500", details={"cursor": 1, "oldest": 500})
            yield event(900)

    class Events:
        @contextlib.asynccontextmanager
        async def watch(self, cursor=None, types=None, scope=None, aggregate=None, start="now"):
            calls.append((cursor, start))
            yield Stream(first=len(calls) == 1)

    @contextlib.asynccontextmanager
    async def connect(url, **kw):
        yield types.SimpleNamespace(events=Events())

    monkeypatch.setattr(rallypoint, "connect", connect)
    assert main(["watch", "--connect", "tcp://127.0.0.1:1", "--json", "--count", "2"]) == 0
    out = capsys.readouterr()
    assert [json.loads(line)["seq"] for line in out.out.splitlines()] == [1, 900]
    assert "fell behind the events kept" in out.err and "going on from now" in out.err
    assert calls == [(None, "now"), (None, "now")]
    calls.clear()
    assert main(["watch", "--connect", "tcp://127.0.0.1:1", "--json", "--cursor", "0"]) == 1
    assert "CURSOR_EXPIRED" in capsys.readouterr().err and len(calls) == 1


def test_runs_ls_before_must_be_a_run_id_and_keys_list_says_when_there_are_none(daemon):
    r = rp("runs", "ls", "--before", "nonsense", "--connect", daemon.url)
    assert r.returncode == 2 and "expected a run id" in r.stderr
    r = rp("keys", "list", "--connect", daemon.url)
    assert r.returncode == 0 and r.stdout == "" and "no API keys (open mode" in r.stderr


def test_keys_create_without_connect_or_data_dir_does_not_write_a_key_a_running_daemon_never_sees(daemon, tmp_path):
    # issue 41, item 10: `keys create` without --connect or --data-dir silently wrote
    # ./rallypoint-data, and the key it printed was then refused by the running daemon
    env = dict(os.environ, RALLYPOINT_URL=daemon.url)
    r = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "create", "--space", "default", "--permission",
                        "admin"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"a daemon answers at {daemon.url}" in r.stderr, r.stderr
    assert not (tmp_path / "rallypoint-data").exists()
    # no daemon there: it makes the data dir, and says so
    from _cluster import free_ports

    env["RALLYPOINT_URL"] = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    r = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "create", "--space", "default", "--permission",
                        "operator"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "making one for this key" in r.stderr, r.stderr
    assert (tmp_path / "rallypoint-data" / "FORMAT").exists()
