"""Gate 13: the device policy decides dtype and kernels per card, as the hand-written table says.

No fleet: `policy_for` and `resolve_dtype` over synthetic DeviceRecords, compared cell by cell
with `references/policy_table.py` (typed rows, not computed from dormouse's thresholds); the
arms a KDA mixer and a MoE of the model pick on each card described to them, through the
`arm` method their forward calls, for every torch era; one real `probe()` of this machine and
the model's arms on its devices checked against the table's rule; then the two loud
refusals. Any differing cell fails the gate and is named in the measured text.
"""

from __future__ import annotations

import dataclasses

import torch

from gates.recorder import log_lines
from gates.status import Record, environment
from references.policy_table import CPU_ROW, ERAS, EXTRA_ROWS, ROWS, Row, era_of, rule

#: Not a fleet claim: `python -m gates --cuda-fleet` runs it as it is (the real probe already
#: reads the CUDA cards wherever they are visible).
CUDA = False

CLAIM = "the device policy decides dtype and kernels per card"
INSTRUMENT = ("policy_for + resolve_dtype('auto') on 8 synthetic DeviceRecords (sm_120, 89, 86, "
              "80, 75, 70, 61, 52; grouped_mm for torch <2.8, 2.8, >=2.9 and the running torch) "
              "vs references/policy_table.py; the arms a KDA mixer and a MoE pick (the `arm` "
              "method their forward calls) on each card described to them, every torch era; one "
              "real probe() and the model's arms on it vs the table's rule; explicit bf16 on "
              "the sm_75 record and fp16 on the sm_52 one")  # fmt: skip
TOLERANCE = ("exact: every cell equals the hand-written row; each refusal is a DtypeError naming "
             "the card, its sm, the sm it needs (sm_80 for bf16, sm_53 for fp16) and the "
             "escape")  # fmt: skip

GiB = 1 << 30
_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _record(row: Row):
    from dormouse.train.plan.device import DeviceRecord

    return DeviceRecord(index=0, name=row.example, kind="cuda", sm=row.sm, total_mem=16 * GiB,
                        free_mem=12 * GiB, pcie_gen_max=4, pcie_width_max=16,
                        multiprocessors=64)  # fmt: skip


def _cells(record, row: Row) -> tuple[list[str], int]:
    """Compare every cell of `row` with what dormouse says for `record`: (mismatches, cells)."""
    from dormouse.train.plan.device import policy_for, resolve_dtype

    where = f"sm_{record.sm[0]}{record.sm[1]}" if record.sm else "cpu"
    bad: list[str] = []
    n = 0

    def cell(name, got, want):
        nonlocal n
        n += 1
        if got != want:
            bad.append(f"{where} {name}: policy {got!r}, table {want!r}")

    now = policy_for(record)  # the running torch
    for name in ("bf16", "fp16", "rung", "auto", "fla_kda"):
        cell(name, getattr(now, name), getattr(row, name))
    cell("fp32 fallback", bool(now.fallback), row.fp32_fallback)
    era = era_of(torch.__version__)
    cell(f"grouped_mm (torch {torch.__version__})", now.grouped_mm, row.grouped_mm[era])
    cell(f"grouped_mm_fused (torch {torch.__version__})", now.grouped_mm_fused,
         row.grouped_mm_fused[era])  # fmt: skip
    for era, version in ERAS.items():
        p = policy_for(record, torch_version=version)
        cell(f"grouped_mm (torch {era})", p.grouped_mm, row.grouped_mm[era])
        cell(f"grouped_mm_fused (torch {era})", p.grouped_mm_fused, row.grouped_mm_fused[era])
    lines: list[str] = []
    with log_lines(lines.append, "dormouse.train.plan.device"):
        dtype, line = resolve_dtype("auto", record)
    cell("auto resolves to", dtype, _DTYPE[row.auto])
    reading = f"bf16={int(row.bf16)} fp16={int(row.fp16)}"
    cell("auto logs its reading", lines == [line] and reading in line and record.name in line,
         True)  # fmt: skip
    return bad, n


