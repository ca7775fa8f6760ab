"""Gate 19: every kernel arm equals its slow, obviously-right twin in `references/`.

No fleet. CPU: the chunked torch KDA arm vs `references/kda_naive.py` (fp32 forward on
shapes that cross and pad chunks, fp64 gradients); the MoE arms (grouped where it
runs, batched, dense) vs `references/moe_dense.py` (dropless) and vs `references/moe_capacity.py`
(capacity 0.5 and 1.0: forward, drops, every gradient). cuda=True: the same MoE arms on the
GPU (TF32 off, the fp64 reference on the CPU), the torch KDA arm on the GPU, and the fla arm
vs kda_naive in fp32, and the fla arm's other mixer ops (the short conv + SiLU: fla's forward
and our backward kernel; our q/k L2-norm) vs `references/short_conv.py` in fp64. The
tolerances are the ones tests/test_kda.py and tests/test_moe.py measured, quoted with their
reasons.
"""

from __future__ import annotations

import math

import torch

from gates.compare import fmt, rel_to_peak, routing_margin
from gates.fixtures import kda_inputs, threads
from gates.status import Record, environment

CUDA = False
SINGLE_CUDA = True

# tests/test_kda.py: the chunked form's fp32 round-off measured ~2e-7; ~50x. Bugs: >= 1e-2.
KDA_FP32_TOL = 1e-5
# tests/test_kda.py: fp64 on both sides, only the algorithm differs.
KDA_FP64_GRAD_TOL = 1e-9
# tests/test_kda.py, H200: fla's TF32 dots measured o 2.6e-4, S 1.5e-3; ~8x. Bugs: > 0.1.
FLA_FP32_TOL_O, FLA_FP32_TOL_S = 2e-3, 1e-2
# fla's mixer ops vs fp64 (tests/test_kda.py, H200): conv+SiLU 1.5e-7, q/k norm 1.8e-7; 60x, 5x.
CONV_FP32_TOL, NORM_FP32_TOL = 1e-5, 1e-6
# tests/test_moe.py: fp32 vs fp64, dots of length <= 32: round-off ~1e-6; ~20x. Bugs: O(0.1).
MOE_ATOL, MOE_RTOL = 2e-5, 1e-4
# tests/test_moe.py's MoE shape (the tolerance above was measured for it).
D, FF, E, K, R = 16, 32, 4, 2, 8

CLAIM = "every kernel arm equals its hand-written reference"
TOLERANCE = (f"KDA torch arm fp32 <= {fmt(KDA_FP32_TOL)} (round-off, measured ~2e-7), fp64 "
             f"gradients <= {fmt(KDA_FP64_GRAD_TOL)}; fla fp32 o <= {fmt(FLA_FP32_TOL_O)}, "
             f"S <= {fmt(FLA_FP32_TOL_S)} (TF32 dots, measured 2.6e-4 / 1.5e-3 on an H200); MoE "
             f"fp32 vs fp64 |d| <= {fmt(MOE_ATOL)} + {fmt(MOE_RTOL)}|ref| (round-off ~1e-6), "
             f"drops equal exactly; on CUDA the fla arm's conv + SiLU <= {fmt(CONV_FP32_TOL)} "
             f"and q/k norm <= {fmt(NORM_FP32_TOL)} relative, fp32 vs fp64 (measured <= 1.5e-7 "
             f"/ 1.8e-7 on an H200)")  # fmt: skip


# ---- KDA -----------------------------------------------------------------------------------


def kda_forward_err(fn, device, shape, seed, **kw) -> tuple[float, float]:
    from references.kda_naive import kda_naive

    q, k, v, g, beta, S0 = (x.to(device) for x in kda_inputs(*shape, seed=seed))
    o_ref, S_ref = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, **kw)
    return (o.float() - o_ref).abs().max().item(), (S - S_ref).abs().max().item()


def kda_grad_err() -> float:
    from dormouse.model.kda_torch import kda_torch
    from references.kda_naive import kda_naive

    base = kda_inputs(1, 11, 2, 4, 3, dtype=torch.float64, seed=11)
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(1, 11, 2, 3, dtype=torch.float64, generator=gen)
    wS = torch.randn(1, 2, 4, 3, dtype=torch.float64, generator=gen)

    def grads(fn, **kw):
        xs = [x.clone().requires_grad_(True) for x in base]
        o, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
        ((o * w).sum() + (S * wS).sum()).backward()
        return [x.grad for x in xs]

    # chunk 4 over 11 steps: state passing and a padded tail; a missing gradient (an input
    # the arm ignores) is an infinite error, not a crash
    return max(math.inf if a is None else (a - b).abs().max().item() for a, b in
               zip(grads(kda_torch, chunk_size=4), grads(kda_naive)))  # fmt: skip


