"""profile: where one training step's time goes (torch.profiler): GPU busy, kernels, phases, top ops.

The step is the loop's own `train_step` (as `bench step` builds it); after untimed warm-up steps,
`--steps` steps run under torch.profiler. The report states, per preset:

* step ms (median, device synchronised) and **GPU busy**: the union of kernel intervals over the
  profiled wall time (1.0 = the card never idles; a launch-bound step is far below), and the
  same busy time over the wall of the same steps run again without the profiler (its tracing
  lengthens every launch on the host, not the kernels);
* kernels per step, and per phase of the step (forward, backward, clip + verdict, optimizer,
  LFB; `loop.PHASES`): wall ms, GPU ms of the kernels the phase launched, kernels;
* the top ops by GPU time (self), per step.

    python -m dormouse bench profile small --device cuda --batch 64 --seq 256
    python -m dormouse bench profile small --device cuda --batch 64 --seq 256 --compile off
    python -m dormouse bench profile tiny --device cpu --steps 3     # CPU: no kernels, phases only

`--compile` (default auto: what `train` runs) pins the compile mode or turns it off; a
compiling first step is timed apart.
"""

from __future__ import annotations

import bisect
import gc
import logging
import statistics

import torch

from .common import (
    BenchError,
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

HEADER = [
    "preset",
    "batch x seq",
    "compile",
    "step ms (median)",
    "tokens/s",
    "GPU busy",
    "kernels/step",
    "GPU ms/step",
    "step ms (unprofiled)",
    "GPU busy (unprofiled wall)",
]
PHASE_HEADER = ["preset", "phase", "wall ms/step", "GPU ms/step", "kernels/step"]
TOP_HEADER = ["preset", "op", "calls/step", "self GPU ms/step", "share of GPU time"]
COMPILE_MODES = ("auto", "off", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


def add_args(ap) -> None:
    ap.add_argument("presets", nargs="*", metavar="PRESET", help="presets (default small)")
    ap.add_argument("--batch", type=int, help="batch size (default: the preset's)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    ap.add_argument("--steps", type=int, default=10, help="profiled steps (default 10)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 1 on CPU, 5 on CUDA)")
    ap.add_argument("--kda-impl", choices=("auto", "torch", "fla"), help="the KDA arm")
    ap.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default="auto",
        help="torch.compile the step in this mode (default auto: as train decides, "
        "compiled on CUDA, off on the CPU)",
    )
    ap.add_argument("--top", type=int, default=15, help="top ops listed per preset (default 15)")


def _annotation(e) -> bool:
    """A range someone named (record_function, Optimizer.step#...), not work: the profiler
    mirrors such ranges onto the GPU's timeline, where they would count as kernels."""
    return (
        bool(getattr(e, "is_user_annotation", False))
        or e.name.startswith("dormouse.")
        or ("#" in e.name and e.name.split("#", 1)[0].endswith(".step"))
    )


def device_events(events) -> list:
    """The GPU's kernels, copies and sets (not the annotations mirrored onto its timeline)."""
    from torch.autograd import DeviceType

    return [
        e
        for e in events
        if getattr(e, "device_type", None) == DeviceType.CUDA and not _annotation(e)
    ]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _phases(events, steps: int) -> list[tuple[str, float, float, float]]:
    """(phase, wall ms, GPU ms, kernels) per step: each kernel counts for the phase whose
    range (on the launching thread's clock) holds the start of the CPU op that launched it;
    the backward's ops run on autograd's threads inside the main thread's backward range."""
    from torch.autograd import DeviceType

    from ..train.step import PHASES

    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name.split(".", 1)[1])
        for e in events
        if e.name.startswith("dormouse.")
        and e.name.split(".", 1)[1] in PHASES
        and getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU
    )
    starts = [r[0] for r in ranges]
    wall = dict.fromkeys(PHASES, 0.0)
    for a, b, p in ranges:
        wall[p] += b - a
    gpu = dict.fromkeys([*PHASES, "other"], 0.0)
    count = dict.fromkeys([*PHASES, "other"], 0)
    for e in events:
        kernels = getattr(e, "kernels", None)
        if not kernels or _annotation(e):
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        p = ranges[i][2] if i >= 0 and e.time_range.start < ranges[i][1] else "other"
        for k in kernels:
            gpu[p] += k.duration
            count[p] += 1
    out = []
    for p in [*PHASES, "other"]:
        if wall.get(p, 0) or count[p]:
            out.append(
                (p, wall.get(p, 0.0) / 1000 / steps, gpu[p] / 1000 / steps, count[p] / steps)
            )
    return out


