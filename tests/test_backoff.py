"""rallypoint.backoff.Backoff: the one back-off policy of the node's retry loops."""

import pytest
import trio

from rallypoint.backoff import Backoff


def test_waits_double_up_to_the_cap_and_reset_starts_again():
    b = Backoff(0.05, 0.3)
    assert [b.next() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert b.current == 0.3
    b.reset()
    assert b.current == 0.05 and b.next() == 0.05
    assert [Backoff(1.0, 10.0, factor=3).next() for _ in range(1)] == [1.0]
    b3 = Backoff(1.0, 10.0, factor=3)
    assert [b3.next() for _ in range(4)] == [1.0, 3.0, 9.0, 10.0]


@pytest.mark.parametrize("args", [(0, 1.0), (0.5, 0.1), (0.1, 1.0, 0.5)])
def test_bounds_out_of_range_are_refused(args):
    with pytest.raises(ValueError):
        Backoff(*args)


async def test_sleep_waits_the_next_wait_at_most_what_is_left(autojump_clock):
    b = Backoff(0.5, 4.0)
    t0 = trio.current_time()
    await b.sleep()
    await b.sleep()
    assert trio.current_time() - t0 == pytest.approx(1.5)
    t0 = trio.current_time()
    await b.sleep(at_most=0.25)  # (a deadline nearer than the wait)
    assert trio.current_time() - t0 == pytest.approx(0.25)
    assert b.current == 4.0  # the wait grew all the same
