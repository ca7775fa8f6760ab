"""step: the training step's speed, one row per preset (the default sub-benchmark).

Each preset's model, optimizer and step as `dormouse train` builds them, untimed warm-up
steps, then timed steps on random byte windows.

    OMP_NUM_THREADS=2 python -m dormouse bench step tiny small --device cpu --steps 5
    python -m dormouse bench step medium b1 --device cuda --batch 8 --seq 512 --out bench.md
    python -m dormouse bench small --baseline gpt --device cuda --batch 64 --seq 256

`--baseline gpt` adds, after each preset, the plain GPT of equal total parameters (model/gpt.py
`gpt_twin`) timed in the same process on the same windows through the same `train_step`, and
the ratio dormouse / GPT tokens/s.

On CUDA a large matmul is timed first (flops.matmul_peak; `--peak-tflops X` gives the figure
instead): MFU and HFU against it stand beside MFU against the datasheet peak (PEAK_TFLOPS).
`--parts` then times each part of the step alone (parts.py) and prints the step against their
sum and the optimizer's share of it.
"""

from __future__ import annotations

import gc
import logging
import math
import resource
import statistics
import sys
import time
from dataclasses import replace

import torch

from ..config import RunConfig, apply_sets, preset, preset_names, validate
from ..model import active_params as active_params_per_token
from ..model.model import mixer_impl
from .common import (
    BenchError,
    GiB,
    compile_text,
    configure,
    harness,
    machine_lines,
    report,
    resolve_device,
    shape_text,
    table,
    timed,
    windows,
)

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
HEADER = [
    "preset",
    "params (M)",
    "active params/token (M)",
    "batch x seq",
    "KDA arm",
    "MoE arm",
    "dtype",
    "compile",
    "first step s",
    "step ms (median)",
    "step ms (min)",
    "tokens/s",
    "model TFLOP/s",
    "MFU (datasheet)",
    "MFU (measured peak)",
    "TFLOP/step: 6N + mixer + polar",
    "HFU (measured peak)",
    "peak memory",
]
NOTES = (
    "Step = forward + backward + clip + MixOptimizer step + LFB update on random bytes, by wall "
    "clock with the device synchronised around each step; with the verdict on the device (the "
    "run's `verdict=...: on the device` line) the timed steps run back to back, as the loop "
    "runs them, the device synchronised before the first and after the last, and each step's "
    "ms is their mean (median = min then); tokens/s = the step's windows x seq / median step (with global_batch: all its micro-batches).",
    "Active params/token: the looped body once per iteration, routed experts at moe_topk/"
    "n_experts, lookups excluded; model TFLOP/s = 6 x that x tokens/s (the 6N rule: KDA's "
    "recurrence, attention's scores and Muon's polar uncounted).",
    (
        "MFU (datasheet): model TFLOP/s over the card's dense datasheet peak (PEAK_TFLOPS; n/a "
        "on the CPU and unlisted cards). MFU (measured peak): the same over the matmul rate "
        "measured above (Peak line): issue #16's definition of MFU."
    ),
    (
        "TFLOP/step: what one step computes: 6N x tokens + the mixer (dormouse: KDA's chunked "
        "recurrence, flops.kda_chunk_flops per head and chunk; GPT: causal attention's two "
        "products), forward x 3 for forward + backward as the 6N rule does, + Muon's Newton-"
        "Schulz polar (flops.polar_flops: per matrix [r <= c] 4r^2c + 2r^3 per iteration x "
        "ns_steps, per step). HFU (measured peak): that sum / step time / the measured peak. "
        "Uncounted: elementwise work (and, with an fla-core release whose saved set "
        "model/kda_fla.py does not know, the KDA forward the compiled op's backward runs again)."
    ),
    "compile: what `train` with these settings runs (compile=auto: on CUDA torch.compile in "
    "reduce-overhead where the shapes are static, else default mode; off on the CPU; "
    "--set compile=false|true, compile_mode=M pin it). First step s: from the model's build "
    "to the end of its first step (tracing, compiling, kernel autotune: the cold start a "
    "`train` pays before step 1; a second run reads inductor's and Triton's caches). The first "
    "two steps are left out of step ms.",
    "Peak memory: torch.cuda.max_memory_allocated on CUDA; on the CPU the process's peak RSS "
    "(the whole process, never lower than an earlier preset's).",
)
PARTS_HEADER = ["preset", "part", "ms (median)", "ms (min)", "share of the step"]
PARTS_NOTE = (
    "Parts (--parts, parts.py): after the timed steps, on the same model, optimizer and window, "
    "each of loop.train_step's pieces alone, {w} untimed then {n} timed repetitions each, the "
    "device synchronised around each: the forward (the step's autocast, compile and CUDA-graph "
    "step marks; its graph then dropped), forward + backward (from no gradients, as in the step; "
    "backward = its median less the forward's), the clip phase (host-row reduction, unscale "
    "under fp16, the optimizer's clip, the verdict read to the host), the optimizer phase "
    "(opt.step(): the captured CUDA graph when the optimizer graph is on; zero_grad), the LFB "
    "update. Sum of parts = forward + backward + clip + optimizer + lfb; the step also holds the "
    "window's host-to-device copy and the lr schedule. A benchmark: the repeated optimizer "
    "steps move the parameters on the same gradients, each clip rescales them again."
)
BASELINE_HEADER = ["dormouse / GPT tokens/s"]
BASELINE_NOTES = (
    "Baseline (--baseline gpt): after each preset, the plain GPT (model/gpt.py: SDPA causal "
    "attention, GELU MLP, tied head) of equal total parameters (gpt_twin: heads of 64, MLP 4 x "
    "d_model, within 3% of the count, d_model / n_layers nearest GPT-2's 64), with the preset's "
    "train config: the same windows, dtype, optimizer routing, clip and loop.train_step.",
    (
        "The GPT's active params count every matrix once, the tied embedding as the head; "
        "attention's score FLOPs are uncounted in model TFLOP/s and MFU (the 6N rule) and counted "
        "in the GPT row's TFLOP/step and HFU, as KDA's recurrence is in the dormouse row's."
    ),
)


