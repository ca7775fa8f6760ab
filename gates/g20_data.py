"""Gate 20: a fleet reads exactly the bytes one process reads, from the same sources."""

from __future__ import annotations

import numpy as np

from gates.fixtures import FleetSpec, batches_of, corpus_path, on, second_corpus_path, worlds
from gates.reference import single
from gates.spawn import fleet
from gates.status import Record, fleet_env

CLAIM = ("the fleet reads the same bytes as one process: at every step the ranks' windows, in "
         "rank order, are the single process's batch, also from a weighted data mixture")  # fmt: skip
INSTRUMENT = ("the input bytes of every training forward on every rank, vs one process at the "
              "global batch: one shuffled corpus at world 3 (capacity 3,1,2, 6 steps) and a "
              "two-corpus mixture (weights 0.7, 0.3) at world 2 (capacity 3,1, 10 steps); the "
              "sources each step drew from")  # fmt: skip


def _runs() -> list[FleetSpec]:
    mix = f"data={corpus_path()},{second_corpus_path()}"
    return [
        FleetSpec("data-stream3", world=3, steps=6, capacity="3,1,2"),
        FleetSpec(
            "data-mixture", world=2, steps=10, capacity="3,1", sets=(mix, "data_weights=0.7,0.3")
        ),
    ]


def _one(spec) -> tuple[bool, str]:
    ranks = fleet(spec)
    ref = single(spec, batches_of(spec))
    want = ref["inputs"]
    got = [np.concatenate([r["inputs"][k] for r in ranks]) for k in range(len(ranks[0]["inputs"]))]
    same = [bool(len(g) == len(w) and (g == w).all()) for g, w in zip(got, want)]
    # which source each step drew from: the second corpus is all lower case, the first has a
    # capital at every sentence start (several in any batch)
    sources = ["B" if not any(65 <= b <= 90 for b in w.reshape(-1)) else "A" for w in want]
    ok = len(got) == len(want) == spec.steps and all(same)
    mixed = "data_weights=0.7,0.3" in spec.sets
    if mixed:
        ok = ok and {"A", "B"} <= set(sources)
    return ok, (
        f"{spec.name} (world {spec.world}, {','.join(ranks[0]['shapes'])}): "
        f"{sum(same)}/{len(want)} steps byte-identical"
        + (f"; sources per step {''.join(sources)}" if mixed else "")
    )


def run(cuda: bool = False) -> Record:
    runs = [on(s, cuda) for s in _runs() if s.world in worlds(cuda, 2, 3)]
    results = [_one(s) for s in runs]
    return Record(
        "g20_data",
        CLAIM,
        INSTRUMENT,
        "; ".join(t for _, t in results),
        "every step byte-identical (exact: a layout is right or wrong); the mixture must draw "
        "from both sources",
        all(ok for ok, _ in results),
        fleet_env(cuda, tuple(sorted({s.world for s in runs}))),
    )
