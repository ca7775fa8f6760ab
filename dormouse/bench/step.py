"""step: the training step's speed, one row per preset (the default sub-benchmark).

Each preset's model, optimizer and step as `dormouse train` builds them, untimed warm-up
steps, then timed steps on random byte windows.

    OMP_NUM_THREADS=2 python -m dormouse bench step tiny small --device cpu --steps 5
    python -m dormouse bench step medium b1 --device cuda --batch 8 --seq 512 --out docs/bench.md
    python -m dormouse bench small --baseline gpt --device cuda --batch 64 --seq 256

`--baseline gpt` adds, after each preset, the plain GPT of equal total parameters (model/gpt.py
`gpt_twin`) timed in the same process on the same windows through the same `train_step`, and
the ratio dormouse / GPT tokens/s.
"""

from __future__ import annotations

import gc
import logging
import re
import resource
import statistics
import sys
from dataclasses import replace

import torch


from ..config import RunConfig, preset, preset_names, validate
from .common import BenchError, GiB, build, configure, machine_lines, report, resolve_device, table
from .common import timed, windows

log = logging.getLogger(__name__)

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
HEADER = ("preset|params (M)|active params/token (M)|batch x seq|KDA arm|MoE arm|dtype|"
          "step ms (median)|step ms (min)|tokens/s|model TFLOP/s|MFU|peak memory").split("|")
NOTES = (
    "Step = forward + backward + clip + MixOptimizer step + LFB update on random bytes, by wall "
    "clock with the device synchronised; tokens/s = batch x seq / median step.",
    "Active params/token: the looped body once per iteration, routed experts at moe_topk/"
    "n_experts, lookups excluded; model TFLOP/s = 6 x that x tokens/s (KDA recurrence FLOPs "
    "uncounted); MFU against the card's dense peak (PEAK_TFLOPS), n/a on CPU, unlisted cards.",
    "Peak memory: torch.cuda.max_memory_allocated on CUDA; on the CPU the process's peak RSS "
    "(the whole process, never lower than an earlier preset's).",
)  # fmt: skip
BASELINE_HEADER = ["compile", "dormouse / GPT tokens/s"]
BASELINE_NOTES = (
    "Baseline (--baseline gpt): after each preset, the plain GPT (model/gpt.py: SDPA causal "
    "attention, GELU MLP, tied head) of equal total parameters (gpt_twin: heads of 64, MLP 4 x "
    "d_model, within 3% of the count, d_model / n_layers nearest GPT-2's 64), with the preset's "
    "train config: the same windows, dtype, optimizer routing, clip and loop.train_step.",
    "The GPT's active params count every matrix once, the tied embedding as the head; "
    "attention's score FLOPs are uncounted in both rows (the 6N rule).",
    "compile: torch.compile(model, dynamic=False) as the loop's net; the first, compiling step "
    "is timed alone (shown) and left out of step ms, then the warm-up and timed steps run.",
)  # fmt: skip


