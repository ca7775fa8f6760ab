"""Row-sparse Adam: the optimizer of the Engram tables, in either store.

Owns `row_adam_` (the step) and `row_state` (the state it reads: per-row Adam moments and
step counts). MixOptimizer keeps one `row_state` per table: under its parameter for a VRAM
table, in its `host_state` for a host-RAM one (engram_ram), whose rows are no parameter.
Which rows a table's gradient touches is the model's rule (`dormouse.model.engram.touched_rows`:
a host store reports only those rows as its pending gradient).
"""

from __future__ import annotations

import torch

from .quant import dequantize_signed, dequantize_sqrt, quantize_signed_, quantize_sqrt_


def row_state(table: torch.Tensor, state_dtype: str = "fp32") -> dict[str, torch.Tensor]:
    """Fresh Adam state of a [n_tables, rows, dim] table, shaped like it (a DTensor's is one
    too, placed like it, so an FSDP2 shard holds its own rows' state).

    step [n_tables, rows] int32 (Adam steps each row has taken: 4 B per row), and the moments,
    which `row_adam_` always computes in fp32, stored by `state_dtype`:

    * "fp32" / "bf16": exp_avg and exp_avg_sq like the table, in that dtype (bf16 halves them).
    * "int8" (`dormouse.train.optim.quant`): exp_avg_q (int8) and exp_avg_sq_q (uint8 codes of
      sqrt(v)) like the table, and per ROW one fp32 scale each, exp_avg_absmax and
      exp_avg_sq_sqrtmax [n_tables, rows]. A block is one table row because the row-sparse
      step reads and writes whole rows: re-quantising a touched row touches its own codes and
      scales and nothing else, and no block mixes a touched row with an untouched one. Cost:
      1 B per value per moment + 4 B per row per moment (dim 32: 1.125 B a value, dim 128:
      1.03 B), against 4 B (fp32) and 2 B (bf16).
    """

    def like(dtype, t=table):
        return torch.zeros_like(t, dtype=dtype, memory_format=torch.contiguous_format)

    state = {"step": like(torch.int32, table[..., 0])}
    if state_dtype == "int8":
        state.update(
            exp_avg_q=like(torch.int8),
            exp_avg_absmax=like(torch.float32, table[..., 0]),
            exp_avg_sq_q=like(torch.uint8),
            exp_avg_sq_sqrtmax=like(torch.float32, table[..., 0]),
        )
        return state
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype]
    state.update(exp_avg=like(dtype), exp_avg_sq=like(dtype))
    return state


def moments(state: dict[str, torch.Tensor]) -> tuple:
    """`row_adam_`'s moment arguments from a `row_state`: (exp_avg, exp_avg_sq, scales)."""
    if "exp_avg_q" in state:
        return (
            state["exp_avg_q"],
            state["exp_avg_sq_q"],
            (state["exp_avg_absmax"], state["exp_avg_sq_sqrtmax"]),
        )
    return state["exp_avg"], state["exp_avg_sq"], None


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
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Adam on the listed rows only, in place; every other row and its moments stay as they are.

    param, exp_avg, exp_avg_sq: [..., dim] contiguous, row r being row r of their [-1, dim]
    view; row_step: the matching [...] int32 (Adam steps each row has taken); rows: LongTensor
    [U] of distinct row numbers on param's device; grad: [U, dim], the summed gradient of
    those rows. No weight decay (a decayed table would erase the n-grams a batch did not see).
    scales: None for fp32/bf16 moments; for int8 ones (`row_state(..., "int8")`) exp_avg and
    exp_avg_sq are the codes and scales = (exp_avg_absmax, exp_avg_sq_sqrtmax), one per row:
    the listed rows are dequantised, stepped in fp32 and quantised back, each row on its own.

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
    p = param.index_select(0, rows)
    if scales is None:
        # moments kept in bf16 are computed in the table's dtype and rounded back once per step
        m = exp_avg.index_select(0, rows).to(p.dtype)
        v = exp_avg_sq.index_select(0, rows).to(p.dtype)
    else:
        m_scale, v_scale = (t.view(-1) for t in scales)
        m = dequantize_signed(exp_avg.index_select(0, rows), m_scale.index_select(0, rows))
        v = dequantize_sqrt(exp_avg_sq.index_select(0, rows), v_scale.index_select(0, rows))
    k = row_step.index_select(0, rows) + 1
    p = _adam_rows(p, m, v, k, grad.to(p.dtype), lr, betas, eps)
    param.index_copy_(0, rows, p)
    row_step.index_copy_(0, rows, k.to(row_step.dtype))
    if scales is None:
        exp_avg.index_copy_(0, rows, m.to(exp_avg.dtype))
        exp_avg_sq.index_copy_(0, rows, v.to(exp_avg_sq.dtype))
        return
    for codes, scale, (q, s) in (
        (exp_avg, m_scale, quantize_signed_(m)),
        (exp_avg_sq, v_scale, quantize_sqrt_(v)),
    ):
        codes.index_copy_(0, rows, q)
        scale.index_copy_(0, rows, s)


