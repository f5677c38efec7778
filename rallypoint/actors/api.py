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



def render_opfacts(table: OpTable = TABLE) -> str:
    """The text of :mod:`rallypoint.opfacts`: the client's facts of every op (shard,
    merge, re-send rule) as ``table``'s marks declare them, written with
    :mod:`rallypoint.opdecl`'s names. RuntimeError for a rule that cannot be written
    so (a ``Resend`` built by hand)."""
    lines = [
        '"""GENERATED from the ``@op`` marks by ``python -m rallypoint.actors.api --write-opfacts``:',
        "do not edit (``tests/test_client_imports.py`` fails when it differs from the marks).",
        "",
        "The facts of every operation the client needs -- its shard (the router), how every",
        "shard's answers merge (fan-out ops) and its re-send rule (the reconnecting transport)",
        "-- so that ``rallypoint.client`` imports no server module. The declaration is the",
        "op's ``@op`` mark (:mod:`rallypoint.actors.opmark`).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from . import protocol as p",
        "from .opdecl import (  # noqa: F401  (the names the facts are written with)",
        "    ALWAYS, NEVER, FactTable, OpFacts, Shard, at_explicit_index_or_step, every_item_keyed, fenced, keyed,",
        "    resend_if,",
        ")",
        "",
        '__all__ = ["TABLE"]',
        "",
        "#: request Struct -> its :class:`~rallypoint.opdecl.OpFacts`, in the protocol's order",
        "TABLE = FactTable({",
    ]
    from .. import protocol as p

    for t, d in table.decls.items():
        if getattr(p, t.__name__, None) is not t:
            raise RuntimeError(f"{t.__name__} is not a name of rallypoint.protocol")
        if d.resend.expr is None:
            raise RuntimeError(f"op {d.tag!r}: its re-send rule {d.resend!r} cannot be written for the client "
                               "(build it with rallypoint.opdecl's ALWAYS, NEVER, keyed, fenced or resend_if)")
        lines.append(f"    p.{t.__name__}: OpFacts({d.shard.expr}, {d.merge!r}, {d.resend.expr}),")
    lines += ["})", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m rallypoint.actors.api --write-opfacts
    import os
    import sys

    if sys.argv[1:] != ["--write-opfacts"]:
        sys.exit("usage: python -m rallypoint.actors.api --write-opfacts")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "opfacts.py")
    with open(path, "w") as f:
        f.write(render_opfacts())
    print(f"wrote {path}")
