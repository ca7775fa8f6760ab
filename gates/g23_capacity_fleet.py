"""Gate 23: the capacity-padded MoE trains on a fleet exactly as in one process (its drop rule
is per row, so splitting the global batch across ranks cannot change a drop)."""

from __future__ import annotations

from gates.compare import SPREAD_K, fmt, judge, max_abs_diff, max_rel_diff, rel_err
from gates.fixtures import FleetSpec, batches_of, on, worlds
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("capacity-padded MoE on a fleet: the trajectory and the gradient equal one process at "
         "the global batch, with assignments actually dropped")  # fmt: skip
INSTRUMENT = ("tiny, moe_capacity=1.0 and 0.5, DDP, capacity 3,1 (world 2) and 3,1,2 (world 3), "
              "10 steps, no clip, vs one process at the global batch: max |dloss|, the step-1 "
              "reduced gradient, every pre-clip norm; the number of assignments the first batch "
              "drops (it must be > 0, else capacity proves nothing)")  # fmt: skip

RUNS = [FleetSpec(f"capfleet-{cap}-w{len(b.split(','))}", world=len(b.split(",")), steps=10,
                  capacity=b, sets=(f"moe_capacity={cap}",))
        for cap in ("1.0", "0.5") for b in ("3,1", "3,1,2")]  # fmt: skip
#: Gate 1's figures, worst of 4 runs: dloss 8.7e-7, gradient 4.9e-7, norms 2.5e-7; 4-6x each.
TOL = {"dloss": 5e-6, "gradient": 2e-6, "norms": 1e-6}


def _drops(spec, inputs) -> int:
    import torch

    from gates.cache import work_dir
    from gates.fixtures import fixture_run
    from references.single import build_model

    model = build_model(fixture_run(spec, work_dir("capdrops"), dist=False))
    with torch.no_grad():
        _, _, aux = model(torch.as_tensor(inputs[0]).long())
    d = aux.get("dropped")
    return int(d.sum()) if torch.is_tensor(d) else int(d or 0)


def _one(spec, cuda: bool) -> tuple[bool, str]:
    ranks = fleet(spec)
    ref_run = single(spec, batches_of(spec))
    ref, got = ref_run["rec"], ranks[0]["rec"]

    def measure(a: dict, b: dict) -> dict[str, float]:
        return {
            "dloss": max_abs_diff(a["losses"], b["losses"]),
            "gradient": rel_err(a["grads"][0], b["grads"][0]),
            "norms": max_rel_diff(a["gnorms"], b["gnorms"]),
        }

    spread = measure(single(spec, batches_of(spec), split_rows=True)["rec"], ref) if cuda else {}
    close, text, tol = judge(cuda, measure(got, ref), TOL, spread)
    drops = _drops(spec, ref_run["inputs"])
    return close and drops > 0, (
        f"{spec.name}: {text}; the first batch drops {drops} "
        f"assignments" + (f" [{tol}]" if cuda else "")
    )


def run(cuda: bool = False) -> Record:
    runs = [on(s, cuda) for s in RUNS if s.world in worlds(cuda, 2, 3)]
    results = [_one(s, cuda) for s in runs]
    return Record(
        "g23_capacity_fleet",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t in results),
        ", ".join(f"{k} <= {fmt(v)}" for k, v in TOL.items())
        + " (fp32 round-off"
        + (f"; on CUDA at least {SPREAD_K:g}x the reference's spread)" if cuda else ")")
        + "; drops > 0",
        all(ok for ok, _ in results),
        fleet_env(cuda, tuple(sorted({s.world for s in runs}))),
    )
