"""Gate 15: SIGTERM on one rank stops the whole fleet on one step, and the resume is exact."""

from __future__ import annotations

from pathlib import Path

from gates.compare import fmt, max_abs_diff
from gates.fixtures import SIGNAL_RUNS, on, worlds
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("a SIGTERM reaching one rank mid-step stops every rank after the same step with one "
         "checkpoint; the fleet resumes it onto the uninterrupted trajectory")  # fmt: skip
INSTRUMENT = ("tiny, 2 windows per rank, 20 steps, world 2 and 3; the last rank signals itself "
              "inside step 4's forward: steps each rank took, the checkpoint's step, rank 0's "
              "stop line; then the fleet resumes to 20: max |dloss| over all 20 steps vs one "
              "process at the global batch")  # fmt: skip

#: The ranks agree on a stop every 10 steps (one small all-reduce), so a signal during step 4
#: must stop both after step 10, not 4 (only rank 1 saw it) and not 20 (the stop was lost).
STOP_AT = 10
#: Gate 1's: ~2 ulp of fp32 summation order, ~4x. A resume that lost any state: >= 1e-3.
TOL_LOSS = 5e-6


def _one(spec) -> tuple[bool, str]:
    from dormouse.train.store.checkpoint import read_checkpoint

    ranks = fleet(spec)
    ref = single(spec)["rec"]
    first = Path(ranks[0]["out"]) / "first.pt"
    saved_step = read_checkpoint(first)["step"]
    took = [len(r["rec"]["decisions"]) for r in ranks]
    stopped = [r["stopped"] for r in ranks]
    said = [ln for ln in ranks[0]["lines"] if ln.startswith("stop requested")]
    said_ok = bool(said) and f"at step {STOP_AT}:" in said[0] and "another rank" in said[0]
    losses = ranks[0]["rec"]["losses"] + ranks[0]["resumed"]["rec"]["losses"]
    dloss = (
        max_abs_diff(losses, ref["losses"]) if len(losses) == len(ref["losses"]) else float("inf")
    )
    same_end = len({r["resumed"]["rec"]["final_fingerprint"] for r in ranks}) == 1
    ok = (all(stopped) and took == [STOP_AT] * spec.world and saved_step == STOP_AT
          and said_ok and dloss <= TOL_LOSS and same_end)  # fmt: skip
    return ok, (
        f"world {spec.world} (signal on rank {spec.signal_rank}): stopped {stopped}, steps "
        f"taken per rank {took}, checkpoint step {saved_step}, rank 0 said "
        f"{said[0] if said else 'nothing'!r}; {len(losses)} steps with the resume, max "
        f"|dloss| vs one process {fmt(dloss)}; ranks identical at the end: {same_end}"
    )


def run(cuda: bool = False) -> Record:
    ws = worlds(cuda, 2, 3)
    results = [_one(on(SIGNAL_RUNS[w], cuda)) for w in ws]
    return Record(
        "g15_signal_stop",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t in results),
        f"every rank stops after step {STOP_AT}; |dloss| <= {fmt(TOL_LOSS)} (gate 1's fp32 "
        f"round-off)",
        all(ok for ok, _ in results),
        fleet_env(cuda, ws),
    )
