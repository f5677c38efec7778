"""GET /events and GET /watch of the runstate HTTP API (runstate-sdk-wire.md rows 43, 57,
58): pages with cursor and limit, the types / scopeId / aggregate filters, a watch held
until an event arrives, a watch without waitSeconds answering before the 0.2 client's
10 s timeout, CURSOR_EXPIRED (410, in the error envelope) for a cursor older than what is
kept or not this server's, and a watch that resumes from its cursor after a restart."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from sdk_compat import HttpDaemon

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = HttpDaemon(str(tmp_path_factory.mktemp("http-events"))).start()
    yield d
    assert d.stop() == 0, d.log.read_text()[-3000:]


def H(d: HttpDaemon) -> dict:
    return {"authorization": f"Bearer {d.secret}"}


def base(d: HttpDaemon) -> str:
    return f"{d.base_url}/v1/spaces/{d.space}"


def get(d, path, **params):
    return httpx.get(f"{base(d)}/{path}", params=params, headers=H(d), timeout=30)


def test_events_pages_with_cursor_and_limit_and_filters(daemon):
    d = daemon
    run = httpx.post(f"{base(d)}/scopes", json={"name": "paged"}, headers=H(d)).json()["id"]
    kid = httpx.post(f"{base(d)}/scopes", json={"name": "kid", "parentId": run}, headers=H(d)).json()["id"]
    other = httpx.post(f"{base(d)}/scopes", json={"name": "other"}, headers=H(d)).json()["id"]
    httpx.post(f"{base(d)}/scopes/{run}/cancel", json={}, headers=H(d))
    # every event, two at a time, following nextCursor
    seen, cursor = [], None
    for _ in range(100):
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        r = get(d, "events", **params)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["events"]) <= 2
        seen += page["events"]
        if page["nextCursor"] == cursor or int(page["nextCursor"]) >= page["newest"]:
            break
        cursor = page["nextCursor"]
    ids = [e["eventId"] for e in seen]
    assert len(ids) == len(set(ids)) and [int(i) for i in ids] == sorted(int(i) for i in ids)
    mine = [e for e in seen if e["scopeId"] in (run, kid)]
    assert [(e["type"], e["aggregateId"]) for e in mine] == [
        ("scope.created", run), ("scope.created", kid), ("scope.cancelled", run)]
    e = mine[0]
    assert e["aggregateType"] == "scope" and e["createdAt"].endswith("Z") and e["payload"]["name"] == "paged"
    # filters: the run's subtree, a type, one aggregate
    sub = get(d, "events", scopeId=run).json()["events"]
    assert {x["aggregateId"] for x in sub} == {run, kid}
    created = get(d, "events", types="scope.created", scopeId=other).json()["events"]
    assert [(x["type"], x["aggregateId"]) for x in created] == [("scope.created", other)]
    agg = get(d, "events", aggregate=f"scope:{kid}").json()["events"]
    assert [x["type"] for x in agg] == ["scope.created"]
    assert get(d, "events", limit=0).status_code == 400


def test_watch_returns_kept_events_then_holds_until_one_arrives(daemon):
    d = daemon
    run = httpx.post(f"{base(d)}/scopes", json={"name": "watched"}, headers=H(d)).json()["id"]
    # no cursor: the events that already exist, at once
    t0 = time.monotonic()
    first = get(d, "watch", scopeId=run).json()
    assert time.monotonic() - t0 < 3
    assert [e["type"] for e in first["events"]] == ["scope.created"]
    cursor = first["nextCursor"]
    # from that cursor: held until the cancel happens, then answered at once
    out: dict = {}

    def watch():
        t = time.monotonic()
        out["page"] = get(d, "watch", scopeId=run, cursor=cursor, waitSeconds=20).json()
        out["s"] = time.monotonic() - t

    th = threading.Thread(target=watch)
    th.start()
    time.sleep(1.0)
    assert th.is_alive()  # held on the server
    httpx.post(f"{base(d)}/scopes/{run}/cancel", json={}, headers=H(d))
    th.join(15)
    assert not th.is_alive()
    assert 0.9 < out["s"] < 10
    assert [e["type"] for e in out["page"]["events"]] == ["scope.cancelled"]
    assert int(out["page"]["nextCursor"]) == int(out["page"]["events"][0]["eventId"])
    # waitSeconds=0: an empty page at once, the cursor kept
    t0 = time.monotonic()
    empty = get(d, "watch", scopeId=run, cursor=out["page"]["nextCursor"], waitSeconds=0).json()
    assert empty["events"] == [] and time.monotonic() - t0 < 3
    assert int(empty["nextCursor"]) >= int(out["page"]["nextCursor"])


def test_a_watch_without_wait_seconds_answers_before_the_02_client_timeout(daemon):
    d = daemon
    newest = get(d, "events", limit=1).json()["newest"]
    t0 = time.monotonic()
    r = get(d, "watch", cursor=str(newest), types="nothing.matches")
    held = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["events"] == []
    assert 5.0 < held < 9.5, held  # held (no spinning client), and answered under 10 s


def test_cursor_expired_and_foreign_cursors_get_410_cursor_expired(tmp_path):
    d = HttpDaemon(str(tmp_path / "d"), extra=["--retain-events", "5"]).start()
    try:
        for i in range(12):
            httpx.post(f"{base(d)}/scopes", json={"name": f"r{i}"}, headers=H(d))
        for path, cursor in (("watch", "1"), ("events", "1"), ("watch", "not-a-cursor")):
            r = get(d, path, cursor=cursor)
            assert r.status_code == 410, r.text
            assert r.json()["error"]["code"] == "CURSOR_EXPIRED"
        page = get(d, "events").json()  # from the oldest kept: 5 or so events
        assert 1 <= len(page["events"]) <= 6 and page["oldest"] > 1
    finally:
        assert d.stop() == 0


def test_a_watch_resumes_from_its_cursor_after_a_restart(tmp_path):
    d = HttpDaemon(str(tmp_path / "d"), durability="fsync").start()
    try:
        for i in range(3):
            httpx.post(f"{base(d)}/scopes", json={"name": f"before-{i}"}, headers=H(d))
        page = get(d, "watch", types="scope.created", waitSeconds=0).json()
        got = [e["payload"]["name"] for e in page["events"]]
        cursor = page["nextCursor"]
        d.stop()
        d.start()
        for i in range(2):
            httpx.post(f"{base(d)}/scopes", json={"name": f"after-{i}"}, headers=H(d))
        page = get(d, "watch", types="scope.created", cursor=cursor, waitSeconds=5).json()
        got += [e["payload"]["name"] for e in page["events"]]
        assert got == ["before-0", "before-1", "before-2", "after-0", "after-1"]
    finally:
        d.stop()
