"""The gates' registry and their records: each gate's `Record`, its environment, the table.

`GATES` lists every gate module in the order of the status table; `timed` runs one and turns a
crash into a FAIL; `write_status` writes docs/status.md (this run's rows, each followed by the
saved GPU rows of the same gate from docs/status-cuda.json, marked stale where the gate changed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gates import ROOT
from gates.fixtures import threads


#: Every gate module, in the order of the status table.
GATES = [
    "g01_trajectory", "g02_identical", "g03_unequal", "g04_fsdp", "g05_nonfinite",
    "g06_nccl", "g07_launch", "g08_rank0", "g09_capacity", "g10_torchrun", "g11_lfb",
    "g12_fsdp_checkpoint", "g13_policy", "g14_engram_ram_fleet", "g15_signal_stop",
    "g16_clip", "g17_bf16_reduce", "g18_causal", "g19_kernels", "g20_data", "g21_multinode",
    "g22_elastic", "g23_capacity_fleet", "g24_fsdp_muon", "g25_sharded_ckpt",
    "g26_accumulation", "g27_resplit", "g28_rebalance", "g29_dropout", "g30_mixed_dtype",
    "g31_compile_fleet", "g32_reference_model", "g33_reference_step",
]  # fmt: skip


def load(name: str):
    import importlib

    return importlib.import_module(f"gates.{name}")


@dataclass
class Record:
    gate: str
    claim: str
    instrument: str
    measured: str
    tolerance: str
    passed: bool
    env: dict = field(default_factory=dict)
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def summary(self) -> str:
        return (f"[{self.verdict()}] {self.gate}: {self.claim}\n    measured: {self.measured}\n"
                f"    tolerance: {self.tolerance}\n    ({self.seconds:.1f} s, {self.env})")  # fmt: skip


def environment(backend: str, device: str, world: str = "-") -> dict:
    return {"torch": torch.__version__, "backend": backend, "device": device, "world": world,
            "python": platform.python_version()}  # fmt: skip


def fleet_env(cuda: bool, world: tuple[int, ...] | int = 2) -> dict:
    ws = ",".join(map(str, world)) if isinstance(world, tuple) else str(world)
    if cuda:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
        return environment("nccl", f"{torch.cuda.device_count()}x {name}", ws)
    return environment("gloo", "cpu", ws)


def timed(gate: str, fn: Callable[[], Record]) -> Record:
    """Run one gate; an exception is a FAIL whose measured text is the error."""
    t0 = time.perf_counter()
    try:
        with threads(1):  # the gate's own references: tiny matmuls, one core each
            rec = fn()
    except Exception as e:  # noqa: BLE001 - a gate that crashes has failed, visibly
        rec = Record(gate, "(gate crashed)", "", f"{type(e).__name__}: {e}"[:2000], "", False,
                     details={"traceback": traceback.format_exc()})  # fmt: skip
    rec.seconds = time.perf_counter() - t0
    return rec


def gate_source_hash(gate: str) -> str:
    """What marks a recorded row stale: the gate module's source changed since it ran."""
    return hashlib.sha256((ROOT / "gates" / f"{gate}.py").read_bytes()).hexdigest()[:12]


#: Records of the GPU runs (`--cuda-fleet`, `--cuda`), kept so the CPU run can show them.
CUDA_RECORDS = ROOT / "docs" / "status-cuda.json"


def save_cuda_records(records: list[Record]) -> None:
    """Merge these GPU records into docs/status-cuda.json (the newest entry per gate)."""
    import json

    old = json.loads(CUDA_RECORDS.read_text()) if CUDA_RECORDS.exists() else []
    new = {r.gate: r for r in records}
    keep = [e for e in old if e["gate"] not in new]
    rows = keep + [{**dataclasses.asdict(r), "details": {}, "source": gate_source_hash(r.gate)}
                   for r in new.values()]  # fmt: skip
    CUDA_RECORDS.write_text(json.dumps(rows, indent=1) + "\n")


def load_cuda_records() -> list[tuple[Record, bool]]:
    """(record, stale) for every saved GPU row; stale when its gate's code changed since."""
    import json

    if not CUDA_RECORDS.exists():
        return []
    out = []
    for e in json.loads(CUDA_RECORDS.read_text()):
        source = e.pop("source", "")
        rec = Record(**e)
        fresh = (ROOT / "gates" / f"{rec.gate}.py").exists() and source == gate_source_hash(rec.gate)
        out.append((rec, not fresh))
    return out


def write_status(records: list[Record], path: Path,
                 extra: list[tuple[Record, bool]] = ()) -> None:
    """The status table: `records` (this run), each followed by the saved GPU rows of the same
    gate from `extra` (marked stale where the gate changed after they ran)."""
    env = records[0].env if records else {}
    lines = [
        "# Status: every claim is a gate",
        "",
        "Generated by `python -m gates` (do not edit by hand): each row is a fleet run compared "
        "with a hand-written reference in `references/`; the tolerance carries its reason.",
        "",
        f"Environment: torch {env.get('torch', torch.__version__)}, "
        f"python {platform.python_version()}; backend/device per row.",
        "",
        "| gate | claim | instrument | measured | tolerance | verdict |",
        "|---|---|---|---|---|---|",
    ]
    def row(r: Record, stale: bool = False) -> str:
        world = r.env.get("world", "-")
        verdict = (f"{r.verdict()} ({r.env.get('backend', '-')}, {r.env.get('device', '-')}"
                   + (f", world {world})" if world != "-" else ")"))
        if stale:
            verdict += " STALE: the gate changed since this row ran"
        cells = [r.gate, r.claim, r.instrument, r.measured, r.tolerance, verdict]
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    for r in records:
        lines.append(row(r))
        lines += [row(e, stale) for e, stale in extra if e.gate == r.gate]
    lines.append("")
    path.write_text("\n".join(lines))


def gate_lines(records: list[Record], extra: list[tuple[Record, bool]] = ()) -> list[str]:
    """The README's lines, from the records of the status table: one per gate, its verdict on
    the CPU, its last GPU row's (nccl, or one card; STALE as in the table), its claim."""

    def verdict(r: Record) -> str:
        backend, device = r.env.get("backend", "-"), r.env.get("device", "-")
        where = [backend] if backend not in ("-", "none") else []
        if not where or not device.startswith("cpu"):
            where.append(device)
        return f"{r.verdict()} ({', '.join(where)})"

    out = []
    for r in records:
        gpu = [(e, stale) for e, stale in extra if e.gate == r.gate]
        last = (verdict(gpu[-1][0]) + (" STALE" if gpu[-1][1] else "")) if gpu else "not run"
        out.append(f"- [`{r.gate}`](docs/status.md): {verdict(r)}; GPU: {last}. {r.claim}")
    return out
