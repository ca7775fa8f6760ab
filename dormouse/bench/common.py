"""What the sub-benchmarks share: the machine lines, the timer, the table, and a preset's
model and training step built as `train` builds them."""

from __future__ import annotations

import logging
import os
import platform
import re
import shlex
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from ..config import RunConfig, apply_sets, preset, validate
from ..errors import UserError

log = logging.getLogger(__name__)

GiB = 1 << 30


class BenchError(UserError, ValueError):
    """A benchmark request that cannot be honoured; names cause and escape."""


def check_counts(steps: int, warmup: int) -> None:
    """Refuse a timing that would time nothing: --steps below 1 or --warmup below 0."""
    if steps < 1 or warmup < 0:
        raise BenchError(f"--steps {steps} --warmup {warmup}: steps must be >= 1 and warmup >= 0")


def resolve_device(name: str) -> torch.device:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise BenchError(f"--device {name!r} is not auto, cpu, cuda or cuda:N")
    from ..train.run import resolve_device

    return resolve_device(name)


def configure(name: str, sets, batch: int | None = None, seq: int | None = None) -> RunConfig:
    """A preset with --set, --batch and --seq applied, validated before anything is timed."""
    # `is not None`: --batch 0 ran the preset's batch under a table that looked measured
    sets = [
        *sets,
        *([f"batch={batch}"] if batch is not None else []),
        *([f"seq_len={seq}"] if seq is not None else []),
    ]
    return validate(apply_sets(preset(name), sets))


@dataclass
class Harness:
    """A preset's model, optimizer and step as `dormouse train` builds them (`s`, the loop's
    own train.step.Step): `step(i, window)` is the loop's `train_step` on a [batch, seq+1]
    window (False: skipped as non-finite). bench step --parts times the step's pieces from
    these same objects (parts.py)."""

    s: object  # train.step.Step

    model = property(lambda self: self.s.model)
    net = property(lambda self: self.s.net)
    opt = property(lambda self: self.s.opt)
    ctx = property(lambda self: self.s.ctx)
    train = property(lambda self: self.s.cfg)
    dtype = property(lambda self: self.s.autocast)
    scaler = property(lambda self: self.s.scaler)
    #: the verdict kept on the device (step.device_verdict, as train decides it): step()
    #: returns it as a bool tensor, and a row's steps are timed back to back (timed's chain)
    defer = property(lambda self: self.s.defer)

    def step(self, i: int, w: torch.Tensor):
        from ..train.step import lr_factor, train_step

        return train_step(self.s, w[:, :-1], w[:, 1:], lr_factor(i, self.s.cfg))[2]


def harness(run: RunConfig, device: torch.device) -> Harness:
    """The seeded model and optimizer of `run` on `device`, as `dormouse train` builds them:
    compile=auto resolved as train resolves it (train.run.resolve_compile: on CUDA compiled,
    reduce-overhead where the shapes are static), so a bench without flags times what a
    train without flags runs. `--set compile=false` times the eager step."""
    from ..train.context import DPContext
    from ..train.optim.mix import MixOptimizer
    from ..train.optim.scaler import LossScaler, loss_scaled
    from ..train.run import build_model, compiled, resolve_autocast, resolve_compile
    from ..train.step import Step, Wrapped, device_verdict

    run = validate(resolve_compile(run, device))
    t = run.train
    model = build_model(run).to(device).train()
    opt = MixOptimizer.from_config(model, t, device.type)
    dtype = resolve_autocast(run, device)
    # a step of global_batch windows runs as the loop runs it: micro-batches of <= batch
    ctx = DPContext.single(device, t.batch, t.seq_len, t.global_batch)
    wrapped = compiled(Wrapped(model), run, device, dtype)
    # an fp16 forward times the loop's loss scaling too (the scale and unscale passes)
    scaler = LossScaler(t.loss_scale_every) if loss_scaled(dtype, ctx) else None
    s = Step(model, wrapped, opt, ctx, t, dtype, scaler)
    s.defer = device_verdict(t, ctx, opt, scaler)
    return Harness(s)


