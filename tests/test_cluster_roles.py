"""The node role and the replication peer state as state machines (issue 43): every move
of each table, every move not in it refused, without sockets or etcd."""

from __future__ import annotations

import enum
import itertools

import pytest

from rallypoint.cluster.noderole import ROLE_MOVES, NodeRole, RoleMachine
from rallypoint.fsm import IllegalTransition, Transitions
from rallypoint.replication.leader import PEER_MOVES, PeerState

R = NodeRole
P = PeerState

#: what the node does, said once more here (a change to the table must change this too)
ROLE_PATHS = {
    (R.STARTING, R.STANDBY), (R.STARTING, R.STOPPED),
    (R.STANDBY, R.LEADER), (R.STANDBY, R.STOPPED),
    (R.LEADER, R.STANDBY), (R.LEADER, R.STOPPING), (R.LEADER, R.STOPPED),
    (R.STOPPING, R.STOPPED),
}
PEER_PATHS = {
    (P.CATCHING_UP, P.JOINING), (P.CATCHING_UP, P.DROPPED),
    (P.JOINING, P.IN_SYNC), (P.JOINING, P.DROPPED),
    (P.IN_SYNC, P.DROPPED),
}


@pytest.mark.parametrize("table,states,paths", [(ROLE_MOVES, NodeRole, ROLE_PATHS),
                                                 (PEER_MOVES, PeerState, PEER_PATHS)],
                         ids=["node role", "peer state"])
def test_every_move_of_the_table_and_no_other(table, states, paths):
    for src, dst in itertools.product(states, states):
        if src is dst:
            assert table.check(src, dst) is False  # staying put is no move
        elif (src, dst) in paths:
            assert table.check(src, dst) is True
        else:
            with pytest.raises(IllegalTransition) as e:
                table.check(src, dst)
            assert e.value.src is src and e.value.dst is dst and src.value in str(e.value)


def test_stopped_is_the_only_terminal_role_and_dropped_the_only_terminal_peer_state():
    assert ROLE_MOVES.terminal() == [R.STOPPED]
    assert PEER_MOVES.terminal() == [P.DROPPED]


def test_the_role_machine_keeps_when_leadership_began_and_counts_moves():
    m = RoleMachine()
    assert m.role is R.STARTING and m.leading_for(5.0) is None
    assert m.move("standby", 1.0) and m.role is R.STANDBY
    assert not m.move(R.STANDBY, 2.0)  # (a rebuilt standby stands by again: no move)
    assert m.move(R.LEADER, 3.0) and m.leading_for(10.0) == 7.0
    assert m.move(R.STANDBY, 11.0) and m.led_since is None  # deposed
    assert m.move(R.LEADER, 12.0) and m.led_since == 12.0  # a new term, a new start
    assert m.move(R.STOPPING, 13.0) and m.leading_for(14.0) is None
    with pytest.raises(IllegalTransition):
        m.move(R.LEADER, 14.0)  # a stopping leader never leads again
    assert m.role is R.STOPPING  # (a refused move changes nothing)
    assert m.move(R.STOPPED, 15.0) and m.changes == 6
    with pytest.raises(ValueError):
        m.move("resigned", 16.0)  # not a role at all
    # the role is its string wherever it is shown (ROLE lines, JSON)
    assert f"{m.role}" == "stopped" and m.role == "stopped"


def test_a_table_must_declare_every_state():
    class S(enum.Enum):
        A = "a"
        B = "b"

    with pytest.raises(ValueError, match="no moves declared"):
        Transitions("t", S, {S.A: {S.B}})
