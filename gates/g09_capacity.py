"""Gate 9: per-rank capacity. `auto` splits the global batch by rates; every parse is sound."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

from gates.fixtures import LFB_RUNS, on, worlds
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = (
    "capacity: auto splits by rates (total exact, min 1; under global_batch into shares that "
    "run in few full micro-batches); parse_capacity is total or refuses"
)
INSTRUMENT = ("fleets with --capacity auto and injected rates 3:1 (world 2) and 3:1:2 (world 3): "
              "every rank's (batch, seq_len) vs the split written by hand; measure_rate on this "
              "device; split_by_rates on a table; hypothesis: >= 500 arbitrary and structured "
              "--capacity strings and rate vectors, each result checked per rank against a "
              "hand-written parse (B or BxT) or the quota rule of a proportional split; under "
              "global_batch the shares' micro-batches by hand and, up to 3 ranks, a brute force "
              "over the packed splits in reach")  # fmt: skip
#: What each fleet must have chosen, per rank, written by hand.
FLEET_WANT = {2: ["3x64", "1x64"], 3: ["3x64", "1x64", "2x64"]}

#: (rates, global batch) -> the split a correct proportional rule must give.
TABLE = [
    ((1.0, 1.0), 8, [4, 4]),
    ((4.0, 1.0), 10, [8, 2]),  # a 1650 at 1/4 of a 5060 Ti carries 1/5 of the tokens
    ((1000.0, 1.0), 4, [3, 1]),  # proportional says 0 for the slow rank; minimum 1 binds
    ((1.0, 2.0, 3.0), 12, [2, 4, 6]),
    ((3.0, 3.0, 3.0), 10, [4, 3, 3]),  # the remainder goes to the lowest rank
    ((1.0, 1.0, 1.0, 1.0), 11, [3, 3, 3, 2]),  # a remainder of 3 is spread, one each
    ((5.0, 3.0, 1.0, 1.0), 17, [8, 5, 2, 2]),  # ideal 8.5, 5.1, 1.7, 1.7: the two .7s round up
]

_SPACE = " \t\n\r\f\v"


def expected_shapes(spec: str, world: int, batch: int, seq: int, max_seq: int = 64):
    """The per-rank (batch, seq_len, micro-batches) an explicit --capacity must give, or None
    when it must be refused. Written from the documented grammar, not from parse_capacity:
    entries split on ',', each 'B', 'BxT' (x or X), 'B*K' or 'BxT*K' of ASCII digits with
    optional ASCII whitespace, one entry per rank, B >= 1, K >= 1, 1 <= T <= max_seq."""
    text = spec.strip()
    if text == "":
        return [(batch, seq, 1)] * world
    parts = text.split(",")
    if len(parts) != world:
        return None
    digits = set("0123456789")
    out = []
    for part in parts:
        body, star, k_text = part.partition("*")
        body, k_text = body.strip(_SPACE), k_text.strip(_SPACE)
        b_text, _, t_text = body.replace("X", "x").partition("x")
        b_text, t_text = b_text.strip(_SPACE), t_text.strip(_SPACE)
        if (
            not b_text
            or not set(b_text) <= digits
            or ("x" in body and (not t_text or not set(t_text) <= digits))
        ):
            return None
        if star and (not k_text or not set(k_text) <= digits):
            return None
        b, t = int(b_text), int(t_text) if "x" in body else seq
        k = int(k_text) if star else 1
        if b < 1 or k < 1 or not 1 <= t <= max_seq:
            return None
        out.append((b, t, k))
    return out


def few_micro(share: int, cap: int) -> bool:
    """By hand: `share` splits into equal micro-batches of <= cap windows no more than twice
    as many as ceil(share / cap) (a share with no divisor that near, a prime above the cap
    say, would run one window at a time)."""
    fewest = -(-share // cap)
    return any(share % k == 0 for k in range(fewest, 2 * fewest + 1))


def _room(b: int, cap: int) -> int:
    """How far from the rates' share b a packed share is looked for: 2 ceil(b / cap) + cap."""
    return 2 * -(-b // cap) + cap


def packed_violation(rates, total: int, cap: int, split: list[int]) -> str | None:
    """None when `split` is what capacity auto must give under global_batch: the proportional
    quota split when its every share runs in few micro-batches (`few_micro`); else a split of
    such shares, each within `_room` of its share, whose predicted step (max share / rate) no
    such split in reach beats (brute force, up to 3 ranks); the quota split itself only where
    no such split lies in reach. The brute force searches a range every proportional share
    (floor or ceil of the exact one) reaches, so it never asks for more than the rule offers."""
    if sum(split) != total or min(split) < 1 or len(split) != len(rates):
        return f"total/minimum: {split} for {total}"
    exact = [Fraction(r) for r in rates]
    ideal = [total * r / sum(exact) for r in exact]
    quota_ok = quota_violation(rates, total, split) is None
    packed = all(few_micro(n, cap) for n in split)
    if quota_ok and packed:
        return None
    lo = [q.numerator // q.denominator for q in ideal]
    bumped = any(q < 1 for q in ideal)  # the minimum of 1 moved shares by up to one a rank
    slack = 1 + (len(split) if bumped else 0)
    if packed and any(abs(n - q) > _room(f + slack, cap) + slack
                      for n, q, f in zip(split, ideal, lo)):  # fmt: skip
        return f"a packed share out of reach: {split} vs exact {[float(q) for q in ideal]}"
    if len(split) > 3 or bumped:  # no brute force: where the rule looks is not pinned down
        return None if packed else f"neither proportional and packed nor packed: {split}"
    ranges = [[n for n in range(max(1, f + 1 - _room(f, cap)), f + _room(f, cap) + 1)
               if few_micro(n, cap)] for f in lo]  # fmt: skip
    best = None
    for head in itertools.product(*ranges[:-1]):
        last = total - sum(head)
        if last in ranges[-1]:
            t = max(Fraction(n) / r for n, r in zip((*head, last), exact))
            best = t if best is None or t < best else best
    if not packed:
        if best is not None:
            return f"a packed split in reach (step {float(best):.4g}) was not taken: {split}"
        return None if quota_ok else f"not packed and not proportional: {split}"
    mine = max(Fraction(n) / r for n, r in zip(split, exact))
    # the rule compares float seconds per window: a tie may round either way
    if best is not None and mine > best * (1 + Fraction(1, 10**9)):
        return f"{split}: step {float(mine):.6g} > {float(best):.6g} of a packed split in reach"
    return None


def quota_violation(rates, total: int, split: list[int]) -> str | None:
    """None when `split` is a proportional split of `total` by `rates`: exact total, every
    rank >= 1, and each rank within one window of its exact share (Fractions, no float): at
    floor or ceil of its share, or 1 where the share is below 1 (others may then give way)."""
    if sum(split) != total or min(split) < 1 or len(split) != len(rates):
        return f"total/minimum: {split} for {total}"
    exact = [Fraction(r) for r in rates]
    ideal = [total * r / sum(exact) for r in exact]
    bumped = any(q < 1 for q in ideal)
    for i, (q, n) in enumerate(zip(ideal, split)):
        lo, hi = q.numerator // q.denominator, -(-q.numerator // q.denominator)
        if q < 1:
            if n != 1:
                return f"rank {i}: share {float(q):.3f} < 1 but got {n}"
        elif not (lo - (len(split) if bumped else 0) <= n <= hi):
            return f"rank {i}: share {float(q):.3f} but got {n}"
    return None


def fuzz(examples: int = 300) -> dict:
    """Run parse_capacity on arbitrary text and on well-formed specs; count violations."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from dormouse.train.fleet.launch import parse_capacity

    stats = {"examples": 0, "shapes": 0, "refused": 0, "violations": []}

    def check(spec: str, world: int, batch: int, seq: int, rates=None):
        stats["examples"] += 1
        try:
            shapes = parse_capacity(spec, world, batch, seq, 64, rates=rates)
        except ValueError as e:
            stats["refused"] += 1
            if not str(e).strip():
                stats["violations"].append(("empty message", spec, world))
            if (
                rates is None
                and spec.strip().lower() != "auto"
                and expected_shapes(spec, world, batch, seq) is not None
            ):
                stats["violations"].append(("refused a valid spec", spec, world, str(e)))
            return
        except Exception as e:
            stats["violations"].append((f"{type(e).__name__}: {e}", spec, world))
            return
        stats["shapes"] += 1
        got = [(s.batch, s.seq_len, s.accum) for s in shapes]
        if rates is not None:
            why = quota_violation(rates, batch * world, [b * k for b, _, k in got])
            if why or any(t != seq or k != 1 for _, t, k in got):
                stats["violations"].append(("not proportional", why, list(rates), got))
            return
        want = expected_shapes(spec, world, batch, seq)
        if got != want:
            stats["violations"].append(("shapes differ from the grammar", spec, world, got, want))

    cfg = settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                   suppress_health_check=list(HealthCheck))  # fmt: skip
    n_ranks = st.integers(min_value=1, max_value=8)

    @cfg
    @given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.text("0123456789x*, auto", max_size=20),
           n_ranks, st.integers(1, 16), st.integers(1, 64))  # fmt: skip
    def arbitrary(spec, world, batch, seq):
        check(spec, world, batch, seq)

    entry = st.tuples(st.integers(0, 40), st.one_of(st.none(), st.integers(0, 80)),
                      st.one_of(st.none(), st.integers(0, 5)))  # fmt: skip

    @cfg
    @given(st.lists(entry, min_size=1, max_size=8), st.integers(-1, 1),
           st.sampled_from([",", " , "]))  # fmt: skip
    def structured(entries, extra, sep):
        # one entry per rank (mostly): the entries' own values decide the outcome
        spec = sep.join((f"{b}" if t is None else f"{b}x{t}") + ("" if k is None else f"*{k}")
                        for b, t, k in entries)  # fmt: skip
        check(spec, max(1, len(entries) + (extra if extra < 0 else 0)), 2, 32)

    @cfg
    @given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=8),
           st.integers(1, 64))  # fmt: skip
    def auto(rates, batch):
        check("auto", len(rates), batch, 16, rates=rates)

    @cfg
    @given(st.lists(st.floats(min_value=0.01, max_value=1e6), min_size=1, max_size=8),
           st.integers(1, 64))  # fmt: skip
    def auto_valid(rates, batch):
        check("auto", len(rates), batch, 16, rates=rates)

    def split_by_hand(share: int, cap: int) -> tuple[int, int]:
        """(micro-batch, count): the fewest equal micro-batches of <= cap windows."""
        k = -(-share // cap)
        while share % k:
            k += 1
        return share // k, k

    @cfg
    @given(st.lists(st.floats(min_value=0.01, max_value=1e6), min_size=1, max_size=8),
           st.integers(1, 16), st.integers(1, 200))  # fmt: skip
    def auto_global(rates, cap, total):
        # global_batch fixes the total; each share runs as micro-batches of <= batch windows
        stats["examples"] += 1
        try:
            shapes = parse_capacity("auto", len(rates), cap, 16, 64, rates=rates,
                                    global_batch=total)  # fmt: skip
        except ValueError as e:
            stats["refused"] += 1
            if total >= len(rates) or not str(e).strip():
                stats["violations"].append(("refused a valid global split", rates, total, str(e)))
            return
        except Exception as e:
            stats["violations"].append((f"{type(e).__name__}: {e}", rates, total))
            return
        stats["shapes"] += 1
        shares = [s.batch * s.accum for s in shapes]
        bad = [s for s, n in zip(shapes, shares) if (s.batch, s.accum) != split_by_hand(n, cap)]
        why = packed_violation(rates, total, cap, shares)
        if why or bad:
            stats["violations"].append(("global split", why, list(rates), total, cap, bad))

    arbitrary()
    structured()
    auto()
    auto_valid()
    auto_global()
    return stats


def run(cuda: bool = False) -> Record:
    import torch

    from dormouse.train.fleet.launch import measure_rate, split_by_rates

    notes, ok = [], True
    ws = worlds(cuda, 2, 3)
    for w in ws:
        spec = on(LFB_RUNS[w], cuda)
        ranks = fleet(spec)
        shapes = [r["shapes"] for r in ranks]
        fleet_ok = all(s == FLEET_WANT[w] for s in shapes)
        ok &= fleet_ok
        rates = ":".join(f"{r:g}" for r in spec.rates)
        notes.append(
            f"world {w} auto (rates {rates}, global {spec.batch * w}) -> "
            f"{','.join(shapes[0])} on every rank, hand-written "
            f"{','.join(FLEET_WANT[w])}: {fleet_ok}"
        )
    rate = measure_rate(torch.device("cuda", 0) if cuda else torch.device("cpu"))
    ok &= math.isfinite(rate) and rate > 0
    notes.append(f"measure_rate {rate / 1e9:.1f} GFLOP/s")
    table_bad = [
        (r, g, split_by_rates(list(r), g)) for r, g, w in TABLE if split_by_rates(list(r), g) != w
    ]
    ok &= not table_bad
    notes.append(f"table {len(TABLE) - len(table_bad)}/{len(TABLE)}")
    stats = fuzz()
    ok &= (
        stats["examples"] >= 500
        and not stats["violations"]
        and stats["shapes"] > 0
        and stats["refused"] > 0
    )
    notes.append(
        f"fuzz {stats['examples']} examples: {stats['shapes']} parsed, {stats['refused']} "
        f"refused with a message, {len(stats['violations'])} violations"
    )
    return Record(
        "g09_capacity",
        CLAIM,
        INSTRUMENT,
        "; ".join(notes),
        "every rank's (batch, seq_len) as written by hand / by the grammar; auto splits within "
        "one window of the exact share (under global_batch: that, or the packed split of the "
        "shortest predicted step in reach); 0 violations in >= 500 examples (both outcomes seen)",
        ok,
        fleet_env(cuda, ws),
        details={"violations": stats["violations"][:10], "table_bad": table_bad},
    )
