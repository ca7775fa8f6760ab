"""Gate 11: the LFB load-balancing controller is fleet-correct (the counts are summed)."""

from __future__ import annotations

from gates.compare import fmt
from gates.fixtures import LFB_RUNS, on, worlds
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = "LFB controller on a fleet: every rank's lfb_bias equals the single process's"
INSTRUMENT = ("moe_lb_coef=0.01, capacity auto split 3,1 (world 2) and 3,1,2 (world 3), 8 steps "
              "vs one process at the global batch: lfb_bias of every MoE on every rank after "
              "every step")  # fmt: skip
#: The split each fleet must have chosen (injected rates 3:1 and 3:1:2), written by hand.
BATCHES = {2: [3, 1], 3: [3, 1, 2]}

#: Measured 0 (integer counts, summed exactly); a count that disagrees moves a bias by coef = 1e-2.
TOL = 1e-6


def _one(spec) -> tuple[float, float, int, int]:
    ranks = fleet(spec)
    ref = single(spec, BATCHES[spec.world])["rec"]
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
    return worst, moved, len(ref_seq), len(ranks)


def run(cuda: bool = False) -> Record:
    ws = worlds(cuda, 2, 3)
    got = {w: _one(on(LFB_RUNS[w], cuda)) for w in ws}
    passed = all(worst <= TOL and moved > 0 for worst, moved, _, _ in got.values())
    return Record(
        "g11_lfb",
        CLAIM,
        INSTRUMENT,
        "; ".join(
            f"world {w}: max |lfb_bias fleet - single| {fmt(worst)} over {n} steps x {P} "
            f"ranks (the bias reached {moved:.2f})"
            for w, (worst, moved, n, P) in got.items()
        ),
        f"<= {fmt(TOL)} (the bias moves in steps of the coefficient 1e-2; counts are exact integers)",
        passed,
        fleet_env(cuda, ws),
    )
