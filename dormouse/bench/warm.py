"""warm: fill the kernel caches (Triton's kernels, fla's autotune results, inductor's compiled step) for a preset's training shapes.

fla's KDA kernels autotune for each new shape on their first call (178-209 s on a fresh H200);
with the cache under dormouse's folder (dormouse/cache.py) a later process reads the winners
back, and on CUDA this writes them as fla's config files into <cache>/fla-configs/<card>
(model/fla_tuned.py), which another machine of the same kind can be given. This builds each preset's model and optimizer on the device as `train` does
and runs one training step (forward, backward, optimizer) at the micro-batch shape a run of
this config uses (compiled as `train` compiles it: compile=auto on CUDA), and one evaluation
forward at the eval shape, each timed. Where no Triton kernel would run and nothing compiles
(the CPU, an old card without fla) it says so and warms nothing.

    python -m dormouse bench warm small --batch 64 --seq 256
    python -m dormouse bench warm b1 --set batch=8 --set seq_len=2048
"""

from __future__ import annotations

import logging

import torch

from ..config import preset_names
from ..model import fla_tuned
from ..model.model import mixer_impl
from .common import (
    BenchError,
    build,
    configure,
    machine_lines,
    report,
    resolve_device,
    table,
    timed,
    windows,
)

log = logging.getLogger(__name__)

HEADER = ["preset", "KDA arm", "dtype", "shape", "what ran", "seconds"]


def add_args(ap) -> None:
    names = ", ".join(preset_names())
    ap.add_argument("presets", nargs="+", metavar="PRESET", help=names)
    ap.add_argument("--batch", type=int, help="batch size (default: the preset's)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the preset's)")


def triton_arm(run, device: torch.device) -> tuple[bool, str]:
    """(whether this run's step on `device` builds something a cache keeps: fla's Triton
    kernels or inductor's compiled step (compile=auto on CUDA), the verdict in words)."""
    from ..model.arms import ArmError, require_arms
    from ..train.run import resolve_autocast, resolve_compile

    compiled = resolve_compile(run, device).train.compile is True
    why = "compile=on: inductor's graphs and kernels" if compiled else "compile=off"
    if run.model.arch != "dormouse":
        return compiled, f"arch={run.model.arch} runs no Triton kernel of its own; {why}"
    try:
        kda, _ = require_arms(run.model, device, resolve_autocast(run, device) or torch.float32)
    except ArmError as e:
        raise BenchError(str(e)) from None
    return kda.name == "fla" or compiled, f"{kda.reason}; {why}"


def run(args, command: str) -> str:
    from ..cache import kernel_cache_line, say_kernel_cache
    from ..train.context import accumulate
    from ..train.step import evaluate

    runs = [configure(n, args.set, args.batch, args.seq) for n in args.presets]
    device = resolve_device(args.device)
    if any(r.train.fit_gb for r in runs):  # the shapes a --fit run trains at
        from ..train.plan.fit import apply_fit

        runs = [apply_fit(r) for r in runs]
    verdicts = [triton_arm(r, device) for r in runs]
    names = [r.source.removeprefix("preset:") for r in runs]
    if not any(tuned for tuned, _ in verdicts):
        why = "; ".join(f"{n}: {reason}" for n, (_, reason) in zip(names, verdicts))
        return (f"bench warm: nothing to warm on {device}: no Triton kernel runs and nothing "
                f"compiles here ({why}). fla's KDA kernels run on CUDA sm_80+ with fla-core "
                f"installed; compile=auto compiles on CUDA\n")  # fmt: skip
    say_kernel_cache()
    rows = []
    for name, r, (tuned, reason) in zip(names, runs, verdicts):
        if not tuned:
            rows.append([name, reason, "-", "-", "nothing to warm (no Triton kernel)", "-"])
            continue
        t = r.train
        micro = accumulate(t.global_batch or t.batch, t.batch, t.seq_len)
        log.info(f"warm {name}: one training step at {micro.batch} x {t.seq_len} and one eval "
                 f"forward at {t.batch} x {t.seq_len} on {device}; a fresh machine tunes for "
                 f"minutes")  # fmt: skip
        model, step, dtype = build(r, device)
        w = windows(r, 1)[0]  # the loop's step splits a step's windows into its micro-batches
        s_train = timed(lambda i: step(0, w), 1, 0, device)[0] / 1000
        model.eval()
        e = w[: t.batch]  # evaluation reads batch windows at a time
        s_eval = timed(lambda i: evaluate(model, [(e[:, :-1], e[:, 1:])], device, dtype),
                       1, 0, device)[0] / 1000  # fmt: skip
        dt = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        arm = mixer_impl(model) if r.model.arch == "dormouse" else "-"
        what = "train step (forward + backward + optimizer)" + (
            f" x {micro.accum} micro-batches" if micro.accum > 1 else ""
        )
        rows += [[name, arm, dt, f"{micro.batch} x {t.seq_len}", what, f"{s_train:.1f}"],
                 [name, arm, dt, f"{t.batch} x {t.seq_len}", "eval forward", f"{s_eval:.1f}"]]  # fmt: skip
        model = step = None  # this preset's memory goes before the next one's build
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes = [kernel_cache_line()]
    if device.type == "cuda":
        folder = fla_tuned.folder_for(torch.cuda.get_device_name(device))
        try:
            kernels, added = fla_tuned.save(folder)
            notes.append(f"fla's tuned configs: {kernels} kernels, {added} new entries written "
                         f"to {folder} (FLA_CONFIG_DIR there: a machine given a copy skips the "
                         "tuning for these keys)")  # fmt: skip
        except OSError as e:  # the warm itself succeeded; only the copy for other machines failed
            notes.append(f"fla's tuned configs NOT written to {folder}: {e}")
    notes += [
             "A second run of this command shows the cached times: what it saves a training run "
             "before its first step. Other shapes (another --batch or --seq, a fleet rank's "
             "own micro-batch, `dormouse eval`'s last short window) tune on their first call.",
             "Each shape's first fla call is logged (kda: first fla call ...), with its time "
             "when over 5 s."]  # fmt: skip
    return report(
        "dormouse bench warm: kernel caches",
        machine_lines(device, command),
        table(HEADER, rows),
        notes,
    )
