"""The data-parallel router's placement, replica by replica."""

from __future__ import annotations

import pytest

from runtime.scheduler.router import BLOCK, Router, block_keys

PREFIX = list(range(100, 100 + 4 * BLOCK))


def test_repeats_of_a_prefix_follow_it_and_new_prefixes_spread():
    router = Router(2)
    first = router.place(PREFIX + [1], [0, 0], [True, True])
    assert [router.place(PREFIX + [n], [0, 0], [True, True]) for n in range(2, 6)] == [first] * 4
    fresh = [router.place([7 * n + i for i in range(3 * BLOCK)], [0, 0], [True, True]) for n in range(10)]
    assert fresh.count(0) == fresh.count(1) == 5


def test_a_loaded_replica_gives_up_its_prefix_past_the_threshold():
    router = Router(2, balance=4)
    home = router.place(PREFIX, [0, 0], [True, True])
    loads = [0, 0]
    loads[home] = 4
    assert router.place(PREFIX, loads, [True, True]) == home
    loads[home] = 5
    assert router.place(PREFIX, loads, [True, True]) == 1 - home


def test_a_replica_that_is_down_gets_nothing_unless_all_are():
    router = Router(2)
    home = router.place(PREFIX, [0, 0], [True, True])
    live = [True, True]
    live[home] = False
    assert router.place(PREFIX, [0, 0], live) == 1 - home
    assert router.place(PREFIX, [0, 0], [False, False]) in (0, 1)


@pytest.mark.parametrize("policy", ["round_robin", "least_load"])
def test_the_other_policies(policy):
    router = Router(3, policy)
    if policy == "round_robin":
        assert sorted(router.place(PREFIX, [9, 0, 0], [True] * 3) for _ in range(6)) == [0, 0, 1, 1, 2, 2]
    else:
        assert {router.place(PREFIX, [9, 3, 1], [True] * 3) for _ in range(4)} == {2}


def test_it_forgets_the_least_recently_matched_blocks_first():
    router = Router(1, remembered_blocks=4)
    router.place(PREFIX, [0], [True])
    router.place([9] * (2 * BLOCK), [0], [True])
    assert router._matched(0, block_keys(PREFIX)) == 0  # its first blocks went first
    assert router._matched(0, block_keys([9] * (2 * BLOCK))) == 2
