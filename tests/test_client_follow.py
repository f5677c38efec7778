"""The client side of a replicated shard: which address a client connects to
(rallypoint/client/follow.py), without servers: ``open_one`` is a fake."""

from __future__ import annotations

import pytest
import trio

from rallypoint.client.follow import LeaderFollower, split_urls
from rallypoint.errors import NotLeaderError, UnavailableError, ValidationError
from rallypoint.wire import HelloOk


class FakeConn:
    def __init__(self, url, shard=None, epoch=None):
        self.url = url
        self.server_info = HelloOk(version=1, server_version="t", shard=shard, epoch=epoch)
        self.closed = False

    async def aclose(self):
        self.closed = True


def not_leader(hint=None):
    leader = None if hint is None else {"node": "x", "address": hint, "http_address": None}
    return NotLeaderError("not the leader", details={"shard": 0, "epoch": 1, "leader": leader})


def test_split_urls():
    assert split_urls("tcp://a:1") == ["tcp://a:1"]
    assert split_urls("tcp://a:1,b:2") == ["tcp://a:1", "tcp://b:2"]
    assert split_urls("tls://a:1, b:2/") == ["tls://a:1", "tls://b:2"]
    with pytest.raises(ValidationError):
        split_urls("tcp://a:1,,b:2")
    # issue 42: --connect refused a bare HOST:PORT that --listen and the address list accept
    assert split_urls("127.0.0.1:7411") == ["tcp://127.0.0.1:7411"]
    assert split_urls("a:1,b:2") == ["tcp://a:1", "tcp://b:2"]


async def test_a_not_leader_hint_is_followed_and_the_leader_is_tried_first_next_time():
    calls = []

    async def open_one(url, timeout):
        calls.append(url)
        if url == "tcp://a:1":
            raise not_leader("b:2")
        return FakeConn(url, shard=0, epoch=7)

    f = LeaderFollower(["tcp://a:1", "tcp://c:3"], open_one)
    conn = await f.open(5)
    assert conn.url == "tcp://b:2" and calls == ["tcp://a:1", "tcp://b:2"]
    assert f.redirects == 1 and f.epochs == {0: 7} and f.current == "tcp://b:2"
    calls.clear()
    await f.open(5)
    assert calls == ["tcp://b:2"]


async def test_the_client_fence_refuses_a_leader_of_an_older_epoch():
    epochs = {"tcp://a:1": 9, "tcp://b:2": 4}
    made = []

    async def open_one(url, timeout):
        c = FakeConn(url, shard=0, epoch=epochs[url])
        made.append(c)
        return c

    f = LeaderFollower(["tcp://a:1", "tcp://b:2"], open_one)
    assert (await f.open(5)).url == "tcp://a:1"
    epochs["tcp://a:1"] = 0  # a is gone...

    async def only_b(url, timeout):
        if url == "tcp://a:1":
            raise UnavailableError("refused")
        return await open_one(url, timeout)

    f._open_one = only_b
    with pytest.raises(UnavailableError):  # ...and b, deposed at epoch 4, is never accepted
        await f.open(0.3)
    assert f.stale >= 1 and all(c.closed for c in made if c.url == "tcp://b:2")


async def test_while_no_leader_is_known_it_tries_again_until_the_timeout():
    state = {"n": 0}

    async def open_one(url, timeout):
        state["n"] += 1
        if state["n"] < 6:
            raise not_leader()  # a failover under way
        return FakeConn(url, shard=0, epoch=3)

    f = LeaderFollower(["tcp://a:1", "tcp://b:2"], open_one)
    conn = await f.open(10)
    assert conn.server_info.epoch == 3 and state["n"] == 6


async def test_one_address_that_is_down_fails_at_once():
    async def open_one(url, timeout):
        raise UnavailableError("connection refused")

    f = LeaderFollower(["tcp://a:1"], open_one)
    with trio.fail_after(1):
        with pytest.raises(UnavailableError):
            await f.open(30)
