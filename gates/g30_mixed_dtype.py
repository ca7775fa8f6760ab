"""Gate 30: a bf16 rank beside an fp16 rank (with the fleet's loss scale) is one process."""

from __future__ import annotations

from gates.compare import fmt, max_abs_diff, max_rel_diff, rel_err
from gates.fixtures import FleetSpec, on
from gates.reference import single
from gates.spawn import fleet, rank_errors
from gates.status import Record, fleet_env

CLAIM = ("a mixed-dtype fleet trains as one process: a bf16 rank beside an fp16 rank carry one "
         "loss scale, skip together on a non-finite step, and stay within the sum of each "
         "dtype's own deviation from fp32")  # fmt: skip
INSTRUMENT = ("tiny, 2 ranks x 2 windows, 20 steps, no clip; rank 0 dtype=bf16, rank 1 dtype=fp16 "
              "(EMULATION of two cards: on the CPU each rank's dtype is given by FleetSpec.dtypes, "
              "where a real fleet's comes from each card's policy); a NaN loss (finite gradient) "
              "on the fp16 rank at step 4: both ranks' verdicts and loss scales every step; the "
              "losses, pre-clip norms and final parameters vs one fp32 process at the global "
              "batch that never trains on the fleet's skipped batches; the same figures of one "
              "bf16 process and one fp16 process (with its scale, its own skips dropped from its "
              "fp32 twin) vs fp32")  # fmt: skip

NAN_STEP = 3
SPEC = FleetSpec("mixed-dtype", steps=20, dtypes=("bf16", "fp16"), nan_ranks=(1,),
                 nan_step=NAN_STEP)  # fmt: skip
#: Tolerance: bf16's + fp16's own deviations from fp32, measured each run; the fleet: 0.45-0.7x.
FIGURES = ("dloss", "norms", "params")


def _skips(rec: dict) -> tuple[int, ...]:
    return tuple(i for i, (_, agreed) in enumerate(rec["decisions"]) if not agreed)


def _measure(rec: dict, ref: dict) -> dict[str, float]:
    taken = [g for g, (_, agreed) in zip(rec["gnorms"], rec["decisions"]) if agreed]
    return {"dloss": max_abs_diff(rec["losses"], ref["losses"]),
            "norms": max_rel_diff(taken, ref["gnorms"]),
            "params": rel_err(rec["final_params"], ref["final_params"])}  # fmt: skip


def _alone(dtype: str, drops: tuple[int, ...], cuda: bool) -> dict[str, float]:
    """One process in `dtype` that never trains on the fleet's skipped batches (`drops`) vs one
    fp32 process that drops those and the dtype's own skips: the same trajectory as the
    fleet's, so the deviations compare."""
    spec = on(FleetSpec(f"mixed-dtype-{dtype}", steps=SPEC.steps, sets=(f"dtype={dtype}",)), cuda)
    rec = single(spec, drop_steps=drops)["rec"]
    taken = [s for s in range(SPEC.steps) if s not in drops]  # decision i is step taken[i]
    own = {taken[i] for i in _skips(rec)}
    ref = single(on(FleetSpec("mixed-dtype-fp32", steps=SPEC.steps), cuda),
                 drop_steps=tuple(sorted(own | set(drops))))["rec"]  # fmt: skip
    return _measure(rec, ref)


def run(cuda: bool = False) -> Record:
    spec = on(SPEC, cuda)
    ranks = fleet(spec, allow_errors=True)
    errors = rank_errors(ranks)
    recs = [r["rec"] for r in ranks]
    n = min(len(r.get("decisions", [])) for r in recs)
    bad = []
    if errors or n < spec.steps:
        bad.append(f"the fleet did not finish ({errors[:300] or f'{n} steps'})")
    agreed = [[a for _, a in r["decisions"]] for r in recs]
    local = [[loc for loc, _ in r["decisions"]] for r in recs]
    if len({tuple(a) for a in agreed}) != 1:
        bad.append(f"the ranks acted on different verdicts: {agreed}")
    if n > NAN_STEP and not (local[0][NAN_STEP] and not local[1][NAN_STEP]):
        bad.append(f"the injection did not split the verdicts at step {NAN_STEP + 1}")
    scales = [r.get("scales", []) for r in recs]
    if len({tuple(s) for s in scales}) != 1:
        bad.append("the ranks' loss scales parted: " + " vs ".join(map(str, scales)))
    # the scale halves exactly on the agreed skips and nowhere else (20 steps < 2000)
    want, s = [], 2.0**16
    for ok in agreed[0]:
        s = s if ok else s / 2
        want.append(s)
    if scales[0] != want:
        bad.append(f"scales {scales[0]} vs halving on each skip {want}")
    skipped = _skips(recs[0]) if n else ()
    ref = single(on(FleetSpec("mixed-dtype-fp32", steps=spec.steps), cuda),
                 drop_steps=skipped)["rec"]  # fmt: skip
    got = _measure(recs[0], ref) if not errors else {k: float("inf") for k in FIGURES}
    apart = rel_err(recs[1]["final_params"], recs[0]["final_params"]) if not errors else 1.0
    dev = {d: _alone(d, skipped, cuda) for d in ("bf16", "fp16")}
    tol = {k: dev["bf16"][k] + dev["fp16"][k] for k in FIGURES}
    over = [k for k in FIGURES if not got[k] <= tol[k]]
    if over:
        bad.append(f"{', '.join(over)} beyond the dtypes' own deviations added")
    if apart != 0:
        bad.append(f"the ranks' parameters differ ({fmt(apart)} relative)")
    ends = ", ".join(str(s[-1]) if s else "-" for s in scales)
    measured = (f"skips {[i + 1 for i in skipped]} on both ranks (injected at {NAN_STEP + 1}); "
                f"final loss scale by rank {ends}; ranks' parameters {fmt(apart)} apart; vs fp32: "
                + ", ".join(f"{k} {fmt(got[k])}" for k in FIGURES)
                + "; alone vs fp32: bf16 " + ", ".join(f"{k} {fmt(dev['bf16'][k])}" for k in FIGURES)
                + "; fp16 " + ", ".join(f"{k} {fmt(dev['fp16'][k])}" for k in FIGURES))  # fmt: skip
    if bad:
        measured += "; FAILED: " + " | ".join(bad)
    return Record(
        "g30_mixed_dtype",
        CLAIM,
        INSTRUMENT,
        measured,
        "the same agreed verdict and the same scale on both ranks every step, halving on each "
        "skip; ranks' parameters equal (0); each figure <= bf16's + fp16's own deviation from "
        "fp32 (" + ", ".join(f"{k} {fmt(tol[k])}" for k in FIGURES) + ")",
        not bad,
        fleet_env(cuda, 2),
        details={"fleet": got, "alone": dev, "scales": scales[0], "skips": list(skipped)},
    )
