"""The frame envelope: what every frame on a rallypoint connection looks like.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack (at most
:data:`MAX_FRAME_BYTES`). The body of a frame is one of the Structs below, tagged by the
field ``t``. Operation bodies (``Request.body``) and reply bodies (``Ok.body``) are kept
as :class:`msgspec.Raw` in the envelope and decoded separately against the operation
union in :mod:`rallypoint.protocol`, so that a bad operation still has a request id to
answer to and a message naming the bad field.

Connection lifecycle::

    client: Hello(version, api_key, client, space?) server: HelloOk(version, server_version)
                                                  or Err(id=0, ...) and close
    client: Request(id, body) | Batch(reqs)      server: Ok(id, body) | Err(id, ...)
    client: Cancel(id)                            (the server ends that request's wait,
                                                   or the subscription ``id``)
    either: Ping(nonce)                           other: Pong(nonce)

A subscription (``events.watch``) is one request: its Ok carries where the stream starts,
then the server sends ``Push(id, events)`` frames for it as events happen, in order,
until the client sends ``Cancel(id)``, the connection closes, or the server ends it with
``Err(id, ...)`` (CURSOR_EXPIRED, SLOW_CONSUMER, UNAVAILABLE at shutdown).

Replies come in any order; ``id`` matches them to requests. Request ids are chosen by
the client, unique per connection, and > 0 (0 is the connection itself).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "MAX_PAYLOAD_BYTES",
    "too_large_message",
    "Hello",
    "HelloOk",
    "Request",
    "Batch",
    "Ok",
    "Err",
    "Cancel",
    "Ping",
    "Pong",
    "Push",
    "ClientFrame",
    "ServerFrame",
]

#: Bumped on any incompatible change of the envelope or of an operation.
PROTOCOL_VERSION = 1
#: Largest frame body, bytes (SPEC §13).
MAX_FRAME_BYTES = 1 << 20
#: Largest encoded payload (task input, outcome, error details), bytes (SPEC §13).
MAX_PAYLOAD_BYTES = 64 * 1024


def too_large_message(field: str, size: int, limit: int, advice: str) -> str:
    """The one wording of every "too large" refusal (a payload over
    :data:`MAX_PAYLOAD_BYTES`, a frame over :data:`MAX_FRAME_BYTES`):
    ``"<field> is <size> bytes encoded, which exceeds <limit> bytes; <advice>"``.
    runstate's SDK 0.3 tells a too-large input or result by the words ``exceeds <digits>
    bytes`` in a VALIDATION_FAILED message (its ``ResultTooLargeError``, on which its
    worker fails the job at once instead of waiting out the lease), so every size limit
    is worded this way (``runstate-sdk-wire.md`` §2.1)."""
    return f"{field} is {size} bytes encoded, which exceeds {limit} bytes; {advice}"


#: The error text for a value nested deeper than msgspec's recursive decoder can go
#: (a little under Python's recursion limit, about 980 levels in the daemon).
NESTING_MESSAGE = (
    "arrays/maps nested too deeply to decode (the limit is about 900 levels); send flatter data"
)


class Hello(msgspec.Struct, tag_field="t", tag="hello", forbid_unknown_fields=False, omit_defaults=True):
    """First frame from the client. ``space``: the space an open-mode server gives the
    connection (default ``default``); a key's own space wins whenever keys exist (a
    sharded cluster's HTTP router opens its open-mode connections with the request's
    space). Fields left at their defaults are not sent (an older server reads them so)."""

    version: int
    api_key: str | None = None
    client: str = ""
    space: str | None = None


class HelloOk(msgspec.Struct, tag_field="t", tag="hello_ok"):
    """The server accepted the handshake. ``shard`` and ``epoch``: on a node of a
    replicated shard (``serve --cluster``), the shard it leads and its epoch; every
    reply on the connection is that leader's (a deposed leader closes its connections),
    so a client that has seen a newer epoch of the shard drops a connection that
    carries an older one (the client fence, SCALE-OUT.md §4.4). None on a single node."""

    version: int
    server_version: str
    space: str = "default"
    shard: int | None = None
    epoch: int | None = None


class Request(msgspec.Struct, tag_field="t", tag="req", array_like=False):
    """One operation. ``body`` is an operation Struct from :mod:`rallypoint.protocol`."""

    id: int
    body: msgspec.Raw


class Batch(msgspec.Struct, tag_field="t", tag="batch"):
    """Several requests in one frame; each is answered by its own Ok/Err."""

    reqs: list[Request]


class Ok(msgspec.Struct, tag_field="t", tag="ok"):
    """Success. ``body`` is the operation's reply Struct (or nil)."""

    id: int
    body: msgspec.Raw


class Err(msgspec.Struct, tag_field="t", tag="err"):
    """Failure of request ``id`` (0: of the connection / handshake)."""

    id: int
    code: str
    message: str
    retry_after: float | None = None
    details: dict[str, Any] | None = None


class Cancel(msgspec.Struct, tag_field="t", tag="cancel"):
    """The client gave up on request ``id``: end its server-side wait, if it is still
    waiting (a receive that has not leased anything yet leases nothing). No reply; a
    request that already finished is unaffected."""

    id: int


class Ping(msgspec.Struct, tag_field="t", tag="ping"):
    nonce: int = 0


class Pong(msgspec.Struct, tag_field="t", tag="pong"):
    nonce: int = 0


class Push(msgspec.Struct, tag_field="t", tag="push"):
    """Events for subscription ``id`` (the request id of its ``events.watch``), in order;
    each is an encoded :class:`rallypoint.protocol.EventView`.

    ``cursor``: the seq the server has scanned up to for this watch: every event after
    the previous push's ``cursor`` and up to this one that passes the watch's filter is
    in ``events`` (or an earlier push). It is past the last event's seq when the filter
    skipped events after it, and a push may carry no events, only a newer ``cursor``
    (a filtered watch over events it skips: at most one such push per subscription every
    0.5 s), so a client resumes from what was scanned, not from its last match. None
    from a server that does not send it: the last event's seq is the cursor. (Added
    without a version bump: a client that does not know the field ignores it, and an
    empty push.)"""

    id: int
    events: list[msgspec.Raw]
    cursor: int | None = None


ClientFrame = Union[Hello, Request, Batch, Cancel, Ping, Pong]
ServerFrame = Union[HelloOk, Ok, Err, Ping, Pong, Push]
