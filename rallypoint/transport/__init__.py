"""TCP transport: framing, the Trio server, and the anyio client connection.

* :class:`~rallypoint.transport.server.Server` serves a
  :class:`~rallypoint.transport.server.Dispatcher` (the coordinator) over TCP.
* :func:`~rallypoint.transport.connection.connect_transport` /
  :class:`~rallypoint.transport.connection.Connection` is the client side.
"""

from .connection import Connection, connect_transport
from .framing import FrameParser, encode_frame
from .server import Dispatcher, Server

__all__ = ["Connection", "connect_transport", "FrameParser", "encode_frame", "Dispatcher", "Server"]
