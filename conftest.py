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


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns numprocesses into workers
def pytest_cmdline_main(config):
    # `pytest -m gate` runs on two xdist workers unless -n says otherwise: a gate's fleet
    # leaves a core idle while its one-process reference, a torchrun agent or an interpreter
    # start runs, and the other worker fills it (measured on the 2-core box, whole gate suite:
    # 450 s serial, 373 s with -n 2). One test at a time per scheduling step, so the slowest
    # gates (first in tests/test_gates.py) start first, on both workers.
    if (
        config.getoption("markexpr", "") == "gate"
        and config.pluginmanager.hasplugin("xdist")
        and not os.environ.get("PYTEST_XDIST_WORKER")
        and config.getoption("numprocesses", None) is None
    ):
        config.option.numprocesses = 2
        if config.getoption("maxschedchunk", None) is None:
            config.option.maxschedchunk = 1


def pytest_configure(config):
    config.addinivalue_line("markers", "gate: a fleet run compared against a reference")
    config.addinivalue_line("markers", "cuda: needs --cuda-fleet and >= 2 CUDA devices")
    config.addinivalue_line("markers", "mutation: a planted bug its gate must catch")


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    # the gates first (the slowest first, as tests/test_gates.py lists them), then the rest:
    # on two xdist workers the short tests fill in around the long fleets instead of a lone
    # gate running last while the other worker idles (the same order on every worker)
    items.sort(key=lambda item: "gate" not in item.keywords)
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


@pytest.fixture(scope="session")
def gate_cache(tmp_path_factory):
    """One cache directory for the gates' fleet runs, shared by every xdist worker of the
    session (through a file lock), so gates that read the same run spawn it once."""
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


# ---- builders the tests share (one version each) ------------------------------------------
# Plain functions behind session fixtures: a test takes the fixture; a rank it spawns is handed
# the function itself (it pickles by reference, as conftest.NAME).


def _tiny_model(seed: int = 0, cfg=None, **fields):
    """The `tiny` preset's model (`fields` replace ModelConfig fields, or `cfg` whole), seeded,
    its Engram conv opened: at its zero init the tables get no gradient."""
    from dataclasses import replace

    import torch

    from dormouse.config import preset
    from dormouse.model import DormouseModel

    torch.manual_seed(seed)
    model = DormouseModel(cfg if cfg is not None else replace(preset("tiny").model, **fields))
    with torch.no_grad():
        model.engram.conv.weight.normal_(0, 0.05)
    return model


def _tiny_run(*sets: str):
    """The `tiny` preset's RunConfig with these --set values (not validated)."""
    from dormouse.config import apply_sets, preset

    return apply_sets(preset("tiny"), list(sets))


def _source_corpus(folder, n: int, salt: bytes = b""):
    """folder/corpus.txt: `salt`, then this repository's own sources (real text, not noise),
    repeated to n bytes; left as it is when it already holds them."""
    from pathlib import Path

    text = salt + b"".join(p.read_bytes() for p in sorted(Path(ROOT, "dormouse").rglob("*.py")))
    data = (text * (n // len(text) + 1))[:n]
    path = Path(folder) / "corpus.txt"
    if not (path.exists() and path.read_bytes() == data):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return path


@pytest.fixture(scope="session")
def tiny_model():
    """tiny_model(seed=0, cfg=None, **fields) -> the tiny DormouseModel, Engram conv opened."""
    return _tiny_model


@pytest.fixture(scope="session")
def tiny_run():
    """tiny_run(*sets) -> the tiny preset's RunConfig with these --set values."""
    return _tiny_run


@pytest.fixture(scope="session")
def source_corpus():
    """source_corpus(folder, n, salt=b"") -> folder/corpus.txt of this repository's sources."""
    return _source_corpus


@pytest.fixture
def corpus(tmp_path, source_corpus):
    """tmp_path/corpus.txt, 60,000 bytes of this repository's sources: what a test's runs train
    on (a module whose runs need another length defines its own `corpus`)."""
    return source_corpus(tmp_path, 60_000)
