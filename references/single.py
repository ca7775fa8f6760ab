"""The fleet's reference (layer 3 of DESIGN §5): the trainer's own single process at the
fleet's GLOBAL batch. Not an independent reference: it RUNS dormouse.train, by design, so a
bug in the code it shares with the fleet is in both; the equation references
(references/model.py, references/step.py; gates 32 and 33) are what hold this one process to
DESIGN §2-§3.

A fleet of P ranks with batches b_r reads, at step s, the union of its ranks' windows, and
that union is exactly the block one process with batch sum(b_r) reads at step s (the data
layout of DESIGN §3). So "the fleet trains correctly" is the claim "the fleet reproduces one
process at the global batch", and this module runs that one process.

It drives `dormouse.train.run.train_run` with no `--dist`: a world of one, whose context is
the identity. The single-process loop IS the behaviour the fleet must reproduce, so using it
here is the point, not a shortcut. What this reference must not share with the fleet is the
distributed layer, and it does not: nothing here imports dormouse's fleet modules (fleet,
watchdog, parallelize), and a world of one never calls them. The model is built from the
run's seed, the same way every fleet rank builds it before wrapping.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from dormouse.config import RunConfig
from dormouse.model import DormouseModel
from dormouse.train import loop  # its train_step: the one a dropped batch replaces
from dormouse.train.run import train_run
from dormouse.train.step import Callbacks


def build_model(run: RunConfig) -> DormouseModel:
    """The model every rank (and this reference) starts from: seeded by run.train.seed."""
    torch.manual_seed(run.train.seed)
    return DormouseModel(run.model)


def global_run(run: RunConfig, batches: list[int]) -> RunConfig:
    """The one-process twin of a fleet run whose ranks take `batches` windows each."""
    t = replace(run.train, batch=int(sum(batches)), dist=False, dist_capacity="")
    return replace(run, train=t)


def run_single(
    run: RunConfig,
    *,
    callbacks: Callbacks | None = None,
    model: torch.nn.Module | None = None,
    resume: bool = False,
    drop_steps: tuple[int, ...] = (),
    split_rows: tuple[int, ...] = (),
) -> tuple[torch.nn.Module, dict]:
    """Train `run` (already at the global batch) in this process; returns (model, report).

    `callbacks` may record what passes through the loop (losses, fingerprints); they must
    not change what the loop does.
    `drop_steps`: at these 0-based steps the batch is read and thrown away: no forward, no
    backward, no optimizer call (the loop counts the step as skipped). That is what a
    fleet's agreed skip must amount to, reached without the fleet's skip path.
    `split_rows` (e.g. (3, 1)): every training forward runs as forwards of these many
    windows, the loss their token-weighted mean, so the gradient is summed over the pieces by
    autograd: the same mathematics in another fp32 order and other matmul shapes, as a
    fleet's ranks have: the reference's own round-off spread, which a CUDA gate measures on
    the card instead of assuming the CPU's.
    """
    if model is None:
        model = build_model(run)
    if split_rows:
        _split_forward(model, split_rows)
    with _dropping(drop_steps):
        report = train_run(run, model=model, callbacks=callbacks, resume=resume)
    return model, report


def _split_forward(model: torch.nn.Module, sizes: tuple[int, ...]) -> None:
    orig = model.forward

    def forward(x, y=None, *args, **kwargs):
        if not model.training or y is None or sum(sizes) != x.shape[0]:
            return orig(x, y, *args, **kwargs)
        outs = [orig(xc, yc, *args, **kwargs)
                for xc, yc in zip(x.split(list(sizes)), y.split(list(sizes)))]  # fmt: skip
        n = [yc.numel() for yc in y.split(list(sizes))]
        loss = sum(o[1] * k for o, k in zip(outs, n)) / sum(n)
        return torch.cat([o[0] for o in outs]), loss, outs[0][2]

    model.forward = forward


@contextmanager
def _dropping(drop: tuple[int, ...]):
    if not drop:
        yield
        return
    calls = [0]
    real = loop.train_step

    def train_step(*args, **kwargs):
        k = calls[0]
        calls[0] += 1
        if k in drop:
            return torch.tensor(float("nan")), {}, False
        return real(*args, **kwargs)

    loop.train_step = train_step
    try:
        yield
    finally:
        loop.train_step = real
