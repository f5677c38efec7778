"""Helpers shared by the task-group tests (tests/test_groups_*.py)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

UNFINISHED = {"QUEUED", "RUNNING"}


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def in_(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


async def new_group(rs, condition: str, **kw):
    """A fresh mailbox (its own name, so tests sharing a daemon never mix), a root run,
    and a group created from that run. Returns (mailbox, run, group)."""
    mbx = await rs.mailboxes.ensure(uniq("grp-mbx"))
    run = await rs.scopes.create()
    group = await run.groups.create(mbx, condition, **kw)
    return mbx, run, group


async def take(mbx, scope, n: int = 100) -> dict:
    """Lease every queued task of ``scope`` (up to n) at once: task_id -> Delivery."""
    got = await mbx.receive(scope, wait=0, max_messages=n)
    if n == 1:
        got = [got] if got is not None else []
    return {d.task_id: d for d in got}


async def submit_n(group, n: int, start: int = 0) -> list:
    return [await group.submit({"i": i}, key=f"m-{i}") for i in range(start, start + n)]


async def succeed_all(mbx, group, tickets, outcome=None) -> None:
    """Lease the group's queued members and complete those in ``tickets`` (the others
    stay RUNNING)."""
    ds = await take(mbx, group.scope_id)
    for t in tickets:
        await ds[t.id].complete(outcome if outcome is not None else {"ok": t.id})


async def states(group) -> dict:
    st = await group.status()
    return {m.task_id: m.task_state for m in st.members}


def decision(st) -> tuple:
    return (st.state, st.outcome, st.outcome_reason)
