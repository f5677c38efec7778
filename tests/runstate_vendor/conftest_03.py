"""conftest.py for the runstate-sdk 0.3.0 source distribution's own integration tests
(``test_v3.py``), pointing them at a rallypoint daemon's HTTP API.

Copied next to the vendor's tests as ``conftest.py`` (with an empty ``__init__.py``: the
tests import ``.conftest``) by ``tests/test_runstate_vendor.py``; the tests themselves run
unchanged. The daemon is given by the environment: ``RUNSTATE_BASE_URL``,
``RUNSTATE_API_KEY``, ``RUNSTATE_SPACE_ID``; ``RALLYPOINT_NATIVE`` names a python that
can import rallypoint (for :func:`db_query`).

What the vendor's tests import from here:
- ``kernel``: ``{"base_url", "api_key", "space_id"}``;
- ``client(run, worker=None)`` (a :class:`ClientFactory`): a ``runstate.Runstate`` joined
  to the named run, each with its own worker id unless one is given;
- ``uniq(prefix)``: a name no other test uses;
- ``db_query(sql)``: the vendor's tests read two numbers straight from the vendor's
  PostgreSQL tables (``permits.units_used``; ``budget_reservations.reserved_minor`` and
  ``budget_entries.amount_minor`` summed). rallypoint has no SQL database: this shim
  recognises exactly those two queries and answers them from the daemon's own views
  (a pool's units in use; a budget's reserved and settled minor units) through the HTTP
  API. Any other SQL raises, so a new vendor query cannot pass unnoticed;
- ``NODE``, ``REPO_ROOT``: for ``test_cross_language.py`` (needs the vendor's TypeScript
  SDK build, not shipped: that module is not run).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any, Optional, Protocol

import httpx
import pytest

import runstate

NODE = os.environ.get("NODE", "node")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _kernel() -> dict:
    return {
        "base_url": os.environ["RUNSTATE_BASE_URL"],
        "api_key": os.environ["RUNSTATE_API_KEY"],
        "space_id": os.environ["RUNSTATE_SPACE_ID"],
    }


@pytest.fixture
def kernel() -> dict:
    return _kernel()


def uniq(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


class ClientFactory(Protocol):
    def __call__(self, run: str, worker: Optional[str] = None) -> runstate.Runstate: ...


@pytest.fixture
def client(kernel) -> ClientFactory:
    def make(run: str, worker: Optional[str] = None) -> runstate.Runstate:
        return runstate.Runstate(api_key=kernel["api_key"], space_id=kernel["space_id"],
                                 base_url=kernel["base_url"], run=run, worker=worker or uniq("worker"))

    return make


def _get(path: str) -> Any:
    k = _kernel()
    r = httpx.get(f"{k['base_url']}/v1/spaces/{k['space_id']}{path}",
                  headers={"authorization": f"Bearer {k['api_key']}"}, timeout=30)
    r.raise_for_status()
    return r.json()


_UNITS_USED = re.compile(r"^\s*SELECT units_used FROM permits WHERE name = '([^']+)'\s*$")
_BALANCE = re.compile(r"FROM budgets b WHERE b\.name = '([^']+)'\s*$")


def db_query(sql: str) -> list[tuple]:
    """The two vendor-database reads of test_v3.py, answered from rallypoint's views."""
    m = _UNITS_USED.match(sql)
    if m:
        (row,) = [p for p in _get("/permits")["permits"] if p["name"] == m.group(1)]
        return [(row["unitsUsed"],)]
    m = _BALANCE.search(sql)
    if m and "budget_reservations" in sql and "budget_entries" in sql:
        (row,) = [b for b in _get("/budgets")["budgets"] if b["name"] == m.group(1)]
        return [(str(row["reservedMinor"]), str(row["settledMinor"]))]
    raise NotImplementedError(f"rallypoint has no SQL database; no shim for: {sql}")
