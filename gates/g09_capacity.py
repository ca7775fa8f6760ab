"""Gate 9: per-rank capacity. `auto` splits the global batch by rates; every parse is sound."""

from __future__ import annotations

import math

from gates.harness import LFB_RUN, Record, fleet, fleet_env, on

CLAIM = "capacity: auto splits by rates (total exact, min 1); parse_capacity is total or refuses"
INSTRUMENT = ("a 2-rank fleet with --capacity auto and injected rates 3:1 (the all-gather and "
              "the split inside init_parallel); measure_rate on this device; split_by_rates on "
              "a table; hypothesis: >= 500 arbitrary and structured --capacity strings")  # fmt: skip

#: (rates, global batch) -> the split a correct proportional rule must give.
TABLE = [
    ((1.0, 1.0), 8, [4, 4]),
    ((4.0, 1.0), 10, [8, 2]),  # a 1650 at 1/4 of a 5060 Ti carries 1/5 of the tokens
    ((1000.0, 1.0), 4, [3, 1]),  # proportional says 0 for the slow rank; minimum 1 binds
    ((1.0, 2.0, 3.0), 12, [2, 4, 6]),
    ((3.0, 3.0, 3.0), 10, [4, 3, 3]),  # the remainder goes to the lowest rank
]


def fuzz(examples: int = 300) -> dict:
    """Run parse_capacity on arbitrary text and on well-formed specs; count violations."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from dormouse.train.distributed import parse_capacity

    stats = {"examples": 0, "shapes": 0, "refused": 0, "violations": []}

    def check(spec: str, world: int, batch: int, seq: int, rates=None, expect_total=None):
        stats["examples"] += 1
        try:
            shapes = parse_capacity(spec, world, batch, seq, 64, rates=rates)
        except ValueError as e:
            stats["refused"] += 1
            if not str(e).strip():
                stats["violations"].append(("empty message", spec, world))
            return
        except Exception as e:  # noqa: BLE001 - any other exception is a violation
            stats["violations"].append((f"{type(e).__name__}: {e}", spec, world))
            return
        stats["shapes"] += 1
        total = sum(s.batch for s in shapes)
        if expect_total is None:
            low = spec.strip().lower()
            expect_total = (batch * world if low in ("", "auto")
                            else sum(int(p.strip().lower().split("x")[0]) for p in spec.split(",")))  # fmt: skip
        if (len(shapes) != world or total != expect_total or min(s.batch for s in shapes) < 1
                or any(not 1 <= s.seq_len <= 64 for s in shapes)):  # fmt: skip
            stats["violations"].append(("bad shapes", spec, world, [s.line() for s in shapes]))

    cfg = settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                   suppress_health_check=list(HealthCheck))  # fmt: skip
    worlds = st.integers(min_value=1, max_value=8)

    @cfg
    @given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.text("0123456789x, auto", max_size=20),
           worlds, st.integers(1, 16), st.integers(1, 64))  # fmt: skip
    def arbitrary(spec, world, batch, seq):
        check(spec, world, batch, seq)

    entry = st.tuples(st.integers(0, 40), st.one_of(st.none(), st.integers(0, 80)))

    @cfg
    @given(st.lists(entry, min_size=1, max_size=8), worlds, st.sampled_from([",", " , "]))
    def structured(entries, world, sep):
        spec = sep.join(f"{b}" if t is None else f"{b}x{t}" for b, t in entries)
        check(spec, world, 2, 32, expect_total=sum(b for b, _ in entries))

    @cfg
    @given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=8),
           st.integers(1, 64))  # fmt: skip
    def auto(rates, batch):
        check("auto", len(rates), batch, 16, rates=rates, expect_total=batch * len(rates))

    arbitrary()
    structured()
    auto()
    return stats


def run(cuda: bool = False) -> Record:
    import torch

    from dormouse.train.distributed import measure_rate, split_by_rates

    spec = on(LFB_RUN, cuda)
    ranks = fleet(spec)
    notes, ok = [], True
    shapes = [r["shapes"] for r in ranks]
    want = [f"{b}x64" for b in split_by_rates(list(spec.rates), spec.batch * spec.world)]
    fleet_ok = all(s == want for s in shapes) and want == ["3x64", "1x64"]
    ok &= fleet_ok
    notes.append(f"fleet auto (rates 3:1, global {spec.batch * spec.world}) -> {shapes[0]} on every rank: {fleet_ok}")
    rate = measure_rate(torch.device("cuda", 0) if cuda else torch.device("cpu"))
    ok &= math.isfinite(rate) and rate > 0
    notes.append(f"measure_rate {rate / 1e9:.1f} GFLOP/s")
    table_bad = [(r, g, split_by_rates(list(r), g)) for r, g, w in TABLE if split_by_rates(list(r), g) != w]
    ok &= not table_bad
    notes.append(f"table {len(TABLE) - len(table_bad)}/{len(TABLE)}")
    stats = fuzz()
    ok &= stats["examples"] >= 500 and not stats["violations"] and stats["shapes"] > 0 and stats["refused"] > 0
    notes.append(f"fuzz {stats['examples']} examples: {stats['shapes']} parsed, {stats['refused']} "
                 f"refused with a message, {len(stats['violations'])} violations")
    return Record(
        "g09_capacity", CLAIM, INSTRUMENT, "; ".join(notes),
        "split exact on every input; 0 violations in >= 500 examples (both outcomes seen)",
        ok, fleet_env(cuda), details={"violations": stats["violations"][:10], "table_bad": table_bad},
    )
