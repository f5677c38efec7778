"""Following the leader of a replicated shard (``rallypoint serve --cluster``).

A client given several addresses (``tcp://a:7411,b:7411``) opens its connection to
whichever node leads the shard now:

- a node that does not lead answers the handshake NOT_LEADER, naming the leader's
  address when it knows one: that address is tried next (Kafka's "metadata from any
  broker");
- while no leader is known (a failover is under way: about the leader lease's TTL,
  2-3 s), every node answers NOT_LEADER without one, and the client tries again until
  its connect timeout;
- **the client fence** (SCALE-OUT.md §4.4, layer 3): every leader's ``HelloOk`` carries
  ``(shard, epoch)``, and a connection whose epoch is older than one this client has
  already seen for that shard is closed at once -- a deposed leader that has not
  noticed yet cannot answer this client.

The reconnecting transport (:mod:`.reconnect`) opens every new connection through
:class:`LeaderFollower`, so a failover is a reconnection: requests in flight that are
safe to re-send are re-sent to the new leader, leases are kept (the new leader extended
them by the failover's gap) and parked waits are issued again.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

import anyio

from ..errors import NotLeaderError, UnavailableError, ValidationError

__all__ = ["LeaderFollower", "split_urls"]

log = logging.getLogger("rallypoint.client")


def split_urls(url: str) -> list[str]:
    """``tcp://a:7411,b:7411`` -> ``["tcp://a:7411", "tcp://b:7411"]`` (the scheme of
    the first applies to all; each part is ``host:port``). One address stays one. A bare
    ``host:port[,host:port...]`` (as ``--listen`` takes it) is ``tcp://``. Raises
    ValidationError for an empty part."""
    if "://" not in url and url.strip():
        url = "tcp://" + url.strip()
    scheme, sep, rest = url.partition("://")
    if not sep or "," not in rest:
        return [url]
    out = []
    for part in rest.split(","):
        part = part.strip().rstrip("/")
        if not part:
            raise ValidationError(f"bad server url {url!r}: an empty address between commas", details={"field": "url"})
        out.append(f"{scheme}://{part}")
    return out


class LeaderFollower:
    """Opens a connection to the shard's current leader among ``urls``.

    ``open_one(url, timeout_s)`` opens and handshakes one connection (raising
    NotLeaderError, UnavailableError or the server's refusal). Attributes:
    ``current`` (the URL of the last connection made), ``epochs`` (shard -> newest
    epoch seen), ``redirects`` (NOT_LEADER hints followed), ``stale`` (connections
    refused by the client fence)."""

    def __init__(self, urls: list[str], open_one: Callable[[str, float], Awaitable[Any]], *,
                 shard: int | None = None, hint: Callable[[], str | None] | None = None) -> None:
        if not urls:
            raise ValidationError("no server address", details={"field": "url"})
        self.urls = list(urls)
        self.current = self.urls[0]
        self._open_one = open_one
        #: only a leader of this shard is accepted (a sharded cluster's per-shard
        #: connection; None: any)
        self.shard = shard
        #: the address the cluster's slot map names as that shard's leader, tried first
        self._hint = hint
        self.epochs: dict[int, int] = {}
        self.redirects = 0
        self.stale = 0
        self._scheme = urlsplit(self.urls[0]).scheme or "tcp"

    def _url_of(self, address: str) -> str:
        return f"{self._scheme}://{address}"

    def accept(self, conn: Any) -> bool:
        """The client fence: False (the caller closes ``conn``) when its leader's epoch
        is older than one seen for its shard; else record it."""
        info = getattr(conn, "server_info", None)
        shard = getattr(info, "shard", None)
        epoch = getattr(info, "epoch", None)
        if self.shard is not None and shard != self.shard:
            return False  # the leader of another shard (a seed address of the cluster)
        if shard is None or epoch is None:
            return True
        seen = self.epochs.get(shard, 0)
        if epoch < seen:
            self.stale += 1
            log.warning("%s leads shard %d at epoch %d, older than epoch %d seen before: a deposed leader; "
                        "trying the others", self.current, shard, epoch, seen)
            return False
        self.epochs[shard] = epoch
        return True

    async def open(self, timeout_s: float) -> Any:
        """A connection to the leader, trying the last one first, then NOT_LEADER hints,
        then the rest; while a failover leaves no leader known (every node answered
        NOT_LEADER without a hint), again until ``timeout_s`` (seconds) pass. Raises the
        last UnavailableError (NotLeaderError included) when none could be made, or a
        refusal that trying again cannot help (e.g. UNAUTHENTICATED)."""
        deadline = anyio.current_time() + timeout_s
        pause = 0.05
        last: UnavailableError | None = None
        while True:
            order = [self.current] + [u for u in self.urls if u != self.current]
            hinted = self._hint() if self._hint is not None else None
            if hinted:
                hurl = self._url_of(hinted)
                order = [hurl] + [u for u in order if u != hurl]
            tried: set[str] = set()
            leaderless = False
            while order:
                url = order.pop(0)
                if url in tried:
                    continue
                tried.add(url)
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    break
                try:
                    conn = await self._open_one(url, remaining)
                except NotLeaderError as e:
                    last = e
                    leader = (e.details or {}).get("leader") or {}
                    hint = leader.get("address")
                    if hint:
                        hurl = self._url_of(hint)
                        if hurl not in self.urls:
                            self.urls.append(hurl)
                        if hurl not in tried:
                            self.redirects += 1
                            order.insert(0, hurl)
                    else:
                        leaderless = True
                    continue
                except UnavailableError as e:
                    last = e
                    continue
                if not self.accept(conn):
                    await conn.aclose()
                    last = UnavailableError(f"{url} is not the leader of the shard wanted (a deposed leader, or "
                                            "another shard's)", retry_after=0.5)
                    continue
                self.current = url
                return conn
            remaining = deadline - anyio.current_time()
            if not (leaderless or last is None or len(self.urls) > 1) or remaining <= 0:
                break
            await anyio.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.2)  # a failover's end is found within 0.2 s
        assert last is not None
        raise last
