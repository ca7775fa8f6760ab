"""Gate 8: only rank 0 writes files and logs the run; other ranks print their own two lines."""

from __future__ import annotations

from pathlib import Path

from gates.fixtures import DDP_RUN, on
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = "rank-0 duties: only rank 0 writes checkpoints, metrics and eval lines"
INSTRUMENT = ("the DDP run of gate 1 with a separate out_dir per rank, eval and checkpoint every "
              "10 steps: files under each rank's out_dir, each rank's log lines")  # fmt: skip


def run(cuda: bool = False) -> Record:
    spec = on(DDP_RUN, cuda)
    ranks = fleet(spec)
    P = len(ranks)
    files = [sorted(p.name for p in Path(r["run_dir"]).glob("*")) if Path(r["run_dir"]).exists()
             else [] for r in ranks]  # fmt: skip
    need = {"ckpt.pt", "metrics.jsonl", "config.json"}
    main_ok = need <= set(files[0])
    others_ok = all(not f for f in files[1:])
    evals = [line for line in ranks[0]["lines"] if line.startswith("eval ")]
    evals_ok = len(evals) >= 2 and all(f"dist=0/{P}" in line for line in evals)
    steps = sum(1 for line in ranks[0]["lines"] if line.startswith("step="))
    # each card speaks for itself (issue #19): its dist line and its card line, nothing more
    quiet = all(len(r["lines"]) == 2 and r["lines"][0].startswith(f"dist rank={i}/{P} ")
                and r["lines"][1].startswith(f"rank {i}: card=")
                for i, r in enumerate(ranks[1:], start=1))  # fmt: skip
    announce = sum(line.startswith(f"dist rank=0/{P} ") for line in ranks[0]["lines"]) == 1
    passed = main_ok and others_ok and evals_ok and quiet and announce and steps == spec.steps
    return Record(
        "g08_rank0",
        CLAIM,
        INSTRUMENT,
        f"rank 0 wrote {files[0]}; ranks 1..{P - 1} wrote {sum(len(f) for f in files[1:])} file(s); "
        f"{len(evals)} eval lines, all tagged dist=0/{P}: {evals_ok}; rank 0 logged {steps} "
        f"step lines; other ranks printed only their dist and card lines: {quiet}",
        "rank 0: ckpt + metrics + config, every eval line tagged; other ranks: no file, two lines "
        "(the dist line and the card's own line)",
        passed,
        fleet_env(cuda),
    )
