"""The training step's parts timed alone (bench step --parts), on the step's own objects.

`step.train_step` runs, on one process: forward, backward, the clip phase (the host-row
reduction, fp16's unscale, the optimizer's clip and the one verdict read to the host), the
optimizer phase (opt.step(), the captured CUDA graph when the optimizer graph is on, then
zero_grad) and the LFB update. `time_parts` runs each of those pieces alone, repeated, on the
same model, optimizer and window: the forward and the clip phase through train_step's own
`step.graph_forward` and `step.clip_and_verdict`, the rest as train_step calls it. The sum of
the parts beside the step says what running them in one step costs or saves: launch gaps,
host waits, overlap.

It is a benchmark, not training: every repetition of the optimizer steps the parameters again
on the same gradients, each clip rescales them again, and every forward adds to the routers'
LFB counts. Host-RAM Engram rows (engram_ram) are no parameters: only the first optimizer
repetition finds them pending, so there the optimizer part under-counts their step.
"""

from __future__ import annotations

import statistics

import torch

from ..train.step import autocast_on, clip_and_verdict, graph_forward
from .common import BenchError, Harness, timed

#: the parts in train_step's order; "forward + backward" is timed, "backward" is its difference
PARTS = ("forward", "backward", "clip", "optimizer", "lfb")


def time_parts(
    h: Harness, window: torch.Tensor, reps: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    """ms of each repetition of each part (PARTS, plus "forward + backward"), after `warmup`
    untimed ones. The backward is not timed alone: "backward" is the median of forward +
    backward less the median of the forward (one list of that one number), since a backward
    needs the forward that built its graph, and retaining that graph would change what the
    compiled step saves."""
    t, ctx, model, opt, scaler = h.train, h.ctx, h.model, h.opt, h.scaler
    if ctx.shape.accum != 1:
        raise BenchError(
            f"--parts times one micro-batch a step; this run accumulates "
            f"{ctx.shape.accum}: drop global_batch"
        )
    x, y = window[:, :-1].to(device), window[:, 1:].to(device)
    last: dict = {}

    def forward() -> torch.Tensor:
        with autocast_on(device, h.dtype):  # with the copies out of a graph's buffers
            loss, _ = graph_forward(h.s.wrapped, x, y)
        last["loss"] = loss.detach()
        return loss

    def forward_backward(_i) -> None:
        with autocast_on(device, h.dtype):
            weighted = forward() * ctx.loss_scale
            (weighted if scaler is None else weighted * scaler.scale).backward()

    def fresh_grads(_i) -> None:  # train_step's backward starts from no gradients
        opt.zero_grad(set_to_none=True)

    def clip(_i) -> None:  # train_step's clip phase, to the verdict on the host
        clip_and_verdict(model, opt, ctx, last["loss"], t, scaler)

    def optimizer(_i) -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def lfb(_i) -> None:
        if hasattr(model, "lfb_update"):
            model.lfb_update(reduce=ctx.lfb_reduce)

    out = {"forward": timed(lambda i: forward(), reps, warmup, device)}
    out["forward + backward"] = timed(forward_backward, reps, warmup, device, setup=fresh_grads)
    grads = [(p, p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None]

    def restore(_i) -> None:  # the optimizer's zero_grad dropped them; the same tensors again
        for p, gr in grads:
            p.grad = gr

    out["clip"] = timed(clip, reps, warmup, device)
    out["optimizer"] = timed(optimizer, reps, warmup, device, setup=restore)
    out["lfb"] = timed(lfb, reps, warmup, device)
    both, fwd = statistics.median(out["forward + backward"]), statistics.median(out["forward"])
    out["backward"] = [both - fwd]
    return out
