"""Row-sparse Adam: the optimizer of the Engram tables, in either store.

Owns `row_adam_` (the step) and `row_state` (the state it reads: per-row Adam moments and
step counts). MixOptimizer keeps one `row_state` per table: under its parameter for a VRAM
table, in its `host_state` for a host-RAM one (engram_ram), whose rows are no parameter.
Which rows a table's gradient touches is the model's rule (`dormouse.model.engram.touched_rows`:
a host store reports only those rows as its pending gradient).
"""

from __future__ import annotations

import torch


def row_state(table: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Fresh Adam state of a [n_tables, rows, dim] table, shaped like it (a DTensor's is one
    too, placed like it, so an FSDP2 shard holds its own rows' state).

    step [n_tables, rows] int32 (Adam steps each row has taken: 4 B per row), exp_avg and
    exp_avg_sq like the table, in `dtype` (default the table's: fp32; bf16 halves the
    moments, which `row_adam_` still computes in fp32)."""
    dtype = dtype or table.dtype
    return {
        "step": torch.zeros_like(table[..., 0], dtype=torch.int32,
                                 memory_format=torch.contiguous_format),  # fmt: skip
        "exp_avg": torch.zeros_like(table, dtype=dtype, memory_format=torch.contiguous_format),
        "exp_avg_sq": torch.zeros_like(table, dtype=dtype,
                                       memory_format=torch.contiguous_format),  # fmt: skip
    }


def row_adam_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    row_step: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """Adam on the listed rows only, in place; every other row and its moments stay as they are.

    param, exp_avg, exp_avg_sq: [..., dim] contiguous, row r being row r of their [-1, dim]
    view; row_step: the matching [...] int32 (Adam steps each row has taken); rows: LongTensor
    [U] of distinct row numbers on param's device; grad: [U, dim], the summed gradient of
    those rows. No weight decay (a decayed table would erase the n-grams a batch did not see).

    Lazy semantics, as torch.optim.SparseAdam: a row's moments move only on the steps
    that touch it. Unlike SparseAdam, the bias correction uses the ROW's own step count,
    not the global one: a row first touched at global step 1000 gets the full first-step
    update (m_hat = g), as it would in a fresh Adam, instead of one damped by
    (1 - beta1) / sqrt(1 - beta2).

    This is the one hand-written Adam in dormouse: torch has no lazy row Adam on dense
    gradients (SparseAdam wants sparse grads and a global step; AdamW decays every row's
    moments and moves rows the batch never touched through their momentum). Each
    operation mirrors torch.optim.AdamW's foreach path (lerp for m, mul + addcmul for v,
    step size and sqrt of the bias correction in float64, then one addcdiv-shaped
    update), so a table whose every row is touched every step follows torch AdamW
    (weight_decay=0) exactly.
    """
    d = param.shape[-1]
    param, exp_avg, exp_avg_sq = param.view(-1, d), exp_avg.view(-1, d), exp_avg_sq.view(-1, d)
    row_step = row_step.view(-1)
    b1, b2 = betas
    p = param.index_select(0, rows)
    # moments kept in bf16 are computed in the table's dtype and rounded back once per step
    m = exp_avg.index_select(0, rows).to(p.dtype)
    v = exp_avg_sq.index_select(0, rows).to(p.dtype)
    k = row_step.index_select(0, rows) + 1
    g = grad.to(p.dtype)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    kd = k.to(torch.float64)
    step_size = (lr / (1 - torch.pow(b1, kd))).to(p.dtype).unsqueeze(1)
    bc2_sqrt = (1 - torch.pow(b2, kd)).sqrt().to(p.dtype).unsqueeze(1)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.add_((-step_size) * m / denom)  # addcdiv's order: (value * m) / denom
    param.index_copy_(0, rows, p)
    exp_avg.index_copy_(0, rows, m.to(exp_avg.dtype))
    exp_avg_sq.index_copy_(0, rows, v.to(exp_avg_sq.dtype))
    row_step.index_copy_(0, rows, k.to(row_step.dtype))
