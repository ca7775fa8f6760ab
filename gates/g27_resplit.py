"""Gate 27: a fleet whose split changes while it trains still trains one process's trajectory,
and resumes exactly across a re-split."""

from __future__ import annotations

import dataclasses

from gates.compare import fmt, max_abs_diff, max_rel_diff
from gates.fixtures import FleetSpec, worlds
from gates.g01_trajectory import TOL_GRAD, TOL_LOSS
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("a split that changes mid-run (forced re-splits, unequal shares) reproduces one process "
         "at the global batch, and a resume across a re-split continues the run exactly")  # fmt: skip
INSTRUMENT = ("tiny, constant lr, no clip, 12 steps: world 2 split 3,1 -> 1,3 at step 4 -> 2,2 "
              "at step 8; world 3 3,1,2 -> 1,2,3 -> 2,3,1 (rebalance_at) vs one process at "
              "batch 4 / 6: max |dloss| and every pre-clip norm; then the same fleet stopped at "
              "step 6 (inside the second split) and resumed to 12 vs the uninterrupted fleet: "
              "losses of steps 7-12 and the final parameters (bit for bit at world 2)")  # fmt: skip

#: (capacity at start, forced re-splits) per world
PLANS = {2: ("3,1", "4:1,3;8:2,2"), 3: ("3,1,2", "4:1,2,3;8:2,3,1")}
_BASE = ("schedule=constant",)


def specs(world: int) -> tuple[FleetSpec, FleetSpec]:
    cap, plan = PLANS[world]
    whole = FleetSpec(f"resplit{world}", world=world, steps=12, capacity=cap,
                      sets=_BASE + (f"rebalance_at={plan}",))  # fmt: skip
    return whole, dataclasses.replace(
        whole, name=f"resplit{world}-resume", steps=6, resume_steps=12
    )


def _one(world: int) -> tuple[bool, str]:
    whole, stopped = specs(world)
    ranks = fleet(whole)
    got = ranks[0]["rec"]
    total = sum(int(b) for b in whole.capacity.split(","))
    # the reference never sees the fleet's knobs: one process at the global batch
    ref = single(dataclasses.replace(whole, sets=_BASE, capacity=""), [total])["rec"]
    dloss = max_abs_diff(got["losses"], ref["losses"])
    norms = max_rel_diff(got["gnorms"], ref["gnorms"])
    switched = [ln for ln in ranks[0]["lines"] if ln.startswith("rebalance step=")]
    last = PLANS[world][1].split(";")[-1].split(":")[1]
    final = ",".join(s.split("x")[0] for s in ranks[0]["shapes"])
    again = fleet(stopped)
    cont = again[0]["resumed"]["rec"]
    joined = again[0]["rec"]["losses"] + cont["losses"]
    exact_loss = joined == got["losses"]
    exact_end = all(r["resumed"]["rec"]["final_fingerprint"] == w["rec"]["final_fingerprint"]
                    for r, w in zip(again, ranks))  # fmt: skip
    resumed_split = any(
        "resume: the checkpoint's split" in ln for ln in again[0]["resumed"]["lines"]
    )
    if world == 2:
        resumed_ok, how = (
            exact_loss and exact_end,
            (
                f"losses {'identical' if exact_loss else 'DIFFER'}, final parameters "
                f"{'identical' if exact_end else 'DIFFER'}"
            ),
        )
    else:
        d = max_abs_diff(joined, got["losses"])
        resumed_ok, how = d <= TOL_LOSS, f"max |dloss| {fmt(d)} vs the uninterrupted fleet"
    ok = (
        len(got["losses"]) == whole.steps
        and dloss <= TOL_LOSS
        and norms <= TOL_GRAD
        and len(switched) == 2
        and final == last
        and resumed_split
        and resumed_ok
    )
    text = (
        f"world {world} ({whole.capacity} -> {PLANS[world][1]}): {len(switched)} re-splits, "
        f"final split {final}; max |dloss| {fmt(dloss)}, norms max rel {fmt(norms)}; resume "
        f"at step 6: {how} (split restored from the checkpoint: "
        f"{'yes' if resumed_split else 'NO'})"
    )
    return ok, text


def run(cuda: bool = False) -> Record:
    ws = worlds(cuda, 2, 3)
    results = [_one(w) for w in ws]
    return Record(
        "g27_resplit",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t in results),
        f"|dloss| <= {fmt(TOL_LOSS)}, norms <= {fmt(TOL_GRAD)} (gate 1's: fp32 round-off of "
        f"another summation order; a split changes only which rank sums which windows); the "
        f"resume bit for bit at world 2 (the same split at every step, the same arithmetic); at "
        f"world 3 within |dloss| <= {fmt(TOL_LOSS)}: after any restart DDP rebuilds its buckets "
        f"in another order and gloo's 3-rank ring sums in another order (measured: the same "
        f"without a re-split; a sum of 2 commutes)",
        bool(results) and all(ok for ok, _ in results),
        fleet_env(cuda, ws),
    )