def add_args(ap) -> None:
    names = ", ".join(preset_names())
    ap.add_argument("presets", nargs="*", metavar="PRESET", help=f"{names} (default small)")
    ap.add_argument("--batch", type=int, help="batch size (default: the preset's)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    ap.add_argument("--steps", type=int, help="timed steps (default 5 on CPU, 20 on CUDA)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 1 on CPU, 5 on CUDA)")
    ap.add_argument("--kda-impl", choices=("auto", "torch", "fla"), help="the KDA arm")
    ap.add_argument(
        "--baseline",
        choices=("gpt",),
        help="also time the plain GPT of equal total parameters on the same bytes "
        "and print dormouse / GPT tokens/s",
    )
    ap.add_argument(
        "--parts",
        action="store_true",
        help="after the timed steps, time each part of the step alone (forward, "
        "backward, clip, optimizer, LFB update) and print the step against their "
        "sum and the optimizer's share",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        metavar="X",
        help="the matmul peak (TFLOP/s) MFU and HFU divide by, instead of the one "
        "measured on CUDA (on the CPU: none without this)",
    )
    ap.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        help="compile of the GPT row (auto, the default: as the dormouse row, "
        "i.e. as train decides: on CUDA, off on the CPU)",
    )


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The dense peak for this card and compute dtype, or None when the card is not listed."""
    for needle, excluded, peaks in PEAK_TFLOPS:
        if needle in device_name and not any(x in device_name for x in excluded):
            return peaks.get(dtype)
    return None


def twin(run: RunConfig) -> RunConfig:
    """The GPT baseline of `run`: equal total parameters (model/gpt.py `gpt_twin`), the same
    train config, hence the same windows, dtype and optimizer."""
    from ..model import count_params
    from ..model.gpt import gpt_twin

    m = gpt_twin(run.model, count_params(run.model))
    name = run.source.removeprefix("preset:")
    same = [
        n
        for n in preset_names()
        if (n.startswith("gpt") and preset(n).model == replace(m, dropout=preset(n).model.dropout))
    ]
    label = f"gpt {m.d_model} x {m.n_layers} (twin of {name}{f'; {same[0]} shape' if same else ''})"
    return validate(RunConfig(source=label, model=m, train=run.train))


def bench_preset(
    run: RunConfig,
    device: torch.device,
    steps: int,
    warmup: int,
    peak: float | None = None,
    parts: bool = False,
) -> tuple[list, int, float, list]:
    """(the table row of `run` on `device`, timed steps skipped as non-finite, seconds from the
    build to the end of the first step (the cold start: compile, CUDA-graph capture, kernel
    autotune), and with `parts` the parts table's rows). `peak`: the matmul TFLOP/s MFU and
    HFU (measured peak) divide by (None: n/a)."""
    from ..model import count_params
    from ..train.plan.device import probe_device
    from .flops import step_flops

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    h = harness(run, device)
    model, step, dtype = h.model, h.step, h.dtype
    data, taken = windows(run, warmup + steps), []
    # the first step traces and compiles (or tunes kernels), timed alone with the build: what
    # a `train` of this config pays before its first step's log line
    try:
        timed(lambda i: step(0, data[0]), 1, 0, device)
        start_s = time.perf_counter() - t0
        # and the second: a guard the first trace broke recompiles here (the lazily chosen
        # KDA arm did: 13.6 s for small on the H200); CUDA graphs are recorded here too
        second_s = timed(lambda i: step(1, data[1 % len(data)]), 1, 0, device)[0] / 1000
    except Exception as e:
        if not h.train.compile:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise BenchError(
            f"torch.compile of {run.source} failed on {device} "
            f"({type(e).__name__}: {first}); rerun with --set compile=false"
        ) from e
    log.info(
        f"{run.source}: build + first step {start_s:.1f} s, second step {second_s:.2f} s "
        f"(untimed in step ms; a second step far above step ms is a recompile: "
        f"TORCH_LOGS=recompiles says why)"
    )
    ms = timed(lambda i: taken.append(step(i, data[i])), steps, warmup, device, chain=h.defer)
    taken = [bool(ok) for ok in taken]  # verdict=device: bool tensors, read once all have run
    if cuda:
        peak_mem = f"{torch.cuda.max_memory_allocated(device) / GiB:.2f} GiB alloc"
    else:  # Linux reports ru_maxrss in KiB, macOS in bytes
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mem = f"{rss * (1 if sys.platform == 'darwin' else 1024) / GiB:.2f} GiB RSS"
    dt = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]  # PEAK_TFLOPS' keys
    med, active = statistics.median(ms), active_params_per_token(model)
    name = probe_device(device).name
    t = run.train
    tok_s = h.ctx.shape.tokens / (med / 1000)
    tflops, top = 6 * active * tok_s / 1e12, peak_tflops(name, dt)
    mfu = (
        "n/a (CPU)"
        if not cuda
        else f"n/a (no {dt} peak known for {name})"
        if top is None
        else f"{100 * tflops / top:.1f}%"
    )
    work = step_flops(model, h.opt, h.ctx.shape.windows, t.seq_len, active)
    mixer = work["KDA"] + work["attention"]
    per_step = (
        f"{work['6N'] / 1e12:.3g} + {mixer / 1e12:.3g} + {work['polar'] / 1e12:.3g} = "
        f"{sum(work.values()) / 1e12:.3g}"
    )
    if peak is None:
        mfu_m = hfu = "n/a (CPU: no peak; --peak-tflops X)" if not cuda else "n/a"
    else:
        mfu_m = f"{100 * tflops / peak:.1f}%"
        hfu = f"{100 * sum(work.values()) / (med / 1000) / 1e12 / peak:.1f}%"
    if run.model.arch == "gpt":
        arms = ["- (SDPA attention)", "- (GELU MLP)"]
    else:
        arms = [
            mixer_impl(model),
            model.blocks[0].moe.arm(device, dtype or torch.float32).name,
        ]
    label = run.source.removeprefix("preset:")
    row = [
        label,
        f"{count_params(run.model) / 1e6:.2f}",
        f"{active / 1e6:.2f}",
        shape_text(run),
        *arms,
        dt,
        compile_text(h.train),
        f"{start_s:.1f}",
        f"{med:.1f}",
        f"{min(ms):.1f}",
        f"{tok_s:,.0f}",
        f"{tflops:.3g}",
        mfu,
        mfu_m,
        per_step,
        hfu,
        peak_mem,
    ]
    part_rows = _part_rows(label, h, data[-1], steps, warmup, device, med) if parts else []
    return row, taken[warmup:].count(False), start_s, part_rows


def _part_rows(
    label: str, h, window, steps: int, warmup: int, device: torch.device, step_ms: float
) -> list[list]:
    """The parts table's rows for one preset (parts.time_parts: `steps` repetitions of each
    after at least one untimed one), then the sum, the step, and the summary cells."""
    from .parts import PARTS, time_parts

    # one untimed repetition at least: a forward alone may first record its CUDA graph
    try:
        got = time_parts(h, window, steps, max(1, warmup), device)
    except Exception as e:  # the step's row stands; the parts table says why it is empty
        log.exception(f"--parts of {label} failed")
        first = (str(e).strip().splitlines() or [""])[0][:200].replace("|", "/")
        return [[label, f"(parts not timed: {type(e).__name__})", "-", "-", first]]

    def share(ms: float) -> str:
        return f"{100 * ms / step_ms:.1f}%"

    rows = []
    for part in ("forward + backward", *PARTS):
        ms = got[part]
        timed_alone = part != "backward"
        rows.append(
            [
                label,
                part if timed_alone else "backward (= forward + backward - forward)",
                f"{statistics.median(ms):.2f}",
                f"{min(ms):.2f}" if timed_alone else "-",
                share(statistics.median(ms))
                if part != "forward + backward"
                else f"({share(statistics.median(ms))})",
            ]
        )
    total = sum(statistics.median(got[p]) for p in PARTS)
    rows.append([label, "sum of parts", f"{total:.2f}", "-", share(total)])
    rows.append([label, "step (the timed steps' median)", f"{step_ms:.2f}", "-", "100.0%"])
    rows.append([label, "step / sum of parts", f"{step_ms / total:.2f}x", "-", "-"])
    return rows


def run(args, command: str) -> str:
    from ..model.arms import require_arms

    sets = args.set + ([f"kda_impl={args.kda_impl}"] if args.kda_impl else [])
    runs = [configure(n, sets, args.batch, args.seq) for n in args.presets or ["small"]]
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    steps = args.steps if args.steps is not None else (20 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    if steps < 1 or warmup < 0:
        raise BenchError(
            f"--steps {steps} --warmup {warmup}: time at least one step "
            f"(steps >= 1) after zero or more warm-up steps"
        )
    if args.compile and not args.baseline:
        raise BenchError(
            f"--compile {args.compile} applies to the GPT baseline row, which is "
            f"not asked for; add --baseline gpt or drop --compile"
        )
    twin_compile = {"on": "compile=true", "off": "compile=false"}.get(args.compile or "auto")
    for r in runs:  # a pinned kda_impl=fla that cannot run here, refused before any timing
        if args.baseline and r.model.arch != "dormouse":
            raise BenchError(
                f"--baseline gpt pairs a dormouse preset with its GPT twin; "
                f"{r.source.removeprefix('preset:')} is already arch={r.model.arch}: "
                f"drop --baseline or name a dormouse preset (tiny, small, ...)"
            )
        try:
            if r.model.arch == "dormouse":  # the GPT has no kernel arms
                require_arms(r.model, device)
        except RuntimeError as e:
            raise BenchError(str(e)) from None
    if any(r.train.fit_gb for r in runs):  # --set fit_gb=GB plans as train --fit does
        from ..train.plan.fit import apply_fit

        runs = [apply_fit(r) for r in runs]
    dts = [_dtype_name(r, device) for r in runs]  # a twin computes in its preset's dtype
    peaks, peak_line = _peaks(sorted(set(dts)), device, args.peak_tflops)
    machine, rows, skipped, part_rows = [*machine_lines(device, command), peak_line], [], [], []
    for k, r in enumerate(runs, 1):
        pair = [r, twin(r)] if args.baseline else [r]
        if twin_compile and args.baseline:
            pair[1] = validate(apply_sets(pair[1], [twin_compile]))
        for x in pair:
            log.info(
                f"[{k}/{len(runs)}] {x.source}: {shape_text(x)} on {device}, 2 first "
                f"(build, compile) + {warmup} warm-up + {steps} timed step(s)"
            )
            row, skips, _, parts = bench_preset(
                x, device, steps, warmup, peaks.get(dts[k - 1]), args.parts
            )
            part_rows += parts
            rows.append(row)
            skipped += [f"{row[0]}: {skips}/{steps}"] if skips else []
        if args.baseline:
            ratio = _tok_s(rows[-2]) / _tok_s(rows[-1])
            rows[-2].append(f"{ratio:.2f}x")
            rows[-1].append("-")
    notes = [
        f"Method: {warmup} untimed warm-up step(s), then {steps} timed step(s) per preset, "
        "built as `dormouse train` builds them.",
        *NOTES,
    ]
    header = HEADER
    if args.baseline:
        header = [*HEADER, *BASELINE_HEADER]
        notes += BASELINE_NOTES
    if skipped:
        notes.append("Timed steps skipped as non-finite (still timed): " + ", ".join(skipped))
    body = table(header, rows)
    if args.parts:
        body += "\n\nThe step's parts, each timed alone (--parts):\n\n" + table(
            PARTS_HEADER, part_rows
        )
        notes += [PARTS_NOTE.format(n=steps, w=max(1, warmup))]
    return report("dormouse bench step: training step", machine, body, notes)


def _dtype_name(run: RunConfig, device: torch.device) -> str:
    from ..train.run import dtype_name, resolve_autocast

    return dtype_name(resolve_autocast(run, device))


def _peaks(
    dts: list[str], device: torch.device, given: float | None
) -> tuple[dict[str, float], str]:
    """({compute dtype: the matmul TFLOP/s MFU and HFU divide by}, the report's Peak line):
    `given` (--peak-tflops) for the rows' one dtype, else measured on CUDA (flops.matmul_peak)
    once per dtype `dts` the rows compute in, else none (the CPU)."""
    if given is not None:
        if not (math.isfinite(given) and given > 0):
            raise BenchError(
                f"--peak-tflops {given}: a peak is a positive TFLOP/s figure "
                f"(e.g. --peak-tflops 790); leave it out to measure it on CUDA"
            )
        if len(dts) > 1:
            raise BenchError(
                f"--peak-tflops {given} is one peak, but these rows compute in "
                f"{' and '.join(dts)}; bench one dtype at a time or leave "
                f"--peak-tflops out to measure each on CUDA"
            )
        return {dts[0]: given}, (
            f"Peak (MFU and HFU, measured peak): {given:g} TFLOP/s "
            f"{dts[0]}, given by --peak-tflops (not measured)"
        )
    if device.type != "cuda":
        return {}, (
            "Peak (MFU and HFU, measured peak): none on the CPU (n/a; --peak-tflops X "
            "divides by a figure of your own)"
        )
    from .flops import PEAK_N, PEAK_REPS, PEAK_WARMUP, matmul_peak

    torch_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    peaks, said = {}, []
    for dt in dts:
        med, best = matmul_peak(device, torch_dt[dt])
        peaks[dt] = med
        said.append(f"{dt} {med:.1f} TFLOP/s (best {best:.1f})")
        log.info(f"matmul peak on {device}: {said[-1]}")
    n = PEAK_N
    return peaks, (
        f"Peak (MFU and HFU, measured peak): torch.mm {n} x {n} x {n} on random "
        f"inputs, the median of {PEAK_REPS} calls timed by CUDA events after "
        f"{PEAK_WARMUP} warm-up: " + "; ".join(said)
    )


def _tok_s(row: list) -> float:
    return float(row[HEADER.index("tokens/s")].replace(",", ""))
