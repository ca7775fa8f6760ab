"""Gate 12: an FSDP2 run writes ONE checkpoint file that one process and the fleet both resume."""

from __future__ import annotations

from pathlib import Path

from gates.harness import FSDP_RUN, Record, fleet, fleet_env, fmt, max_abs_diff, on, single

CLAIM = "FSDP2 checkpoint: one file (rank 0) that reloads in one process and resumes on the fleet"
INSTRUMENT = ("the FSDP2 + AdamW run of gate 4: its step-20 file loaded in one process (SHA-256 vs "
              "the fleet's gathered parameters), then resumed to step 25 by the fleet and by one "
              "process: max |dloss| over steps 21-25")  # fmt: skip

#: The two resumes start from the same file; they then differ by fp32 round-off of the
#: summation order (gate 4's numerics over 5 steps), measured 4.8e-7 (1 ulp). Gate 4's
#: tolerance; a resume that lost the optimizer moments or the data position is >= 1e-3 off.
TOL_LOSS = 5e-6


def run(cuda: bool = False) -> Record:
    from dormouse.model import DormouseModel
    from dormouse.train.checkpoint import load_model_state, read_checkpoint
    from references.fingerprint import fingerprint

    spec = on(FSDP_RUN, cuda)
    ranks = fleet(spec)
    first = Path(ranks[0]["out"]) / "first.pt"
    ck = read_checkpoint(first)  # weights_only=True: plain tensors only, no DTensor
    model = DormouseModel(ck["run"].model)
    load_model_state(model, ck, first)
    same = fingerprint(model) == ranks[0]["rec"]["final_fingerprint"]
    plain = all(not hasattr(v, "placements") for v in ck["model"].values())
    resumed = ranks[0]["resumed"]["rec"]
    ref = single(spec, resume_from=str(first), steps=spec.resume_steps)["rec"]
    n = spec.resume_steps - spec.steps
    dloss = max_abs_diff(resumed["losses"], ref["losses"])
    ranks_same = len({r["resumed"]["rec"]["final_fingerprint"] for r in ranks}) == 1
    passed = same and plain and len(resumed["losses"]) == n and dloss <= TOL_LOSS and ranks_same
    return Record(
        "g12_fsdp_checkpoint", CLAIM, INSTRUMENT,
        f"one-process reload == fleet's gathered parameters: {same}; {len(resumed['losses'])} "
        f"resumed steps, max |dloss| fleet vs one process {fmt(dloss)}; ranks identical after "
        f"the resume: {ranks_same}",
        f"bitwise reload; |dloss| <= {fmt(TOL_LOSS)} (fp32 round-off)",
        passed, fleet_env(cuda),
    )
