"""Gate 31: compile=true on a DDP fleet and on an FSDP2 fleet trains the eager single process's
trajectory.

torch.compile of the DDP module (dynamo splits the graph at DDP's buckets, so each bucket's
all-reduce still starts while the backward runs) and of the FSDP2-sharded model (FSDP2's
all-gather and reduce-scatter hooks run between the compiled pieces) must change nothing but
round-off: every rank compiled, unequal shares, and accumulation. The reference is the eager
one-process run of the same windows, never compiled.

On the CPU the fleets compile with compile_backend=aot_eager: dynamo's graphs, DDP's graph
split, FSDP2's hooks and AOTAutograd's forward/backward partition exactly as inductor receives
them, run by eager kernels. Inductor's C++ code generation for the same fixture took 183 s of
the gate's 3-minute budget on the 2-core CI box (42 s with aot_eager); inductor's own kernels
are held to eager on one process by tests/test_compile.py (measured 4.8e-7), and on a CUDA
fleet (`--cuda-fleet`) the gate runs inductor.
"""

from __future__ import annotations

import dataclasses

from gates.compare import fmt, max_abs_diff, max_rel_diff, rel_err
from gates.fixtures import FleetSpec, on
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("compile=true on a DDP fleet and on an FSDP2 fleet (compile_mode=default) reproduces "
         "the eager single process at the global batch, with unequal shares and with "
         "accumulation")  # fmt: skip
INSTRUMENT = ("tiny, compile=true (CPU: compile_backend=aot_eager; CUDA: inductor), DDP and "
              "dist_shard=fsdp (Muon on the shards), 6 steps, no clip, global_batch=8 as 3 "
              "windows x 2 micro-batches on rank 0 and 1 x 2 on rank 1 (unequal shares, "
              "accumulation through the compiled wrapper) vs one eager process at batch 8: max "
              "|dloss|, the step-1 reduced gradient, every pre-clip norm; dynamo's compiled "
              "graphs counted on every rank (0 would mean nothing was compiled)")  # fmt: skip

_COMPILE = ("compile=true", "compile_backend=aot_eager", "global_batch=8")
#: Each fleet run compiles on every rank. Equal micro-batch counts on both ranks, as DDP's
#: no_sync needs. (A no_sync lost on the compiled wrapper would cost an extra all-reduce, not
#: a wrong sum: DDP averages, and the average of an already averaged gradient plus the next
#: micro-batch's is the same mean.)
RUNS = [FleetSpec("compile-ddp-3x2+1x2", world=2, steps=6, capacity="3*2,1*2", batch=4,
                  sets=_COMPILE),
        FleetSpec("compile-fsdp-3x2+1x2", world=2, steps=6, capacity="3*2,1*2", batch=4,
                  sets=(*_COMPILE, "dist_shard=fsdp"))]  # fmt: skip
#: Gate 1's: measured 9.5e-7, 1.1e-7, 1.4e-7 (aot_eager; DDP, FSDP2 alike); 5x, 18x, 7x. Twice: 1.
TOL = {"dloss": 5e-6, "gradient": 2e-6, "norms": 1e-6}


def _eager(spec: FleetSpec) -> FleetSpec:
    """The same fixture without compile: the reference's config."""
    return dataclasses.replace(
        spec, sets=tuple(s for s in spec.sets if not s.startswith("compile"))
    )


def _one(spec: FleetSpec, cuda: bool) -> tuple[bool, str]:
    if cuda:  # inductor on the cards: what a user's compile=true runs
        spec = dataclasses.replace(
            spec, sets=tuple(s for s in spec.sets if s != "compile_backend=aot_eager")
        )
    ranks = fleet(spec)
    got = ranks[0]["rec"]
    ref = single(_eager(spec), [8])["rec"]
    graphs = [r.get("graphs", 0) for r in ranks]
    m = {"dloss": max_abs_diff(got["losses"], ref["losses"]),
         "gradient": rel_err(got["grads"][0], ref["grads"][0]),
         "norms": max_rel_diff(got["gnorms"], ref["gnorms"])}  # fmt: skip
    ok = (all(m[k] <= TOL[k] for k in TOL) and len(got["losses"]) == spec.steps
          and min(graphs) >= 1)  # fmt: skip
    return ok, (f"{spec.name}: {len(got['losses'])} steps, graphs compiled per rank {graphs}, "
                f"dloss {fmt(m['dloss'])}, gradient {fmt(m['gradient'])}, norms "
                f"{fmt(m['norms'])}")  # fmt: skip


def run(cuda: bool = False) -> Record:
    results = [_one(on(s, cuda), cuda) for s in RUNS]
    return Record(
        "g31_compile_fleet",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t in results),
        ", ".join(f"{k} <= {fmt(v)}" for k, v in TOL.items()) + " (fp32 round-off; inductor's "
        "fused kernels measured 4.8e-7 against eager); >= 1 compiled graph on every rank",
        all(ok for ok, _ in results),
        fleet_env(cuda, (2,)),
    )
