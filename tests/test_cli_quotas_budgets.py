"""``rallypoint quotas ls|show`` and ``rallypoint budgets ls|show`` (issue 15 item 8):
readable columns, ``--json``, one error line."""

from __future__ import annotations

import json

import trio

import rallypoint

from test_cli_ops import one_line, rp


def _setup(url: str) -> dict:
    async def main():
        async with rallypoint.connect(url) as rs:
            run = await rs.scopes.create()
            q = await rs.quotas.ensure("cli-quota", units_limit=50, window_seconds=3600)
            await q.take(7, scope=run)
            w = await q.enqueue(50, scope=run, ttl=600, holder="agent-9")
            b = await rs.budgets.ensure("cli-budget", limit=1234, currency="EUR", scale=2)
            r = await b.reserve(300, scope=run, settle_within_seconds=600)
            await r.settle(100, final=False)
            return {"waiter": w.id, "reservation": r.id, "run": run.id}

    return trio.run(main)


def test_quotas_and_budgets_ls_and_show(daemon):
    ids = _setup(daemon.url)
    r = rp("quotas", "ls", "--connect", daemon.url)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split() == ["NAME", "LIMIT", "WINDOW", "USED", "REMAINING", "WAITING", "COOLDOWN_UNTIL"]
    row = next(x.split() for x in rows if x.startswith("cli-quota "))
    # (if the hour rolled meanwhile, the waiter was granted the new window's 50)
    assert row[1:6] in (["50", "1h", "7", "43", "1"], ["50", "1h", "50", "0", "0"])
    r = rp("quotas", "show", "cli-quota", "--connect", daemon.url)
    assert r.returncode == 0 and "50 units per 1h (fixed windows)" in r.stdout
    if "waiting     1" in r.stdout:
        assert ids["waiter"] in r.stdout and "agent-9" in r.stdout
    j = json.loads(rp("quotas", "show", "cli-quota", "--json", "--connect", daemon.url).stdout)
    assert j["name"] == "cli-quota" and j["units_limit"] == 50 and j["window_ms"] == 3_600_000

    r = rp("budgets", "ls", "--connect", daemon.url)
    header, *rows = r.stdout.splitlines()
    assert header.split() == ["NAME", "CURRENCY", "LIMIT", "SETTLED", "RESERVED", "AVAILABLE", "OPEN"]
    assert next(x.split() for x in rows if x.startswith("cli-budget ")) == \
        ["cli-budget", "EUR", "12.34", "1.00", "2.00", "9.34", "1"]
    r = rp("budgets", "show", "cli-budget", "--connect", daemon.url)
    assert r.returncode == 0
    assert "available   9.34 EUR" in r.stdout and ids["reservation"] in r.stdout and "ACTIVE" in r.stdout
    j = json.loads(rp("budgets", "ls", "--json", "--connect", daemon.url).stdout)
    b = next(x for x in j if x["name"] == "cli-budget")
    assert (b["limit_minor"], b["settled_minor"], b["reserved_minor"], b["available_minor"]) == (1234, 100, 200, 934)


def test_show_of_a_missing_one_is_one_error_line(daemon):
    for what in ("quotas", "budgets"):
        r = rp(what, "show", "nope", "--connect", daemon.url)
        assert r.returncode == 1
        line = one_line(r.stderr)
        assert line.startswith("rallypoint: NOT_FOUND:") and "ensure()" in line
