"""Gate 11: the LFB load-balancing controller is fleet-correct (the counts are summed)."""

from __future__ import annotations

from gates.harness import LFB_RUN, Record, fleet, fleet_env, fmt, on, single

CLAIM = "LFB controller on a fleet: every rank's lfb_bias equals the single process's"
INSTRUMENT = ("moe_lb_coef=0.01, capacity auto split 3,1, 8 steps vs one process at batch 4: "
              "lfb_bias of every MoE on every rank after every step")  # fmt: skip

#: The bias moves in steps of +-coef, +0: any disagreement in the fleet's counts shows up as a
#: difference of at least coef = 1e-2. Measured 0: the counts are integers, summed exactly.
TOL = 1e-6


def run(cuda: bool = False) -> Record:
    spec = on(LFB_RUN, cuda)
    ranks = fleet(spec)
    ref = single(spec)["rec"]
    ref_seq = ref["lfb"][1:] + [ref["final_lfb"]]
    worst, moved = 0.0, 0.0
    for r in ranks:
        seq = r["rec"]["lfb"][1:] + [r["rec"]["final_lfb"]]
        if len(seq) != len(ref_seq):
            worst = float("inf")
            continue
        for mine, theirs in zip(seq, ref_seq):
            for name in theirs:
                worst = max(worst, float((mine[name] - theirs[name]).abs().max()))
                moved = max(moved, float(theirs[name].abs().max()))
    passed = worst <= TOL and moved > 0
    return Record(
        "g11_lfb", CLAIM, INSTRUMENT,
        f"max |lfb_bias fleet - single| {fmt(worst)} over {len(ref_seq)} steps x {len(ranks)} "
        f"ranks (the bias reached {moved:.2f})",
        f"<= {fmt(TOL)} (the bias moves in steps of the coefficient 1e-2; counts are exact integers)",
        passed, fleet_env(cuda),
    )
