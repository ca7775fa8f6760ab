"""Gate 2: the ranks of a DDP fleet hold identical parameters after every step."""

from __future__ import annotations

from gates.harness import DDP_RUN, Record, fleet, fleet_env, on

CLAIM = "ranks stay identical"
INSTRUMENT = "SHA-256 of every parameter on each rank, before step 1, after every step (DDP run of gate 1)"


def run(cuda: bool = False) -> Record:
    spec = on(DDP_RUN, cuda)
    ranks = fleet(spec)
    seqs = [r["rec"]["fingerprints"] + [r["rec"]["final_fingerprint"]] for r in ranks]
    states = len(seqs[0])
    differ = [k for k in range(states) if len({s[k] if k < len(s) else None for s in seqs}) != 1]
    # A model that never moved would be "identical" trivially: the run must change it.
    moved = seqs[0][0] != seqs[0][-1]
    passed = states == spec.steps + 1 and not differ and moved and all(len(s) == states for s in seqs)
    return Record(
        "g02_identical", CLAIM, INSTRUMENT,
        f"{states - len(differ)}/{states} states identical on {len(ranks)} ranks"
        + (f" (first difference after step {differ[0]})" if differ else "")
        + ("" if moved else "; the parameters never changed"),
        "every state identical (bitwise: one reducer result, the same optimizer)",
        passed, fleet_env(cuda),
    )