# ---- the fla arm's mixer ops ---------------------------------------------------------------

# (B, T, C, taps): a row of several spans of the backward's plan, a part-masked block (130,
# 600), fewer steps than taps, taps 3 and 5
CONV_SHAPES = ((2, 100, 96, 4), (3, 2, 130, 4), (1, 300, 64, 3), (2, 77, 600, 5))
# (B, T, heads, head_dim): an odd head_dim (24: a masked tile), b1's 128
NORM_SHAPES = ((2, 100, 3, 64), (1, 33, 2, 24), (1, 20, 12, 128))


def conv_errors(op, device, shape, seed: int) -> dict:
    """op(x, w) (silu of the short conv, with gradients) in fp32 on `device` vs the fp64
    reference on the CPU: the output, dx and dw, relative to each one's largest entry."""
    from references.short_conv import short_conv_silu

    B, T, C, W = shape
    gen = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(B, T, C, generator=gen), torch.randn(B, T, C, generator=gen)
    w = torch.rand(C, W, generator=gen) - 0.5
    x32 = x.to(device, copy=True).requires_grad_(True)
    w32 = w.to(device, copy=True).requires_grad_(True)
    y = op(x32, w32)
    (y * dy.to(device)).sum().backward()
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = short_conv_silu(x64, w64)
    (ref * dy.double()).sum().backward()
    return {
        "y": rel_to_peak(y, ref),
        "dx": rel_to_peak(x32.grad, x64.grad),
        "dw": rel_to_peak(w32.grad, w64.grad),
    }


def norm_errors(op, device, shape, seed: int) -> dict:
    """op(qkv, heads) -> (q, k, v) in fp32 on `device` vs the fp64 reference on the CPU:
    q, k and the gradient into q|k|v's layout, relative; v must pass through bitwise."""
    from references.short_conv import qk_l2norm

    B, T, H, Dh = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 3 * H * Dh, generator=gen)
    x[0, 0, :Dh] = 0  # a zero row: eps alone under the root
    dys = [torch.randn(B, T, H, Dh, generator=gen) for _ in range(3)]
    x32 = x.to(device, copy=True).requires_grad_(True)
    outs = op(x32, H)
    sum((o * d.to(device)).sum() for o, d in zip(outs, dys)).backward()
    x64 = x.double().requires_grad_(True)
    refs = qk_l2norm(x64, H)
    sum((o * d.double()).sum() for o, d in zip(refs, dys)).backward()
    v = x[..., 2 * H * Dh :].reshape(B, T, H, Dh)
    return {
        "q": rel_to_peak(outs[0], refs[0]),
        "k": rel_to_peak(outs[1], refs[1]),
        "dx": rel_to_peak(x32.grad, x64.grad),
        "v_exact": torch.equal(outs[2].detach().cpu(), v),
    }


def mixer_op_parts(bad: list) -> list[str]:
    """The fla arm's conv + SiLU and q/k norm ops on CUDA vs references/short_conv.py."""
    from dormouse.model.qk_norm import qk_l2norm

    parts = []
    conv = [conv_errors(torch.ops.dormouse.conv_silu, "cuda", s, 30 + i)
            for i, s in enumerate(CONV_SHAPES)]  # fmt: skip
    worst = {k: max(e[k] for e in conv) for k in ("y", "dx", "dw")}
    if max(worst.values()) > CONV_FP32_TOL:
        bad.append(f"conv + SiLU fp32 {worst} > {fmt(CONV_FP32_TOL)}")
    parts.append("conv_silu/cuda fp32 " + " ".join(f"{k} {fmt(v)}" for k, v in worst.items()))
    norm = [norm_errors(lambda x, h: list(qk_l2norm(x, h)), "cuda", s, 40 + i)
            for i, s in enumerate(NORM_SHAPES)]  # fmt: skip
    worst = {k: max(e[k] for e in norm) for k in ("q", "k", "dx")}
    if max(worst.values()) > NORM_FP32_TOL or not all(e["v_exact"] for e in norm):
        bad.append(f"q/k norm fp32 {worst} > {fmt(NORM_FP32_TOL)} or v not passed through")
    parts.append("qk_l2norm/cuda fp32 " + " ".join(f"{k} {fmt(v)}" for k, v in worst.items())
                 + ", v bitwise" * all(e["v_exact"] for e in norm))  # fmt: skip
    return parts


