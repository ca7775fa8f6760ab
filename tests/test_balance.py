"""The fleet's re-balancing policy (dormouse/train/balance.py): memory caps bound a share,
and the log says when memory, not speed, decided. Injected times and budgets: no clock."""

from __future__ import annotations

import logging
import random

import pytest

from dormouse.config import preset
from dormouse.train.balance import Balancer, RateMeter, rank_window_cap, split_capped
from dormouse.train.context import DistError
from dormouse.train.fit import estimate


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
            logging.getLogger("dormouse.train.balance").info(d.line())
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
