"""The mixer's q/k L2-norm on the fla arm: one custom op, two Triton kernels of our own.

`KDAMixer` normalises q and k (each head's row of head_dim, fp32 inside, eps 1e-6 under the
root) after the short conv, whose output holds q|k|v side by side ([B, T, 3, H, D]). On the
torch arm that is `kda.l2norm` on two strided views, and under torch.compile inductor fused it
with the split into q, k, v: measured on an H200 at b1 32 x 2048 (docs/performance.md), the
forward and the backward (the norm's gradient fused with the stack of dq|dk|dv back into the
conv's layout) ran 37 ms of an ~800 ms step at ~1.2 TB/s, and v's own copy for fla's kernel
another ~4.5 ms. Here, on CUDA with Triton:

- forward: one pass over q|k|v reads each row once and writes q and k normalised and v, each
  contiguous [B, T, H, D] (what fla's `chunk_kda` takes without another copy), and the
  reciprocal norms [B, T, 2, H] in fp32;
- backward: one pass writes d(q|k|v) straight into the conv's layout,
  dx = r (dy - y (y . dy)) per row, from the normalised rows (kept by fla's kernel anyway)
  and r: no pre-norm copy is kept.

The torch arm, the CPU and any machine without Triton keep `kda.l2norm`; this module imports
Triton only when a kernel first runs. The kernels take fixed block shapes (no autotuning): a
row is head_dim wide (a power of two up to 256 in every preset), BT rows a program.
"""

from __future__ import annotations

import contextlib
import functools

import torch

EPS = 1e-6  # under the root; kda.l2norm (the torch arm) takes the same
_BT = 16  # rows (tokens) a program: 16 x 128 bf16 = 4 KiB a tile; memory-bound either way


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(x, q, k, v, r, N, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
            BT: tl.constexpr):  # fmt: skip
        i_t = tl.program_id(0)
        i_p = tl.program_id(1)  # part x head: 0..H-1 q, H..2H-1 k, 2H..3H-1 v
        h = i_p % H
        o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
        o_d = tl.arange(0, BD)
        m_t = o_t < N
        m = m_t[:, None] & (o_d[None, :] < D)
        b_x = tl.load(x + o_t[:, None] * (3 * H * D) + i_p * D + o_d[None, :], mask=m, other=0.0)
        dst = o_t[:, None] * (H * D) + h * D + o_d[None, :]
        if i_p >= 2 * H:
            tl.store(v + dst, b_x, mask=m)
        else:
            b_xf = b_x.to(tl.float32)
            b_r = 1.0 / tl.sqrt(tl.sum(b_xf * b_xf, 1) + eps)
            b_y = b_xf * b_r[:, None]
            tl.store(r + o_t * (2 * H) + i_p, b_r, mask=m_t)
            if i_p < H:
                tl.store(q + dst, b_y.to(q.dtype.element_ty), mask=m)
            else:
                tl.store(k + dst, b_y.to(k.dtype.element_ty), mask=m)

    @triton.jit
    def bwd(q, k, r, dq, dk, dv, dx, N, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
            BT: tl.constexpr):  # fmt: skip
        i_t = tl.program_id(0)
        i_p = tl.program_id(1)
        h = i_p % H
        o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
        o_d = tl.arange(0, BD)
        m_t = o_t < N
        m = m_t[:, None] & (o_d[None, :] < D)
        src = o_t[:, None] * (H * D) + h * D + o_d[None, :]
        dst = o_t[:, None] * (3 * H * D) + i_p * D + o_d[None, :]
        if i_p >= 2 * H:
            b_dv = tl.load(dv + src, mask=m, other=0.0)
            tl.store(dx + dst, b_dv.to(dx.dtype.element_ty), mask=m)
        else:
            if i_p < H:
                b_y = tl.load(q + src, mask=m, other=0.0).to(tl.float32)
                b_dy = tl.load(dq + src, mask=m, other=0.0).to(tl.float32)
            else:
                b_y = tl.load(k + src, mask=m, other=0.0).to(tl.float32)
                b_dy = tl.load(dk + src, mask=m, other=0.0).to(tl.float32)
            b_r = tl.load(r + o_t * (2 * H) + i_p, mask=m_t, other=0.0)
            b_dx = (b_dy - b_y * tl.sum(b_dy * b_y, 1)[:, None]) * b_r[:, None]
            tl.store(dx + dst, b_dx.to(dx.dtype.element_ty), mask=m)

    return triton, fwd, bwd


