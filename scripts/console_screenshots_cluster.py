"""Screenshots of the console on a real 3-shard cluster (issue 46), into ``docs/console/``.

Starts a one-member etcd and 3 shards x 2 ``rallypoint serve --cluster --shard S``
processes (node ``n0b``, a standby of shard 0, serves ``--console``), runs a small
workload through the SDK's router (a root run on every shard, children, tasks on a
queue), kills -9 shard 1's leader while the Live page is open and submits more, then
saves:

- ``cluster.png``: the health page after the failover (every shard's leader, epoch,
  members, in-sync set, standby lag, the failover);
- ``cluster-live.png``: the Live page, its note of the failover and of the resume;
- ``cluster-runs.png``: the runs of every shard, each with its shard and node.

    python3 scripts/console_screenshots_cluster.py            # into docs/console/
    python3 scripts/console_screenshots_cluster.py --out /tmp/shots

Needs the ``etcd`` binary, Chromium and Playwright (as the browser tests).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "console"), help="where the PNG files go")
    args = ap.parse_args()

    import trio
    from playwright.sync_api import sync_playwright

    from _browser import CHROMIUM_ARGS, chromium_path
    from _etcd import EtcdCluster
    from test_console_cluster import Cluster, _submit, _wait_page, _workload

    path = chromium_path()
    if path is None or shutil.which("etcd") is None:
        print("needs Chromium and etcd", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="rp-shots-")
    os.makedirs(os.path.join(root, "etcd"))
    etcd = EtcdCluster(os.path.join(root, "etcd"), size=1).start()
    c = Cluster(etcd, root)
    try:
        trio.run(c.start)
        c.ids = trio.run(_workload, c)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": 1280, "height": 820}).new_page()
            page.goto(c.console() + "/runs")
            page.wait_for_selector("body[data-live=on]")
            page.screenshot(path=os.path.join(args.out, "cluster-runs.png"), full_page=True)
            page.goto(c.console() + "/live")
            page.wait_for_selector("body[data-live=on]")
            page.wait_for_selector("body[data-charted=yes]")
            trio.run(_submit, c, 2, "before")
            t = threading.Thread(target=lambda: trio.run(_submit, c, 10, "during"))
            t.start()
            c.nodes[1][0].kill()
            trio.run(c.nodes[1][1].wait_role, "leader")
            t.join(120)
            page.wait_for_selector('#cluster-notes li.resumed[data-shard="1"]', timeout=30_000)
            _wait_page(page, lambda: True, "")
            page.screenshot(path=os.path.join(args.out, "cluster-live.png"), full_page=False)
            page.goto(c.console() + "/cluster")
            page.wait_for_selector('table.shards tr[data-shard="1"][data-leader="n1b"]')
            page.screenshot(path=os.path.join(args.out, "cluster.png"), full_page=True)
            browser.close()
        for name in ("cluster.png", "cluster-live.png", "cluster-runs.png"):
            print(os.path.join(args.out, name), os.path.getsize(os.path.join(args.out, name)), "bytes")
        return 0
    finally:
        c.stop()
        etcd.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
