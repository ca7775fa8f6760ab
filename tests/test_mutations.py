"""The mutation list as tests: `pytest -m mutation` plants each bug and runs its gates.

Every (mutation, gate) pair is one test that passes only when the gate returns FAIL by its
own verdict (a crashed gate does not count). The fast tests below keep the list honest: every
gate has a mutation, and every target still exists under its name.
"""

from __future__ import annotations

import pytest

from gates.mutation_list import MUTATIONS
from gates.mutations import _resolve, run_one
from gates.status import GATES

PAIRS = [(m, g) for m in MUTATIONS for g in m.gates]


@pytest.mark.mutation
@pytest.mark.usefixtures("gate_cache")
@pytest.mark.parametrize("mutation, gate", PAIRS, ids=[f"{m.name}-{g}" for m, g in PAIRS])
def test_gate_catches_mutation(mutation, gate):
    row = run_one(mutation, gate)
    assert row["outcome"] == "caught", (
        f"{mutation.name} -> {gate}: {row['outcome']}: {row['measured']}"
    )


def test_every_gate_has_a_mutation():
    covered = {g for m in MUTATIONS for g in m.gates}
    assert set(GATES) <= covered, f"gates no mutation can fail: {sorted(set(GATES) - covered)}"


def test_every_mutation_names_a_real_target_and_gate():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
    for m in MUTATIONS:
        assert m.scope in ("fleet", "process", "source")
        assert set(m.gates) <= set(GATES), m.name
        for target, _ in m.patches:
            owner, attr = _resolve(target)
            assert hasattr(owner, attr), f"{m.name}: {target} is gone (renamed?)"


@pytest.mark.slow
def test_mutations_run_in_worker_processes():
    """`python -m gates --mutations --jobs 2`: the pairs in two spawned workers, every row
    back in the list's order (two quick process-scope pairs here; the full list is the
    mutation tests above)."""
    import subprocess
    import sys

    from gates import ROOT

    names = ["rebalance_without_hysteresis", "kda_fla_from_sm70"]
    got = subprocess.run([sys.executable, "-m", "gates", "--mutations", *names, "--jobs", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr
    caught = [ln for ln in got.stdout.splitlines() if ln.startswith("[caught]")]
    assert sorted(ln.split()[1] for ln in caught) == sorted(names), got.stdout
    assert "2/2 caught" in got.stdout
    bad = subprocess.run([sys.executable, "-m", "gates", "--jobs", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert bad.returncode == 2 and "--jobs 0" in bad.stderr


def test_a_planted_bug_reaches_a_module_that_took_the_name_and_leaves_with_the_undo():
    """loop.py takes lr_factor by name (`from .step import lr_factor`); the list's mechanism,
    not the import's shape, carries the bug there, and its undo takes it back everywhere, also
    from a module imported while the bug was in place."""
    import sys
    import types

    from dormouse.train import loop, step
    from gates.mutations import apply

    good = step.lr_factor
    late = types.ModuleType("dormouse._late_importer")
    undo = apply("cosine_from_step_zero")
    try:
        assert loop.lr_factor is step.lr_factor is not good
        sys.modules[late.__name__] = late
        late.lr_factor = step.lr_factor  # what `from .step import lr_factor` binds now
    finally:
        undo()
        sys.modules.pop(late.__name__, None)
    assert step.lr_factor is good and loop.lr_factor is good and late.lr_factor is good
