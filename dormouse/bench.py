"""`python -m dormouse bench`: how fast the trainer's step runs, as a markdown table.

Owns the training-speed benchmark. For each preset it builds the model and optimizer the
way `dormouse train` does (seeded build, the loop's device and autocast resolution,
`MixOptimizer.from_config`, clipping through `opt.clip_grad_norm_`, the LR schedule and
the LFB update after each step), runs untimed warm-up steps and then timed steps on
random byte batches, and prints one row per preset under a statement of the machine.

A benchmark reports; it asserts nothing (tests assert correctness, this reports speed).

    python -m dormouse bench                                   # small, on the auto device
    OMP_NUM_THREADS=2 python -m dormouse bench tiny small --device cpu --steps 5 --warmup 2
    python -m dormouse bench medium b1 --device cuda --batch 8 --seq 512 --out docs/bench.md
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import re
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import torch

from .config import RunConfig, apply_sets, preset, preset_names, validate
from .errors import is_user_error

GiB = 1 << 30

#: Dense peak tensor throughput (TFLOP/s, no 2:4 sparsity) of the cards MFU is quoted for,
#: by the compute dtype the step ran in. Matched on the CUDA device name: (a substring the
#: name must contain, substrings that rule the match out, peaks). H100/H200 numbers are the
#: SXM parts'; the PCIe and NVL parts run lower clocks and are left unmatched ("n/a") rather
#: than guessed. fp32 means plain fp32 FMA (torch's default matmul precision, "highest");
#: with TF32 enabled the fp32 row understates the card, which the machine line states.
PEAK_TFLOPS: tuple[tuple[str, tuple[str, ...], dict[str, float]], ...] = (
    ("H100", ("PCIe", "NVL"), {"bf16": 989.0, "fp32": 67.0}),
    ("H200", ("NVL",), {"bf16": 989.0, "fp32": 67.0}),
    ("A100", (), {"bf16": 312.0, "fp32": 19.5}),
    ("RTX 4090", (), {"bf16": 165.0, "fp32": 82.6}),
)

HEADER = (
    "preset", "params (M)", "active params/token (M)", "batch x seq", "KDA arm", "MoE arm",
    "dtype", "step ms (median)", "step ms (min)", "tokens/s", "model TFLOP/s", "MFU",
    "peak memory",
)  # fmt: skip

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class BenchError(ValueError):
    """A benchmark request that cannot be honoured; names cause and escape."""


@dataclass
class BenchRow:
    preset: str
    params: int
    active: float  # parameters a token's forward applies (see active_params_per_token)
    batch: int
    seq: int
    kda_arm: str
    moe_arm: str
    dtype: str  # "bf16" | "fp32": the forward's compute dtype
    step_ms: list[float]  # one entry per timed step
    peak_bytes: int
    peak_kind: str  # "alloc" (torch.cuda.max_memory_allocated) | "RSS" (process high-water)
    device_name: str
    device_type: str
    skipped: int = 0  # timed steps the loop's rule skipped (non-finite loss or gradient)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.seq / (self.median_ms / 1000)

    @property
    def model_tflops(self) -> float:
        return 6 * self.active * self.tokens_per_s / 1e12

    def mfu(self) -> str:
        if self.device_type != "cuda":
            return "n/a (CPU)"
        peak = peak_tflops(self.device_name, self.dtype)
        if peak is None:
            return f"n/a (no {self.dtype} peak known for {self.device_name})"
        return f"{100 * self.model_tflops / peak:.1f}%"

    def cells(self) -> list[str]:
        return [
            self.preset,
            f"{self.params / 1e6:.2f}",
            f"{self.active / 1e6:.2f}",
            f"{self.batch} x {self.seq}",
            self.kda_arm,
            self.moe_arm,
            self.dtype,
            f"{self.median_ms:.1f}",
            f"{min(self.step_ms):.1f}",
            f"{self.tokens_per_s:,.0f}",
            f"{self.model_tflops:.3g}",
            self.mfu(),
            f"{self.peak_bytes / GiB:.2f} GiB {self.peak_kind}",
        ]


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak for this card and compute dtype, or None when the card is not listed."""
    for needle, excluded, peaks in PEAK_TFLOPS:
        if needle in device_name and not any(x in device_name for x in excluded):
            return peaks.get(dtype)
    return None


