"""Issue 31 item 14: a name a person typed that is not found says what was probably
meant (mailboxes, pools, quotas, budgets; event types in ``watch``); ``runs show|cancel``
take a run's name; ``open_embedded``'s errors speak Python, not CLI flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

import rallypoint
from rallypoint.errors import NotFoundError
from rallypoint.persistence.errors import DataDirLocked



async def test_a_mistyped_name_is_not_found_with_a_suggestion(rs):
    run = await rs.scopes.create()
    await rs.mailboxes.ensure("drafts-review")
    await rs.pools.ensure("browsers", units_total=2)
    await rs.quotas.ensure("search-api", units_limit=5, window_seconds=60)
    await rs.budgets.ensure("model-spend", limit=500)
    with pytest.raises(NotFoundError) as ei:
        await rs.mailbox("drafts-reveiw").submit({"x": 1}, scope=run)
    assert "did you mean 'drafts-review'?" in ei.value.message, ei.value.message
    with pytest.raises(NotFoundError) as ei:
        await rs.pool("browser").status()
    assert "did you mean 'browsers'?" in ei.value.message, ei.value.message
    with pytest.raises(NotFoundError) as ei:
        await rs.quota("serch-api").status()
    assert "did you mean 'search-api'?" in ei.value.message, ei.value.message
    with pytest.raises(NotFoundError) as ei:
        await rs.budget("model-spnd").status()
    assert "did you mean 'model-spend'?" in ei.value.message, ei.value.message
    with pytest.raises(NotFoundError) as ei:  # nothing close: no guess
        await rs.mailbox("zzzz").submit({"x": 1}, scope=run)
    assert "did you mean" not in ei.value.message


def test_watch_suggests_the_event_type_meant(capsys):
    from rallypoint.cli import main

    url = "tcp://127.0.0.1:1"  # refused before connecting
    assert main(["watch", "--connect", url, "--types", "task.complete"]) == 2
    assert "did you mean 'task.completed'?" in capsys.readouterr().err
    assert main(["watch", "--connect", url, "--types", "tsk.*"]) == 2
    assert "did you mean 'task.*'?" in capsys.readouterr().err


def _rp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rallypoint", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_runs_show_and_cancel_take_a_run_name(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        named = rs.scopes.create(name="nightly report 31")
        twin_a, twin_b = rs.scopes.create(name="twin 31"), rs.scopes.create(name="twin 31")
    out = _rp("runs", "show", "nightly report 31", "--connect", daemon.url)
    assert out.returncode == 0 and named.id in out.stdout, out.stderr
    out = _rp("runs", "cancel", "nightly reprot 31", "--connect", daemon.url)
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr, out.stderr
    assert "did you mean 'nightly report 31'?" in out.stderr, out.stderr
    out = _rp("runs", "cancel", "nightly report 31", "--connect", daemon.url)
    assert out.returncode == 0 and out.stdout.split()[:2] == [named.id, "CANCELLED"], out.stdout + out.stderr
    out = _rp("runs", "cancel", "nightly report 31", "--connect", daemon.url)  # no active one left
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr, out.stderr
    out = _rp("runs", "cancel", "twin 31", "--connect", daemon.url)  # two active: which one?
    assert out.returncode == 1 and "CONFLICT" in out.stderr and twin_a.id in out.stderr and twin_b.id in out.stderr
    with rallypoint.sync.connect(daemon.url) as rs:
        assert rs.scope(twin_a.id).status().stored_state == "ACTIVE"  # nothing cancelled on a guess
        assert rs.scope(named.id).status().stored_state == "CANCELLED"


async def test_open_embedded_errors_name_its_own_arguments(tmp_path):
    data = str(tmp_path / "data")
    async with rallypoint.open_embedded(data):
        with pytest.raises(DataDirLocked) as ei:
            async with rallypoint.open_embedded(data):
                pass
    text = str(ei.value)
    assert "in use by" in text and "data_dir=" in text and "--data-dir" not in text, text
