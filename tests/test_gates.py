"""The gates as tests: `pytest -m gate` runs every module of gates/ (python -m gates does the same).

One test per gate. The fleet runs behind the gates are shared between tests (and between
pytest-xdist workers) through a cache directory with a file lock, so gates that read the same
run spawn it once per session. `--cuda-fleet` adds the nccl variants (one process per card).
"""

from __future__ import annotations

import os

import pytest

from gates.harness import GATES, load, timed

#: Gates whose claim is about a fleet (they have an nccl, one-process-per-card variant).
CUDA_GATES = [g for g in GATES if g not in ("g06_nccl", "g07_launch", "g13_policy")]


@pytest.fixture(scope="session", autouse=True)
def _shared_gate_cache(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker has its own basetemp; their parent is shared by the session.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    old = os.environ.get("DORMOUSE_GATE_CACHE")
    os.environ["DORMOUSE_GATE_CACHE"] = str(shared / "dormouse-gates")
    yield
    if old is None:
        os.environ.pop("DORMOUSE_GATE_CACHE", None)
    else:
        os.environ["DORMOUSE_GATE_CACHE"] = old


def _check(name: str, cuda: bool) -> None:
    rec = timed(name, lambda: load(name).run(cuda=cuda))
    tb = rec.details.get("traceback", "")
    assert rec.passed, f"{rec.summary()}\n{tb}"


@pytest.mark.gate
@pytest.mark.parametrize("name", GATES)
def test_gate(name):
    _check(name, cuda=False)


@pytest.mark.gate
@pytest.mark.cuda
@pytest.mark.parametrize("name", CUDA_GATES)
def test_gate_cuda_fleet(name):
    _check(name, cuda=True)
