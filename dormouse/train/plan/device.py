"""Per-device probe and dtype policy.

Owns three things, in order of use:

* the probe: what a device *is* (name, compute capability, memory, PCIe link), read from
  metadata only. It never allocates a tensor and never launches a kernel; reading free
  memory does open the driver's context on the card, which is why `probe(memory=False)`
  exists for callers that only want the link.
* the policy: which dtype rung the device can honour, and which kernel arms may run on it
  (asked of the model's own rule, `dormouse.model.arms.choose_arm`, about the card).
* `dtype=` resolution: `auto` logs the reading and the verdict, and an explicit rung the
  device cannot honour is refused loudly.

`python -m dormouse probe` prints `format_probe_table(probe())` through `main_probe`.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import typing
from dataclasses import dataclass

import torch

from ...config import Dtype
from ...errors import UserError
from ...model.arms import Card, choose_arm, release, why_not

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30

#: Headroom held back from free memory before anything is planned into it: the
#: allocator's fragmentation and the kernels' workspaces live there.
BUDGET_RESERVE = 512 * MiB

# The CUDA ladder. fp16 arithmetic is native from sm_53 (Maxwell GM20B); bf16 from sm_80
# (Ampere), the first generation with bf16 tensor cores.
FP16_SM = (5, 3)
BF16_SM = (8, 0)

DTYPES = typing.get_args(Dtype)
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Why auto picks fp16 on an fp16-rung card, said in its line.
_WHY_FP16 = (
    "no bf16 below sm_80: fp16 autocast over fp32 masters, with a dynamic loss scale "
    "the fleet agrees on"
)


class DtypeError(UserError, ValueError):
    """A dtype the device or the forward cannot honour; names cause, fact and escape."""


class DeviceError(UserError, ValueError):
    """A device that does not exist here; names what does."""


# ---- the record ---------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceRecord:
    """What one device is. -1 in a memory field means "could not be read", never a guess."""

    index: int  # CUDA ordinal; 0 for the CPU
    name: str
    kind: str  # "cuda" | "cpu"
    sm: tuple[int, int] | None  # compute capability; None on the CPU
    total_mem: int  # bytes
    free_mem: int  # bytes; -1 = unknown (another process may hold the card)
    pcie_gen_max: int | None  # max generation this device and slot can train to
    pcie_width_max: int | None
    multiprocessors: int  # SMs on CUDA, logical cores on the CPU
    note: str = ""  # why a field is unknown, in words

    @property
    def label(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else "cpu"

    @property
    def sm_text(self) -> str:
        return f"{self.sm[0]}.{self.sm[1]}" if self.sm else "-"


# ---- the probe ----------------------------------------------------------------------


def probe(index: int | None = None, memory: bool = True) -> list[DeviceRecord]:
    """Records for every visible device (or only `index`); a CPU record where CUDA is absent."""
    if not torch.cuda.is_available():
        if index not in (None, 0):
            raise DeviceError(
                f"device index {index} asked for, but torch {torch.__version__} sees no CUDA "
                f"device; only the CPU is here"
            )
        return [_probe_cpu()]
    count = torch.cuda.device_count()
    if index is None:
        return [_probe_cuda(i, memory) for i in range(count)]
    if not 0 <= index < count:
        raise DeviceError(
            f"cuda:{index} does not exist: {count} CUDA device(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            f"use an index in 0..{count - 1}"
        )
    return [_probe_cuda(index, memory)]


def probe_device(device: torch.device | str | int | None = None) -> DeviceRecord:
    """The record of one device: a torch.device, "cpu", "cuda", "cuda:N", an ordinal, or
    None for the device `auto` would pick."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cpu":
        return _probe_cpu()
    if dev.type != "cuda":
        raise DeviceError(f"device {dev} is neither cpu nor cuda; dormouse probes only those")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"{dev} asked for, but torch {torch.__version__} sees no CUDA device (a CPU build, "
            f"or no driver); use --device cpu"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return probe(index)[0]