def active_params_per_token(model) -> float:
    """Parameters one token's forward multiplies through, the N of the 6N-FLOPs rule.

    Counted per application, not per distinct tensor: the body's blocks run max_iter times
    per token, so their shared weights count max_iter times, while each iteration's
    low-rank delta ({q,k,v,o}_delta.i) runs once. Routed expert stacks (moe.w1/w2/w3)
    count at moe_topk/n_experts, since a token visits only its top-k experts. The byte
    embedding and the Engram tables are excluded: a token gathers one row, a lookup, not
    a matmul. Norm gains, biases and conv taps stay in (elementwise, a rounding error).
    """
    cfg = model.cfg
    share = cfg.moe_topk / cfg.n_experts
    total = 0.0
    for name, p in model.named_parameters():
        if name == "embed.weight" or name.startswith("engram.store."):
            continue
        if not name.startswith("blocks."):
            total += p.numel()
        elif "_delta." in name:
            total += p.numel()
        elif re.search(r"\.moe\.w[123]$", name):
            total += p.numel() * cfg.max_iter * share
        else:
            total += p.numel() * cfg.max_iter
    return total


# ---- the machine ----------------------------------------------------------------------


def machine_lines(device: torch.device, command: str) -> list[str]:
    """Who measured: the device, torch, the CPU and its threads, the date, the command."""
    from .train.device import probe_device

    rec = probe_device(device)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu_name = rec.name if rec.kind == "cpu" else probe_device("cpu").name
    cpu = (f"{cpu_name}, {os.cpu_count()} logical cores ({usable} usable), "
           f"torch threads {torch.get_num_threads()}")  # fmt: skip
    if rec.kind == "cuda":
        dev = (f"{rec.name} ({rec.label}, sm_{rec.sm[0]}{rec.sm[1]}, "
               f"{rec.total_mem / GiB:.1f} GiB)")  # fmt: skip
        tv = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        dev = f"CPU ({rec.name})"
        tv = f"torch {torch.__version__}"
    return [
        f"Machine: {dev}; {tv}; float32 matmul precision "
        f"{torch.get_float32_matmul_precision()}",
        f"CPU: {cpu}; {platform.system()} {platform.machine()}, Python {platform.python_version()}",
        f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"Command: `{command}`",
    ]


def _command(argv: list[str]) -> str:
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
                   if k in os.environ)  # fmt: skip
    cmd = "python -m dormouse bench" + (" " + shlex.join(argv) if argv else "")
    return f"{env} {cmd}" if env else cmd


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


# ---- one preset -----------------------------------------------------------------------


