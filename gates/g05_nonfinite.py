"""Gate 5: a non-finite step on ONE rank makes every rank skip it, together, without a hang."""

from __future__ import annotations

from gates.harness import UNEQUAL_RUN, Record, fleet, fleet_env, on

CLAIM = "non-finite agreement: one rank's NaN makes every rank skip that step"
INSTRUMENT = ("rank 1's loss made NaN at step 2 (its gradient stays finite, so only that rank's "
              "local check disagrees), capacity 4,2, 3 steps: each rank's local and agreed "
              "verdicts, skips, fingerprints after every step, wall time")  # fmt: skip


def run(cuda: bool = False) -> Record:
    spec = on(UNEQUAL_RUN, cuda)
    ranks = fleet(spec)
    k = spec.nan_step
    local = [[d[0] for d in r["rec"]["decisions"]] for r in ranks]
    agreed = [[d[1] for d in r["rec"]["decisions"]] for r in ranks]
    skips = [r["report"]["skips"] for r in ranks]
    seqs = [r["rec"]["fingerprints"] + [r["rec"]["final_fingerprint"]] for r in ranks]
    identical = all(len(set(states)) == 1 for states in zip(*seqs))
    # The injection must have split the ranks' LOCAL verdicts; otherwise agreement proves nothing.
    split = len({loc[k] for loc in local}) > 1
    all_skip = all(not a[k] for a in agreed) and all(all(a[i] for i in range(len(a)) if i != k) for a in agreed)
    frozen = all(s[k] == s[k + 1] for s in seqs)  # the skipped step moved nothing
    passed = split and all_skip and skips == [1] * len(ranks) and identical and frozen
    return Record(
        "g05_nonfinite", CLAIM, INSTRUMENT,
        f"local verdicts at step {k + 1}: {[loc[k] for loc in local]}; agreed: "
        f"{[a[k] for a in agreed]}; skips per rank {skips}; fingerprints identical "
        f"{'at every state' if identical else 'NO'}; skipped step moved nothing: {frozen}; "
        f"{ranks[0]['wall']:.1f} s wall (no hang)",
        "every rank skips exactly the poisoned step; states bitwise identical; finishes within "
        "the spawn deadline",
        passed, fleet_env(cuda),
    )
