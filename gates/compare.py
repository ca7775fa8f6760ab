"""How a gate compares a fleet's figures with its reference's, and the tolerance rule on CUDA."""

from __future__ import annotations

import math

import torch


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """max |a_i - b_i| / |b_i| (inf on a length mismatch or a non-finite entry)."""
    if len(a) != len(b) or not a:
        return float("inf")
    out = 0.0
    for x, y in zip(a, b):
        if not (math.isfinite(x) and math.isfinite(y)):
            return float("inf")
        out = max(out, abs(x - y) / max(abs(y), 1e-30))
    return out


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors together (fp64)."""
    if set(a) != set(b):
        return float("inf")
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / max(den, 1e-300)) ** 0.5


def update_rel_err(after: dict, ref_after: dict, before: dict) -> float:
    """Relative error of the UPDATE: ||(a - p0) - (r - p0)|| / ||r - p0||. Far more sensitive
    than the parameter error, whose denominator is the (large) parameters themselves."""
    du = {k: after[k].double() - before[k].double() for k in before}
    dr = {k: ref_after[k].double() - before[k].double() for k in before}
    return rel_err(du, dr)


def flat_tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """{path: tensor} of every floating-point tensor in a nested state (an optimizer's)."""
    out: dict[str, torch.Tensor] = {}
    if torch.is_tensor(obj):
        if obj.is_floating_point():
            t = obj.detach()
            out[prefix] = (t.to_local() if hasattr(t, "to_local") else t).to("cpu")  # a DTensor
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}/{i}"))
    return out


def rel_to_peak(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| in fp64 on the CPU: the error relative to the largest entry."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def routing_margin(moe, x: torch.Tensor) -> float:
    """The smallest gap between a token's k-th and (k+1)-th routing score (sigmoid affinity
    plus LFB bias, fp64 on the CPU) for input x: how far `moe`'s picks are from a flip. Well
    above fp32's ~1e-7, fp32 and an fp64 reference pick the same experts."""
    w, k = moe.router.weight.detach().double().cpu(), moe.topk
    with torch.no_grad():
        s = torch.sigmoid(x.detach().reshape(-1, w.shape[1]).double().cpu() @ w.t())
        top = torch.topk(s + moe.lfb_bias.detach().double().cpu(), k + 1, dim=-1).values
    return float((top[:, k - 1] - top[:, k]).min())


#: On CUDA a tolerance is at least this many times the reference's spread on the card (as on CPU).
SPREAD_K = 4.0


def tol_on(cuda: bool, fp32_tol: float, spread: float) -> float:
    """The tolerance a gate applies: the fp32 one on the CPU; on CUDA at least SPREAD_K x
    the reference's spread. The spread: the one-process reference against itself with each
    global batch cut into the fleet's per-rank pieces (no communication). GPU kernels pick
    their blocking by shape, so the pieces round differently, which Adam's normalisation turns
    into visible update differences on near-zero gradients; a row permutation of the batch
    keeps every shape and under-measures it (17x below the fleet's update error on an H200)."""
    return max(fp32_tol, SPREAD_K * spread) if cuda else fp32_tol


def judge(
    cuda: bool,
    figures: dict[str, float],
    fp32_tol: dict[str, float],
    spread: dict[str, float] | None = None,
) -> tuple[bool, str, str]:
    """(every figure within its tolerance, "name figure, ..." text, "name <= tol, ..." text).
    On CUDA each tolerance is tol_on(...) of the reference's spread of the same figure."""
    spread = spread or {}
    tol = {k: tol_on(cuda, t, spread.get(k, 0.0)) for k, t in fp32_tol.items()}
    ok = all(figures[k] <= tol[k] for k in tol)
    text = ", ".join(f"{k} {fmt(figures[k])}" for k in tol)
    if cuda and spread:
        text += (
            " (the reference's own spread: "
            + ", ".join(f"{k} {fmt(spread[k])}" for k in tol if k in spread)
            + ")"
        )
    return ok, text, ", ".join(f"{k} <= {fmt(v)}" for k, v in tol.items())


def fmt(x: float) -> str:
    return f"{x:.2e}" if x != 0 else "0"
