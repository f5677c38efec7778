"""The schedules' HTTP routes (rallypoint's own, under /v1/spaces/{space}/schedules):
create, list, describe, trigger, pause/unpause, backfill, update, delete; bad input is
the error envelope with VALIDATION_FAILED naming the field."""

from __future__ import annotations

import functools
from datetime import datetime, timedelta, timezone

import httpx
import trio

import rallypoint
from rallypoint.http.server import serve_http

from test_http_hostile import OPEN_KEY


async def test_the_schedule_routes_end_to_end():
    async with rallypoint.open_embedded() as rs:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            api, urls = await nursery.start(functools.partial(serve_http, rs.node.service, "127.0.0.1", 0,
                                                              shutdown=stop))
            base = f"{urls[0]}/v1/spaces/default"
            async with httpx.AsyncClient(base_url=base, headers=OPEN_KEY) as c:
                r = await c.post("/schedules", json={"name": "h", "everySeconds": 3600, "overlap": "allow_all",
                                                     "metadata": {"k": "v"}})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["name"] == "h" and body["intervalMs"] == 3_600_000 and len(body["nextFires"]) == 5
                r = await c.post("/schedules", json={"name": "bad", "cron": "99 * * * *"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "VALIDATION_FAILED"
                assert "cron[0]" in r.json()["error"]["message"]
                r = await c.post("/schedules", json={"name": "bad", "everySeconds": 60, "timezone": "No/Where"})
                assert r.status_code == 400 and "timezone" in r.json()["error"]["message"]
                r = await c.post("/schedules/h/trigger", json={})
                assert r.status_code == 200 and r.json()["actions"] == 1
                assert r.json()["recent"][0]["origin"] == "trigger"
                end = datetime.now(timezone.utc)
                r = await c.post("/schedules/h/backfill", json={
                    "start": (end - timedelta(hours=3)).isoformat(), "end": end.isoformat()})
                assert r.status_code == 200 and r.json()["actions"] == 4
                r = await c.post("/schedules/h/pause", json={"note": "later"})
                assert r.json()["paused"] is True and r.json()["note"] == "later"
                r = await c.post("/schedules/h/unpause", json={})
                assert r.json()["paused"] is False
                r = await c.post("/schedules/h/update", json={"cron": ["0 12 * * *"], "everySeconds": 0})
                assert r.status_code == 200 and r.json()["cron"] == ["0 12 * * *"] and r.json()["intervalMs"] is None
                r = await c.get("/schedules/h", params={"nextN": 2, "recent": 2})
                assert len(r.json()["nextFires"]) == 2 and len(r.json()["recent"]) == 2
                r = await c.get("/schedules")
                assert [s["name"] for s in r.json()["schedules"]] == ["h"]
                r = await c.post("/schedules/h/delete", json={})
                assert r.status_code == 200
                r = await c.get("/schedules/h")
                assert r.status_code == 404
            stop.set()


async def test_the_console_resources_page_shows_schedules_with_next_fires_and_recent_runs():
    from rallypoint.console.app import ConsoleApp

    async with rallypoint.open_embedded() as rs:
        app = ConsoleApp(rs.node.service)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console.test")
        s = await rs.schedules.create("nightly", cron="0 3 * * *", timezone="Europe/Berlin", overlap="allow_all")
        d = await s.trigger()
        await (await rs.schedules.get("nightly")).pause("<i>freeze</i>")
        r = await client.get("/resources?part=schedules")
        assert r.status_code == 200
        assert "nightly" in r.text and "<i>freeze</i>" not in r.text  # the note is escaped
        assert "cron 0 3 * * * (Europe/Berlin)" in r.text and "PAUSED · &lt;i&gt;freeze&lt;/i&gt;" in r.text
        assert d.recent[0].run_id in r.text and "trigger" in r.text
        await (await rs.schedules.get("nightly")).unpause()
        r = await client.get("/resources?part=schedules")
        assert r.text.count("data-deadline=") == 3  # the next three fires, counted down
        await client.aclose()
