"""Gate 28: the re-balancing policy converges to the rate-proportional split and does not flap.

Deterministic: no clock. Each rank's compute time per step is injected (its windows x its
seconds per window x seeded noise) into the same `RateMeter` and `Balancer` every fleet rank
runs (dormouse/train/fleet/balance.py), one decision per period, the split in force feeding back into
the next period's times, as in a fleet.
"""

from __future__ import annotations

import random

from gates.status import Record, environment

CLAIM = ("re-balancing: with rank 1 at 2x the per-window time (+-20% noise) the split reaches the "
         "rate-proportional one +-1 window within 3 periods and then holds for 20 periods")  # fmt: skip
INSTRUMENT = ("balance.RateMeter + Balancer with injected times (uniform +-20% per step, 10 "
              "seeds), global batch 16 (world 2: 1x, 2x) and 24 (world 3: 1x, 2x, 1x), start "
              "split equal, rebalance_every 20, default threshold: the first period the split "
              "is within +-1 window of split_by_rates(1/time); the 20 periods after: every split within "
              "+-1, no flap (a split left and taken again)")  # fmt: skip

#: Periods allowed to reach the proportional split, and periods it must then hold (the issue's).
REACH, HOLD = 3, 20
NOISE = 0.2
EVERY = 20
SEEDS = range(10)
CASES = {2: (16, (1.0, 2.0)), 3: (24, (1.0, 2.0, 1.0))}


def simulate(world: int, seed: int) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """The split in force at each period's end, and the rate-proportional target."""
    from dormouse.config import TrainConfig
    from dormouse.train.fleet.balance import KEEP_PERIODS, Balancer, RateMeter
    from dormouse.train.fleet.launch import split_by_rates

    total, slow = CASES[world]
    rng = random.Random(seed)
    target = tuple(split_by_rates([1 / s for s in slow], total))
    split = tuple([total // world] * world)
    split = split[:-1] + (total - sum(split[:-1]),)
    meters = [RateMeter(KEEP_PERIODS * EVERY) for _ in range(world)]
    bal = Balancer(total, TrainConfig.rebalance_threshold)
    history = []
    for period in range(1, REACH + HOLD + 1):
        for _ in range(EVERY):
            for r, m in enumerate(meters):
                m.add(split[r] * slow[r] * 1e-3 * (1 + rng.uniform(-NOISE, NOISE)), split[r])
        d = bal.decide(period * EVERY, split, [m.value() for m in meters])  # the gathered list
        if d.switched:
            split = d.new
            for m in meters:
                m.reset()
        history.append(split)
    return history, target


def judge(history, target) -> tuple[bool, int, int]:
    """(passed, the first period within +-1 window, switches in the HOLD periods after it).

    Holding: every split of those periods within +-1 window of the target, and no split
    left and then taken again (A -> B -> A is a flap; a last one-window refinement is not)."""

    def near(s):
        return max(abs(a - b) for a, b in zip(s, target)) <= 1

    first = next((i for i, s in enumerate(history) if near(s)), None)
    if first is None or first >= REACH:
        return False, (first + 1 if first is not None else -1), 0
    after = history[first : first + HOLD + 1]
    runs = [s for i, s in enumerate(after) if i == 0 or s != after[i - 1]]
    good = len(after) == HOLD + 1 and all(near(s) for s in after) and len(set(runs)) == len(runs)
    return good, first + 1, len(runs) - 1


def run(cuda: bool = False) -> Record:
    notes, ok = [], True
    for world in CASES:
        reached, switches, fails = [], 0, []
        target = None
        for seed in SEEDS:
            history, target = simulate(world, seed)
            good, first, n = judge(history, target)
            reached.append(first)
            switches = max(switches, n)
            if not good:
                fails.append(seed)
        ok &= not fails
        notes.append(
            f"world {world} (target {','.join(map(str, target))}): reached in period "
            f"{min(reached)}-{max(reached)}, then at most {switches} switch(es) in "
            f"{HOLD} periods, none back to a split it left"
            + (f"; FAILED seeds {fails}" if fails else "")
        )
    return Record(
        "g28_rebalance",
        CLAIM,
        INSTRUMENT,
        "; ".join(notes),
        f"within +-1 window by period {REACH}, then for {HOLD} periods every split within +-1 "
        f"and no split left and taken again (every seed; the issue's bounds)",
        ok,
        environment("-", "cpu (no clock: injected times)"),
    )