def _reference_consistent() -> list[str]:
    """The literal rows against the reference's own rule: a typo in either shows here."""
    out = []
    for row in ROWS + EXTRA_ROWS + (CPU_ROW,):
        want = rule(row.sm)
        for f in Row.__dataclass_fields__:
            if f != "example" and getattr(row, f) != getattr(want, f):
                out.append(f"reference inconsistent: {row.example} {f} row {getattr(row, f)!r} "
                           f"vs rule {getattr(want, f)!r}")  # fmt: skip
    return out


def _models():
    """A KDA mixer and a MoE of the tiny preset, both `auto`: the modules whose forward asks
    `arm(device, dtype)` which kernel to run."""
    from dormouse.config import preset
    from dormouse.model.kda import KDAMixer
    from dormouse.model.moe import MoE

    cfg = dataclasses.replace(preset("tiny").model, kda_impl="auto", moe_impl="auto")
    return KDAMixer(cfg), MoE(cfg)


def _arm_cells(models, device, row: Row, era: str, where: str) -> list[tuple[str, bool, bool]]:
    """(cell, model, table) for the model's arms on `device`: the mixer's auto arm in the
    card's auto dtype (fla_kda), the MoE pinned to grouped (grouped_mm[era]) and the MoE's
    auto arm in bf16 (grouped_mm_fused[era] on CUDA; the CPU takes grouped wherever it runs)."""
    from dormouse.model.arms import ArmError

    mixer, moe = models
    fla = mixer.arm(device, _DTYPE[row.auto]).name == "fla"
    moe.impl = "grouped"
    try:
        runs = moe.arm(device, torch.float32).name == "grouped"
    except ArmError:
        runs = False
    moe.impl = "auto"
    auto = moe.arm(device, torch.bfloat16).name == "grouped"
    want_auto = row.grouped_mm_fused[era] if row.sm else row.grouped_mm[era]
    return [(f"{where} model KDA arm is fla", fla, row.fla_kda),
            (f"{where} model MoE grouped runs", runs, row.grouped_mm[era]),
            (f"{where} model MoE auto bf16 is grouped", auto, want_auto)]  # fmt: skip


def _model_arms() -> tuple[list[str], int]:
    """The arms the MODEL picks on each card of the table described to it (sm, name, torch
    release; fla-core taken as installed: the table is about the card), every torch era."""
    from dormouse.model.arms import Card

    models = _models()
    cells = []
    for row in ROWS + EXTRA_ROWS + (CPU_ROW,):
        for version in (*ERAS.values(), torch.__version__):
            tv = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
            card = Card("cuda" if row.sm else "cpu", row.sm, row.example, torch_version=tv)
            where = f"{'sm_%d%d' % row.sm if row.sm else 'cpu'} torch {version}"
            cells += _arm_cells(models, card, row, era_of(version), where)
    bad = [f"{name}: {got}, table {want}" for name, got, want in cells if got != want]
    return bad, len(cells)


def _real_probe() -> tuple[list[str], str, str]:
    from dormouse.model.arms import card_of
    from dormouse.train.plan.device import probe

    cuda = torch.cuda.is_available()
    before = torch.cuda.memory_allocated() if cuda else 0
    records = probe()
    allocated = (torch.cuda.memory_allocated() - before) if cuda else 0
    bad, said = [], []
    if allocated:
        bad.append(f"probe allocated {allocated} B through torch (metadata only was promised)")
    for r in records:
        if r.total_mem <= 0 or not (r.free_mem == -1 or 0 < r.free_mem <= r.total_mem):
            bad.append(f"{r.label}: memory reading total={r.total_mem} free={r.free_mem}")
        if (r.kind == "cuda") != cuda or (r.sm is None) != (r.kind == "cpu"):
            bad.append(f"{r.label}: kind {r.kind} sm {r.sm} on a machine with cuda={cuda}")
        want = rule(r.sm)
        wrong, n = _cells(r, want)
        # the model on the real device: fla runs where the card has it AND fla-core imports
        dev = torch.device(r.label)
        if card_of(dev).fla is not None:
            want = dataclasses.replace(want, fla_kda=False)
        arms = _arm_cells(_models(), dev, want, era_of(torch.__version__), r.label)
        wrong += [f"{name}: {got}, rule {w}" for name, got, w in arms if got != w]
        n += len(arms)
        bad += [f"real {r.label} ({r.name}): {w}" for w in wrong]
        said.append(f"{r.label} {r.name!r} sm={r.sm_text} -> auto {want.auto}, "
                    f"{n - len(wrong)}/{n} cells = rule")  # fmt: skip
    device = "cpu" if not cuda else f"{len(records)}x {records[0].name}"
    return bad, "; ".join(said), device