def bench_preset(
    run: RunConfig, device: torch.device, steps: int, warmup: int, say: Callable[[str], None]
) -> BenchRow:
    """Warm up, then time `steps` training steps of `run` on `device`; one table row."""
    from .model import DormouseModel, count_params
    from .train.device import probe_device
    from .train.loop import lr_factor, resolve_autocast, train_step
    from .train.seams import RankShape, Seams
    from .train.optim import MixOptimizer

    cfg = run.train
    dtype = resolve_autocast(run, device, say)
    compute = dtype or torch.float32
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    torch.manual_seed(cfg.seed)
    model = DormouseModel(run.model)
    model.to(device)
    model.train()
    opt = MixOptimizer.from_config(model, cfg, device.type, log=say)

    # Random bytes, drawn before the clock starts so the RNG is not timed; each step still
    # moves its batch to the device, as the loop does.
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    windows = [torch.randint(0, 256, (cfg.batch, cfg.seq_len + 1), generator=gen)
               for _ in range(warmup + steps)]  # fmt: skip

    seams = Seams([RankShape(cfg.batch, cfg.seq_len)])

    def step(i: int) -> bool:
        w = windows[i]
        return train_step(model, opt, seams, w[:, :-1], w[:, 1:], cfg, lr_factor(i, cfg),
                          device, dtype)[2]  # fmt: skip

    say(f"  {warmup} warm-up step(s) (untimed) ...")
    for i in range(warmup):
        step(i)
    say(f"  {steps} timed step(s) ...")
    times: list[float] = []
    skipped = 0
    if cuda:
        torch.cuda.synchronize(device)
        events = []
        for i in range(warmup, warmup + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            skipped += not step(i)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
        peak, peak_kind = torch.cuda.max_memory_allocated(device), "alloc"
    else:
        for i in range(warmup, warmup + steps):
            t0 = time.perf_counter()
            skipped += not step(i)
            times.append(1000 * (time.perf_counter() - t0))
        peak, peak_kind = _peak_rss_bytes(), "RSS"

    mixer, moe = model.blocks[0].mixer, model.blocks[0].moe
    row = BenchRow(
        preset=run.source.removeprefix("preset:"),
        params=count_params(run.model),
        active=active_params_per_token(model),
        batch=cfg.batch,
        seq=cfg.seq_len,
        kda_arm=mixer.impl or "?",
        moe_arm=moe._arm(device, compute),  # the MoE's own verdict for this device and dtype
        dtype="fp32" if dtype is None else str(dtype).replace("torch.", ""),
        step_ms=times,
        peak_bytes=int(peak),
        peak_kind=peak_kind,
        device_name=probe_device(device).name,
        device_type=device.type,
        skipped=skipped,
    )
    del model, opt, windows
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


# ---- the table ------------------------------------------------------------------------


def format_table(rows: list[BenchRow]) -> str:
    text_cols = {"preset", "batch x seq", "KDA arm", "MoE arm", "dtype"}
    out = ["| " + " | ".join(HEADER) + " |",
           "|" + "|".join("---" if h in text_cols else "---:" for h in HEADER) + "|"]  # fmt: skip
    out += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(out)


def _peaks_text() -> str:
    return "; ".join(
        f"{needle}" + (f" (not {'/'.join(excl)})" if excl else "") + ": "
        + ", ".join(f"{dt} {v:g}" for dt, v in peaks.items())
        for needle, excl, peaks in PEAK_TFLOPS
    )


def format_report(rows: list[BenchRow], machine: list[str], steps: int, warmup: int) -> str:
    peak_note = (
        "torch.cuda.max_memory_allocated over warm-up and timed steps (alloc)"
        if rows and rows[0].device_type == "cuda"
        else "the process's peak resident set (RSS, getrusage ru_maxrss): the whole process "
        "since start, torch included, and never lower than an earlier preset's"
    )
    notes = [
        f"Method: {warmup} untimed warm-up step(s), then {steps} timed training step(s) per "
        "preset on uniform random bytes; step = forward + backward + clip + MixOptimizer "
        "step + LFB update, built as `dormouse train` builds it. Step ms is "
        + ("CUDA-event time per step" if rows and rows[0].device_type == "cuda"
           else "wall time per step (perf_counter)")
        + "; tokens/s = batch x seq / median step.",
        "Active params/token: what one token's forward multiplies through: the looped body's "
        "shared weights once per iteration (max_iter), each iteration's low-rank delta once, "
        "routed experts at moe_topk/n_experts; embedding and Engram table lookups excluded.",
        "Model TFLOP/s = 6 x active params/token x tokens/s. It ignores the KDA recurrence's "
        "own FLOPs (the chunked state updates), so it understates the work done. MFU = model "
        f"TFLOP/s / the card's dense peak in the step's compute dtype ({_peaks_text()}); n/a "
        "on the CPU and on unlisted cards.",
        f"Peak memory: {peak_note}.",
    ]
    skipped = [f"{r.preset}: {r.skipped}/{len(r.step_ms)}" for r in rows if r.skipped]
    if skipped:
        notes.append("Timed steps skipped as non-finite (still timed): " + ", ".join(skipped))
    return "\n".join(
        ["## dormouse bench: training step", ""]
        + [f"- {line}" for line in machine]
        + ["", format_table(rows), ""]
        + [f"- {n}" for n in notes]
    ) + "\n"


# ---- the command ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dormouse bench", description=__doc__.splitlines()[0])
    names = ", ".join(preset_names())
    ap.add_argument("presets", nargs="*", metavar="PRESET",
                    help=f"presets to time ({names}; default small)")  # fmt: skip
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    ap.add_argument("--batch", type=int, help="batch size (default: the preset's)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    ap.add_argument("--steps", type=int, help="timed steps (default 5 on CPU, 20 on CUDA)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 1 on CPU, 5 on CUDA)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, as in train")  # fmt: skip
    ap.add_argument("--kda-impl", choices=("auto", "torch", "fla"), help="the KDA arm")
    ap.add_argument("--out", help="also write the markdown report to this file")
    return ap


def _runs(args) -> list[RunConfig]:
    """Every preset's run, resolved and validated before anything is timed."""
    sets = list(args.set)
    if args.batch is not None:
        sets.append(f"batch={args.batch}")
    if args.seq is not None:
        sets.append(f"seq_len={args.seq}")
    if args.kda_impl:
        sets.append(f"kda_impl={args.kda_impl}")
    return [validate(apply_sets(preset(name), sets)) for name in args.presets or ["small"]]


def _refuse_unrunnable_kda(runs: list[RunConfig], device: torch.device) -> None:
    """An explicit kda_impl=fla that cannot run here, refused before anything is timed.

    fp32 stands in for the compute dtype: fla takes fp32 and bf16 alike, so the dtype is
    never the blocker for a run dormouse can configure.
    """
    from .model.kda import choose_kda_impl

    for run in runs:
        try:
            choose_kda_impl(run.model.kda_impl, device, torch.float32, run.model.head_dim)
        except RuntimeError as e:
            raise BenchError(str(e)) from None


def main_bench(argv: list[str]) -> int:
    """`python -m dormouse bench [PRESET ...] [flags]`: print (and --out) the table."""
    argv = list(argv)
    if argv[:1] == ["--"]:  # the CLI's remainder separator
        argv = argv[1:]
    args = _parser().parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if not _DEVICE_RE.match(args.device):
            raise BenchError(f"--device {args.device!r} is not auto, cpu, cuda or cuda:N")
        runs = _runs(args)
        from .train.loop import resolve_device

        device = resolve_device(args.device, say)
        cuda = device.type == "cuda"
        steps = args.steps if args.steps is not None else (20 if cuda else 5)
        warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
        if steps < 1 or warmup < 0:
            raise BenchError(f"--steps {steps} --warmup {warmup}: time at least one step "
                             f"(steps >= 1) after zero or more warm-up steps")  # fmt: skip
        _refuse_unrunnable_kda(runs, device)
        if any(r.train.fit_gb for r in runs):  # --set fit_gb=GB plans as train --fit does
            from .train.fit import apply_fit

            runs = [apply_fit(r, log=say) for r in runs]
        machine = machine_lines(device, _command(argv))
        rows = []
        for k, run in enumerate(runs, 1):
            name = run.source.removeprefix("preset:")
            say(f"[{k}/{len(runs)}] {name}: batch {run.train.batch} x seq {run.train.seq_len} "
                f"on {device}")  # fmt: skip
            row = bench_preset(run, device, steps, warmup, say)
            say(f"  {name}: median {row.median_ms:.1f} ms/step, {row.tokens_per_s:,.0f} tokens/s")
            rows.append(row)
    except Exception as e:
        if isinstance(e, BenchError) or is_user_error(e):
            print(f"bench: {e}", file=sys.stderr)
            return 2
        raise

    text = format_report(rows, machine, steps, warmup)
    print(text, end="", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        say(f"written to {args.out}")
    return 0