def add_args(ap) -> None:
    names = ", ".join(preset_names())
    ap.add_argument("presets", nargs="*", metavar="PRESET", help=f"{names} (default small)")
    ap.add_argument("--batch", type=int, help="batch size (default: the preset's)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    ap.add_argument("--steps", type=int, help="timed steps (default 5 on CPU, 20 on CUDA)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 1 on CPU, 5 on CUDA)")
    ap.add_argument("--kda-impl", choices=("auto", "torch", "fla"), help="the KDA arm")
    ap.add_argument("--baseline", choices=("gpt",),
                    help="also time the plain GPT of equal total parameters on the same bytes "
                    "and print dormouse / GPT tokens/s")  # fmt: skip
    ap.add_argument("--compile", choices=("auto", "on", "off"),
                    help="torch.compile the GPT row (auto, the default: on CUDA, off on the CPU "
                    "where inductor compiles slowly); its compile is timed apart")  # fmt: skip


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak for this card and compute dtype, or None when the card is not listed."""
    for needle, excluded, peaks in PEAK_TFLOPS:
        if needle in device_name and not any(x in device_name for x in excluded):
            return peaks.get(dtype)
    return None


def active_params_per_token(model) -> float:
    """Parameters one token's forward multiplies through, the N of the 6N-FLOPs rule: the
    body's shared weights max_iter times (routed expert stacks at moe_topk/n_experts of
    that), each iteration's low-rank delta once; the embedding and Engram tables are
    lookups, not matmuls. Gains, biases and conv taps stay in (a rounding error). The GPT
    baseline: every block once, the tied embedding counted as the head it also is, the
    position table a lookup."""
    cfg, total = model.cfg, 0.0
    if cfg.arch == "gpt":  # every block once; the tied embedding is the head's matmul
        return float(sum(p.numel() for name, p in model.named_parameters() if name != "pos.weight"))
    for name, p in model.named_parameters():
        if name == "embed.weight" or name.startswith("engram.store."):
            continue
        if not name.startswith("blocks.") or "_delta." in name:
            total += p.numel()
        else:
            share = cfg.moe_topk / cfg.n_experts if re.search(r"\.moe\.w[123]$", name) else 1
            total += p.numel() * cfg.max_iter * share
    return total


def twin(run: RunConfig) -> RunConfig:
    """The GPT baseline of `run`: equal total parameters (model/gpt.py `gpt_twin`), the same
    train config, hence the same windows, dtype and optimizer."""
    from ..model import count_params
    from ..model.gpt import gpt_twin

    m = gpt_twin(run.model, count_params(run.model))
    name = run.source.removeprefix("preset:")
    same = [n for n in preset_names() if (n.startswith("gpt") and preset(n).model ==
            replace(m, dropout=preset(n).model.dropout))]  # fmt: skip
    label = f"gpt {m.d_model} x {m.n_layers} (twin of {name}{f'; {same[0]} shape' if same else ''})"
    return validate(RunConfig(source=label, model=m, train=run.train))


def bench_preset(run: RunConfig, device: torch.device, steps: int, warmup: int,
                 compile: bool = False) -> tuple[list, int, float | None]:  # fmt: skip
    """(the table row of `run` on `device`, timed steps skipped as non-finite, seconds of the
    first (compiling) step when `compile`, else None)."""
    from ..model import count_params
    from ..train.device import probe_device

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, step, dtype = build(run, device, compile=compile)
    data, taken = windows(run, warmup + steps), []
    compile_s = None
    compile = compile or run.train.compile
    if compile:  # dynamo traces and inductor compiles on the first call: timed alone
        try:
            compile_s = timed(lambda i: step(0, data[0]), 1, 0, device)[0] / 1000
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise BenchError(f"torch.compile of {run.source} failed on {device} "
                             f"({type(e).__name__}: {first}); rerun with --compile off") from e
    ms = timed(lambda i: taken.append(step(i, data[i])), steps, warmup, device)
    if cuda:
        peak = f"{torch.cuda.max_memory_allocated(device) / GiB:.2f} GiB alloc"
    else:  # Linux reports ru_maxrss in KiB, macOS in bytes
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = f"{rss * (1 if sys.platform == 'darwin' else 1024) / GiB:.2f} GiB RSS"
    dt = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]  # PEAK_TFLOPS' keys
    med, active = statistics.median(ms), active_params_per_token(model)
    name = probe_device(device).name
    tok_s = run.train.batch * run.train.seq_len / (med / 1000)
    tflops, top = 6 * active * tok_s / 1e12, peak_tflops(name, dt)
    mfu = ("n/a (CPU)" if not cuda else f"n/a (no {dt} peak known for {name})" if top is None
           else f"{100 * tflops / top:.1f}%")  # fmt: skip
    if run.model.arch == "gpt":
        arms = ["- (SDPA attention)", "- (GELU MLP)"]
    else:
        arms = [model.blocks[0].mixer.impl, model.blocks[0].moe.arm(device, dtype or torch.float32).name]
    return [run.source.removeprefix("preset:"), f"{count_params(run.model) / 1e6:.2f}",
            f"{active / 1e6:.2f}", f"{run.train.batch} x {run.train.seq_len}", *arms,
            dt, f"{med:.1f}", f"{min(ms):.1f}", f"{tok_s:,.0f}", f"{tflops:.3g}", mfu,
            peak], taken[warmup:].count(False), compile_s  # fmt: skip


def run(args, command: str) -> str:
    from ..model.arms import require_arms

    sets = args.set + ([f"kda_impl={args.kda_impl}"] if args.kda_impl else [])
    runs = [configure(n, sets, args.batch, args.seq) for n in args.presets or ["small"]]
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    steps = args.steps if args.steps is not None else (20 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    if steps < 1 or warmup < 0:
        raise BenchError(f"--steps {steps} --warmup {warmup}: time at least one step "
                         f"(steps >= 1) after zero or more warm-up steps")  # fmt: skip
    if args.compile and not args.baseline:
        raise BenchError(f"--compile {args.compile} applies to the GPT baseline row, which is "
                         f"not asked for; add --baseline gpt or drop --compile")  # fmt: skip
    compile = {"on": True, "off": False}.get(args.compile or "auto", cuda)
    for r in runs:  # a pinned kda_impl=fla that cannot run here, refused before any timing
        if args.baseline and r.model.arch != "dormouse":
            raise BenchError(f"--baseline gpt pairs a dormouse preset with its GPT twin; "
                             f"{r.source.removeprefix('preset:')} is already arch={r.model.arch}: "
                             f"drop --baseline or name a dormouse preset (tiny, small, ...)")
        try:
            if r.model.arch == "dormouse":  # the GPT has no kernel arms
                require_arms(r.model, device)
        except RuntimeError as e:
            raise BenchError(str(e)) from None
    if any(r.train.fit_gb for r in runs):  # --set fit_gb=GB plans as train --fit does
        from ..train.fit import apply_fit

        runs = [apply_fit(r) for r in runs]
    machine, rows, skipped = machine_lines(device, command), [], []
    for k, r in enumerate(runs, 1):
        pair = [r, twin(r)] if args.baseline else [r]
        for j, x in enumerate(pair):
            c = compile and j == 1
            log.info(f"[{k}/{len(runs)}] {x.source}: batch {x.train.batch} x seq "
                     f"{x.train.seq_len} on {device}, {'1 compiling + ' if c else ''}{warmup} "
                     f"warm-up + {steps} timed step(s)")  # fmt: skip
            row, skips, compile_s = bench_preset(x, device, steps, warmup, c)
            if args.baseline:
                row += [f"on ({compile_s:.1f} s first step)" if compile_s is not None else
                        "- (as train runs it)" if j == 0 else "off"]  # fmt: skip
            rows.append(row)
            skipped += [f"{row[0]}: {skips}/{steps}"] if skips else []
        if args.baseline:
            ratio = _tok_s(rows[-2]) / _tok_s(rows[-1])
            rows[-2].append(f"{ratio:.2f}x")
            rows[-1].append("-")
    notes = [f"Method: {warmup} untimed warm-up step(s), then {steps} timed step(s) per preset, "
             "built as `dormouse train` builds them.", *NOTES]
    header = HEADER
    if args.baseline:
        header = [*HEADER, *BASELINE_HEADER]
        notes += BASELINE_NOTES
    if skipped:
        notes.append("Timed steps skipped as non-finite (still timed): " + ", ".join(skipped))
    return report("dormouse bench step: training step", machine, table(header, rows), notes)


def _tok_s(row: list) -> float:
    return float(row[HEADER.index("tokens/s")].replace(",", ""))
