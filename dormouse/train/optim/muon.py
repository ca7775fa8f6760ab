"""Muon, batched: the Newton-Schulz polar (quintic or Polar Express), the update scale and
the step of one shape group of matrices whose momentum is one flat tensor: the stacked
[N, R, C] in one process, the local shards' elements of FSDP2 DTensors (dim 0 sharded), whose
whole matrices the step all-gathers for the polar (gather everywhere: every rank runs the
same polar and applies its own rows; docs/fleet.md has its bytes next to DDP's).

MixOptimizer (dormouse.train.optim.mix) builds the groups and their stacks and calls
`muon_step_`; the slow, obviously-right twin is `references/muon_single.py`, held to this one
matrix by matrix by the tests. torch.optim.Muon is not used: it rejects 3-D expert stacks.

Muon per matrix, with g its gradient and m its momentum:
    m <- mu*m + g;  u <- g + mu*m (nesterov) or m (plain)
    O <- NS(u)  (quintic or Polar Express, in ns_dtype)
    p <- p*(1 - lr*wd) - lr*scale(R, C)*O

Conventions that differ from the public ones (docs/references.md has the measurements):
the momentum is the sum form, where Keller Jordan's muon.py and torch.optim.Muon keep the
average (m <- lerp(m, g, 1 - mu)): kept, because the polar's normalisation cancels the factor
(torch's step in fp32: 1.6e-6 apart) and every checkpoint holds the buffer in this form,
(1 - mu)^-1 = 20x torch's. The default muon_sf=rms is torch's adjust_lr_fn="match_rms_adamw",
not its default "original" (jordan): kept, because Muon shares AdamW's lr, and rms puts the
update's RMS at 0.16-0.22 x lr on every matrix of `small` where jordan's spreads 0.05-0.40.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...config import ConfigError
from ..context import local_shard
from .quant import BLOCK, dequantize_signed, quantize_signed_

# Keller Jordan's quintic Newton-Schulz coefficients (https://kellerjordan.github.io/posts/muon/),
# the same triple torch.optim.Muon uses by default.
QUINTIC = (3.4445, -4.7750, 2.0315)

# Polar Express, degree 5: Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix
# Sign Methods and Their Application to the Muon Algorithm" (arXiv:2505.16932), Algorithm 1,
# code at https://github.com/NoahAmsel/PolarExpress. Step i uses triple i; steps beyond the
# table repeat the last triple. The paper divides every triple but the last by the safety
# factor 1.01 (a, b, c -> a/1.01, b/1.01^3, c/1.01^5) so bf16 round-off cannot push a singular
# value past the interval the polynomials were optimised for, and normalises the input by
# 1.01 * ||X||_F for the same reason.
_PE_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
PE_SAFETY = 1.01
POLAR_EXPRESS = tuple(
    (a / PE_SAFETY, b / PE_SAFETY**3, c / PE_SAFETY**5) for a, b, c in _PE_RAW[:-1]
) + (_PE_RAW[-1],)

#: added to ||X||_F before dividing, so a zero momentum (e.g. a zero-initialised B's partner)
#: orthogonalises to exactly zero instead of NaN; torch.optim.Muon uses the same 1e-7.
NS_EPS = 1e-7

#: ns_dtype / muon_state_dtype names (muon_state_dtype="int8" is no dtype: int8 codes with
#: one scale per block, `dormouse.train.optim.quant`)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def ns_coefficients(ns_kind: str, ns_steps: int) -> list[tuple[float, float, float]]:
    if ns_kind == "quintic":
        return [QUINTIC] * ns_steps
    if ns_kind == "polar_express":
        return [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(ns_steps)]
    raise ConfigError(f"ns_kind={ns_kind!r} is not one of ('quintic', 'polar_express')")


def newton_schulz(U: Tensor, ns_steps: int, ns_kind: str, dtype: torch.dtype) -> Tensor:
    """Approximate polar factor of each matrix of U [N, R, C], computed in `dtype`.

    The Frobenius normalisation runs in U's precision (fp32) before the cast, so a bf16
    iteration starts from a correctly scaled matrix. Wide orientation (R <= C) keeps the Gram
    matrix X X^T at its smallest.
    """
    tall = U.size(-2) > U.size(-1)
    X = U.mT if tall else U
    norm = X.norm(dim=(-2, -1), keepdim=True)
    if ns_kind == "polar_express":
        norm = norm * PE_SAFETY
    X = (X / (norm + NS_EPS)).to(dtype)
    for a, b, c in ns_coefficients(ns_kind, ns_steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b*A + c*A@A
        X = torch.baddbmm(X, B, X, beta=a)  # a*X + B@X
    return X.mT if tall else X


def muon_scale(sf: str, rows: int, cols: int) -> float:
    """Multiplier on lr for a [rows, cols] polar factor.

    jordan: sqrt(max(1, rows/cols)) (Keller Jordan's Muon; torch adjust_lr_fn="original").
    rms: 0.2*sqrt(max(rows, cols)) (Moonshot, "Muon is Scalable for LLM Training"; torch
    "match_rms_adamw"): the update's RMS matches AdamW's, so AdamW's lr and wd carry over.
    """
    if sf == "jordan":
        return math.sqrt(max(1.0, rows / cols))
    if sf == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ConfigError(f"muon_sf={sf!r} is not one of ('rms', 'jordan')")


def muon_step_(
    g: dict,
    buf: Tensor,
    offsets: list[int],
    absmax: Tensor | None = None,
    lr_t: Tensor | None = None,
) -> None:
    """One Muon step of shape group g (its params, matrix [R, C] and hyperparameters), in place.

    buf: the group's momentum, one flat tensor (fp32 or bf16) of this process's elements of
    its parameters (all of them, or the local shards of FSDP2 DTensors), parameter i's from
    offsets[i] to offsets[i + 1]. With `absmax` (muon_state_dtype=int8) buf is instead int8
    codes [blocks, BLOCK] with one absmax per block (`dormouse.train.optim.quant`), parameter i's
    blocks from offsets[i] to offsets[i + 1], its last block zero-padded. A parameter whose
    grad is None does not move and its momentum does not change. A bf16 or int8 buf is
    APPROXIMATE by design: the update is computed in fp32 from the stored momentum and the new
    momentum is rounded again (bf16: to 8 significant bits; int8: to the nearest of 255
    levels spanning its block).

    The momentum update is elementwise, so it runs on whatever elements this process holds;
    the polar needs whole matrices, so sharded directions are all-gathered first
    (`_whole_matrices`), every rank runs the same batched polar on the same bytes, and each
    applies its own rows (`_own_rows`).

    `lr_t` (the step captured in a CUDA graph, `MixOptimizer.capture_step`): a float64 0-dim
    tensor on the device holding g["lr"], read by every replay; the decay factor and the
    update's scale are then computed on the device from it (1 - lr*wd and -lr*scale in
    float64, rounded to fp32 as the Python scalars are) and the scaled direction added in a
    second pass, where the float path adds lr*scale*O in one (its fused multiply-add rounds
    once: the two differ by an ulp of the update).
    """
    params = g["params"]
    have = [i for i, p in enumerate(params) if p.grad is not None]
    if not have:
        return
    R, C = g["matrix"]
    mu = g["momentum"]
    grads = [local_shard(params[i].grad).reshape(-1) for i in have]
    G = (torch.cat(grads) if len(grads) > 1 else grads[0]).to(torch.float32)
    sizes = [t.numel() for t in grads]
    if absmax is not None:
        U = _momentum_int8_(
            g,
            buf,
            absmax,
            [(offsets[i], offsets[i + 1]) for i in have],
            G,
            sizes,
            whole=len(have) == len(params),
        )
    else:
        # Only the slots of parameters that have a gradient take part; the others' momentum is
        # neither decayed nor touched. One fp32 slot (the usual case: every parameter has a
        # gradient) is updated in place; anything else in an fp32 copy, written back.
        slots = (
            [buf] if len(have) == len(params) else [buf[offsets[i] : offsets[i + 1]] for i in have]
        )
        M = (slots[0] if len(slots) == 1 else torch.cat(slots)).float()
        M.mul_(mu).add_(G)
        U = G.add(M, alpha=mu) if g["nesterov"] else M
        if M is not slots[0]:
            torch._foreach_copy_(slots, list(M.split([t.numel() for t in slots])))
    mine = [params[i] for i in have]
    O = newton_schulz(
        _whole_matrices(mine, U, sizes, R, C), g["ns_steps"], g["ns_kind"], DTYPES[g["ns_dtype"]]
    )
    lr, wd = g["lr"], g["weight_decay"]
    views = [local_shard(p).view(-1) for p in mine]
    scale = muon_scale(g["muon_sf"], R, C)
    if lr_t is not None:
        if wd:
            torch._foreach_mul_(views, (1.0 - lr_t * wd).to(torch.float32))
        O = O.to(views[0].dtype) * (-lr_t * scale).to(torch.float32)
        torch._foreach_add_(views, _own_rows(mine, O))
        return
    if wd:
        torch._foreach_mul_(views, 1.0 - lr * wd)
    O = _own_rows(mine, O.to(views[0].dtype))
    torch._foreach_add_(views, O, alpha=-lr * scale)


def _momentum_int8_(
    g: dict,
    codes: Tensor,
    absmax: Tensor,
    spans: list[tuple[int, int]],
    G: Tensor,
    sizes: list[int],
    whole: bool,
) -> Tensor:
    """muon_step_'s momentum update on int8 blocks: the blocks `spans` (of the parameters with
    a gradient; `whole`: all of them) dequantised to fp32, m <- mu*m + g there, quantised back
    (round to nearest). Returns the direction u (flat fp32, those parameters' elements).

    The fp32 momentum and its new codes are freed on return, before the polar (whose own
    workspace is larger): the step's peak is fp32 momentum's (docs/fit.md)."""
    mu = g["momentum"]
    if whole:
        M = dequantize_signed(codes, absmax)
    else:
        M = torch.cat([dequantize_signed(codes[a:b], absmax[a:b]) for a, b in spans])
    flat = M.view(-1)
    # each parameter's elements start its own first block; the padding after them stays 0
    # (0 * mu + 0), so a padded block quantises as its real values alone
    starts = [0]
    for a, b in spans[:-1]:
        starts.append(starts[-1] + (b - a) * BLOCK)
    padded = flat.numel() != G.numel()
    if padded:
        Gp = torch.zeros_like(flat)
        for s, piece in zip(starts, G.split(sizes), strict=True):
            Gp[s : s + piece.numel()] = piece
    else:
        Gp = G
    flat.mul_(mu).add_(Gp)
    U = Gp.add(flat, alpha=mu) if g["nesterov"] else flat
    if padded:
        U = torch.cat([U[s : s + n] for s, n in zip(starts, sizes, strict=True)])
    elif U is flat:
        U = flat.clone()  # quantize_signed_ overwrites M, and the polar still needs it
    q, scale = quantize_signed_(M)
    if whole:
        codes.copy_(q)
        absmax.copy_(scale)
    else:
        n = [b - a for a, b in spans]
        torch._foreach_copy_([codes[a:b] for a, b in spans], list(q.split(n)))
        torch._foreach_copy_([absmax[a:b] for a, b in spans], list(scale.split(n)))
    return U


# ---- FSDP2: whole matrices for the polar, own rows for the update ----------------------------


def shard_rows(p: Tensor) -> tuple[int, int, int]:
    """(rows per rank, this rank's first row, its row count) of p's dim 0. FSDP2's Shard(0)
    splits as torch.chunk does: ceil(D0 / world) rows per rank, the last ranks get fewer
    or none (dim 0 = 4 on 3 ranks: 2, 2, 0). A plain tensor: all of dim 0 on "rank 0"."""
    if not hasattr(p, "placements"):
        return p.shape[0], 0, p.shape[0]
    world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    chunk = -(-p.shape[0] // world)
    first = min(rank * chunk, p.shape[0])
    return chunk, first, min(chunk, p.shape[0] - first)


def _whole_matrices(params: list[Tensor], U: Tensor, sizes: list[int], R: int, C: int) -> Tensor:
    """[N, R, C]: the group's whole matrices, from U, this process's elements of them (flat,
    `sizes` per parameter).

    Plain parameters: U itself, viewed. DTensors: ONE all-gather for the group. Every rank
    sends each parameter's rows padded to the chunk size (an empty shard sends zeros of that
    size), so the ranks' buffers are equal and nobody waits on a collective its peer skipped."""
    if not hasattr(params[0], "placements"):
        return U.view(-1, R, C)
    import torch.distributed as dist

    pieces = []
    for p, u in zip(params, U.split(sizes), strict=True):
        chunk, _, n = shard_rows(p)
        row = p.numel() // p.shape[0]
        pieces.append(torch.nn.functional.pad(u, (0, (chunk - n) * row)))
    mesh = params[0].device_mesh
    send = torch.cat(pieces)
    got = send.new_empty(mesh.size(), send.numel())
    dist.all_gather(list(got.unbind(0)), send, group=mesh.get_group())
    whole, at = [], 0
    for p, piece in zip(params, pieces, strict=True):
        whole.append(got[:, at : at + piece.numel()].reshape(-1)[: p.numel()].view(-1, R, C))
        at += piece.numel()
    return torch.cat(whole)


def _own_rows(params: list[Tensor], O: Tensor) -> list[Tensor]:
    """Each parameter's part of the group's polar O [N, R, C], as its flat local elements."""
    out, at = [], 0
    for p in params:
        n = p.numel() // (O.shape[1] * O.shape[2])
        whole = O[at : at + n].reshape(p.shape)
        at += n
        _, first, rows = shard_rows(p)
        out.append(whole if rows == p.shape[0] else whole[first : first + rows])
    return [t.reshape(-1) for t in out]
