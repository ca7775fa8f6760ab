"""The backward of the fla arm's short conv + SiLU: one Triton kernel of our own.

`ShortConv.silu(fused=True)` runs fla's `causal_conv1d` forward: silu of a causal depthwise
conv over time, tap 0 x the oldest input .. tap W-1 x the current byte, zeros before the
window, the sums in fp32. fla's backward does three things:
- it re-runs that forward to write the pre-activation out (one pass writing [B, T, C], one
  reading it);
- per 64-step tile, it loads dy and the pre-activation once per tap, and so computes each
  SiLU derivative W times;
- it writes each tile's tap gradients to a [B x T / 64, C, W] fp32 buffer, which a sum then
  reduces.
Measured on an H200 at b1 32 x 2048 x 4608 (docs/performance.md): 2.3-2.4 ms a call with the
sum, 37.5 ms of an ~810 ms step.

Here each program walks its span of time one step at a time, for one block of channels, with
windows of rows held in registers and slid by one row a step:
- x rows t-(W-1) .. t+W-1 and dy row t+W-1, each loaded P rows ahead of their use, so every
  row of x and dy is read from memory once and the loads of later steps are in flight;
- the SiLU gradients g rows t .. t+W-1: each step computes only the newest,
  z[t+W-1] = sum_j w[j] x[t+j] and g = dy silu'(z), so every derivative is computed once;
- dx[t] = sum_s w[W-1-s] g[t+s] is written, and dw[j] += g[t] x[t-(W-1)+j] is summed in fp32
  registers over the span, then written once per (batch row, span) and summed by torch.
Measured on the H200 (`bench kernels`, docs/performance.md): 0.92 ms a call at
that shape (1.98 TB/s of the least bytes: x, dy read, dx written).

The block shapes come from the input's shape (`_plan`), with no autotuning. Triton is imported
only when the kernel first runs.
"""

from __future__ import annotations

import functools

import torch

from .qk_norm import on_card  # launch on the tensors' card, as the norm's kernels do

_LANES = 4  # channels a thread holds: 8-byte bf16 loads; x, dy and g windows + W sums in regs
_AHEAD = 2  # rows of x and dy loaded ahead of the step that uses them
_SPANS = (128, 64, 32, 16)  # rows a program walks, longest first
_PROGRAMS = 1024  # a span is shortened until the grid has at least this many programs


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def bwd(x, w, dy, dx, dwp, T, C, NS, W: tl.constexpr, BC: tl.constexpr,
            SPAN: tl.constexpr, P: tl.constexpr):  # fmt: skip
        i_c = tl.program_id(0)
        i_s = tl.program_id(1)  # span of time
        i_b = tl.program_id(2)
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        base = i_b.to(tl.int64) * T * C  # within a batch row, offsets fit int32 (checked)
        p_x, p_dy, p_dx = x + base, dy + base, dx + base
        taps = ()
        for j in tl.static_range(W):
            taps = taps + (tl.load(w + o_c * W + j, mask=m_c, other=0.0).to(tl.float32),)
        t0 = i_s * SPAN
        xs = ()  # x rows t-(W-1) .. t+W-1+P: entry k is row t-(W-1)+k
        for k in tl.static_range(2 * W - 1 + P):
            r = t0 - (W - 1) + k
            xs = xs + (tl.load(p_x + r * C + o_c, mask=m_c & (r >= 0) & (r < T), other=0.0),)
        ds = ()  # dy rows t+W-1 .. t+W-1+P
        for k in tl.static_range(P + 1):
            r = t0 + W - 1 + k
            ds = ds + (tl.load(p_dy + r * C + o_c, mask=m_c & (r < T), other=0.0),)
        gs = ()  # g rows t .. t+W-2
        for s in tl.static_range(W - 1):
            r = t0 + s
            z = xs[s].to(tl.float32) * taps[0]
            for j in tl.static_range(1, W):
                z += xs[s + j].to(tl.float32) * taps[j]
            d = tl.load(p_dy + r * C + o_c, mask=m_c & (r < T), other=0.0).to(tl.float32)
            sg = tl.sigmoid(z)
            gs = gs + (d * sg * (1 + z * (1 - sg)),)
        acc = ()
        for _j in tl.static_range(W):
            acc = acc + (tl.zeros((BC,), dtype=tl.float32),)
        for i in range(SPAN):
            t = t0 + i
            z = xs[W - 1].to(tl.float32) * taps[0]  # the newest g, row t+W-1: x rows t..t+W-1
            for j in tl.static_range(1, W):
                z += xs[W - 1 + j].to(tl.float32) * taps[j]
            sg = tl.sigmoid(z)
            gf = gs + (ds[0].to(tl.float32) * sg * (1 + z * (1 - sg)),)  # g rows t .. t+W-1
            b_dx = gf[0] * taps[W - 1]
            for s in tl.static_range(1, W):
                b_dx += gf[s] * taps[W - 1 - s]
            tl.store(p_dx + t * C + o_c, b_dx.to(dx.dtype.element_ty), mask=m_c & (t < T))
            new = ()
            for j in tl.static_range(W):
                new = new + (acc[j] + gf[0] * xs[j].to(tl.float32),)
            acc = new
            r = t + W + P  # slide every window one row
            nx = ()
            for k in tl.static_range(1, 2 * W - 1 + P):
                nx = nx + (xs[k],)
            xs = nx + (tl.load(p_x + r * C + o_c, mask=m_c & (r < T), other=0.0),)
            nd = ()
            for k in tl.static_range(1, P + 1):
                nd = nd + (ds[k],)
            ds = nd + (tl.load(p_dy + r * C + o_c, mask=m_c & (r < T), other=0.0),)
            ng = ()
            for s in tl.static_range(1, W):
                ng = ng + (gf[s],)
            gs = ng
        p_dw = dwp + (i_b * NS + i_s).to(tl.int64) * C * W + o_c * W
        for j in tl.static_range(W):
            tl.store(p_dw + j, acc[j], mask=m_c)

    return triton, bwd


