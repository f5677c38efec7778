"""``consume()``: the SDK worker loop (SPEC §3).

Receives deliveries from a mailbox for a run (and its descendants), runs the handler on
each inside its own cancel scope, renews the lease every ``lease_seconds / 3``,
completes with the handler's return value, retries on an exception (its message as the
error), and cancels the handler as soon as a renewal is refused (the lease was lost or
the run stopped). Returns when the run becomes inactive. Works under Trio and asyncio.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Awaitable, Callable

import anyio

from ..errors import LeaseLostError, ScopeInactiveError
from .api import Client, Delivery, Mailbox, _id_of, _mailbox_name

log = logging.getLogger("rallypoint.consume")

__all__ = ["consume", "ConsumeStats"]


class ConsumeStats:
    """What a ``consume`` call did: counts of deliveries by how they ended."""

    def __init__(self) -> None:
        self.received = 0
        self.completed = 0
        self.retried = 0
        self.lost = 0
        self.stop_reason: str | None = None

    def __repr__(self) -> str:
        return (
            f"ConsumeStats(received={self.received}, completed={self.completed}, retried={self.retried}, "
            f"lost={self.lost}, stop_reason={self.stop_reason!r})"
        )


async def consume(
    rs: Client,
    mailbox: Mailbox | str,
    scope: Any,
    handler: Callable[[Delivery], Awaitable[Any] | Any],
    *,
    concurrency: int = 1,
    lease_seconds: float = 30,
    wait: float = 20,
) -> ConsumeStats:
    """Serve ``mailbox`` for ``scope`` until the run becomes inactive.

    Args:
        handler: ``async def handler(delivery) -> outcome`` or a plain function (run in
            a worker thread). ``delivery.input`` is the task input.
        concurrency: deliveries handled at once (one receive loop each).
        lease_seconds: lease per delivery (5-600 s); renewed every third of it.
        wait: long-poll per receive request, seconds.

    Returns :class:`ConsumeStats` once a receive is refused with SCOPE_CANCELLED or
    DEADLINE_EXCEEDED. Other errors (e.g. UnavailableError) propagate.
    """
    mbx = rs.mailbox(_mailbox_name(mailbox))
    scope_id = _id_of(scope)
    is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)
    )
    stats = ConsumeStats()

    async def run_one(d: Delivery) -> None:
        outcome: dict[str, Any] = {}

        async def renewer(cancel_handler: anyio.CancelScope) -> None:
            while True:
                await anyio.sleep(lease_seconds / 3)
                try:
                    await d.renew()
                except (LeaseLostError, ScopeInactiveError) as e:
                    outcome["lost"] = e
                    cancel_handler.cancel()
                    return

        async with anyio.create_task_group() as tg:
            handler_scope = anyio.CancelScope()
            tg.start_soon(renewer, handler_scope)
            with handler_scope:
                try:
                    if is_async:
                        outcome["value"] = await handler(d)
                    else:
                        outcome["value"] = await anyio.to_thread.run_sync(handler, d, abandon_on_cancel=True)
                except Exception as e:  # the handler failed: retry
                    outcome["error"] = e
            tg.cancel_scope.cancel()
        if "lost" in outcome:
            stats.lost += 1
            return
        try:
            if "error" in outcome:
                err = outcome["error"]
                await d.retry(error=f"{type(err).__name__}: {err}")
                stats.retried += 1
            elif "value" in outcome:
                await d.complete(outcome["value"])
                stats.completed += 1
        except (LeaseLostError, ScopeInactiveError):
            stats.lost += 1

    async def worker(tg: anyio.abc.TaskGroup) -> None:
        while True:
            try:
                d = await mbx.receive(scope_id, lease_seconds=lease_seconds, wait=wait)
            except ScopeInactiveError as e:
                stats.stop_reason = e.code
                tg.cancel_scope.cancel()
                return
            if d is None:
                continue
            stats.received += 1
            await run_one(d)

    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker, tg)
    return stats
