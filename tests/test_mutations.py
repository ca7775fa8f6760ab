"""The mutation list as tests: `pytest -m mutation` plants each bug and runs its gates.

Every (mutation, gate) pair is one test that passes only when the gate returns FAIL by its
own verdict (a crashed gate does not count). The fast tests below keep the list honest: every
gate has a mutation, and every target still exists under its name.
"""

from __future__ import annotations

import pytest

from gates.harness import GATES
from gates.mutations import MUTATIONS, _resolve, run_one

PAIRS = [(m, g) for m in MUTATIONS for g in m.gates]


@pytest.mark.mutation
@pytest.mark.usefixtures("gate_cache")
@pytest.mark.parametrize("mutation, gate", PAIRS, ids=[f"{m.name}-{g}" for m, g in PAIRS])
def test_gate_catches_mutation(mutation, gate):
    row = run_one(mutation, gate)
    assert row["outcome"] == "caught", f"{mutation.name} -> {gate}: {row['outcome']}: {row['measured']}"


def test_every_gate_has_a_mutation():
    covered = {g for m in MUTATIONS for g in m.gates}
    assert set(GATES) <= covered, f"gates no mutation can fail: {sorted(set(GATES) - covered)}"


def test_every_mutation_names_a_real_target_and_gate():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
    for m in MUTATIONS:
        assert m.scope in ("fleet", "process")
        assert set(m.gates) <= set(GATES), m.name
        for target, _ in m.patches:
            owner, attr = _resolve(target)
            assert hasattr(owner, attr), f"{m.name}: {target} is gone (renamed?)"
