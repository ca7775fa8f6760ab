"""The token-weighted gradient of ONE fleet step, computed by hand in one process (a fleet
reference, layer 3 of DESIGN §5: it steps with the trainer's own optimizer).

A fleet whose rank r holds t_r tokens must step with the gradient of the mean loss over the
GLOBAL batch's tokens:

    g = sum_r (t_r / sum_t) * g_r,     g_r = d(mean loss over rank r's own window)/d(params)

This module computes each g_r with a plain forward/backward on rank r's bytes (read from the
corpus by dormouse.train.data's layout, block order unshuffled: step 0's block starts at
byte 0 and rank r's window at sum_{i<r} b_i (T_i + 1)), forms the weighted sum, clips it by
its global norm as the loop does, and applies it with the optimizer constructor the trainer
uses (`MixOptimizer.from_config`), so the post-step parameters are what a correct fleet's
step-1 parameters must be. Nothing of `dormouse.train` is imported except that constructor.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dormouse.train.optim.mix import MixOptimizer


def rank_windows(corpus: bytes, shapes: list[tuple[int, int]]):
    """(x, y) int64 [b_r, T_r] of every rank at step 0, straight from the file's first bytes."""
    out, off = [], 0
    for b, t in shapes:
        n = b * (t + 1)
        raw = np.frombuffer(corpus[off : off + n], dtype=np.uint8).astype(np.int64)
        assert raw.shape[0] == n, "the corpus is shorter than one fleet step"
        w = torch.from_numpy(raw).view(b, t + 1)
        out.append((w[:, :-1], w[:, 1:]))
        off += n
    return out


def token_weighted_step(
    model: torch.nn.Module,
    corpus: bytes,
    shapes: list[tuple[int, int]],
    train_cfg,
    weights: list[float] | None = None,
    *,
    device: str = "cpu",
    reverse: bool = False,
) -> dict:
    """One optimizer step of `model` with sum_r w_r g_r (w_r = t_r / sum_t unless given).

    The run's schedule must give step 0 the full lr (warmup=0: factor 1). Returns the
    per-rank local losses and the weights used. `weights` exists so a gate can compute the
    WRONG (unweighted) step too and show it is distinguishable from the right one.
    "grads" in the result is the weighted gradient sum_r w_r g_r itself, before any clip.
    `device`: where the model and windows go (a CUDA fleet's reference runs on its card);
    `reverse`: accumulate the ranks last to first (the same sum in another fp32 order: the
    reference's own spread).
    """
    if train_cfg.warmup != 0:
        raise ValueError("token_weighted_step reproduces step 0 at lr factor 1: use warmup=0")
    if getattr(train_cfg, "shuffle", False):
        raise ValueError("token_weighted_step reads step 0's block at byte 0: use shuffle=false")
    tokens = [b * t for b, t in shapes]
    if weights is None:
        weights = [t / sum(tokens) for t in tokens]
    model.to(device)
    params = list(model.parameters())
    acc = [torch.zeros_like(p) for p in params]
    got = [False] * len(params)
    local = []
    model.train()
    pairs = list(zip(rank_windows(corpus, shapes), weights))
    for (x, y), w in pairs[::-1] if reverse else pairs:
        model.zero_grad(set_to_none=True)
        _, loss, _ = model(x.to(device), y.to(device))
        local.append(float(loss.detach()))
        loss.backward()
        for i, p in enumerate(params):
            if p.grad is not None:
                acc[i].add_(p.grad, alpha=w)
                got[i] = True
    for i, p in enumerate(params):
        p.grad = acc[i] if got[i] else None
    names = [n for n, _ in model.named_parameters()]
    weighted = {n: acc[i].detach().cpu().clone() for i, n in enumerate(names) if got[i]}
    # The loop clips by the global L2 norm: coef = clip / (norm + 1e-6), at most 1.
    if train_cfg.grad_clip > 0:
        grads = [p.grad for p in params if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        coef = min(1.0, train_cfg.grad_clip / (norm + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    if reverse:
        local.reverse()
    opt = MixOptimizer.from_config(model, train_cfg, torch.device(device).type)
    opt.set_lr_factor(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.lfb_update()  # one process saw every rank's tokens: its counts ARE the fleet's
    return {"local_losses": local, "weights": list(weights), "tokens": tokens, "grads": weighted}