def _plan(B: int, T: int, C: int) -> tuple[int, int, int]:
    """(channels a program, its warps, rows it walks) for a [B, T, C] input: 512 channels (C
    rounded up to a power of two below that), and the longest span that still gives the grid
    `_PROGRAMS` programs. Measured on the H200 (2026-12-04):
    - b1's 32 x 2048 x 4608: span 128 0.93 ms, 64 0.96, 32 1.02; 256 channels on 2 warps
      0.96 at span 64, 1024 on 8 warps 1.18;
    - small's 64 x 256 x 768 (two blocks a row, the second half masked): span 32 0.142 ms, 64
      0.151, 128 0.179; 256 channels on 2 warps 0.183 at span 64."""
    bc = min(512, 1 << max(C - 1, 0).bit_length())
    span = next((s for s in _SPANS if -(-C // bc) * B * -(-T // s) >= _PROGRAMS), _SPANS[-1])
    rows = 1 << max(T - 1, 0).bit_length()
    return bc, max(1, bc // (32 * _LANES)), min(span, max(rows, _SPANS[-1]))


def conv_silu_bwd(x: torch.Tensor, w: torch.Tensor,
                  dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx, dw) of y = silu(causal depthwise conv of x [B, T, C] by w [C, W]); dx in x's dtype,
    dw in w's (each tap's sum over B and T in fp32)."""
    x, w, dy = x.contiguous(), w.contiguous(), dy.contiguous()
    B, T, C = x.shape
    W = w.shape[1]
    if (T + 2 * W) * C >= 2**31:
        raise ValueError(f"conv_silu_bwd: one batch row of {T} x {C} exceeds the kernel's int32 "
                         "offsets; use a shorter seq_len or kda_impl=torch")  # fmt: skip
    bc, warps, span = _plan(B, T, C)
    ns = -(-T // span)
    dx = torch.empty_like(x)
    dwp = torch.zeros(B * ns, C, W, device=x.device, dtype=torch.float32)
    if x.numel():
        triton, bwd = _kernel()
        with on_card(x):
            bwd[(triton.cdiv(C, bc), ns, B)](x, w, dy, dx, dwp, T, C, ns, W=W, BC=bc, SPAN=span,
                                             P=_AHEAD, num_warps=warps)  # fmt: skip
    return dx, dwp.sum(0).to(w.dtype)