def _probe_cuda(index: int, memory: bool = True) -> DeviceRecord:
    props = torch.cuda.get_device_properties(index)
    notes = []
    free = -1
    total = int(props.total_memory)
    if memory:
        try:
            free, total = (int(v) for v in torch.cuda.mem_get_info(index))
        except Exception as e:
            # Measured: while another process holds the card the driver refuses a second
            # context; get_device_properties still answers, mem_get_info does not.
            notes.append(f"free memory unreadable ({type(e).__name__}: {_first_line(e)})")
    else:
        notes.append("free memory not read (memory=False)")
    gen, width, why = _nvml_link(props)
    if why:
        notes.append(why)
    return DeviceRecord(
        index=index,
        name=str(props.name),
        kind="cuda",
        sm=(int(props.major), int(props.minor)),
        total_mem=total,
        free_mem=free,
        pcie_gen_max=gen,
        pcie_width_max=width,
        multiprocessors=int(props.multi_processor_count),
        note="; ".join(notes),
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"


def _nvml_link(props) -> tuple[int | None, int | None, str]:
    """Max PCIe generation/width through NVML; (None, None, why) when it cannot be read.

    The max, not the current value: an idle card downclocks its link (nvidia-smi's
    "current" reads gen3 x8 on a gen3 x16 slot), and the all-reduce sees the trained max.
    """
    try:
        import pynvml  # the nvidia-ml-py distribution
    except ImportError:
        return None, None, "PCIe unread: nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return None, None, f"PCIe unread: nvmlInit failed ({_first_line(e)})"
    try:
        handle, how = _nvml_handle(pynvml, props)
        if handle is None:
            return None, None, f"PCIe unread: {how}"
        gen = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
        width = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
        return gen, width, ""
    except Exception as e:
        return None, None, f"PCIe unread: NVML said {_first_line(e)}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvml_handle(pynvml, props):
    # NVML numbers devices in PCI order and ignores CUDA_VISIBLE_DEVICES, while CUDA's
    # ordinals follow CUDA_DEVICE_ORDER and the mask: match by PCI address or UUID, never
    # by ordinal.
    dom = getattr(props, "pci_domain_id", None)
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    if None not in (dom, bus, dev):
        address = f"{int(dom):08X}:{int(bus):02X}:{int(dev):02X}.0"
        get = (
            getattr(pynvml, "nvmlDeviceGetHandleByPciBusId_v2", None)
            or pynvml.nvmlDeviceGetHandleByPciBusId
        )
        return get(address), f"pci {address}"
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        text = text if text.startswith("GPU-") else "GPU-" + text
        return pynvml.nvmlDeviceGetHandleByUUID(text), "uuid"
    return None, "torch exposes neither the PCI address nor the UUID to match NVML's handle"


def _probe_cpu() -> DeviceRecord:
    notes = []
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = -1
        notes.append("total memory unreadable (no sysconf)")
    free = _meminfo_available()
    if free < 0:
        notes.append("free memory unreadable (no /proc/meminfo MemAvailable)")
    return DeviceRecord(
        index=0,
        name=_cpu_name(),
        kind="cpu",
        sm=None,
        total_mem=int(total),
        free_mem=free,
        pcie_gen_max=None,
        pcie_width_max=None,
        multiprocessors=os.cpu_count() or 1,
        note="; ".join(notes),
    )


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    return -1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


# ---- the policy ---------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What a device may run. `rung` is the hardware ladder's answer; `auto` is what
    dtype=auto actually runs once the forward's own gaps are applied."""

    record: DeviceRecord
    bf16: bool  # an explicit dtype=bf16 is honoured
    fp16: bool  # an explicit dtype=fp16 is honoured (the card computes fp16; the CPU emulates)
    rung: str  # the ladder verdict: bf16 | fp16 | fp32
    auto: str  # what dtype=auto runs: bf16 | fp16 | fp32
    # "" or why auto runs below the rung. No rung falls back since the fp16 forward exists;
    # kept so a future gap is counted and printed (fleet table, probe) the same way.
    fallback: str
    fla_kda: bool  # fla's KDA kernel runs on this card (given fla-core installed)
    grouped_mm: bool  # torch's grouped matmul runs on this device and torch
    grouped_mm_fused: bool  # ... and moe_impl=auto takes it in bf16 (the fused kernel)
    why: tuple[str, ...] = ()  # the reason for every illegal arm and every non-obvious verdict


def policy_for(record: DeviceRecord, torch_version: str | None = None) -> Policy:
    """The dtype ladder and kernel arms for `record` (under `torch_version`, default the
    running torch: grouped matmul legality moved between torch releases)."""
    if record.kind == "cuda" and record.sm is None:
        raise DeviceError(f"{record.label} ({record.name}) has no compute capability recorded")
    card = Card(record.kind, record.sm, record.name, release(torch_version or torch.__version__))
    no_fla, no_gmm = why_not("kda", "fla", card), why_not("moe", "grouped", card)
    fused = (
        not no_gmm
        and card.type == "cuda"
        and choose_arm("moe", "auto", card, torch.bfloat16).name == "grouped"
    )
    why = [f"fla_kda: {no_fla}; the torch arm runs"] if no_fla else []
    if no_gmm:
        why.append(f"grouped_mm: {no_gmm}; the batched arm runs")
    elif card.type == "cuda" and not fused:
        why.append(
            "grouped_mm: runs through torch's mm-loop fallback (a host sync per call); "
            "moe_impl=auto takes the batched arm"
        )
    arms = dict(fla_kda=not no_fla, grouped_mm=not no_gmm, grouped_mm_fused=fused)
    if record.kind == "cpu":
        # CPU autocast runs bf16 and (torch 2.13) fp16, so an explicit request is honoured;
        # auto stays fp32 because the CPU arm is the reference path and a half dtype there is
        # opt-in, not a default (and slower: the CPU converts instead of computing in it).
        why.append(
            "auto: fp32 on the CPU (the reference arm); dtype=bf16 or fp16 opts into autocast"
        )
        return Policy(
            record,
            bf16=True,
            fp16=True,
            rung="fp32",
            auto="fp32",
            fallback="",
            why=tuple(why),
            **arms,
        )
    sm = record.sm
    bf16 = sm >= BF16_SM
    fp16 = sm >= FP16_SM
    rung = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    auto, fallback = rung, ""
    return Policy(
        record,
        bf16=bf16,
        fp16=fp16,
        rung=rung,
        auto=auto,
        fallback=fallback,
        why=tuple(why),
        **arms,
    )


def _sm(sm: tuple[int, int]) -> str:
    return f"{sm[0]}{sm[1]}"


# ---- memory budget ------------------------------------------------------------------


def memory_budget(record: DeviceRecord) -> int | None:
    """Free memory minus BUDGET_RESERVE, in bytes; None when free memory is unknown."""
    if record.free_mem < 0:
        return None
    return max(0, record.free_mem - BUDGET_RESERVE)


def budget_text(record: DeviceRecord) -> str:
    b = memory_budget(record)
    if b is None:
        return "budget=unknown (free memory unreadable)"
    return f"budget={b / GiB:.1f}GiB (free-{BUDGET_RESERVE // MiB}MiB)"


# ---- dtype resolution ---------------------------------------------------------------

_fallbacks = 0


def fallback_count() -> int:
    """How many times this process's dtype=auto ran fp32 where fp16 was the card's rung."""
    return _fallbacks


def resolve_dtype(requested: str, record: DeviceRecord | None = None) -> tuple[torch.dtype, str]:
    """Turn `dtype=` into the forward's compute dtype, with the line that says why (logged).

    Returns torch.float32 for fp32 (plain, no autocast), torch.bfloat16 for bf16 and
    torch.float16 for fp16 (the loop then carries a loss scale, train/optim/scaler.py); probes the device
    `auto` would pick when `record` is None and the answer depends on the card.
    """
    global _fallbacks
    if requested not in DTYPES:
        raise DtypeError(f"dtype={requested!r} is not one of {DTYPES}; use --set dtype=auto")
    if requested == "fp32":
        where = f" device={record.name}" if record else ""
        dtype, line = "fp32", f"dtype=fp32{where} (explicit; every device honours it)"
    else:
        record = record or probe_device(None)
        pol = policy_for(record)
        reading = (
            f"device={record.name} sm={record.sm_text} bf16={int(pol.bf16)} fp16={int(pol.fp16)}"
        )
        dtype, verdict = pol.auto, pol.auto
        if requested == "bf16" and not pol.bf16:
            raise DtypeError(
                f"dtype=bf16 needs sm_{_sm(BF16_SM)} (Ampere) or newer; this card "
                f"({record.name}, {record.label}) is sm_{_sm(record.sm)}; use --set dtype=auto "
                f"(this card's best rung that the forward runs: {pol.auto}) or --set dtype=fp32"
            )
        if requested == "fp16" and not pol.fp16:
            raise DtypeError(
                f"dtype=fp16 needs sm_{_sm(FP16_SM)} or newer; this card ({record.name}, "
                f"{record.label}) is sm_{_sm(record.sm)}; use --set dtype=fp32 (this card's "
                f"rung) or --set dtype=auto"
            )
        if requested in ("bf16", "fp16"):
            dtype, verdict = requested, f"{requested} (explicit)"
            if requested == "fp16":
                verdict += " with a dynamic loss scale"
        elif pol.fallback:
            _fallbacks += 1
            verdict = (
                f"{pol.rung} -> {pol.auto} (counted fp32 fallback #{_fallbacks}: {pol.fallback})"
            )
        elif record.kind == "cpu":
            verdict = (
                f"{pol.auto} (CPU: auto stays fp32; dtype=bf16 or fp16 opts into CPU autocast)"
            )
        elif pol.auto == "fp16":
            verdict = f"fp16 ({_WHY_FP16})"
        line = f"dtype={requested} {reading} -> {verdict} {budget_text(record)}"
    log.info("%s", line)
    return _TORCH_DTYPE[dtype], line


# ---- the probe table ----------------------------------------------------------------


def _gib(n: int) -> str:
    return "unknown" if n < 0 else f"{n / GiB:.1f}GiB"


def format_probe_table(records: list[DeviceRecord]) -> str:
    """One row per device: the reading, the budget and the policy's verdicts."""
    head = (
        "device",
        "name",
        "sm",
        "total",
        "free",
        "budget",
        "pcie max",
        "SMs/cores",
        "bf16",
        "fp16",
        "auto",
        "fla_kda",
        "grouped_mm",
    )
    rows = [head]
    notes = []
    for r in records:
        p = policy_for(r)
        budget = memory_budget(r)
        link = f"gen{r.pcie_gen_max} x{r.pcie_width_max}" if r.pcie_gen_max else "-"
        gmm = ("fused" if p.grouped_mm_fused else "loop") if p.grouped_mm else "no"
        auto = f"{p.auto} ({p.rung} rung)" if p.fallback else p.auto
        rows.append(
            (
                r.label,
                r.name,
                r.sm_text,
                _gib(r.total_mem),
                _gib(r.free_mem),
                "unknown" if budget is None else _gib(budget),
                link,
                str(r.multiprocessors),
                _yn(p.bf16),
                _yn(p.fp16),
                auto,
                _yn(p.fla_kda),
                gmm,
            )
        )
        said = [r.note] + list(p.why) + [p.fallback]
        notes += [f"  {r.label}: {text}" for text in said if text]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if notes:
        lines += ["", "notes:"] + notes
    lines.append(
        f"budget = free - {BUDGET_RESERVE // MiB} MiB; pcie max = the trained maximum "
        f"(NVML), not the idle current value"
    )
    return "\n".join(lines)


def _yn(b: bool) -> str:
    return "yes" if b else "no"


def main_probe(argv: list[str] | None = None) -> int:
    """`python -m dormouse probe [--index N]`: print the table for the visible devices."""
    ap = argparse.ArgumentParser(prog="dormouse probe", description=main_probe.__doc__)
    ap.add_argument("--index", type=int, default=None, help="only this CUDA ordinal")
    args = ap.parse_args(argv or [])
    try:
        records = probe(args.index)
    except DeviceError as e:
        print(f"probe: {e}")
        return 2
    print(format_probe_table(records))
    return 0