def _adam_rows(p, m, v, k, g, lr, betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Adam on whole rows: m and v ([rows, dim], the table's dtype) move in place; returns the
    rows' new values. k [rows] is each row's step count after this step (its bias correction);
    lr a float or a 0-dim tensor. torch.optim.AdamW's foreach order: lerp for m, mul +
    addcmul for v, step size and sqrt of the bias correction in float64, then the update in
    addcdiv's order, (value * m) / denom."""
    b1, b2 = betas
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    kd = k.to(torch.float64)
    step_size = (lr / (1 - torch.pow(b1, kd))).to(p.dtype).unsqueeze(1)
    bc2_sqrt = (1 - torch.pow(b2, kd)).sqrt().to(p.dtype).unsqueeze(1)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    return p + (-step_size) * m / denom


#: Rows per pass of `row_adam_dense_` (x dim values): bounds its temporaries (a handful of
#: [rows, dim] fp32 buffers) on b1-sized tables, whose whole-table temporaries would be GBs.
DENSE_CHUNK_VALUES = 1 << 22


def row_adam_dense_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    row_step: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """`row_adam_` without asking the host which rows: every row is computed and the touched
    ones (a gradient row not all zero, `touched_rows`' rule) are written back by a mask.

    No `nonzero`, no host synchronisation and no data-dependent shape, so it can be captured
    in a CUDA graph (the optimizer step under compile_mode=reduce-overhead); `lr` is a
    float64 0-dim tensor on the table's device, which the captured graph reads each replay.
    The touched rows get the same elementwise operations in the same order as `row_adam_`,
    so the two agree bit for bit; untouched rows, their moments and step counts are left as
    they were (a row never touched has step 0: its bias correction divides by zero, and the
    mask discards that). fp32 / bf16 moments only (int8 codes take `row_adam_`). The table
    is walked in passes of DENSE_CHUNK_VALUES values, so the extra memory is a few such
    buffers whatever the table's size; the cost is reading every row every step (at 4.8 TB/s
    an H200 reads 1 GB of table, moments and gradient in ~0.2 ms).
    """
    d = param.shape[-1]
    P, M, V, G = (t.view(-1, d) for t in (param, exp_avg, exp_avg_sq, grad))
    S = row_step.view(-1)
    n = max(1, DENSE_CHUNK_VALUES // d)
    for a in range(0, P.shape[0], n):
        p_, m_, v_, s_, g_ = (t[a : a + n] for t in (P, M, V, S, G))
        hit = g_.any(1)
        k = s_ + hit.to(s_.dtype)
        m = m_.to(p_.dtype, copy=True)
        v = v_.to(p_.dtype, copy=True)
        p = _adam_rows(p_, m, v, k, g_.to(p_.dtype), lr, betas, eps)
        h = hit.unsqueeze(1)
        p_.copy_(torch.where(h, p, p_))
        m_.copy_(torch.where(h, m.to(m_.dtype), m_))
        v_.copy_(torch.where(h, v.to(v_.dtype), v_))
        s_.copy_(torch.where(hit, k, s_))
