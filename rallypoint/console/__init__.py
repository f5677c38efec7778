"""The web console for operators (``rallypoint serve --console HOST:PORT``): read-only
pages over the coordinator's read operations, live through server-sent events.
:class:`ConsoleApp` is the ASGI application (:mod:`rallypoint.console.app`), its pages are
in :mod:`rallypoint.console.pages`, :func:`serve_console` serves it."""

from .app import ConsoleApp, serve_console

__all__ = ["ConsoleApp", "serve_console"]
