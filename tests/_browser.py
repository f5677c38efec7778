"""A real headless browser for the console tests: Debian's Chromium driven by Playwright's
Python package (``executable_path``: Playwright's own browser downloads are not used).

Without the browser or the package the tests skip, saying what to install; under
``CI=true`` they fail instead (``.ci/run`` installs ``chromium``, the ``test`` extra
installs ``playwright``)."""

from __future__ import annotations

import os
import shutil

import pytest

#: Chromium's flags for a shared CI machine: no sandbox (root), no GPU, nothing fetched.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str | None:
    for name in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if name and os.path.exists(name):
            return name
    return None


def require_browser() -> str:
    """The Chromium executable, once Playwright imports; else skip (fail under CI=true)."""
    path = chromium_path()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = "the playwright package (pip install -e '.[test]')"
    else:
        if path:
            return path
        missing = "Chromium (apt-get install chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{missing} is not installed and CI=true (.ci/run installs both)", pytrace=False)
    pytest.skip(f"{missing} is not installed")
