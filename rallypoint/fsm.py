"""Explicit state machines: an enum of states and the table of the moves allowed
between them (issue 43: the cluster's roles and replication's peer states were strings
set wherever a branch felt like it; ``"stopping"`` was set though the docstring listed
four roles).

Sans-I/O, as :mod:`rallypoint.transport.connstate` is for a connection: a
:class:`Transitions` table checks each move and raises :class:`IllegalTransition` (an
internal error: a bug, never a client's doing) for one it does not list; staying in the
same state is always allowed and is no move. The tables themselves live beside the
states they order: :data:`rallypoint.cluster.noderole.ROLE_MOVES` (a node of a shard)
and :data:`rallypoint.replication.leader.PEER_MOVES` (a standby as its leader sees it).
"""

from __future__ import annotations

import enum
from typing import Generic, Iterable, Mapping, TypeVar

__all__ = ["IllegalTransition", "Transitions"]

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """A move the state machine's table does not allow (``what``: the machine's name,
    ``src`` and ``dst``: the states). A bug in the caller, never a client's input."""

    def __init__(self, what: str, src: enum.Enum, dst: enum.Enum) -> None:
        super().__init__(f"{what}: {src.value} -> {dst.value} is not a move this state machine allows")
        self.what, self.src, self.dst = what, src, dst


class Transitions(Generic[S]):
    """The allowed moves of one enum of states: ``moves[src]`` is the set of states
    ``src`` may move to. Every member of the enum must be a key (a terminal state maps
    to an empty set), so a state added to the enum without its moves fails at import."""

    def __init__(self, what: str, states: type[S], moves: Mapping[S, Iterable[S]]) -> None:
        missing = [s for s in states if s not in moves]
        if missing:
            raise ValueError(f"{what}: no moves declared for {[s.value for s in missing]}")
        self.what = what
        self.states = states
        self.moves: dict[S, frozenset[S]] = {s: frozenset(moves[s]) for s in states}

    def allowed(self, src: S, dst: S) -> bool:
        """True when ``src -> dst`` is a move of the table (or no move: ``src is dst``)."""
        return src is dst or dst in self.moves[src]

    def check(self, src: S, dst: S) -> bool:
        """Check ``src -> dst``: True for a move, False for staying put; raises
        :class:`IllegalTransition` for a move the table does not list."""
        if src is dst:
            return False
        if dst not in self.moves[src]:
            raise IllegalTransition(self.what, src, dst)
        return True

    def terminal(self) -> list[S]:
        """The states with no move out."""
        return [s for s, out in self.moves.items() if not out]
