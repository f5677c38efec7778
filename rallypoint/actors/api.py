"""The operation table, built from the ``@op`` marks beside the handlers.

Every operation is declared once, by the ``@op(...)`` mark on the kind's ``op_*``
handler that decides it (:mod:`rallypoint.actors.opmark`): its request and reply
Structs, the actor it runs on, the permission it needs, whether a client may send it
again after a dropped connection, whether it is a server-side wait the client asked for.
This module is the table of those marks for the kinds a :class:`Coordinator` holds
(:data:`~rallypoint.actors.coordinator.KIND_CLASSES`), for whoever needs it without a
running coordinator:

- the HTTP layer and the simulator decode replies with :data:`REPLY_TYPES`;
- :func:`rallypoint.client.reconnect.reissue_safe` reads :data:`TABLE` (imported at the
  first dropped connection, so ``import rallypoint`` stays cheap);
- :data:`op_decoder` decodes a request body against :data:`Op`.

A coordinator builds the same table at construction (the same object: the build is
cached per set of classes) and binds each op's handler and route to its kind objects
(``Coordinator.ops``); ``Service.submit`` reads that. An op of :mod:`rallypoint.protocol`
with no handler, two handlers, or a mark without a route, permission or re-send rule
stops the import of this module and the construction of a coordinator with a
RuntimeError naming it (``tests/test_op_table.py``).
"""

from __future__ import annotations

from .coordinator import KIND_CLASSES
from .opmark import ANY_KEY, LOCAL, NODE, PERMISSIONS, OpDecl, OpTable, build_table

__all__ = ["TABLE", "OPS", "REPLY_TYPES", "Op", "op_decoder", "OpDecl", "PERMISSIONS", "ANY_KEY", "LOCAL", "NODE"]

#: The table of every kind's marks.
TABLE: OpTable = build_table(KIND_CLASSES)
#: request Struct -> its declaration, in the protocol's order
OPS: dict[type, OpDecl] = TABLE.decls
#: request Struct -> reply Struct
REPLY_TYPES: dict[type, type] = TABLE.reply_types
#: the tagged union (tag field ``op``) a request body is decoded against
Op = TABLE.union
op_decoder = TABLE.decoder
