"""Gate 6: a CUDA fleet without NCCL is refused loudly; it never falls back to gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gates.cache import work_dir
from gates.fixtures import FleetSpec, fixture_run
from gates.status import Record, environment

#: Not a fleet claim: `python -m gates --cuda-fleet` runs it as it is.
CUDA = False

CLAIM = "NCCL missing on a CUDA fleet: loud refusal, never gloo"
INSTRUMENT = ("choose_backend('cuda', nccl_available=False) and fleet.join on a simulated "
              "2-rank CUDA fleet without NCCL; controls: cuda+NCCL -> nccl, cpu -> gloo")  # fmt: skip


def run(cuda: bool = False) -> Record:
    from dormouse.train.fleet.launch import DistError, choose_backend, join

    notes, ok = [], True
    try:
        got = choose_backend("cuda", nccl_available=False)
        ok = False
        notes.append(f"choose_backend returned {got!r}")
    except DistError as e:
        msg = str(e)
        loud = "NCCL" in msg and "--device cpu" in msg and "gloo" in msg
        ok &= loud
        notes.append(
            f"choose_backend refused ({'names cause and escape' if loud else 'message lacks cause/escape'})"
        )
    run_cfg = fixture_run(FleetSpec("nccl"), work_dir("nccl"), dist=True)
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}  # fmt: skip
    try:
        join(run_cfg, torch.device("cuda", 0), nccl_available=False, env=env)
        ok = False
        notes.append("fleet.join started a fleet")
    except DistError as e:
        ok &= "NCCL" in str(e) and not dist.is_initialized()
        notes.append(
            "fleet.join refused before any process group existed"
            if not dist.is_initialized()
            else "a process group was created"
        )
    controls = (choose_backend("cuda", nccl_available=True), choose_backend("cpu"))
    ok &= controls == ("nccl", "gloo")
    notes.append(f"controls {controls}")
    return Record(
        "g06_nccl",
        CLAIM,
        INSTRUMENT,
        "; ".join(notes),
        "a DistError naming NCCL, the gloo non-fallback and the escape; no process group",
        ok,
        environment("simulated", "cuda"),
    )