def build(run: RunConfig, device: torch.device):
    """(model, step, dtype) of `harness(run, device)`."""
    h = harness(run, device)
    return h.model, h.step, h.dtype


def compile_text(t) -> str:
    """A resolved train config's compile, in a table cell: off, default, reduce-overhead."""
    return t.compile_mode if t.compile is True else "off"


def windows(run: RunConfig, n: int) -> list[torch.Tensor]:
    """n steps' random byte windows (global_batch of them a step where set, else batch),
    drawn before any clock starts."""
    g = torch.Generator().manual_seed(run.train.seed)
    rows = run.train.global_batch or run.train.batch
    return [torch.randint(0, 256, (rows, run.train.seq_len + 1), generator=g) for _ in range(n)]


def shape_text(run: RunConfig) -> str:
    """ "B x T" of a step, with its micro-batches where global_batch accumulates."""
    from ..train.context import accumulate

    t = run.train
    s = accumulate(t.global_batch or t.batch, t.batch, t.seq_len)
    return f"{s.windows} x {t.seq_len}" + (f" ({s.batch} x {s.accum} micro)" if s.accum > 1 else "")


def timed(
    fn, steps: int, warmup: int, device: torch.device, setup=None, chain: bool = False
) -> list[float]:
    """ms per call of fn(i): `warmup` untimed calls, then `steps` timed ones, the device
    synchronised around each so a CUDA call is timed to its end. `setup(i)`, when given, runs
    before each call, outside the clock. chain=True (no setup): the timed calls run back to
    back, the device synchronised before the first and after the last, as the loop runs its
    steps between two log lines (with the verdict on the device the host queues a step while
    the device runs the one before); every call's ms is then their mean."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d: None)
    if chain and setup is None:
        for i in range(warmup):
            fn(i)
        sync(device)
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            fn(i)
        sync(device)
        return [1000 * (time.perf_counter() - t0) / max(1, steps)] * steps
    out = []
    for i in range(warmup + steps):
        if setup is not None:
            setup(i)
        sync(device)
        t0 = time.perf_counter()
        fn(i)
        sync(device)
        out.append(1000 * (time.perf_counter() - t0))
    return out[warmup:]


def machine_lines(device: torch.device, command: str) -> list[str]:
    """Who measured: the device, torch, the CPU and its threads, the date, the command."""
    from ..train.plan.device import probe_device

    rec, cpu = probe_device(device), probe_device("cpu")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    dev = (
        f"{rec.name} ({rec.label}, sm_{rec.sm[0]}{rec.sm[1]}, {rec.total_mem / GiB:.1f} GiB), "
        f"CUDA {torch.version.cuda}"
        if rec.kind == "cuda"
        else f"CPU ({rec.name})"
    )
    return [
        f"Machine: {dev}; torch {torch.__version__}; float32 matmul precision "
        f"{torch.get_float32_matmul_precision()}",
        f"CPU: {cpu.name}, {os.cpu_count()} logical cores ({usable} usable), torch threads "
        f"{torch.get_num_threads()}; {platform.system()} {platform.machine()}, Python "
        f"{platform.python_version()}",
        f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"Command: `{command}`",
    ]


def command_line(argv: list[str]) -> str:
    env = [
        f"{k}={os.environ[k]}"
        for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
        if k in os.environ
    ]
    return " ".join([*env, "python -m dormouse bench", shlex.join(argv)])


def table(header, rows) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in lines)


def report(title: str, machine: list[str], body: str, notes: list[str]) -> str:
    bullets = lambda lines: [f"- {line}" for line in lines]
    return "\n".join([f"## {title}", "", *bullets(machine), "", body, "", *bullets(notes)]) + "\n"
