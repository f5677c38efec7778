"""Serving :class:`~rallypoint.http.app.HttpApi` with hypercorn's Trio worker (HTTP/1.1
and h2; no HTTP parsing of our own)."""

from __future__ import annotations

import logging
import ssl

import trio

from .app import HttpApi

log = logging.getLogger("rallypoint.http")

__all__ = ["serve_http"]


async def serve_http(
    service,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    max_requests: int = 1024,
    keep_alive_s: float = 75.0,
    graceful_s: float = 5.0,
    shutdown: trio.Event | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP API on ``host:port`` (0: any free port) until ``shutdown`` is set
    (or the task is cancelled). ``task_status.started`` gets ``(api, bound)``: the app
    and hypercorn's bound addresses (``http://127.0.0.1:8080``). TLS with
    ``certfile``/``keyfile`` (the TCP listener's ``--tls-cert``/``--tls-key``)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    api = HttpApi(service, max_requests=max_requests)
    cfg = Config()
    cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    cfg.keep_alive_timeout = keep_alive_s
    cfg.graceful_timeout = graceful_s
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("rallypoint.http.hypercorn")
    cfg.include_server_header = False
    if certfile:
        cfg.certfile = certfile
        cfg.keyfile = keyfile
    stop = shutdown if shutdown is not None else trio.Event()

    class _Started:
        def started(self, value=None):
            task_status.started((api, value or []))

    await serve(api, cfg, shutdown_trigger=stop.wait, task_status=_Started())
