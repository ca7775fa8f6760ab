"""The MoE FFN one token at a time: the reference `dormouse.model.moe.MoE` is held against.

For each token x (a row vector of width D):

    s_e   = sigmoid(router_w[e] . x)                      affinity to expert e
    picked = the topk experts by s_e + bias_e             the bias steers the choice only
    g_e   = s_e / sum_{j in picked} s_j                   unbiased, renormalised over picked
    y     = sum_{e in picked} g_e * (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]  +  shared(x)

Weight layout: router_w [E, D], w1 and w3 [E, D, F], w2 [E, F, D]. `shared` is a
callable, a tuple (s1 [R, D], s3 [R, D], s2 [D, R]) in nn.Linear convention, or None.
`drop` is a set of (token index, expert) assignments that contribute nothing (the
capacity rule's outcome, decided by the caller); the other gates are left as they are.

No batching, no sorting, no cleverness: a Python loop over tokens and over the picked
experts. Ties in s + bias go to the lower expert index (Python's sort is stable).
Computed in the dtype it is given, so fp64 inputs give a double-precision reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _swiglu(x, a, b, c):
    return (F.silu(x @ a) * (x @ b)) @ c


def moe_dense(
    x: torch.Tensor,
    router_w: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    shared=None,
    bias: torch.Tensor | None = None,
    topk: int = 2,
    drop=(),
) -> torch.Tensor:
    n_experts = router_w.shape[0]
    rows = x.reshape(-1, x.shape[-1])
    drop = set(drop)
    outs = []
    for t in range(rows.shape[0]):
        xt = rows[t]
        s = [torch.sigmoid(router_w[e] @ xt) for e in range(n_experts)]
        score = [
            float(s[e].detach()) + (float(bias[e]) if bias is not None else 0.0)
            for e in range(n_experts)
        ]
        picked = sorted(range(n_experts), key=lambda e: -score[e])[:topk]
        total = sum(s[e] for e in picked)
        y = torch.zeros_like(xt)
        for e in picked:
            if (t, e) in drop:
                continue
            y = y + (s[e] / total) * _swiglu(xt, w1[e], w3[e], w2[e])
        if shared is not None:
            if callable(shared):
                y = y + shared(xt)
            else:
                s1, s3, s2 = shared
                y = y + _swiglu(xt, s1.t(), s3.t(), s2.t())
        outs.append(y)
    return torch.stack(outs).reshape(x.shape)


def pick_experts(x: torch.Tensor, router_w: torch.Tensor, topk: int, bias=None):
    """(affinities s [N, E], picked experts [N, topk] best first, margin): the same rule as
    moe_dense, for every token at once. Ties go to the lower expert index (a stable sort).
    `margin` is the smallest gap between a token's topk-th and next score (inf when every
    expert is picked): below the round-off of whoever is compared with this, they may pick
    differently."""
    rows = x.reshape(-1, x.shape[-1])
    s = torch.sigmoid(rows @ router_w.t())
    score = s.detach() + (bias.to(s.dtype) if bias is not None else 0.0)
    ordered, idx = torch.sort(score, dim=-1, descending=True, stable=True)
    margin = (float((ordered[:, topk - 1] - ordered[:, topk]).min())
              if topk < score.shape[-1] and score.shape[0] else float("inf"))  # fmt: skip
    return s, idx[:, :topk], margin


def moe_all_experts(
    x: torch.Tensor,
    router_w: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    shared=None,
    bias: torch.Tensor | None = None,
    topk: int = 2,
    dropped: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_dense's rule with every expert computed for every token: the output is the sum
    over ALL experts of g_e * expert_e(x), where g_e is the renormalised affinity of a picked
    expert and exactly 0 for the others. The same equations as the loop above (held to it by
    tests/test_references.py), fast enough to sit inside a whole-model reference that trains.

    `dropped`: a bool [N, E] mask of assignments the capacity rule dropped; a dropped pick
    keeps its share in the normaliser (the token loses that share) and contributes nothing,
    as moe_dense's `drop`. `shared` as in moe_dense (a tuple or None)."""
    rows = x.reshape(-1, x.shape[-1])
    s, picked, _ = pick_experts(rows, router_w, topk, bias)
    mask = torch.zeros_like(s).scatter(1, picked, 1.0)
    g = s * mask
    g = g / g.sum(-1, keepdim=True)
    if dropped is not None:
        g = g.masked_fill(dropped, 0.0)
    every = torch.stack([_swiglu(rows, w1[e], w3[e], w2[e]) for e in range(w1.shape[0])], 1)
    y = (g.unsqueeze(-1) * every).sum(1)  # [N, E, D] -> [N, D]
    if shared is not None:
        s1, s3, s2 = shared
        y = y + _swiglu(rows, s1.t(), s3.t(), s2.t())
    return y.reshape(x.shape)
