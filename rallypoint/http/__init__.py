"""rallypoint's HTTP API: the runstate SDK's wire protocol (0.2.0 and 0.3.0) over the same
coordinator as the TCP listener. :class:`HttpApi` is the ASGI application
(:mod:`rallypoint.http.app`), :data:`ROUTES` its endpoints
(:mod:`rallypoint.http.endpoints`), :func:`serve_http` runs it with hypercorn's Trio
worker."""

from .app import HttpApi
from .endpoints import ROUTES
from .server import serve_http

__all__ = ["HttpApi", "ROUTES", "serve_http"]
