"""moe: the MoE arms at presets' shapes, one MoE call's forward + backward per arm, eager and compiled.

`moe_impl=auto`'s rule (model/arms.py: DENSE_MAX_WIDTH) reads n_experts * d_ffn; this is the
measurement behind it. For each preset the MoE of its shape (cfg.model) runs on random inputs
of [batch x seq_len, d_model] under the run's autocast dtype (bf16 on CUDA sm_80+, fp32
elsewhere), forward and backward into every weight, with each arm that runs here: grouped,
batched (dropless: one host sync a call), dense (every expert on every token). "compiled" is
`torch.compile` (mode default) of the same call. The kernel count is bench profile's (its
device events), one eager call on CUDA.

    python -m dormouse bench moe small medium b1 --device cuda --batch 64 --seq 256
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

import torch

from ..model.arms import moe_shape, why_not
from ..model.moe import MoE
from .common import (
    BenchError,
    check_counts,
    configure,
    machine_lines,
    report,
    resolve_device,
    table,
    timed,
)
from .profile import device_events

log = logging.getLogger(__name__)

HEADER = ["preset", "E x d_ffn (d_model)", "tokens", "arm", "eager ms", "compiled ms",
          "kernels (eager, CUDA)", "auto picks"]  # fmt: skip
ARMS = ("grouped", "batched", "dense")


def add_args(ap) -> None:
    ap.add_argument("presets", nargs="*", default=["small", "medium", "b1"], metavar="PRESET")
    ap.add_argument("--batch", type=int, help="windows a call (default the preset's batch)")
    ap.add_argument("--seq", type=int, help="bytes a window (default the preset's seq_len)")
    ap.add_argument("--steps", type=int, default=20, help="timed calls per arm (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per arm (default 3)")
    ap.add_argument("--no-compile", action="store_true", help="time the eager call only")


def _kernels(fn, device: torch.device) -> str:
    """The device kernels one call launches (bench profile's count); "-" off CUDA."""
    if device.type != "cuda":
        return "-"
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
    return str(len(device_events(prof.events())))


def _rows(name, cfg, tokens, device, dtype, args, said: list[str]) -> list[list[str]]:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, cfg.d_model, device=device, generator=gen)
    dy = torch.randn(tokens, cfg.d_model, device=device, generator=gen)
    auto = MoE(dataclasses.replace(cfg, moe_impl="auto")).arm(device, dtype or torch.float32)
    said.append(f"{name}: {auto.reason}")
    rows = []
    for arm in ARMS:
        why = why_not("moe", arm, device, dtype or torch.float32, moe_shape(cfg))
        shape = f"{cfg.n_experts} x {cfg.d_ffn} ({cfg.d_model})"
        if why:
            rows.append([name, shape, str(tokens), arm, "-", "-", "-", why])
            continue
        torch.manual_seed(0)
        moe = MoE(dataclasses.replace(cfg, moe_impl=arm, moe_capacity=0.0)).to(device)

        def call(m=moe):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                out, _ = m(x.requires_grad_(True))
            torch.autograd.backward(out, dy)

        log.info(f"bench moe: {name} {arm} ...")
        eager = statistics.median(timed(lambda _i: call(), args.steps, args.warmup, device))
        comp = "-"
        if not args.no_compile and arm != "batched":  # batched runs eager (a host sync)
            cm = torch.compile(moe)
            comp = f"{statistics.median(timed(lambda _i: call(cm), args.steps, args.warmup, device)):.3f}"
        rows.append([name, shape, str(tokens), arm, f"{eager:.3f}", comp, _kernels(call, device),
                     "<- auto" if auto.name == arm else ""])  # fmt: skip
    return rows


def run(args, command: str) -> str:
    check_counts(args.steps, args.warmup)
    device = resolve_device(args.device)
    from ..train.run import resolve_autocast

    rows, said = [], []
    for name in args.presets:
        r = configure(name, args.set, args.batch, args.seq)
        if r.model.arch != "dormouse":
            raise BenchError(f"{name} has no MoE (arch={r.model.arch}); name a dormouse preset")
        dtype = resolve_autocast(r, device)
        rows += _rows(name, r.model, r.train.batch * r.train.seq_len, device, dtype, args, said)
    notes = ["forward + backward of one MoE call (routing, experts, shared expert) on random "
             f"inputs; median of {args.steps} calls after {args.warmup} untimed, the device "
             "synchronised around each", "kernels: device kernels one eager call launches",
             *said]  # fmt: skip
    return report("dormouse bench moe: the MoE arms", machine_lines(device, command),
                  table(HEADER, rows), notes)  # fmt: skip
