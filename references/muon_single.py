"""Muon for ONE matrix: the slow, obviously-right twin of the batched Muon (dormouse.train.optim.muon).

Written from the algorithm, not from dormouse/train/optim/muon.py (nothing is imported from it):
no stacking, no batching, no in-place tricks, float64 by default. A 3D expert stack is fed
to it one [rows, cols] matrix at a time by the caller.

    m <- momentum*m + g
    u <- g + momentum*m   (nesterov)   or   m   (plain)
    O <- Newton-Schulz polar factor of u  (ns_steps iterations, quintic or Polar Express)
    p <- p*(1 - lr*wd) - lr*scale*O,  scale = sqrt(max(1, rows/cols))   (sf="jordan")
                                              0.2*sqrt(max(rows, cols))  (sf="rms")
"""

from __future__ import annotations

import math

import torch

# Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024).
QUINTIC = (3.4445, -4.7750, 2.0315)

# Amsel, Persson, Musco, Gower, "The Polar Express" (arXiv:2505.16932), Algorithm 1 (degree 5).
# All triples except the last are divided by 1.01 (a), 1.01^3 (b), 1.01^5 (c), and the input is
# divided by 1.01*||X||_F: the paper's safety margin. Later steps reuse the last triple.
_PE_TABLE = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
_SAFETY = 1.01
EPS = 1e-7


def _pe_triple(i: int) -> tuple[float, float, float]:
    last = len(_PE_TABLE) - 1
    if i >= last:
        return _PE_TABLE[last]
    a, b, c = _PE_TABLE[i]
    return (a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5)


def polar(u: torch.Tensor, ns_steps: int, ns_kind: str) -> torch.Tensor:
    """Newton-Schulz approximation of U V^T for u = U S V^T, one 2D matrix."""
    assert u.dim() == 2, "one matrix at a time"
    x = u.clone()
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # iterate on the wide orientation; the polar factor transposes with it
        x = x.t()
    fro = math.sqrt(float((x * x).sum()))
    if ns_kind == "quintic":
        x = x / (fro + EPS)
    elif ns_kind == "polar_express":
        x = x / (fro * _SAFETY + EPS)
    else:
        raise ValueError(f"unknown ns_kind {ns_kind!r}")
    for i in range(ns_steps):
        a, b, c = QUINTIC if ns_kind == "quintic" else _pe_triple(i)
        xxt = x @ x.t()
        # the odd polynomial a*x + b*x^3 + c*x^5 applied to the singular values
        x = a * x + b * (xxt @ x) + c * (xxt @ (xxt @ x))
    return x.t() if transposed else x


def scale(sf: str, rows: int, cols: int) -> float:
    if sf == "jordan":
        return math.sqrt(max(1.0, rows / cols))
    if sf == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown sf {sf!r}")


def muon_single_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    lr: float,
    wd: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    ns_kind: str,
    sf: str,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Muon step of one [rows, cols] matrix. Returns (new p, new m) in `dtype`."""
    assert p.dim() == 2 and p.shape == g.shape == m.shape
    p, g, m = p.to(dtype), g.to(dtype), m.to(dtype)
    m_new = momentum * m + g
    u = g + momentum * m_new if nesterov else m_new
    o = polar(u, ns_steps, ns_kind)
    rows, cols = p.shape
    p_new = p * (1.0 - lr * wd) - lr * scale(sf, rows, cols) * o
    return p_new, m_new
