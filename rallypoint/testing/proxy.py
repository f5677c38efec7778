"""A loopback TCP proxy for fault tests: put it between two nodes (a leader and its
standby, a client and a daemon) and cut, hold or slow the link on command, without
root or iptables (SCALE-OUT.md §5).

Modes (:meth:`Proxy.set_mode`):

- ``pass``: bytes flow both ways;
- ``hold``: nothing is forwarded (bytes wait in the proxy, then flow on ``pass``): a
  partition where TCP stays up, as a stalled network looks;
- ``blackhole``: everything received is dropped, and new connections are accepted
  and then ignored: the peer's bytes vanish;
- ``reset``: every open connection is closed at once and new ones are closed on
  accept (a crashed peer as TCP sees it).

Use::

    async with trio.open_nursery() as n:
        proxy = Proxy("127.0.0.1", target_port)
        port = await n.start(proxy.run)
        ...                       # point the client at port
        proxy.set_mode("hold")    # cut
"""

from __future__ import annotations

import trio

__all__ = ["Proxy", "MODES"]

MODES = ("pass", "hold", "blackhole", "reset")


class Proxy:
    """Forward connections accepted on ``listen_host`` (a free port) to
    ``target_host:target_port``, subject to the current mode."""

    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.mode = "pass"
        self.port: int | None = None
        self.connections = 0
        self.bytes = 0
        self._changed = trio.Event()
        self._scopes: set[trio.CancelScope] = set()

    def set_mode(self, mode: str) -> None:
        """Switch mode (see the module docstring). ``reset`` closes every connection."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode = mode
        if mode == "reset":
            for scope in list(self._scopes):
                scope.cancel()
        ev, self._changed = self._changed, trio.Event()
        ev.set()

    def retarget(self, host: str, port: int) -> None:
        """Send new connections to another address (existing ones are unaffected)."""
        self.target = (host, port)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen and forward until cancelled; ``task_status.started(port)``."""
        listeners = await trio.open_tcp_listeners(0, host=self.listen_host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, client: trio.SocketStream) -> None:
        if self.mode == "reset":
            await trio.aclose_forcefully(client)
            return
        try:
            upstream = await trio.open_tcp_stream(*self.target)
        except OSError:
            await trio.aclose_forcefully(client)
            return
        self.connections += 1
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                    nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)
            finally:
                self._scopes.discard(scope)
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(upstream)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope) -> None:
        try:
            while True:
                while self.mode == "hold":
                    await self._changed.wait()
                data = await src.receive_some(65536)
                if not data:
                    break
                while self.mode == "hold":
                    await self._changed.wait()
                if self.mode == "blackhole":
                    continue
                await dst.send_all(data)
                self.bytes += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            scope.cancel()
