"""Gate 29: with dropout on, over several passes of a small corpus, a fleet is one process."""

from __future__ import annotations

from gates.compare import fmt, max_abs_diff, max_rel_diff
from gates.fixtures import FleetSpec, batches_of, corpus_path, on, worlds
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("dropout masks and each pass's random phase are the fleet's, not a rank's: with "
         "dropout 0.3 over 3.4 passes of a short corpus, the fleet reads the single process's "
         "bytes and follows its trajectory")  # fmt: skip
INSTRUMENT = ("tiny, dropout 0.3, a 3,000-byte corpus (7 blocks a pass: every pass starts at its "
              "own phase, a window crossing the seam), 24 steps at capacity 4,2 (world 2) and "
              "3,1,2 (world 3), no clip: the input bytes of every forward on every rank in rank "
              "order vs one process at the global batch; max |dloss| and the pre-clip gradient "
              "norms' max relative error; the same single run with dropout 0 as the distance a "
              "mask bug would have to hide in")  # fmt: skip

#: g01's: measured |dloss| 9.5e-7, norms 2.6e-7 (w3); ~5x, ~4x. Masks keyed per rank: 3e-2.
TOL_LOSS = 5e-6
TOL_NORM = 1e-6
#: The dropout-0 run must sit far outside the tolerance, or the gate could not see a mask bug.
MIN_SEPARATION = 1e-3
SHORT_BYTES = 3000


def short_corpus():
    where = corpus_path().with_name("corpus-short.txt")
    body = corpus_path().read_bytes()[:SHORT_BYTES]
    if not where.exists() or where.read_bytes() != body:
        tmp = where.with_suffix(".tmp")
        tmp.write_bytes(body)
        tmp.replace(where)
    return where


def _spec(world: int) -> FleetSpec:
    cap = {2: "4,2", 3: "3,1,2"}[world]
    return FleetSpec(f"dropout{world}", world=world, steps=24, capacity=cap,
                     sets=(f"data={short_corpus()}", "val_frac=0", "dropout=0.3"))  # fmt: skip


def _one(spec: FleetSpec) -> tuple[bool, str, dict]:
    import dataclasses

    import numpy as np

    ranks = fleet(spec)
    ref = single(spec, batches_of(spec))
    plain = single(
        dataclasses.replace(spec, name=spec.name + "-nodrop", sets=spec.sets[:-1] + ("dropout=0",)),
        batches_of(spec),
    )
    want = ref["inputs"]
    got = [np.concatenate([r["inputs"][k] for r in ranks]) for k in range(len(ranks[0]["inputs"]))]
    same = sum(bool(len(g) == len(w) and (g == w).all()) for g, w in zip(got, want))
    rec, r = ranks[0]["rec"], ref["rec"]
    m = {
        "dloss": max_abs_diff(rec["losses"], r["losses"]),
        "norms": max_rel_diff(rec["gnorms"], r["gnorms"]),
    }
    sep = max_abs_diff(plain["rec"]["losses"], r["losses"])
    ok = (len(want) == spec.steps and same == spec.steps and m["dloss"] <= TOL_LOSS
          and m["norms"] <= TOL_NORM and sep >= MIN_SEPARATION)  # fmt: skip
    text = (
        f"world {spec.world} ({','.join(ranks[0]['shapes'])}): {same}/{len(want)} steps "
        f"byte-identical; max |dloss| {fmt(m['dloss'])}, norms max rel {fmt(m['norms'])}; "
        f"dropout 0 is {fmt(sep)} away"
    )
    return ok, text, m


def run(cuda: bool = False) -> Record:
    ws = worlds(cuda, 2, 3)
    results = [_one(on(_spec(w), cuda)) for w in ws]
    return Record(
        "g29_dropout",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t, _ in results),
        f"every step byte-identical; |dloss| <= {fmt(TOL_LOSS)}, norms <= {fmt(TOL_NORM)} "
        f"(g01's fp32 round-off of a different summation order); dropout 0 >= "
        f"{fmt(MIN_SEPARATION)} away",
        all(ok for ok, _, _ in results),
        fleet_env(cuda, tuple(ws)),
        details={f"world{w}": m for w, (_, _, m) in zip(ws, results)},
    )