def _refusals() -> tuple[list[str], int, bool]:
    from dormouse.train.plan.device import DtypeError, resolve_dtype

    turing = _record(next(r for r in ROWS if r.sm == (7, 5)))
    maxwell = _record(next(r for r in ROWS if r.sm == (5, 2)))
    cases = {
        "bf16 on sm_75": (turing, "bf16", (turing.name, "sm_75", "sm_80", "--set dtype=auto",
                                           "dtype=fp32")),
        "fp16 on sm_52": (maxwell, "fp16", (maxwell.name, "sm_52", "sm_53", "--set dtype=auto",
                                            "dtype=fp32")),
    }  # fmt: skip
    bad, loud = [], 0
    for name, (record, dtype, must) in cases.items():
        try:
            got = resolve_dtype(dtype, record)
            bad.append(f"refusal {name}: accepted ({got[0]})")
        except DtypeError as e:
            missing = [m for m in must if m not in str(e)]
            if missing:
                bad.append(f"refusal {name}: message lacks {missing}: {e}")
            else:
                loud += 1
    # Controls: the refusals are per card, not blanket.
    ampere = _record(next(r for r in ROWS if r.sm == (8, 0)))
    try:
        controls = (resolve_dtype("bf16", ampere)[0], resolve_dtype("fp32", maxwell)[0],
                    resolve_dtype("fp16", turing)[0])  # fmt: skip
    except DtypeError as e:
        controls = (f"refused: {e}",)
    ok = controls == (torch.bfloat16, torch.float32, torch.float16)
    if not ok:
        bad.append(f"controls: bf16 on sm_80 / fp32 on sm_52 / fp16 on sm_75 gave {controls}")
    return bad, loud, ok


def run(cuda: bool = False) -> Record:
    bad = _reference_consistent()
    rows_equal, cells, cells_equal = 0, 0, 0
    for row in ROWS:
        wrong, n = _cells(_record(row), row)
        bad += wrong
        rows_equal += not wrong
        cells += n
        cells_equal += n - len(wrong)
    extra_bad = []
    for row in EXTRA_ROWS:
        extra_bad += _cells(_record(row), row)[0]
    bad += extra_bad
    probe_bad, probe_text, device = _real_probe()
    bad += probe_bad
    refusal_bad, loud, controls_ok = _refusals()
    bad += refusal_bad
    arm_bad, arms = _model_arms()
    bad += arm_bad
    extra = ", ".join(f"sm_{r.sm[0]}{r.sm[1]}" for r in EXTRA_ROWS)
    measured = (f"{rows_equal}/{len(ROWS)} rows equal ({cells_equal}/{cells} cells); extra rows "
                f"{extra} {'equal' if not extra_bad else 'DIFFER'}; the model's own arms on the "
                f"described cards: {arms - len(arm_bad)}/{arms} = table; real probe: "
                f"{probe_text}; "
                f"{loud}/2 refusals loud; controls (bf16 on sm_80, fp32 on sm_52, fp16 on sm_75) "
                f"{'accepted' if controls_ok else 'REFUSED'}")  # fmt: skip
    if bad:
        measured += f"; {len(bad)} mismatch(es): " + " | ".join(bad[:6])
    return Record("g13_policy", CLAIM, INSTRUMENT, measured, TOLERANCE, not bad,
                  environment("none", device), details={"mismatches": bad})  # fmt: skip
