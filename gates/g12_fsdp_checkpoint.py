"""Gate 12: an FSDP2 run's sharded checkpoint resumes on the fleet, and its export to one file
reloads and resumes in one process."""

from __future__ import annotations

from pathlib import Path

from gates.compare import SPREAD_K, flat_tensors, judge, max_abs_diff, rel_err, update_rel_err
from gates.fixtures import FSDP_RUN, on
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("FSDP2 checkpoint: the sharded checkpoint resumes on the fleet; its export (one file) "
         "reloads in one process and resumes there")  # fmt: skip
INSTRUMENT = ("the FSDP2 + AdamW run of gate 4: its step-20 checkpoint exported and loaded in one process (SHA-256 vs "
              "the fleet's gathered parameters), then resumed to step 25 by the fleet and by one "
              "process: max |dloss| over steps 21-25; the parameter update over those 5 steps "
              "and the gathered optimizer state at step 25 (relative errors)")  # fmt: skip

#: |dloss| of the two resumes over 5 steps: measured 4.8e-7 (1 ulp); gate 4's. Lost state: 1e-3.
TOL_LOSS = 5e-6
#: 5-step update and step-25 Adam moments, relative: measured 3.7e-7, 4.3e-10; ~4x. 1% off: 9.8e-4.
TOL_UPDATE = 1.5e-6
TOL_OPT = 2e-9


def run(cuda: bool = False) -> Record:
    from dormouse.model import DormouseModel
    from dormouse.train.store.checkpoint import load_model, read_checkpoint
    from references.fingerprint import fingerprint

    spec = on(FSDP_RUN, cuda)
    ranks = fleet(spec)
    first = Path(ranks[0]["out"]) / "first.pt"
    ck = read_checkpoint(first)  # weights_only=True: plain tensors only, no DTensor
    model = DormouseModel(ck["run"].model)
    load_model(model, ck, first)
    same = fingerprint(model) == ranks[0]["rec"]["final_fingerprint"]
    plain = all(not hasattr(v, "placements") for v in ck["model"].values())
    resumed = ranks[0]["resumed"]["rec"]
    ref = single(spec, resume_from=str(first), steps=spec.resume_steps)["rec"]
    n = spec.resume_steps - spec.steps
    ranks_same = len({r["resumed"]["rec"]["final_fingerprint"] for r in ranks}) == 1

    def measure(a: dict, b: dict) -> dict[str, float]:
        return {"dloss": max_abs_diff(a["losses"], b["losses"]),
                "update": update_rel_err(a["final_params"], b["final_params"], ref["params"][0]),
                "optimizer state": rel_err(flat_tensors(a["final_opt"]),
                                           flat_tensors(b["final_opt"]))}  # fmt: skip

    spread = (measure(single(spec, resume_from=str(first), steps=spec.resume_steps,
                             split_rows=True)["rec"], ref) if cuda else {})  # fmt: skip
    close, figures, tol = judge(
        cuda,
        measure(resumed, ref),
        {"dloss": TOL_LOSS, "update": TOL_UPDATE, "optimizer state": TOL_OPT},
        spread,
    )
    passed = same and plain and len(resumed["losses"]) == n and ranks_same and close
    return Record(
        "g12_fsdp_checkpoint",
        CLAIM,
        INSTRUMENT,
        f"one-process reload == fleet's gathered parameters: {same}; {len(resumed['losses'])} "
        f"resumed steps, fleet vs one process: {figures}; ranks identical after the resume: "
        f"{ranks_same}",
        f"bitwise reload; {tol} (fp32 round-off"
        + (f"; on CUDA at least {SPREAD_K:g}x the reference's spread)" if cuda else ")"),
        passed,
        fleet_env(cuda),
    )
