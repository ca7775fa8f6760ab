"""pytest wiring shared by tests/: markers, the --cuda-fleet option, common fixtures."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see dormouse/__init__.py

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:  # gates/ and references/ import from the repo root
    sys.path.insert(0, ROOT)


def pytest_addoption(parser):
    parser.addoption(
        "--cuda-fleet",
        action="store_true",
        default=False,
        help="run the gates on nccl, one process per CUDA device (needs >= 2 GPUs)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gate: a fleet run compared against a reference")
    config.addinivalue_line("markers", "cuda: needs --cuda-fleet and >= 2 CUDA devices")


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    if not any("cuda" in item.keywords for item in items):
        return
    n = _cuda_count()
    if not config.getoption("--cuda-fleet"):
        reason = "cuda fleet tests need --cuda-fleet (and >= 2 CUDA devices)"
    elif n < 2:
        reason = f"--cuda-fleet given but {n} CUDA device(s) visible; the fleet needs >= 2"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_fleet(request) -> bool:
    return bool(request.config.getoption("--cuda-fleet"))


@pytest.fixture(autouse=True)
def _one_thread():
    # Many small ops: on the 2-core CI box one intra-op thread per process is several times
    # faster than two competing ones (xdist already runs two workers; measured up to 100x
    # slower per tiny forward with a second, spinning thread under load).
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group for tests of code that calls collectives."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
