"""The fleet's re-balancing policy (dormouse/train/balance.py): memory caps bound a share,
and the log says when memory, not speed, decided. Injected times and budgets: no clock."""

from __future__ import annotations

import logging
import random

import pytest

from dormouse.config import preset
from dormouse.train.context import DistError
from dormouse.train.fleet.balance import Balancer, RateMeter, rank_window_cap, split_capped
from dormouse.train.plan.fit import estimate


def test_split_capped_is_proportional_without_caps():
    assert split_capped([2.0, 1.0], 12) == ([8, 4], [])
    assert split_capped([2.0, 1.0], 12, [None, None]) == ([8, 4], [])


def test_split_capped_water_fills():
    # rank 0 would take 9 of 12 by speed; its cap is 5: the rest goes by the others' rates
    assert split_capped([3.0, 1.0, 0.5], 12, [5, None, None]) == ([5, 5, 2], [0])


def test_split_capped_refuses_a_batch_that_does_not_fit():
    with pytest.raises(DistError, match="memory caps"):
        split_capped([1.0, 1.0], 12, [5, 5])


def test_a_capped_fast_rank_never_exceeds_its_cap_and_the_log_says_memory(caplog):
    """Rank 1 is 3x faster but its budget holds 6 windows: over 30 periods of noisy injected
    times its share never exceeds 6, and every decision that capped it says memory decided."""
    total, caps, slow = 16, [None, 6], (3.0, 1.0)
    rng = random.Random(0)
    split = (8, 8)  # over the cap at start: the policy must bring it down
    bal, meters = Balancer(total, 0.05, caps), [RateMeter(40), RateMeter(40)]
    seen, lines = [], []
    with caplog.at_level(logging.INFO, logger="dormouse"):
        for period in range(1, 31):
            for _ in range(10):
                for r, m in enumerate(meters):
                    m.add(split[r] * slow[r] * 1e-3 * (1 + rng.uniform(-0.2, 0.2)), split[r])
            d = bal.decide(period * 10, split, [m.value() for m in meters])
            logging.getLogger("dormouse.train.fleet.balance").info(d.line())
            lines.append(d.line())
            if d.switched:
                split = d.new
                for m in meters:
                    m.reset()
            seen.append(split)
    assert seen[0] == (10, 6)  # the first decision already obeys the cap
    assert all(s[1] <= 6 and sum(s) == total for s in seen)
    assert "memory, not speed, decided rank 1 (cap 6 windows)" in lines[0]
    assert any("memory, not speed, decided rank 1" in r.getMessage() for r in caplog.records)


def test_rank_window_cap_follows_the_memory_model():
    run = preset("small")
    one = estimate(run, batch=1).total
    four = estimate(run, batch=4).total
    assert rank_window_cap(run, one - 1, world=1) == 0
    assert rank_window_cap(run, four, world=1) == 4
    # a fleet rank also holds DDP's gradient buckets: the same bytes fit fewer windows
    assert rank_window_cap(run, four, world=2) < 4


# ---- shares that accumulate in few full micro-batches --------------------------------------


def test_packed_flags_shares_that_would_run_one_window_at_a_time():
    from dormouse.train.context import accumulate, packed

    assert accumulate(67, 16, 64).line() == "1x64*67"  # the trap: 67 is prime
    assert not packed(67, 16) and not packed(17, 16) and not packed(59, 16)
    assert packed(64, 16) and packed(70, 16) and packed(16, 16) and packed(5, 16)
    assert packed(40, 16)  # 4 of 10 where 3 is the fewest: within twice the fewest
    assert all(packed(b, 16) for b in range(1, 17))  # a share that fits is one forward


def test_packed_split_moves_a_prime_share_to_the_nearest_packed_one():
    from dormouse.train.context import packed, packed_split

    # rank 1 at 2.3x rank 0's time per window: 67,29 is the rate-proportional split of 96
    new = packed_split((67, 29), (1.0, 2.3), (16, 16))
    assert sum(new) == 96 and all(packed(b, 16) for b in new)
    assert new == (66, 30)  # step 66 x 1.0 vs 30 x 2.3 = 69: the shortest packed step
    assert packed_split((64, 32), (1.0, 2.0), (16, 16)) == (64, 32)  # packed: untouched
    # a share's own memory limit holds
    assert packed_split((67, 29), (1.0, 2.3), (16, 16), (64, None)) == (64, 32)


def test_packed_split_holds_for_any_fleet():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from dormouse.train.context import accumulate, packed, packed_split

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(1, 300), min_size=1, max_size=4), st.integers(1, 32),
           st.lists(st.floats(0.2, 5.0), min_size=4, max_size=4))  # fmt: skip
    def check(split, cap, pw):
        new = packed_split(split, pw[: len(split)], [cap] * len(split))
        assert sum(new) == sum(split) and min(new) >= 1 and len(new) == len(split)
        if new != tuple(split):  # moved: every share packed, each within reach of its own
            assert all(packed(b, cap) for b in new)
            assert all(abs(b - a) <= 2 * -(-a // cap) + cap for a, b in zip(split, new))
        fewest = [-(-b // cap) for b in new]
        if all(packed(b, cap) for b in new):
            assert all(accumulate(b, cap, 8).accum <= 2 * f for b, f in zip(new, fewest))

    check()


def test_the_balancer_under_global_batch_hands_out_packed_shares():
    from dormouse.train.context import packed

    bal = Balancer(96, 0.05, None, micro=(16, 16))
    d = bal.decide(50, (48, 48), (1e-3, 2.3e-3))
    assert d.switched and sum(d.new) == 96 and all(packed(b, 16) for b in d.new), d.line()
    assert Balancer(96, 0.05).decide(50, (48, 48), (1e-3, 2.3e-3)).new == (67, 29)  # one forward


def test_capacity_auto_under_global_batch_gives_packed_shares():
    from dormouse.train.context import packed
    from dormouse.train.fleet.launch import parse_capacity

    shapes = parse_capacity("auto", 2, 16, 64, 512, rates=[2.3, 1.0], global_batch=96)
    assert sum(s.windows for s in shapes) == 96
    assert all(packed(s.windows, 16) for s in shapes), [s.line() for s in shapes]
    # 66 as 6 x 11 (the fewest would be 5): at most twice the fewest, never one window at a time
    assert [s.line() for s in shapes] == ["11x64*6", "15x64*2"]


def test_a_share_that_runs_one_window_at_a_time_is_said():
    from dormouse.train.context import accumulate, unpacked_lines

    lines = unpacked_lines([accumulate(17, 4, 64)], 4)
    assert lines == ["17 windows a step in micro-batches of at most 4 run as 17 micro-batches of 1 "
                     "(the fewest equal ones that divide 17; 5 would do), each paying a forward's "
                     "fixed cost: a share of 16 or 18 windows runs as 4x64*4 or 3x64*6 (set "
                     "global_batch or --capacity)"]  # fmt: skip
    assert unpacked_lines([accumulate(16, 4, 64), accumulate(3, 4, 64)], 4) == []
    two = unpacked_lines([accumulate(16, 4, 64), accumulate(23, 4, 64)], 4)
    assert len(two) == 1 and two[0].startswith("rank 1: 23 windows")
