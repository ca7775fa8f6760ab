"""The capacity-padded MoE row by row: what the dispatch arms' capacity rule is held against.

The rule (DESIGN.md §2): a row of T tokens may send cap = ceil(capacity * T * k / E)
assignments to each expert; they are kept first come, first served in position order (a
token's k picks in their pick order, though they never share an expert), the rest dropped.

    for each row:
        taken = [0] * E
        for t in 0 .. T-1:
            for e in the token's picked experts (in pick order):
                if taken[e] < cap: taken[e] += 1     kept
                else:              (row, t, e) is dropped

The routing (which experts a token picks) is computed here too, by `references/moe_dense.py`'s
rule, so nothing of `dormouse.model.moe` is trusted. Plain Python loops; no sorting, no
batching. `prior` (per row, per expert: assignments seen before this chunk) makes the same
loop describe a decoder that continues a row.
"""

from __future__ import annotations

import math

import torch

from references.moe_dense import moe_dense


def capacity_of(capacity: float, row_len: int, topk: int, n_experts: int) -> int:
    return math.ceil(capacity * row_len * topk / n_experts)


def picks(x_row: torch.Tensor, router_w: torch.Tensor, topk: int, bias=None) -> list[list[int]]:
    """Each token's picked experts, best first (ties to the lower index), as moe_dense picks."""
    n_experts = router_w.shape[0]
    out = []
    for xt in x_row:
        score = [float(torch.sigmoid(router_w[e] @ xt).detach())
                 + (float(bias[e]) if bias is not None else 0.0)
                 for e in range(n_experts)]  # fmt: skip
        out.append(sorted(range(n_experts), key=lambda e: -score[e])[:topk])
    return out


def drops_of_row(row_picks: list[list[int]], cap: int, n_experts: int, prior=None) -> set:
    """{(t, e)} dropped in one row, first come first served; `prior`: [E] counts so far."""
    taken = [int(c) for c in prior] if prior is not None else [0] * n_experts
    dropped = set()
    for t, experts in enumerate(row_picks):
        for e in experts:
            if taken[e] < cap:
                taken[e] += 1
            else:
                dropped.add((t, e))
    return dropped


def moe_capacity(
    x: torch.Tensor,
    router_w: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    capacity: float,
    shared=None,
    bias: torch.Tensor | None = None,
    topk: int = 2,
) -> tuple[torch.Tensor, list[set]]:
    """x [B, T, D] (or [T, D]: one row) -> (output like x, per row the set of dropped (t, e)).

    Each row on its own: its picks, its drops, then moe_dense over the row with those drops.
    """
    rows = x if x.dim() == 3 else x.unsqueeze(0)
    n_experts = router_w.shape[0]
    cap = capacity_of(capacity, rows.shape[1], topk, n_experts)
    outs, drops = [], []
    for row in rows:
        d = drops_of_row(picks(row, router_w, topk, bias), cap, n_experts)
        outs.append(moe_dense(row, router_w, w1, w3, w2, shared=shared, bias=bias, topk=topk,
                              drop=d))  # fmt: skip
        drops.append(d)
    return torch.stack(outs).reshape(x.shape), drops
