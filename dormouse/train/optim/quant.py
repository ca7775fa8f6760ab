"""Blockwise 8-bit codes for optimizer state (muon_state_dtype / engram_state_dtype = "int8").

A block of values (the last dimension of the tensor handed in) is kept as 8-bit codes and one
fp32 scale. The optimizer step dequantises the blocks it reads to fp32, does its arithmetic
there and quantises the result back, rounding to nearest: like bf16 storage this is
APPROXIMATE by design (each step adds at most half a code step of error per value).

* signed (Muon's momentum, Adam's exp_avg): int8 q = round(x / absmax * 127), x ~ q * absmax
  / 127, absmax the block's largest |x|. Round to nearest: |error| <= absmax / 254.
* sqrt (Adam's exp_avg_sq, v >= 0): uint8 q = round(sqrt(v) / smax * 255), v ~ (q * smax /
  255)^2, smax the block's largest sqrt(v). v holds squared gradients, so a 1000x spread of
  gradients within a block is a 1e6 spread of v but only 1000x of sqrt(v): coding sqrt halves
  the range in orders of magnitude that 255 linear steps must span, and Adam divides by
  sqrt(v), so the error lands where it is used, a fixed fraction of the block's largest
  denominator. One exception to round-to-nearest: a positive v never codes to 0 (code 1 at
  least). Adam's update is m / (sqrt(v) + eps) with eps = 1e-8; m has its own scale, so a v
  rounded to zero beside an m that is not would step that value by ~m / eps, 1e8 times m
  (the failure of linear 8-bit Adam that bitsandbytes' dynamic code avoids). With the floor,
  such a value's denominator is one code step, smax / 255, at least twice its true sqrt(v):
  its step is damped, never blown up.

Zero blocks (a never-touched Engram row, a zero momentum) keep scale 0 and codes 0 and
dequantise to exact zeros: the division uses 1 where the scale is 0, so no NaN appears.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Muon's momentum block: 256 values per fp32 scale costs 4/256 = 1.6% over the int8 codes
#: (1.016 B a value), while a block stays small enough that one large entry flattens only its
#: 255 neighbours' resolution (bitsandbytes' 8-bit optimizers use blocks of 256 for the same
#: trade). The Engram tables use one table row as the block instead (`row_state`).
BLOCK = 256

SIGNED_MAX = 127  # int8 codes -127..127 (-128 unused: the code is symmetric)
SQRT_MAX = 255  # uint8 codes 0..255


def _safe(scale: Tensor) -> Tensor:
    """The divisor for a block's values: its scale, or 1 for a zero block (whose values are
    all 0, so they code to 0 instead of 0/0 = NaN)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)


def quantize_signed_(x: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 codes like x, fp32 absmax per block [x.shape[:-1]]) of fp32 x [..., block].
    x is overwritten (the caller's scratch: one fp32 temporary less)."""
    absmax = torch.linalg.vector_norm(x, float("inf"), dim=-1)
    # x / absmax first (<= 1 in magnitude, so a subnormal absmax cannot overflow 127 / absmax)
    q = x.div_(_safe(absmax)).mul_(SIGNED_MAX).round_().to(torch.int8)
    return q, absmax


def dequantize_signed(q: Tensor, absmax: Tensor) -> Tensor:
    """fp32 values [..., block] of int8 codes q and their blocks' absmax."""
    return q.to(torch.float32).mul_((absmax / SIGNED_MAX).unsqueeze(-1))


def quantize_sqrt_(v: Tensor) -> tuple[Tensor, Tensor]:
    """(uint8 codes of sqrt(v), fp32 max of sqrt(v) per block) of fp32 v >= 0 [..., block].
    A positive v codes to 1 at least (the module docstring says why). v is overwritten."""
    s = v.sqrt_()
    smax = torch.amax(s, dim=-1)
    positive = s > 0
    q = s.div_(_safe(smax)).mul_(SQRT_MAX).round_()
    q = torch.maximum(q, positive.to(q.dtype))  # 1 where v > 0 rounded to 0
    return q.to(torch.uint8), smax


def dequantize_sqrt(q: Tensor, smax: Tensor) -> Tensor:
    """fp32 v [..., block] of uint8 codes q of sqrt(v) and their blocks' max of sqrt(v)."""
    return q.to(torch.float32).mul_((smax / SQRT_MAX).unsqueeze(-1)).square_()