def profile_preset(run, device, steps: int, warmup: int, compile: str, top: int):
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    h = harness(run, device)
    step, chain = h.step, h.defer  # verdict=device: steps timed back to back, as the loop runs
    data = windows(run, warmup + steps + 1)
    first = "off"
    if h.train.compile:
        try:
            first = (
                f"{compile_text(h.train)} ("
                f"{timed(lambda i: step(0, data[0]), 1, 0, device)[0] / 1000:.1f} s first step)"
            )
        except Exception as e:
            msg = (str(e).strip().splitlines() or [""])[0][:300]
            raise BenchError(
                f"torch.compile ({compile}) of {run.source} failed on {device} "
                f"({type(e).__name__}: {msg}); rerun with --compile off"
            ) from e
    timed(lambda i: step(i, data[i]), warmup, 0, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ms = []
    with profile(activities=acts) as prof:
        ms = timed(lambda i: step(warmup + i, data[warmup + i]), steps, 0, device, chain=chain)
    # The same steps again with no profiler: CUPTI's tracing adds host time to every launch
    # (it does not lengthen the kernels), so a launch-bound step's profiled wall overstates
    # its idle GPU; the kernels' busy time per step over this wall is the unprofiled figure.
    plain = timed(lambda i: step(warmup + i, data[warmup + i]), steps, 0, device, chain=chain)
    events = prof.events()
    wall_ms = sum(ms)
    kern = device_events(events)
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in kern])
    gpu_ms = sum(e.time_range.end - e.time_range.start for e in kern) / 1000
    name = run.source.removeprefix("preset:")
    med, plain_med = statistics.median(ms), statistics.median(plain)
    tok_s = h.ctx.shape.tokens / (med / 1000)
    busy_plain = min(1.0, busy_us / 1000 / steps / plain_med)
    row = [
        name,
        shape_text(run),
        first,
        f"{med:.1f}",
        f"{tok_s:,.0f}",
        f"{100 * busy_us / 1000 / wall_ms:.0f}%" if cuda else "n/a (CPU)",
        f"{len(kern) / steps:,.0f}" if cuda else "n/a",
        f"{gpu_ms / steps:.1f}" if cuda else "n/a",
        f"{plain_med:.1f}",
        f"{100 * busy_plain:.0f}%" if cuda else "n/a (CPU)",
    ]
    phases = [
        [name, p, f"{w:.2f}", f"{g:.2f}" if cuda else "n/a", f"{c:,.0f}" if cuda else "n/a"]
        for p, w, g, c in _phases(events, steps)
    ]
    tops = []
    if cuda:
        avg = prof.key_averages()
        avg = [a for a in avg if not (a.key.startswith("dormouse.") or "#" in a.key)]
        total = sum(getattr(a, "self_device_time_total", 0.0) for a in avg) or 1.0
        best = sorted(avg, key=lambda a: -getattr(a, "self_device_time_total", 0.0))[:top]
        for a in best:
            t = getattr(a, "self_device_time_total", 0.0)
            if t <= 0:
                break
            tops.append(
                [
                    name,
                    f"`{a.key[:70]}`",
                    f"{a.count / steps:,.1f}",
                    f"{t / 1000 / steps:.2f}",
                    f"{100 * t / total:.1f}%",
                ]
            )
    return row, phases, tops


def run(args, command: str) -> str:
    from ..model.arms import require_arms

    sets = args.set + ([f"kda_impl={args.kda_impl}"] if args.kda_impl else [])
    if args.compile == "off":
        sets += ["compile=false"]
    elif args.compile != "auto":  # compiled as `train --set compile=true` compiles
        sets += ["compile=true", f"compile_mode={args.compile}"]
    runs = [configure(n, sets, args.batch, args.seq) for n in args.presets or ["small"]]
    device = resolve_device(args.device)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    if args.steps < 1 or warmup < 0:
        raise BenchError(
            f"--steps {args.steps} --warmup {warmup}: profile at least one step "
            f"after zero or more warm-up steps"
        )
    for r in runs:
        if r.model.arch == "dormouse":
            try:
                require_arms(r.model, device)
            except RuntimeError as e:
                raise BenchError(str(e)) from None
    rows, phases, tops = [], [], []
    for k, r in enumerate(runs, 1):
        log.info(
            f"[{k}/{len(runs)}] {r.source}: {shape_text(r)} "
            f"on {device}, {warmup} warm-up + {args.steps} profiled step(s), compile "
            f"{args.compile}"
        )
        row, ph, tp = profile_preset(r, device, args.steps, warmup, args.compile, args.top)
        rows.append(row)
        phases += ph
        tops += tp
    body = table(HEADER, rows) + "\n\nPer phase of the step:\n\n" + table(PHASE_HEADER, phases)
    if tops:
        body += "\n\nTop ops by GPU time (self):\n\n" + table(TOP_HEADER, tops)
    notes = [
        f"Method: {warmup} untimed warm-up step(s), then {args.steps} step(s) under "
        "torch.profiler (CPU + CUDA activities); the profiler's own overhead is in the wall "
        "times, so `bench step` is the speed figure and this the breakdown.",
        "GPU busy: the union of kernel intervals / the profiled steps' wall time; GPU ms: "
        "the sum of kernel durations (overlapping streams count twice).",
        "Unprofiled: the same steps timed again with no profiler (the profiler's tracing "
        "adds host time to every launch, not kernel time); GPU busy (unprofiled wall) = "
        "the profiled kernels' busy time per step / the unprofiled median step, capped at "
        "100%: the figure for a launch-bound step, where the profiled wall overstates the "
        "idle GPU.",
        "Phases: record_function ranges of loop.train_step; a kernel counts for the phase "
        "whose range holds the start of the op that launched it ('other': outside every "
        "range, e.g. the data's copy to the device).",
    ]
    notes.append(
        "Verdict on the device (the run's `verdict=...: on the device` line): the "
        "steps are timed back to back, profiled and unprofiled, as the loop runs them "
        "(the host queues a step while the device runs the one before), each step's ms "
        "their mean; a phase's wall is the host's time in it (the optimizer's includes "
        "the wait for the step before to reach its own optimizer: the host runs about a "
        "step ahead)."
    )
    return report(
        "dormouse bench profile: where the step's time goes",
        machine_lines(device, command),
        body,
        notes,
    )
