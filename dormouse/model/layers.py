"""Small building blocks shared by the model's modules: RMSNorm, the low-rank delta and the
keyed dropout."""

from __future__ import annotations

import torch
from torch import nn


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """t in fp32 for the reductions and gates the model keeps in fp32 (under bf16/fp16 too), but
    fp64 stays fp64, so a model built in fp64 computes in fp64 throughout and can be held to the
    fp64 reference (references/model.py) at fp64 round-off."""
    return t if t.dtype == torch.float64 else t.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = at_least_fp32(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


class LowRankDelta(nn.Module):
    """The low-rank delta B A of a weight, B zero-initialised so it starts at exactly zero. The
    mixers add its `matrix()` to the weight it adjusts (`with_deltas`) rather than computing
    B (A x) beside W x."""

    def __init__(self, d_in: int, d_out: int, rank: int, std: float = 0.02):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, d_in) * std)
        self.B = nn.Parameter(torch.zeros(d_out, rank))

    def matrix(self) -> torch.Tensor:
        """B A [d_out, d_in], in fp32 whatever autocast says: the delta as a weight, so that
        x (W + B A)^T is one full-width matmul where x W^T + B (A x) was three (the mixers
        fold their deltas this way: two matmuls fewer each way per projection and call, for
        rank x d_in x d_out multiply-adds)."""
        with torch.autocast(self.A.device.type, enabled=False):
            return self.B @ self.A


def with_deltas(weights: list[torch.Tensor], deltas: list[LowRankDelta] | None) -> torch.Tensor:
    """The stacked weights [sum d_out, d_in], each plus its delta's matrix where there are
    deltas (rank > 0)."""
    w = torch.cat(weights) if len(weights) > 1 else weights[0]
    if deltas is None:
        return w
    return w + torch.cat([d.matrix() for d in deltas])


# ---- dropout keyed by (seed, step, global row) -------------------------------------------

_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (two multiply-xorshift rounds) on int64 values in [0, 2^32):
    a bijection, so distinct inputs give distinct outputs. Constants below 2^27 keep every
    product inside int64 on every device."""
    h = (((h >> 16) ^ h) * 0x45D9F3B) & _M32
    h = (((h >> 16) ^ h) * 0x45D9F3B) & _M32
    return (h >> 16) ^ h


def row_keys(seed: int, step: int, rows: torch.Tensor) -> torch.Tensor:
    """One key per window from (seed, step, the window's row in the fleet's global batch).

    A rank, a micro-batch or a resume that holds global row r at step s draws the same key,
    so dropout masks do not depend on how the batch is split or accumulated."""
    h = _mix32(torch.tensor(int(seed) & _M32, dtype=torch.int64))
    h = _mix32(h ^ (int(step) & _M32))
    return _mix32(h ^ (rows.to(torch.int64) & _M32))


class KeyedDropout:
    """Dropout whose mask is a pure function of (row key, site, position): no RNG state.

    `site` names the place in the network (embedding, Engram, each mixer and FFN output per
    iteration), so every site draws its own mask; activation checkpointing recomputes the
    very same mask. Inverted scaling (kept values x 1/(1-p)), as torch's dropout.

    The mask, in 32-bit unsigned arithmetic (mix32 as `_mix32`; M32 = 2^32 - 1):

        key(seed, step, row) = mix32(mix32(mix32(seed) ^ step) ^ row)      (row_keys)
        base                 = mix32(key ^ ((site * 0x9E3779B + 1) & M32))
        h[i]                 = mix32(base ^ i)     i: the value's flat index within its window
        kept                 = (h[i] & 0xFFFFFF) >= round(p * 2^24)

    Sites: 0 the embedding, 1 the Engram branch, 2 + 2 * (iteration * n_layers + layer) a
    block's mixer output and the next site its FFN output."""

    def __init__(self, keys: torch.Tensor, p: float):
        self.keys = keys.to(torch.int64)
        self.p = float(p)
        self._threshold = round(self.p * 2**24)

    def __call__(self, t: torch.Tensor, site: int) -> torch.Tensor:
        b, n = t.shape[0], t[0].numel()
        base = _mix32(self.keys.to(t.device) ^ ((int(site) * 0x9E3779B + 1) & _M32))
        pos = torch.arange(n, device=t.device, dtype=torch.int64)
        h = _mix32(base.view(b, 1) ^ pos.view(1, n))
        keep = ((h & 0xFFFFFF) >= self._threshold).view(t.shape)
        return t * keep.to(t.dtype) * (1.0 / (1.0 - self.p))


def dropout_for(training: bool, p: float, keys: torch.Tensor | None, batch: int,
                device: torch.device) -> KeyedDropout | None:  # fmt: skip
    """The forward's dropout: None in eval or at p=0; keys from the loop, else fresh random
    keys (a caller outside the loop, such as a benchmark, that gives none)."""
    if not training or p <= 0:
        return None
    if keys is None:
        keys = torch.randint(0, 2**31, (batch,), dtype=torch.int64)
    elif keys.shape[0] != batch:
        raise ValueError(f"dropout keys: {keys.shape[0]} keys for {batch} windows; give one "
                         f"per window (layers.row_keys)")  # fmt: skip
    return KeyedDropout(keys.to(device), p)
