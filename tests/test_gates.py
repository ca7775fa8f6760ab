"""The gates as tests: `pytest -m gate` runs every module of gates/ (python -m gates does the same).

One test per gate. The fleet runs behind the gates are shared between tests (and between
pytest-xdist workers) through a cache directory with a file lock, so gates that read the same
run spawn it once per session. `--cuda-fleet` adds the nccl variants (one process per card).
"""

from __future__ import annotations

import pytest

from gates.status import GATES, load, timed

#: The slowest gates first (45-130 s each on the 2-core box, measured; the rest take 20 s or
#: less): under xdist (`pytest -m gate` runs two workers) each worker starts on one of them,
#: instead of one worker finishing a long gate alone after the other has run out of work.
SLOW_FIRST = ["g31_compile_fleet", "g25_sharded_ckpt", "g24_fsdp_muon", "g22_elastic",
              "g26_accumulation"]  # fmt: skip
ORDER = SLOW_FIRST + [g for g in GATES if g not in SLOW_FIRST]
#: The two slowest run in the slow tier (`.ci/run`'s second command, and `pytest -m gate`), so
#: the README's test command stays under 5 minutes on the 2-core box (it measured 4:22-5:04
#: with them; each took 26-37 s of a worker's time).
SLOW_TIER = {"g31_compile_fleet", "g22_elastic"}
#: Gates whose claim is about a fleet (they have an nccl, one-process-per-card variant).
CUDA_GATES = [g for g in ORDER if getattr(load(g), "CUDA", True)]


pytestmark = pytest.mark.usefixtures("gate_cache")


def _check(name: str, cuda: bool) -> None:
    rec = timed(name, lambda: load(name).run(cuda=cuda))
    tb = rec.details.get("traceback", "")
    assert rec.passed, f"{rec.summary()}\n{tb}"


@pytest.mark.gate
@pytest.mark.parametrize(
    "name", [pytest.param(g, marks=pytest.mark.slow) if g in SLOW_TIER else g for g in ORDER]
)
def test_gate(name):
    _check(name, cuda=False)


@pytest.mark.gate
@pytest.mark.cuda
@pytest.mark.parametrize("name", CUDA_GATES)
def test_gate_cuda_fleet(name):
    _check(name, cuda=True)


def test_references_shared_only_where_a_process_cannot_tell(tmp_path):
    """gates.reference.single shares one reference between gates whose references differ only in the
    fields of _FLEET_ONLY (and in the fleet's split: only the global batch reaches one
    process). Held here: each such field at a non-default value trains the same bytes-exact
    run as the default in one process, and a field outside the list keeps its own key."""
    import dataclasses

    from gates.fixtures import FleetSpec, fixture_run
    from gates.reference import _FLEET_ONLY, _reference_key
    from references.fingerprint import fingerprint
    from references.single import global_run, run_single

    other = {"dist_shard": "fsdp", "dist_reduce": "bf16", "bucket_mb": 1.0, "dist_timeout": 30.0}
    assert set(other) == set(_FLEET_ONLY)

    def trained(sets: tuple[str, ...]) -> tuple[list, str]:
        spec = FleetSpec("shared", steps=3, sets=sets)
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        run = global_run(fixture_run(spec, out, dist=False), [2, 2])
        losses = []
        from dormouse.train.step import Callbacks

        model, _ = run_single(run, callbacks=Callbacks(on_log=lambda i: losses.append(i["loss"])))
        return losses, fingerprint(model)

    base = trained(())
    for k, v in other.items():
        assert trained((f"{k}={v}",)) == base, k
    plain = FleetSpec("a", steps=3)
    assert _reference_key(plain, [2, 2], None) == _reference_key(
        dataclasses.replace(
            plain, name="b", capacity="3,1", sets=tuple(f"{k}={v}" for k, v in other.items())
        ),
        [3, 1],
        None,
    )
    assert _reference_key(plain, [2, 2], None) != _reference_key(
        dataclasses.replace(plain, sets=("lr=2e-3",)), [2, 2], None
    )
    assert _reference_key(plain, [2, 2], None) != _reference_key(plain, [3, 2], None)
