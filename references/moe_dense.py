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
        score = [float(s[e].detach()) + (float(bias[e]) if bias is not None else 0.0)
                 for e in range(n_experts)]
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
