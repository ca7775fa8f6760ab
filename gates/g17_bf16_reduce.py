"""Gate 17: the bf16 gradient reduce (what dist_reduce=auto picks on a bf16 GPU fleet) is the
token-weighted mean, off by nothing but bf16's own rounding."""

from __future__ import annotations

import torch

from gates.compare import fmt, rel_err
from gates.fixtures import FleetSpec, on
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("the bf16 reduce (dist_reduce=bf16, the comm hook auto picks on bf16 fleets) gives the "
         "global-batch gradient up to bf16 rounding")  # fmt: skip
INSTRUMENT = ("tiny, fp32 compute, DDP with dist_reduce=bf16, 2x2 windows vs one process at 4 in "
              "fp32, no clip: relative error of the step-1 reduced gradient and pre-clip norm; "
              "the tolerance is measured from the path's own round-off: the reference gradient "
              "sent through a bf16 round trip")  # fmt: skip

BF16_RUN = FleetSpec("bf16-reduce", steps=2, sets=("dist_reduce=bf16",))
#: In bf16 round trips (`unit`, measured): the hook rounds twice (g_r / world, the sum), +1 spare.
UNITS = 3.0


def run(cuda: bool = False) -> Record:
    spec = on(BF16_RUN, cuda)
    ranks = fleet(spec)
    ref = single(spec)["rec"]
    got = ranks[0]["rec"]
    g_ref = ref["grads"][0]
    unit = rel_err({k: v.to(torch.bfloat16).float() for k, v in g_ref.items()}, g_ref)
    g_err = rel_err(got["grads"][0], g_ref)
    n_err = abs(got["gnorms"][0] - ref["gnorms"][0]) / ref["gnorms"][0]
    tol = UNITS * unit
    passed = unit > 0 and g_err <= tol and n_err <= tol and g_err > 0
    return Record(
        "g17_bf16_reduce",
        CLAIM,
        INSTRUMENT,
        f"step-1 gradient rel {fmt(g_err)}, norm rel {fmt(n_err)}; one bf16 round trip of the "
        f"reference gradient costs {fmt(unit)}"
        + ("" if g_err > 0 else "; the fleet gradient is bitwise fp32: the bf16 path never ran"),
        f"<= {UNITS:g} x the round-trip unit = {fmt(tol)} (two bf16 roundings in the hook); and "
        f"> 0 (the bf16 path ran)",
        passed,
        fleet_env(cuda, 2),
    )