# ---- MoE -----------------------------------------------------------------------------------


def make_moe(arm: str, capacity: float, seed: int):
    from dormouse.config import ModelConfig
    from dormouse.model.moe import MoE

    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=D, d_ffn=FF, n_experts=E, moe_topk=K, shared_rank=R, init_std=0.3,
                      n_heads=1, head_dim=D, moe_impl=arm, moe_capacity=capacity)  # fmt: skip
    m = MoE(cfg)
    with torch.no_grad():  # the bias steers some picks, so its path is held too
        m.lfb_bias.copy_(torch.tensor([0.0, 0.1, -0.05, 0.02]))
    return m


def moe_errors(arm: str, capacity: float, device: str, seed: int = 13) -> dict:
    """The arm on `device` vs the fp64 reference on the CPU: forward, x and weight grads."""
    from references.moe_capacity import moe_capacity
    from references.moe_dense import moe_dense

    m = make_moe(arm, capacity, seed).to(device)
    x = torch.randn(3, 8, D, generator=torch.Generator().manual_seed(seed + 1))
    margin = routing_margin(m, x)
    x32 = x.to(device).clone().requires_grad_()
    out, aux = m(x32)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2))
    (out * probe.to(device)).sum().backward()

    w = {n: p.detach().double().cpu().clone().requires_grad_() for n, p in m.named_parameters()}
    shared = (w["shared.w1.weight"], w["shared.w3.weight"], w["shared.w2.weight"])
    x64 = x.double().clone().requires_grad_()
    bias = m.lfb_bias.double().cpu()
    if capacity > 0:
        ref, drops = moe_capacity(x64, w["router.weight"], w["w1"], w["w3"], w["w2"], capacity,
                                  shared=shared, bias=bias, topk=K)  # fmt: skip
        ref_drops = sum(len(d) for d in drops)
    else:
        ref = moe_dense(x64, w["router.weight"], w["w1"], w["w3"], w["w2"], shared=shared,
                        bias=bias, topk=K)  # fmt: skip
        ref_drops = 0
    (ref * probe.double()).sum().backward()

    def excess(a, b) -> float:  # how far past |d| <= atol + rtol |b| (<= 0 passes)
        a, b = a.detach().double().cpu(), b.detach()
        return ((a - b).abs() - MOE_ATOL - MOE_RTOL * b.abs()).max().item()

    def err(a, b) -> float:
        return (a.detach().double().cpu() - b.detach()).abs().max().item()

    pairs = [(out, ref), (x32.grad, x64.grad)]
    pairs += [(p.grad, w[n].grad) for n, p in m.named_parameters()]
    return {
        "fwd": err(out, ref),
        "grad": max(err(a, b) for a, b in pairs[1:]),
        "excess": max(excess(a, b) for a, b in pairs),
        "drops": int(aux["dropped"]),
        "ref_drops": ref_drops,
        "margin": margin,
    }


def _moe_arms(device: str) -> list[str]:
    from dormouse.model.arms import why_not

    shape = {"d_model": D, "d_ffn": FF}
    arms = ("grouped", "batched", "dense")
    return [a for a in arms if not why_not("moe", a, device, shape=shape)]


# ---- the gate ------------------------------------------------------------------------------


def run(cuda: bool = False) -> Record:
    # One CPU thread, as `timed` gives every gate: these are tiny matmuls, and two threads on
    # a busy two-core machine measured 13 s for g18 against 0.6 s with one.
    with threads(1):
        return _run(cuda)


