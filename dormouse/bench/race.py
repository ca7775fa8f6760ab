"""race: a preset and its GPT twin trained for the same wall-clock budget; best val of each.

The question a user asks before training dormouse's model rather than a plain GPT: which one
learns more in the minutes I have? Each model's step is timed first (`bench step`'s timer,
the first, compiling steps left out), its step count set to fill `--seconds` of training, and
both trained as `train` trains them (their own full schedule: warm-up and decay over their
own steps; dropout=auto; compile=auto) into RUN/NAME; the table gives each one's best
validation loss, the step of it, the bytes it read and the training seconds it took.

    python -m dormouse bench race small --seconds 120 --data input.txt --device cuda --set batch=64 --set seq_len=256 --set val_bytes=111540 --out race.md
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import fields
from pathlib import Path

import torch

from ..config import apply_sets, preset, preset_names, validate
from .common import (
    BenchError,
    configure,
    harness,
    machine_lines,
    report,
    resolve_device,
    table,
    timed,
    windows,
)

log = logging.getLogger(__name__)

HEADER = [
    "model",
    "params (M)",
    "step ms",
    "steps",
    "best val nats/byte (step)",
    "best bpb",
    "bytes read",
    "training s",
    "run folder",
]
#: steps timed to set each model's step count (after two untimed ones: compile, graph capture)
TIMED_STEPS = 5


def add_args(ap) -> None:
    names = ", ".join(n for n in preset_names() if not n.startswith("gpt"))
    ap.add_argument("preset", metavar="PRESET", help=f"a dormouse preset ({names})")
    ap.add_argument(
        "--seconds",
        type=float,
        required=True,
        help="training seconds each model gets (evaluation and checkpoints apart)",
    )
    ap.add_argument("--data", nargs="+", help="byte corpora (default: the embedded corpus)")
    ap.add_argument(
        "--evals",
        type=int,
        default=10,
        help="evaluations over each run (default 10): eval_every = steps / evals",
    )
    ap.add_argument("--runs", default="runs/race", help="where the two run folders go")
    ap.add_argument(
        "--overwrite", action="store_true", help="replace the runs an earlier race left in --runs"
    )


def step_ms(run, device: torch.device) -> float:
    """The median ms of one training step of `run`, as train runs it, after two untimed."""
    step, defer = _stepper(run, device)
    data = windows(run, TIMED_STEPS + 2)
    ms = timed(lambda i: step(i, data[i]), TIMED_STEPS, 2, device, chain=defer)
    step = None  # the model and optimizer go before the run trains
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(ms)


def _stepper(run, device: torch.device):
    h = harness(run, device)
    return h.step, h.defer


def label(run, name: str) -> str:
    """The table's name for `run`: the preset, and the model fields --set changed from it (a
    race of `small --set attn_every=2` must not read as one of `small`)."""
    if run.model.arch != "dormouse":
        return run.source.removeprefix("preset:")
    base = preset(name).model
    changed = [
        f"{f.name}={getattr(run.model, f.name)}"
        for f in fields(base)
        if getattr(run.model, f.name) != getattr(base, f.name)
    ]
    return f"{name} ({', '.join(changed)})" if changed else name


def best_of(folder: Path) -> dict:
    """(best val, its step, the last eval's train_s) from a run folder's metrics.jsonl."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if r["kind"] == "eval" and r["step"] > 0]
    if not ev:
        raise BenchError(f"{folder}: no evaluation after step 0; give more --seconds or --evals")
    best = min(ev, key=lambda r: r["loss"])
    return {
        "loss": best["loss"],
        "bpb": best["bpb"],
        "step": best["step"],
        "train_s": ev[-1]["train_s"],
    }


def run(args, command: str) -> str:
    from ..model import count_params
    from ..train.run import train_run
    from ..train.store.folder import RunDir
    from .step import twin

    if not (math.isfinite(args.seconds) and args.seconds > 0):
        raise BenchError(f"--seconds {args.seconds}: give the training seconds each model gets")
    if args.evals < 1:
        raise BenchError(f"--evals {args.evals}: at least one evaluation a run")
    sets = list(args.set) + ([f"data={','.join(args.data)}"] if args.data else [])
    mine = configure(args.preset, sets)
    if mine.model.arch != "dormouse":
        raise BenchError(
            f"race pairs a dormouse preset with its GPT twin; {args.preset} is "
            f"arch={mine.model.arch}: name a dormouse preset"
        )
    device = resolve_device(args.device)
    rows = []
    for name, r in (("dormouse", mine), ("gpt", twin(mine))):
        ms = step_ms(r, device)
        steps = max(1, int(1000 * args.seconds / ms))
        every = max(1, steps // args.evals)
        out = Path(args.runs) / name
        log.info(
            f"race {name}: {ms:.1f} ms a step -> {steps} steps in {args.seconds:g} s, "
            f"an evaluation every {every}; into {out}"
        )
        r = validate(
            apply_sets(
                r,
                [
                    f"steps={steps}",
                    f"eval_every={every}",
                    "ckpt_every=0",
                    f"warmup={min(r.train.warmup, steps // 10)}",
                    f"out_dir={out}",
                    f"device={device}",
                ],
            )
        )
        folder = RunDir(out)
        with folder.hold(r, overwrite=args.overwrite):  # the run folder's rules, as train's
            folder.plan(r, "never", args.overwrite)
            train_run(r, folder=folder)
        b = best_of(out)
        t = r.train
        read = steps * (t.global_batch or t.batch) * (t.seq_len + 1)
        rows.append(
            [
                label(r, args.preset),
                f"{count_params(r.model) / 1e6:.2f}",
                f"{ms:.1f}",
                str(steps),
                f"{b['loss']:.4f} ({b['step']})",
                f"{b['bpb']:.4f}",
                f"{read / 2**20:.2f} MiB",
                f"{b['train_s']:.0f}",
                str(out),
            ]
        )
    notes = [
        f"Each model trained for ~{args.seconds:g} s of steps: its step count = the budget / "
        f"its median step ({TIMED_STEPS} timed after 2 untimed), its own warm-up and decay "
        f"over those steps, {args.evals} evaluations. Training s: the last evaluation's "
        f"train_s (evaluation, checkpoints and the first, compiling step excluded).",
        "The GPT twin: model/gpt.py `gpt_twin`, equal total parameters, the same train "
        "config (windows, dtype, optimizer routing, schedule).",
    ]
    return report(
        "dormouse bench race: equal wall-clock",
        machine_lines(device, command),
        table(HEADER, rows),
        notes,
    )
