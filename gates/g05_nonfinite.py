"""Gate 5: a non-finite step on any rank makes every rank skip it, together, leaving no trace."""

from __future__ import annotations

from gates.compare import SPREAD_K, fmt, judge, max_abs_diff, rel_err
from gates.fixtures import DEVICE_VERDICT_RUNS, FAULT_RUNS, on, worlds
from gates.reference import single
from gates.spawn import fleet, rank_errors
from gates.status import Record, fleet_env

CLAIM = ("non-finite agreement: a NaN on any rank makes every rank skip that step, the skip "
         "leaves no trace, and the run continues as if that batch had never been read")  # fmt: skip
INSTRUMENT = ("a NaN loss with a finite gradient at step 3 of 5 on rank 0, on rank 1, on both "
              "(world 2, capacity 3,1) and on each of ranks 0, 1, 2 (world 3, capacity 3,1,2); "
              "engram_ram, the LFB controller on, adam_eps=1e-5: every rank's local and "
              "agreed verdicts; SHA-256 of each rank's whole state (parameters, gradients, "
              "buffers, host tables and moments, optimizer state) before and after the skipped "
              "step; the losses, "
              "parameters, host tables and LFB biases after it vs one process that never "
              "trains on that batch; and with verdict=device (no host tables), world 3, NaN "
              "on rank 0 and on rank 2")  # fmt: skip

#: |dloss| over the 2 steps after the skip: measured <= 4.8e-7; gate 1's tolerance, ~10x.
TOL_LOSS = 5e-6
#: Final parameters, 24 runs (6 seeds): measured <= 3.5e-8 relative; ~4x. A leaked gradient: 1e-3.
TOL_PARAM = 1.5e-7
#: Engram tables, the same 24 runs: measured <= 2.1e-7 relative (row Adam); ~5x. Leak: 6.9e-2.
TOL_TABLE = 1e-6
#: LFB biases move in steps of coef = 1e-2 from integer counts: any disagreement is >= 1e-2.
TOL_LFB = 1e-6


def check(spec, cuda: bool = False) -> tuple[bool, str]:
    """One fault run: (passed, one measured clause)."""
    ranks = fleet(spec, allow_errors=True)
    k, P, nan = spec.nan_step, spec.world, set(spec.nan_ranks)
    tag = f"world {P} NaN on rank{'s' if len(nan) > 1 else ''} {','.join(map(str, sorted(nan)))}"
    errors = rank_errors(ranks)
    local = [[d[0] for d in r["rec"].get("decisions", [])] for r in ranks]
    agreed = [[d[1] for d in r["rec"].get("decisions", [])] for r in ranks]
    if any(len(a) <= k for a in agreed):
        return False, f"{tag}: a rank never reached step {k + 1}" + (
            f" ({errors})" if errors else ""
        )
    if errors:  # a rank died: what the ranks decided before that is the verdict
        split = len({a[k] for a in agreed}) > 1
        return False, (f"{tag}: " + (f"the ranks acted on different verdicts at step {k + 1}: "
                       f"{[a[k] for a in agreed]}" if split else
                       f"agreed verdicts at step {k + 1} {[a[k] for a in agreed]}")
                       + f"; then {errors[:300]}")  # fmt: skip
    # The injection must have split the verdicts as planned, else agreement proves nothing.
    injected = [not loc[k] for loc in local] == [r in nan for r in range(P)]
    skip_k = all(not a[k] for a in agreed)
    others = all(all(a[i] for i in range(len(a)) if i != k) for a in agreed)
    changed = sorted({c for r in ranks for c, v in r["rec"]["states"][k].items()
                      if v != r["rec"]["states"][k - 1][c]})  # fmt: skip
    unchanged = not changed
    ref = single(spec, drop_steps=(k,))["rec"]
    got = ranks[0]["rec"]

    def measure(a: dict, b: dict) -> dict[str, float]:
        # VRAM Engram tables (the device-verdict runs) are judged as the host tables are:
        # the same row Adam's round-off (TOL_TABLE), not the dense parameters'
        def split(d: dict, tables: bool) -> dict:
            return {n: v for n, v in d.items() if ("store.table" in n) == tables}

        vram = split(b["final_params"], True)
        return {
            "dloss": max_abs_diff(a["losses"], b["losses"]),
            "params": rel_err(split(a["final_params"], False), split(b["final_params"], False)),
            "host": (rel_err(a["final_host"], b["final_host"]) if b["final_host"] else
                     rel_err(split(a["final_params"], True), vram) if vram else 0.0),
            "LFB": max((float((a["final_lfb"][n] - b["final_lfb"][n]).abs().max())
                        for n in b["final_lfb"]), default=float("inf")),
        }  # fmt: skip

    spread = (measure(single(spec, drop_steps=(k,), split_rows=True)["rec"], ref)
              if cuda else {})  # fmt: skip
    spread.pop("LFB", None)  # the LFB rule is exact integers on any device: no spread
    close, figures, tol = judge(cuda, measure(got, ref), {"dloss": TOL_LOSS, "params": TOL_PARAM,
                                "host": TOL_TABLE, "LFB": TOL_LFB}, spread)  # fmt: skip
    skips = [r["report"]["skips"] for r in ranks]
    ok = injected and skip_k and others and unchanged and skips == [1] * P and close
    short = lambda xs: "".join("T" if x else "F" for x in xs)
    text = (
        f"{tag}: local {short(loc[k] for loc in local)} -> agreed "
        f"{short(a[k] for a in agreed)}, skips {skips}, changed by the skip: "
        f"{', '.join(changed) or 'nothing'}; then {figures}" + (f" [{tol}]" if cuda else "")
    )
    return ok, text


def run(cuda: bool = False) -> Record:
    ws = worlds(cuda, 2, 3)
    results = [check(on(s, cuda), cuda) for s in FAULT_RUNS + DEVICE_VERDICT_RUNS if s.world in ws]
    return Record(
        "g05_nonfinite",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t in results),
        f"every rank skips exactly the poisoned step (agreed False, local split as injected); "
        f"state hash bitwise unchanged by the skip; afterwards |dloss| <= {fmt(TOL_LOSS)}, "
        f"params <= {fmt(TOL_PARAM)}, host tables <= {fmt(TOL_TABLE)} (fp32 round-off"
        + (
            f"; on CUDA at least {SPREAD_K:g}x the reference's spread, per run in brackets"
            if cuda
            else ""
        )
        + f"), LFB <= {fmt(TOL_LFB)}",
        all(ok for ok, _ in results),
        fleet_env(cuda, ws),
    )
