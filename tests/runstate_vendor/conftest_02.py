"""conftest.py for the runstate-sdk 0.2.0 source distribution's own integration tests
(``test_sdk.py``, ``test_sync.py``), pointing them at a rallypoint daemon's HTTP API.

Copied next to the vendor's tests as ``conftest.py`` by ``tests/test_runstate_vendor.py``;
the tests themselves run unchanged. The daemon is given by the environment:
``RUNSTATE_BASE_URL`` (http://127.0.0.1:PORT), ``RUNSTATE_API_KEY`` (a rallypoint API
key), ``RUNSTATE_SPACE_ID`` (its space).

Fixtures the vendor's tests expect (absent from the sdist):
- ``kernel``: ``{"base_url", "api_key", "space_id"}``;
- ``bus_factory(holder)``: an ``AsyncRunstate`` for that holder (the test closes it).
"""

from __future__ import annotations

import os

import pytest

from runstate import AsyncRunstate


@pytest.fixture
def kernel() -> dict:
    return {
        "base_url": os.environ["RUNSTATE_BASE_URL"],
        "api_key": os.environ["RUNSTATE_API_KEY"],
        "space_id": os.environ["RUNSTATE_SPACE_ID"],
    }


@pytest.fixture
def bus_factory(kernel):
    def make(holder: str) -> AsyncRunstate:
        return AsyncRunstate(api_key=kernel["api_key"], space_id=kernel["space_id"], base_url=kernel["base_url"],
                             holder=holder)

    return make
