"""The gates as tests: `pytest -m gate` runs every module of gates/ (python -m gates does the same).

One test per gate. The fleet runs behind the gates are shared between tests (and between
pytest-xdist workers) through a cache directory with a file lock, so gates that read the same
run spawn it once per session. `--cuda-fleet` adds the nccl variants (one process per card).
"""

from __future__ import annotations

import pytest

from gates.harness import GATES, load, timed

#: The slowest gates first (45-130 s each on the 2-core box, measured; the rest take 20 s or
#: less): under xdist (`pytest -m gate` runs two workers) each worker starts on one of them,
#: instead of one worker finishing a long gate alone after the other has run out of work.
SLOW_FIRST = ["g31_compile_fleet", "g25_sharded_ckpt", "g24_fsdp_muon", "g22_elastic",
              "g26_accumulation"]  # fmt: skip
ORDER = SLOW_FIRST + [g for g in GATES if g not in SLOW_FIRST]
#: Gates whose claim is about a fleet (they have an nccl, one-process-per-card variant).
CUDA_GATES = [g for g in ORDER if getattr(load(g), "CUDA", True)]


pytestmark = pytest.mark.usefixtures("gate_cache")


def _check(name: str, cuda: bool) -> None:
    rec = timed(name, lambda: load(name).run(cuda=cuda))
    tb = rec.details.get("traceback", "")
    assert rec.passed, f"{rec.summary()}\n{tb}"


@pytest.mark.gate
@pytest.mark.parametrize("name", ORDER)
def test_gate(name):
    _check(name, cuda=False)


@pytest.mark.gate
@pytest.mark.cuda
@pytest.mark.parametrize("name", CUDA_GATES)
def test_gate_cuda_fleet(name):
    _check(name, cuda=True)
