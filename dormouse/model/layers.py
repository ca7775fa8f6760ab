"""Small building blocks shared by the model's modules: RMSNorm and the low-rank delta."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class LowRankDelta(nn.Module):
    """x -> B(A x), with B zero-initialised so the delta starts at exactly zero."""

    def __init__(self, d_in: int, d_out: int, rank: int, std: float = 0.02):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, d_in) * std)
        self.B = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.A.t().to(x.dtype)) @ self.B.t().to(x.dtype)
