"""Gate 2: the ranks of a DDP fleet hold identical parameters after every step, faults included."""

from __future__ import annotations

from gates.fixtures import DDP_RUN, FAULT_RUNS, on, worlds
from gates.spawn import fleet, rank_errors
from gates.status import Record, fleet_env

CLAIM = "ranks stay identical, also through a step that one rank found non-finite"
INSTRUMENT = ("SHA-256 of every parameter on each rank before step 1 and after every step: the "
              "DDP run of gate 1 (20 steps) and the fault runs of gate 5 (a NaN on one rank, on "
              "two; world 2 and 3); in the fault runs also which steps each rank took")  # fmt: skip


def _identical(spec) -> tuple[bool, str]:
    ranks = fleet(spec, allow_errors=True)
    took = [[agreed for _, agreed in r["rec"].get("decisions", [])] for r in ranks]
    errors = rank_errors(ranks)
    n = min(len(t) for t in took)
    if len({tuple(t[:n]) for t in took}) != 1:
        first = next(i for i in range(n) if len({t[i] for t in took}) != 1)
        return False, (
            f"{spec.name}: the ranks took different steps: step {first + 1} taken "
            f"{[t[first] for t in took]}" + (f"; then {errors[:200]}" if errors else "")
        )
    if errors:
        return False, f"{spec.name}: {errors[:300]}"
    seqs = [r["rec"]["fingerprints"] + [r["rec"]["final_fingerprint"]] for r in ranks]
    states = len(seqs[0])
    differ = [k for k in range(states) if len({s[k] if k < len(s) else None for s in seqs}) != 1]
    # A model that never moved would be "identical" trivially: the run must change it.
    moved = seqs[0][0] != seqs[0][-1]
    ok = states == spec.steps + 1 and not differ and moved and all(len(s) == states for s in seqs)
    return ok, (
        f"{spec.name}: {states - len(differ)}/{states} states identical on {len(ranks)} "
        f"ranks"
        + (f" (first difference after step {differ[0]})" if differ else "")
        + ("" if moved else "; the parameters never changed")
    )


def run(cuda: bool = False) -> Record:
    ws = worlds(cuda, 2, 3)
    specs = [DDP_RUN] + [s for s in FAULT_RUNS if s.world in ws]
    results = [_identical(on(s, cuda)) for s in specs]
    return Record(
        "g02_identical",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t in results),
        "every state identical on every rank (bitwise: one reducer result, one agreed verdict, "
        "the same optimizer); every rank takes the same steps",
        all(ok for ok, _ in results),
        fleet_env(cuda, ws),
    )
