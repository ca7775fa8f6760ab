"""The mixer's short conv + SiLU and its q/k L2-norm, one step and one row at a time: the
references the fla arm's fused ops are held against (`dormouse::conv_silu`: fla's forward and
`dormouse/model/conv_silu.py`'s backward; `dormouse::qk_l2norm`: `dormouse/model/qk_norm.py`).

Short conv, for x [B, T, C] and taps w [C, W], at every step t and channel c:

    y[t, c] = sum_{j = 0}^{W-1} w[c, j] * x[t - (W-1) + j, c]      x before step 0 is zero
    out     = y * sigmoid(y)                                          SiLU

so tap 0 meets the oldest input and tap W-1 the current one. q/k norm, for q|k|v [B, T, 3 H D]
laid out as [B, T, 3, H, D]: each of q's and k's rows of D divided by sqrt(|row|^2 + eps),
v as it is.

A Python loop over steps and taps, and a written-out root; no padding tricks, no fused
arithmetic. Computed in the dtype it is given (fp64 inputs: a double-precision reference);
gradients come from autograd through these loops.
"""

from __future__ import annotations

import torch


def short_conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    W = w.shape[1]
    steps = []
    for t in range(T):
        y = torch.zeros(B, C, dtype=x.dtype, device=x.device)
        for j in range(W):
            s = t - (W - 1) + j
            if s >= 0:
                y = y + w[:, j] * x[:, s]
        steps.append(y * torch.sigmoid(y))
    return torch.stack(steps, dim=1)


def qk_l2norm(qkv: torch.Tensor, heads: int, eps: float = 1e-6) -> list[torch.Tensor]:
    B, T, width = qkv.shape
    parts = qkv.reshape(B, T, 3, heads, width // (3 * heads))
    out = []
    for p in range(2):
        row = parts[:, :, p]
        out.append(row / torch.sqrt((row * row).sum(dim=-1, keepdim=True) + eps))
    return [*out, parts[:, :, 2]]
