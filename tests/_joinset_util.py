"""Helpers shared by the join-set and task-run tests (issue 13)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
import trio

from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.errors import ChildError


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def in_(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


async def take(mbx, run, n: int) -> list:
    """Lease ``n`` tasks of ``run`` (oldest first: submission order)."""
    out = []
    for _ in range(n):
        d = await mbx.receive(run, wait=5)
        assert d is not None
        out.append(d)
    return out


async def child_error(coro) -> ChildError:
    with pytest.raises(ChildError) as ei:
        await coro
    return ei.value


async def raw_record(rs, js, index: int):
    """The wire reply for record ``index`` (a re-read: shows the ``closing`` flag)."""
    return await rs._call(p.JoinNext(joinset_id=js.id, index=index), t._JoinNextReply)


async def records(rs, js, n: int) -> list[tuple]:
    """``(child_id, ok, failure_kind, closing)`` of records ``0..n-1``."""
    out = []
    for k in range(n):
        r = await raw_record(rs, js, k)
        out.append((r.child_id, r.ok, r.failure_kind, r.closing))
    return out


async def until(pred, what: str, timeout: float = 10.0) -> None:
    """Poll an async predicate (a status read) until it holds: for states another task
    reaches over TCP, where nothing can be awaited directly."""
    with trio.fail_after(timeout):
        while not await pred():
            await trio.sleep(0.005)
