"""The coordinator: one class per kind of entity, each entity an actor of the runtime.

- :mod:`.runtime`: actors (inbox, task, nursery, parked waiters), passivation, the
  nursery tree, the activity heap;
- :mod:`.coordinator`: the kinds composed, the commit pipeline, time;
- one module per kind: :mod:`.run`, :mod:`.queue` (work queues and tasks),
  :mod:`.group`, :mod:`.barrier`, :mod:`.timer`, :mod:`.joinset`, :mod:`.keys`,
  :mod:`.space`, :mod:`.quota`, :mod:`.budget`, :mod:`.inbox` (messages), :mod:`.claim`,
  :mod:`.pool` (pools and grants), :mod:`.admission` (work limits, task requirements);
- :mod:`.api`: the operation table (route, handler, permission).
"""

from .common import MemoryJournal
from .coordinator import Coordinator, FatalError

__all__ = ["Coordinator", "FatalError", "MemoryJournal"]
