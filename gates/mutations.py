"""Planting the mutation list's bugs (gates/mutation_list/) and running the gates that must catch
them.

A gate that cannot fail proves nothing. Each entry of the list plants ONE plausible bug by
replacing a named function, method, property or constant of `dormouse/` (found by name at run
time, so the list survives refactoring as long as the name does), names the gates that must
FAIL with it, and says where the bug lives:

* scope "fleet": inside every fleet rank gates/spawn.py starts (and every process a gate
  launches, through a sitecustomize on PYTHONPATH), never in the gate's own process, where
  the single-process references run unpatched;
* scope "process": in the gate's own process (gates that call dormouse functions directly:
  capacity parsing, the device policy, the launch rules, the model's kernel arms);
* scope "source": a bug in code the single process and the fleet share (the loss, the clip,
  the schedule, the optimizer, LFB, the data order, evaluation, resume state): planted in
  the gate's own process AND in every fleet rank, so the fleet and its one-process reference
  carry it alike. Only a gate that holds the trainer to the equations (g32, g33) or to a
  bound of its own (g01: the fixture must learn) can see it.

`python -m gates --mutations` runs every entry against its gates and writes
docs/mutations.md; `pytest -m mutation` does the same as tests. A mutation counts as caught
only when the gate returns a FAIL record by its verdict: a gate that crashed (an exception,
a fleet that died or hung) has not shown that its instrument sees the bug.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from gates import cache, status
from gates.mutation_list import BY_NAME, Mutation

_MISSING = object()
_IN_PROCESS = ("process", "source")
#: The mutation every fleet started in this process runs (scope "fleet" or "source", set by
#: `planted`; gates/spawn.py passes it to its ranks and to the processes a gate launches).
ACTIVE_MUTATION = ""


def _resolve(target: str):
    module, _, qual = target.partition(":")
    owner: Any = importlib.import_module(module)
    *path, attr = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _rebind(attr: str, old: Any, new: Any, owner: types.ModuleType) -> None:
    """Bind `attr` to `new` in every dormouse module but `owner` where it is bound to `old`."""
    for name, m in list(sys.modules.items()):
        mine = m is not None and m is not owner and name.split(".")[0] == "dormouse"
        if mine and m.__dict__.get(attr) is old:
            setattr(m, attr, new)


def _patch(target: str, make: Callable[[Any], Any]) -> Callable[[], None]:
    owner, attr = _resolve(target)
    if not hasattr(owner, attr):
        raise AttributeError(f"mutation target {target} does not exist (renamed?)")
    own = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr)
    original = getattr(owner, attr) if own is _MISSING else own
    bug = make(original)
    setattr(owner, attr, bug)
    # a module-level name is also bound in every dormouse module that took it by name
    # (`from .step import lr_factor`): the bug replaces those bindings too, so production code
    # imports as it reads best and the planted bug still reaches it
    if isinstance(owner, types.ModuleType):
        _rebind(attr, original, bug, owner)

    def undo() -> None:
        if isinstance(owner, types.ModuleType):  # a module imported meanwhile took the bug too
            _rebind(attr, bug, original, owner)
        if own is _MISSING:
            delattr(owner, attr)  # it was inherited: uncover the base class's again
        else:
            setattr(owner, attr, own)

    return undo


def apply(name: str) -> Callable[[], None]:
    """Plant mutation `name` in this process; returns the function that removes it."""
    m = BY_NAME[name]
    undos = [_patch(target, make) for target, make in m.patches]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


@contextlib.contextmanager
def planted(name: str):
    """Within the block: the gate's fleets (scope "fleet" or "source") and this process
    (scope "process" or "source") run mutation `name`."""
    global ACTIVE_MUTATION
    m = BY_NAME[name]
    undo = apply(name) if m.scope in _IN_PROCESS else (lambda: None)
    ACTIVE_MUTATION = name if m.scope in ("fleet", "source") else ""
    try:
        yield m
    finally:
        ACTIVE_MUTATION = ""
        undo()


def apply_from_env() -> None:
    """For processes a gate launches (torchrun's workers): plant $DORMOUSE_MUTATION."""
    name = os.environ.get("DORMOUSE_MUTATION")
    if name:
        apply(name)


# ---- running them ---------------------------------------------------------------------------


def run_one(m: Mutation, gate: str, cuda: bool = False) -> dict:
    """Run `gate` with `m` planted: one row of the table (caught only by a FAIL verdict)."""
    before = cache.remembered()
    with _isolated_cache(m), planted(m.name):
        rec = status.timed(gate, lambda: status.load(gate).run(cuda=cuda))
    if m.scope in _IN_PROCESS:  # references computed while the bug sat in this process
        cache.forget(cache.remembered() - before)
    crashed = rec.claim == "(gate crashed)"
    outcome = "caught" if not rec.passed and not crashed else ("crashed" if crashed else "MISSED")
    return {
        "mutation": m.name,
        "bug": m.bug,
        "scope": m.scope,
        "gate": gate,
        "outcome": outcome,
        "measured": rec.measured,
        "tolerance": rec.tolerance,
        "seconds": rec.seconds,
    }


def run_named(mutation: str, gate: str) -> dict:
    """run_one by the mutation's name: what a worker process of `python -m gates --mutations
    --jobs N` is sent (a name pickles; the Mutation's patch functions need not)."""
    return run_one(BY_NAME[mutation], gate)


@contextlib.contextmanager
def _isolated_cache(m: Mutation):
    """A process-scope bug may change what a reference computes here: keep such results out
    of the cache that unmutated gates share (fleets are keyed by their mutation anyway)."""
    if m.scope not in _IN_PROCESS or "DORMOUSE_GATE_CACHE" not in os.environ:
        yield
        return
    old = os.environ.pop("DORMOUSE_GATE_CACHE")
    try:
        yield
    finally:
        os.environ["DORMOUSE_GATE_CACHE"] = old


HEADER = "| mutation | the bug | scope | gate | outcome | measured (with the bug) | tolerance |"
_FIELDS = ("mutation", "bug", "scope", "gate", "outcome", "measured", "tolerance")


def classes_section(rows: list[dict]) -> list[str]:
    """The classes a gate must hold (gates/mutation_list/held.py: CLASSES), each with its gate
    and its mutations' outcomes in `rows`."""
    from gates.mutation_list.held import CLASSES

    def seen(m: str) -> str:
        got = [f"{r['gate']} {r['outcome']}" for r in rows if r["mutation"] == m]
        return f"{m} ({', '.join(got) or 'not run'})"

    out = ["The classes of bugs held by a gate's verdict (not by a unit test alone), each with "
           "its planted bugs:", "", "| class | gate (case) | mutations (gate outcome) |",
           "|---|---|---|"]  # fmt: skip
    out += [f"| {c} | {g} | {'; '.join(seen(m) for m in ms)} |" for c, g, ms in CLASSES]
    return [*out, ""]


def read_table(path) -> list[dict]:
    """The rows of a table write_table wrote (none if there is no file)."""
    import re
    from pathlib import Path

    if not Path(path).exists():
        return []
    rows, inside = [], False
    for line in Path(path).read_text().splitlines():
        if line == HEADER:
            inside = True
        elif inside and line.startswith("| "):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append(dict(zip(_FIELDS, cells, strict=True)))
        elif inside and not line.startswith("|"):
            break
    return rows


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """old with each (mutation, gate) row of new in its place, new pairs in list order."""
    from gates.mutation_list import MUTATIONS

    by = {(r["mutation"], r["gate"]): r for r in old}
    by.update({(r["mutation"], r["gate"]): r for r in new})
    order = [(m.name, g) for m in MUTATIONS for g in m.gates]
    return [by[k] for k in order if k in by]


def write_table(rows: list[dict], path) -> None:
    from pathlib import Path

    import torch

    caught = sum(r["outcome"] == "caught" for r in rows)
    lines = [
        "# Mutations: every gate must be able to fail",
        "",
        (
            "Generated by `python -m gates --mutations` (do not edit by hand). Each row plants one "
            "plausible bug (`gates/mutation_list/`: a monkeypatch of a named function) and runs the "
            "gate that must catch it. `caught` = the gate returned FAIL by its own verdict; "
            "`crashed` or `MISSED` would be a gate without the power to fail. Scope: where the "
            "bug is planted: `fleet` inside every fleet rank, `process` in the gate's own process, "
            "`source` in both (the single-process reference carries it too: docs/references.md)."
        ),
        "",
        f"torch {torch.__version__}, gloo on the CPU. {caught}/{len(rows)} caught.",
        "",
        *classes_section(rows),
        HEADER,
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["mutation"],
            r["bug"],
            r["scope"],
            r["gate"],
            r["outcome"],
            r["measured"],
            r["tolerance"],
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ")
                                        for c in cells) + " |")  # fmt: skip
    lines.append("")
    Path(path).write_text("\n".join(lines))
