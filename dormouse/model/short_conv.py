"""The mixer's short causal depthwise conv and its SiLU: the torch form (a sum over the taps,
so a byte-by-byte decode reproduces the full forward) and, on the fla arm, both fused in
custom ops (`dormouse::conv_silu`, its backward our Triton kernel in conv_silu.py). Its
reference is `references/short_conv.py`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The fused forward is fla's causal_conv1d kernel, each output the taps' products summed in
# fp32 in tap order (tap 0 x the oldest input .. tap W-1 x the current byte, zeros before the window)
# and rounded once; the backward is our own kernel (conv_silu.py), which recomputes the
# pre-activation from x in registers rather than keeping it. Custom ops, as kda_chunk: fla's
# functions are compiler-disabled, and an op is one opaque node in a compiled graph. Measured
# on an H200 at b1 32 x 2048 (docs/performance.md): the eager chain it replaces (padded cat,
# W products and sums, SiLU, each a pass over [B, T, 3 x d_attn]) ran ~110 ms of the 842 GPU
# ms of a step, compiled, at ~1.25 TB/s.


@torch.library.custom_op("dormouse::conv_silu", mutates_args=())
def _conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv of x [B, T, C] by the taps w [C, W]), x's dtype."""
    from fla.modules.causal_conv1d import causal_conv1d_fwd

    y, _ = causal_conv1d_fwd(x, w, None, None, activation="silu")
    return y


@_conv_silu.register_fake
def _(x, w):
    return torch.empty_like(x)


@torch.library.custom_op("dormouse::conv_silu_bwd", mutates_args=())
def _conv_silu_bwd(x: torch.Tensor, w: torch.Tensor,
                   dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx, dw) of `dormouse::conv_silu` (dw in w's dtype, summed over B and T in fp32)."""
    from .conv_silu import conv_silu_bwd

    return conv_silu_bwd(x, w, dy)


@_conv_silu_bwd.register_fake
def _(x, w, dy):
    return torch.empty_like(x), torch.empty_like(w)


def _conv_silu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_silu_backward(ctx, dy):
    x, w = ctx.saved_tensors
    return torch.ops.dormouse.conv_silu_bwd(x, w, dy.contiguous())


_conv_silu.register_autograd(_conv_silu_backward, setup_context=_conv_silu_setup)


class ShortConv(nn.Module):
    """Causal depthwise conv over time; `tail` holds the previous conv_size-1 inputs."""

    def __init__(self, channels: int, size: int):
        super().__init__()
        self.size = size
        bound = 1.0 / math.sqrt(size)  # nn.Conv1d's default range for a depthwise filter
        self.weight = nn.Parameter(torch.empty(channels, size).uniform_(-bound, bound))

    def forward(
        self, x: torch.Tensor, tail: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C], tail [B, size-1, C] or None (zeros) -> (y [B, T, C], new tail)."""
        B, T, Ch = x.shape
        if tail is None:
            tail = x.new_zeros(B, self.size - 1, Ch)
        xt = torch.cat([tail.to(x.dtype), x], dim=1)
        w = self.weight.to(x.dtype)
        # a sum over the taps, not F.conv1d: each output is the same few ops whatever T is,
        # so a byte-by-byte decode reproduces the full forward
        y = xt[:, 0:T] * w[:, 0]
        for j in range(1, self.size):
            y = y + xt[:, j : j + T] * w[:, j]
        return y, xt[:, T:]

    def silu(
        self, x: torch.Tensor, tail: torch.Tensor | None, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(silu(conv(x)), new tail), as forward + F.silu. `fused` (the fla arm, CUDA): both
        in fla's kernel (`dormouse::conv_silu`), fp32 sums rounded once; a given tail is
        put before x and its outputs cut off, so a byte-by-byte decode runs the same sums."""
        if not fused:
            y, new_tail = self(x, tail)
            return F.silu(y), new_tail
        B, T, Ch = x.shape
        w = self.weight.to(x.dtype)
        if tail is None:
            y = torch.ops.dormouse.conv_silu(x.contiguous(), w)
            keep = self.size - 1
            new_tail = (x[:, T - keep:] if keep <= T else
                        torch.cat([x.new_zeros(B, keep - T, Ch), x], dim=1))  # fmt: skip
            return y, new_tail
        xt = torch.cat([tail.to(x.dtype), x], dim=1)
        y = torch.ops.dormouse.conv_silu(xt, w)[:, tail.shape[1] :]
        return y, xt[:, T:]
