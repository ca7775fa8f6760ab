"""Gate 24: FSDP2 runs the project's own optimizer: Muon on sharded parameters, and the host-RAM
Engram tables (engram_ram) beside them, reproduce one process at the global batch.

Muon under FSDP2 (`dormouse.train.optim.muon`) updates its momentum on each rank's shard, all-gathers
each shape group's whole matrices for the polar, and applies each rank's own rows. The
fixture's `tiny` preset shards evenly at world 2 (every dim 0 is even) and unevenly at world 3:
every dim 0 of 64 splits 22, 22, 20 and of 8 (f_down, the deltas' A) 3, 3, 2, and the router
[4, 64], b_proj [4, 64], expert stacks [4, 64, 128] / [4, 128, 64] and the Engram table
[4, 64, 8] split 2, 2, 0, so rank 2 holds empty shards and still takes part in every group's
all-gather (a hang there fails the fleet, and the gate). Capacity is unequal (3,1 and 3,1,2),
so each rank's gradient carries the loss-scale weighting. The tolerances were measured over
seeds 7-11 (torch 2.13, CPU/gloo), where DDP at the same split measures the same figures: at
world 3 the first polar magnifies the gradient's round-off along its smallest singular
directions (the update is the noisy figure), and a polar of a rank's own rows moves it by O(1).
"""

from __future__ import annotations

from gates.compare import SPREAD_K, fmt, judge, max_abs_diff, tol_on
from gates.fixtures import FleetSpec, on, worlds
from gates.g01_trajectory import FP32_TOL, measure
from gates.g14_engram_ram_fleet import ENGRAM_SETS
from gates.g14_engram_ram_fleet import _one as engram_one
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("FSDP2 + Muon (opt=mix) and FSDP2 + engram_ram reproduce one process at the global "
         "batch; gathered parameters and host tables identical across ranks")  # fmt: skip
INSTRUMENT = ("tiny, dist_shard=fsdp, opt=mix, capacity 3,1 / 3,1,2 (world 2, 3) vs one process "
              "at the global batch, 20 steps, ns_dtype=fp32, no clip: gate 1's figures (max "
              "|dloss|, step-1 gradient, parameters and update, every step's pre-clip norm) and "
              "SHA-256 of the gathered parameters on each rank after every step; the same with "
              "engram_ram=true, 16 steps: gate 14's figures (loss, norms with the host rows, "
              "host table and its update) and SHA-256 of each rank's host table after every "
              "step; ns_dtype=bf16 at world 2: max |dloss|")  # fmt: skip

_FSDP = ("dist_shard=fsdp",)
MUON_RUNS = {w: FleetSpec(f"fsdp_muon{w}", world=w, steps=20, capacity=cap, sets=_FSDP)
             for w, cap in ((2, "3,1"), (3, "3,1,2"))}  # fmt: skip
#: Gate 14's fixture and tolerances: FSDP2 measured table 3.9e-7, update 1.5e-6 (w3), as DDP.
RAM_RUNS = {w: FleetSpec(f"fsdp_ram{w}", world=w, steps=16, capacity=cap,
                         sets=_FSDP + ENGRAM_SETS)
            for w, cap in ((2, "3,1"), (3, "3,1,2"))}  # fmt: skip
BF16_RUN = FleetSpec("fsdp_muon_bf16", steps=20, capacity="3,1", sets=_FSDP + ("ns_dtype=bf16",))

#: w2: gate 1's. w3: 4x DDP's worst (gradient 5.0e-7, params 1.2e-7, update 3.4e-5); FSDP2 alike.
MUON_TOL = {2: FP32_TOL, 3: {**FP32_TOL, "gradient": 2e-6, "params": 5e-7, "update": 1.5e-4}}
#: bf16 polar vs one process's, w2: max |dloss| measured <= 1.9e-4 (DDP: the same bits); ~5x.
TOL_BF16_LOSS = 1e-3


def _muon(spec: FleetSpec, cuda: bool) -> tuple[bool, str, dict]:
    ranks = fleet(spec)
    ref = single(spec)["rec"]
    got = ranks[0]["rec"]
    spread = measure(single(spec, split_rows=True)["rec"], ref) if cuda else {}
    close, figures, tol = judge(cuda, measure(got, ref), MUON_TOL[spec.world], spread)
    seqs = [r["rec"]["fingerprints"] + [r["rec"]["final_fingerprint"]] for r in ranks]
    states = len(seqs[0])
    differ = [k for k in range(states) if len({s[k] for s in seqs}) != 1]
    moved = seqs[0][0] != seqs[0][-1]
    ok = (close and moved and not differ and states == spec.steps + 1
          and len(got["losses"]) == spec.steps)  # fmt: skip
    text = (
        f"Muon world {spec.world}: {figures}; {states - len(differ)}/{states} gathered "
        f"states identical" + (f" [{tol}]" if cuda else "")
    )
    return ok, text, {"fleet_losses": got["losses"], "ref_losses": ref["losses"]}


def _bf16(cuda: bool) -> tuple[bool, str, dict]:
    spec = on(BF16_RUN, cuda)
    got = fleet(spec)[0]["rec"]
    ref = single(spec)["rec"]
    spread = (max_abs_diff(single(spec, split_rows=True)["rec"]["losses"], ref["losses"])
              if cuda else 0.0)  # fmt: skip
    d = max_abs_diff(got["losses"], ref["losses"])
    ok = len(got["losses"]) == spec.steps and d <= tol_on(cuda, TOL_BF16_LOSS, spread)
    return (
        ok,
        f"bf16 polar world 2: max |dloss| {fmt(d)}",
        {"fleet_losses": got["losses"], "ref_losses": ref["losses"]},
    )


def _tol_text(tol: dict[str, float]) -> str:
    return ", ".join(f"{k} <= {fmt(v)}" for k, v in tol.items())


def run(cuda: bool = False) -> Record:
    ws = worlds(cuda, 2, 3)
    results = [_muon(on(MUON_RUNS[w], cuda), cuda) for w in ws]
    results += [engram_one(on(RAM_RUNS[w], cuda), cuda) for w in ws]
    results.append(_bf16(cuda))
    return Record(
        "g24_fsdp_muon",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t, _ in results),
        f"Muon world 2: gate 1's ({_tol_text(MUON_TOL[2])})"
        + (f"; world 3: {_tol_text(MUON_TOL[3])} (4x DDP's own round-off there)" if 3 in ws else "")
        + f"; engram_ram: gate 14's; bf16 polar |dloss| <= {fmt(TOL_BF16_LOSS)}; SHA-256 equal"
        + (f" (on CUDA at least {SPREAD_K:g}x the reference's spread)" if cuda else ""),
        all(ok for ok, _, _ in results),
        fleet_env(cuda, ws),
        details={f"run{i}": d for i, (_, _, d) in enumerate(results)},
    )