def on_card(t: torch.Tensor):
    """Launch on t's card (Triton launches on the current one; a fleet rank may hold another)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _outputs(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """The forward's (q, k, v, r), allocated: the op and its fake share the shapes."""
    *lead, width = qkv.shape
    if width % (3 * heads):
        raise ValueError(f"qk_l2norm: the last dim {width} is not 3 x {heads} heads of one width")
    d = width // (3 * heads)
    return (*(qkv.new_empty(*lead, heads, d) for _ in range(3)),
            qkv.new_empty(*lead, 2, heads, dtype=torch.float32))  # fmt: skip


@torch.library.custom_op("dormouse::qk_l2norm", mutates_args=())
def _qk_l2norm(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor]:  # fmt: skip
    """qkv [..., 3 x heads x D] (contiguous) -> (q, k L2-normalised per head row; v), each
    [..., heads, D] contiguous in qkv's dtype, and the reciprocal norms [..., 2, heads] fp32."""
    triton, fwd, _ = _kernels()
    q, k, v, r = _outputs(qkv, heads)
    n, d = r.numel() // (2 * heads), q.shape[-1]
    if n:
        with on_card(qkv):
            fwd[(triton.cdiv(n, _BT), 3 * heads)](qkv, q, k, v, r, n, EPS, H=heads, D=d,
                                                   BD=triton.next_power_of_2(d), BT=_BT)  # fmt: skip
    return q, k, v, r


@_qk_l2norm.register_fake
def _(qkv, heads):
    return _outputs(qkv, heads)


@torch.library.custom_op("dormouse::qk_l2norm_bwd", mutates_args=())
def _qk_l2norm_bwd(q: torch.Tensor, k: torch.Tensor, r: torch.Tensor, dq: torch.Tensor,
                   dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """d(q|k|v) [..., 3 x heads x D] of `dormouse::qk_l2norm`, from its normalised q, k, the
    reciprocal norms and the three output gradients (all contiguous)."""
    triton, _, bwd = _kernels()
    *lead, heads, d = q.shape
    dx = q.new_empty(*lead, 3 * heads * d)
    n = r.numel() // (2 * heads)
    if n:
        with on_card(q):
            bwd[(triton.cdiv(n, _BT), 3 * heads)](q, k, r, dq, dk, dv, dx, n, H=heads, D=d,
                                                   BD=triton.next_power_of_2(d), BT=_BT)  # fmt: skip
    return dx


@_qk_l2norm_bwd.register_fake
def _(q, k, r, dq, dk, dv):
    *lead, heads, d = q.shape
    return q.new_empty(*lead, 3 * heads * d)


def _setup(ctx, inputs, output):
    q, k, _, r = output
    ctx.mark_non_differentiable(r)
    ctx.save_for_backward(q, k, r)


def _backward(ctx, dq, dk, dv, _dr):
    q, k, r = ctx.saved_tensors
    grads = [torch.zeros_like(q) if g is None else g.contiguous() for g in (dq, dk, dv)]
    return torch.ops.dormouse.qk_l2norm_bwd(q, k, r, *grads), None


_qk_l2norm.register_autograd(_backward, setup_context=_setup)


def qk_l2norm(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) [B, T, heads, D] from the conv's qkv [B, T, 3 x heads x D]: q and k each
    row divided by sqrt(|row|^2 + 1e-6) in fp32, as `kda.l2norm`; v as it is."""
    q, k, v, _ = torch.ops.dormouse.qk_l2norm(qkv.contiguous(), heads)
    return q, k, v
