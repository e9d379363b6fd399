"""LanePolicy: weighted shares under backlog, idle lanes, bounded credit."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings, strategies as st

from streamfleet.workers.lanes import LanePolicy

INF = math.inf


def run_round(policy: LanePolicy, free: int, backlog: dict[str, float]) -> dict[str, int]:
    """One admission round as the worker process does it: ask by ``split``, then refill
    the leftover slots from the lanes in priority order, then ``record``."""
    asked = policy.split(free)
    assert sum(asked.values()) == free
    admitted = {lane: int(min(n, backlog[lane])) for lane, n in asked.items()}
    left = free - sum(admitted.values())
    for lane in policy.lanes:
        if left > 0 and admitted[lane] == asked[lane]:  # a lane that came up short is empty
            extra = int(min(left, backlog[lane] - admitted[lane]))
            asked[lane] += left
            admitted[lane] += extra
            left -= extra
    for lane in admitted:
        backlog[lane] -= admitted[lane]
    policy.record(admitted, asked)
    return admitted


def simulate(policy, rounds: int, free: Callable[[int], int], backlog_fn) -> list[dict[str, int]]:
    history = []
    for r in range(rounds):
        history.append(run_round(policy, free(r), backlog_fn(r)))
    return history


def flooded(_r):
    return {"high": INF, "normal": INF}


def shares(history):
    tot = {k: sum(h[k] for h in history) for k in history[0]}
    n = sum(tot.values())
    return {k: v / n for k, v in tot.items()}, tot


#: the free slots of the "free=random" case: one seeded generator for the whole run
FREE_RNG = random.Random(1)


@pytest.mark.parametrize(
    "free",
    [lambda r: 1, lambda r: 3, lambda r: 16, lambda r: FREE_RNG.randint(0, 9)],
    ids=["free=1", "free=3", "free=16", "free=random"],
)
def test_both_backlogged_normal_gets_at_least_its_share(free):
    policy = LanePolicy({"high": 0.8, "normal": 0.2})
    history = simulate(policy, 2000, free, flooded)
    share, tot = shares(history)
    n = sum(tot.values())
    assert share["normal"] >= 0.2 - 1 / n
    assert share["high"] >= 0.8 - 1 / n
    # and at every point in time, not only on average
    got = {"high": 0, "normal": 0}
    for h in history:
        for k in got:
            got[k] += h[k]
        n = got["high"] + got["normal"]
        assert got["normal"] >= 0.2 * n - 1.0
        assert got["high"] >= 0.8 * n - 1.0


def test_free_one_exact_pattern():
    policy = LanePolicy({"high": 0.8, "normal": 0.2})
    seq = []
    for _ in range(10):
        a = run_round(policy, 1, {"high": INF, "normal": INF})
        seq.append("h" if a["high"] else "n")
    assert "".join(seq) == "hhnhhhhnhh"


def test_other_weights():
    policy = LanePolicy({"high": 3, "normal": 1})  # relative weights are normalised
    _, tot = shares(simulate(policy, 1000, lambda r: 1, flooded))
    assert tot == {"high": 750, "normal": 250}


def test_idle_high_gives_everything_to_normal():
    policy = LanePolicy({"high": 0.8, "normal": 0.2})
    history = simulate(policy, 500, lambda r: 4, lambda r: {"high": 0, "normal": INF})
    assert all(h == {"high": 0, "normal": 4} for h in history)
    assert max(abs(c) for c in policy.credit.values()) <= 1.0


def test_idle_normal_gives_everything_to_high():
    policy = LanePolicy({"high": 0.8, "normal": 0.2})
    history = simulate(policy, 500, lambda r: 1, lambda r: {"high": INF, "normal": 0})
    assert all(h == {"high": 1, "normal": 0} for h in history)
    assert max(abs(c) for c in policy.credit.values()) <= 1.0


def test_idle_lane_does_not_hoard_credit():
    """After a long idle spell, a lane that comes back gets its share, not a burst
    that starves the other lane (and vice versa)."""
    policy = LanePolicy({"high": 0.8, "normal": 0.2})
    simulate(policy, 1000, lambda r: 2, lambda r: {"high": INF, "normal": 0})
    after = simulate(policy, 20, lambda r: 1, flooded)
    assert sum(h["high"] for h in after) >= 15
    assert sum(h["normal"] for h in after) >= 3

    policy = LanePolicy({"high": 0.8, "normal": 0.2})
    simulate(policy, 1000, lambda r: 2, lambda r: {"high": 0, "normal": INF})
    after = simulate(policy, 20, lambda r: 1, flooded)
    assert sum(h["normal"] for h in after) >= 3
    assert sum(h["high"] for h in after) >= 15


def test_trickling_high_lane_normal_still_gets_share():
    """high has a task every other round; normal is flooded."""
    policy = LanePolicy({"high": 0.8, "normal": 0.2})
    backlog = {"high": 0.0, "normal": INF}

    def feed(r):
        backlog["high"] += 0.5
        return backlog

    share, _ = shares(simulate(policy, 1000, lambda r: 1, feed))
    assert share["normal"] >= 0.2


def test_split_and_validation():
    policy = LanePolicy({"high": 0.8, "normal": 0.2})
    assert policy.lanes == ("high", "normal")
    assert policy.split(0) == {"high": 0, "normal": 0}
    assert policy.split(10) == {"high": 8, "normal": 2}
    assert policy.split(10) == {"high": 8, "normal": 2}  # split alone changes nothing
    with pytest.raises(ValueError):
        policy.split(-1)
    with pytest.raises(KeyError):
        policy.record({"vip": 1}, {"vip": 1})
    for bad in ({}, {"high": -1, "normal": 1}, {"high": 0, "normal": 0}):
        with pytest.raises(ValueError):
            LanePolicy(bad)


def test_single_lane_and_zero_weight_lane():
    only = LanePolicy({"normal": 1})
    assert only.split(5) == {"normal": 5}
    zero = LanePolicy({"high": 1, "batch": 0})
    assert zero.split(5) == {"high": 5, "batch": 0}
    # the zero-weight lane is only served by refills, and gains no credit from them
    run_round(zero, 5, {"high": 2, "batch": INF})
    assert zero.split(5) == {"high": 5, "batch": 0}


def test_three_lanes_each_get_their_share():
    policy = LanePolicy({"a": 0.5, "b": 0.3, "c": 0.2})
    history = simulate(policy, 1000, lambda r: 1, lambda r: {"a": INF, "b": INF, "c": INF})
    _, tot = shares(history)
    assert tot == {"a": 500, "b": 300, "c": 200}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 8), st.sampled_from([0, 1, 3, INF]), st.sampled_from([0, 1, 3, INF])),
        min_size=1,
        max_size=200,
    ),
    st.floats(0.05, 0.95),
)
def test_property_credit_bounded_and_split_sums(rounds, w):
    policy = LanePolicy({"high": 1 - w, "normal": w})
    for free, hi, no in rounds:
        admitted = run_round(policy, free, {"high": hi, "normal": no})
        assert sum(admitted.values()) <= free
        assert sum(admitted.values()) == min(free, hi + no)
        assert max(abs(c) for c in policy.credit.values()) <= 1.0
        assert abs(sum(policy.credit.values())) < 1e-6