def _run(cuda: bool) -> Record:
    from dormouse.model.arms import choose_arm
    from dormouse.model.kda_fla import kda_fla
    from dormouse.model.kda_torch import kda_torch

    device = "cuda" if cuda else "cpu"
    bad, parts = [], []
    tf32 = torch.backends.cuda.matmul.allow_tf32 if cuda else None
    if cuda:
        # fp32 products on the GPU, so the CPU's measured fp32 tolerances hold for the torch arms
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        # KDA torch arm: T crosses chunk borders (37 = 2x16 + 5, padded) and chunk 1 (29)
        errs = [kda_forward_err(kda_torch, device, (2, T, 3, 16, 8), T, chunk_size=c)
                for T, c in ((37, 16), (64, 16), (29, 1))]  # fmt: skip
        eo, eS = max(e[0] for e in errs), max(e[1] for e in errs)
        if max(eo, eS) > KDA_FP32_TOL:
            bad.append(f"kda torch ({device}) o {fmt(eo)} S {fmt(eS)} > {fmt(KDA_FP32_TOL)}")
        parts.append(f"kda torch/{device} fp32 o {fmt(eo)} S {fmt(eS)}")
        if not cuda:
            eg = kda_grad_err()
            if eg > KDA_FP64_GRAD_TOL:
                bad.append(f"kda torch fp64 gradients {fmt(eg)} > {fmt(KDA_FP64_GRAD_TOL)}")
            parts.append(f"fp64 grads {fmt(eg)}")
        else:
            impl, reason = choose_arm("kda", "auto", "cuda")
            if impl == "fla":
                # test_kda's fla case: 2 x 100 steps, 2 heads of 64, fp32 inputs
                eo, eS = kda_forward_err(kda_fla, device, (2, 100, 2, 64, 64), 7)
                if eo > FLA_FP32_TOL_O or eS > FLA_FP32_TOL_S:
                    bad.append(f"kda fla fp32 o {fmt(eo)} S {fmt(eS)} over {fmt(FLA_FP32_TOL_O)}"
                               f" / {fmt(FLA_FP32_TOL_S)}")  # fmt: skip
                parts.append(f"kda fla/cuda fp32 o {fmt(eo)} S {fmt(eS)}")
                parts += mixer_op_parts(bad)
            else:
                parts.append(f"kda fla: not run ({reason})")

        for arm in _moe_arms(device):
            for capacity in (0.0, 0.5, 1.0):
                r = moe_errors(arm, capacity, device)
                name = f"moe {arm}/{device} " + (f"cap{capacity}" if capacity else "dropless")
                if r["margin"] <= 1e-4:  # fp32 and fp64 would pick different experts
                    bad.append(f"{name}: routing margin {fmt(r['margin'])}: the fixture flips")
                if r["excess"] > 0:
                    bad.append(f"{name}: fwd {fmt(r['fwd'])} grad {fmt(r['grad'])} past the bound")
                if r["drops"] != r["ref_drops"]:
                    bad.append(f"{name}: {r['drops']} drops, the reference {r['ref_drops']}")
                if capacity and not r["ref_drops"]:
                    bad.append(f"{name}: the reference dropped nothing (the case proves nothing)")
                text = f"{name} fwd {fmt(r['fwd'])} grad {fmt(r['grad'])}"
                parts.append(text + (f" drops {r['drops']}/{r['ref_drops']}" if capacity else ""))
    finally:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    instrument = ("KDA: kda_torch vs references/kda_naive.py, fp32, (B,T,H,K,V)="
                  "(2,{37,64,29},3,16,8) with chunks 16/16/1 and a carried state, fp64 "
                  "gradients at T=11 chunk 4"
                  + ("; kda_fla vs kda_naive fp32 at (2,100,2,64,64); the fla arm's "
                     "conv + SiLU op (B,T,C,taps) in " + str(CONV_SHAPES) + " and q/k norm op "
                     "(B,T,H,D) in " + str(NORM_SHAPES) + " vs references/short_conv.py, "
                     "forward and gradients, fp32 vs fp64" if cuda else "")
                  + f"; MoE (D={D}, F={FF}, E={E}, k={K}, shared {R}) each dispatch arm vs "
                  "references/moe_dense.py (dropless) and references/moe_capacity.py (capacity "
                  "0.5, 1.0), 3 rows x 8 tokens, forward + x and weight gradients vs fp64"
                  + (" (GPU arms, TF32 off, reference on the CPU)" if cuda else ""))  # fmt: skip
    measured = "; ".join(parts)
    if bad:
        measured += f"; {len(bad)} FAILURE(S): " + " | ".join(bad[:6])
    env = environment("none", torch.cuda.get_device_name(0) if cuda else "cpu")
    return Record("g19_kernels", CLAIM, instrument, measured, TOLERANCE, not bad, env,
                  details={"failures": bad})  # fmt: skip
