"""KDA: the chunked torch arm and the mixer against the per-step reference recurrence."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dormouse.config import preset
from dormouse.model import arms
from dormouse.model.arms import ArmError, Card, choose_arm
from dormouse.model.kda import KDAMixer
from dormouse.model.kda_fla import kda_fla
from dormouse.model.kda_torch import kda_torch
from dormouse.model.short_conv import ShortConv
from gates.fixtures import kda_inputs
from references.kda_naive import kda_naive

# fp32 round-off: outputs and states are O(1) and each entry is a sum of at most a few
# hundred O(1) products, which the chunked form reassociates (measured ~2e-7); a wrong mask,
# decay or ordering shows up at 1e-2 or more.
FP32_TOL = 1e-5


# ---- (a) the chunked arm reproduces the recurrence ------------------------------------


@pytest.mark.parametrize(
    "T,chunk", [(1, 16), (7, 16), (16, 16), (37, 16), (64, 16), (37, 8), (29, 1)]
)
def test_torch_arm_matches_naive(T, chunk):
    q, k, v, g, beta, S0 = kda_inputs(2, T, 3, 16, 8, seed=T)
    o_ref, S_ref = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o, S = kda_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=chunk)
    assert o.dtype == q.dtype and S.dtype == torch.float32
    assert (o - o_ref).abs().max().item() <= FP32_TOL
    assert (S - S_ref).abs().max().item() <= FP32_TOL


def test_torch_arm_without_state_and_scale():
    q, k, v, g, beta, _ = kda_inputs(1, 21, 2, 8, 8, seed=3)
    o_ref, _ = kda_naive(q, k, v, g, beta, scale=0.7)
    o, S = kda_torch(q, k, v, g, beta, scale=0.7)
    assert S is None
    assert (o - o_ref).abs().max().item() <= FP32_TOL


def test_torch_arm_strong_decay_stays_finite():
    # per-step log decays down to about -1000: any exp of a positive within-chunk
    # difference would overflow to inf and poison the output with nan
    # (forward AND backward: an inf masked away after the exp still turns its gradient nan)
    q, k, v, g, beta, S0 = kda_inputs(2, 40, 2, 16, 16, decay=50.0, seed=5)
    assert g.min().item() < -200
    o_ref, S_ref = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    g.requires_grad_(True)
    o, S = kda_torch(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert (o - o_ref).abs().max().item() <= FP32_TOL
    assert (S - S_ref).abs().max().item() <= FP32_TOL
    (o.sum() + S.sum()).backward()
    assert torch.isfinite(g.grad).all()


def test_torch_arm_returns_input_dtype():
    q, k, v, g, beta, _ = kda_inputs(1, 5, 1, 8, 8, dtype=torch.bfloat16)
    o, S = kda_torch(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32


# ---- (b) gradients ------------------------------------------------------------------


def test_torch_arm_gradients_match_naive():
    # fp64 on both sides, so the only difference is the algorithm: 1e-9 is round-off
    # of the chunked reassociation in double precision, far below any real defect
    base = kda_inputs(1, 11, 2, 4, 3, dtype=torch.float64, seed=11)
    w = torch.randn(1, 11, 2, 3, dtype=torch.float64)
    wS = torch.randn(1, 2, 4, 3, dtype=torch.float64)

    def grads(fn, **kw):
        xs = [x.clone().requires_grad_(True) for x in base]
        q, k, v, g, beta, S0 = xs
        o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, **kw)
        ((o * w).sum() + (S * wS).sum()).backward()
        return [x.grad for x in xs]

    ref = grads(kda_naive)
    got = grads(kda_torch, chunk_size=4)  # 11 = 4 + 4 + 3: state passing and a padded tail
    for name, a, b in zip(["q", "k", "v", "g", "beta", "S0"], got, ref):
        assert torch.allclose(a, b, atol=1e-9, rtol=0), name


# ---- the mixer ----------------------------------------------------------------------


def _cfg(**kw):
    return replace(preset("tiny").model, **{"kda_impl": "torch", **kw})


def _mixer(cfg, seed=0):
    """A mixer whose every weight is O(1)-scaled and whose deltas are non-zero, so a wrong
    cache or a dropped delta changes the output visibly."""
    torch.manual_seed(seed)
    m = KDAMixer(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 2 and "conv" not in name:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return m


def test_mixer_segments_match_naive_with_carried_state():
    seg, T = 8, 24
    m = _mixer(_cfg(segment_len=seg))
    h = torch.randn(2, T, m.cfg.d_model)
    for it in range(m.max_iter):
        out, cache = m(h, iteration=it)
        assert cache is None
        # reference: each segment on its own, state and conv tail handed on by hand
        tail, S, ref = None, None, []
        with torch.no_grad():
            for s in range(0, T, seg):
                x = h[:, s : s + seg]
                q, k, v, g, beta, tail = m.kernel_inputs(x, it, tail)
                o, S = kda_naive(q, k, v, g, beta, initial_state=S, output_final_state=True)
                ref.append(m.kernel_output(o, x, it))
        err = (out - torch.cat(ref, dim=1)).abs().max().item()
        assert err <= FP32_TOL, (it, err)
        assert out.abs().max().item() > 0.1  # the comparison is not between two zeros


def _early_grad(segment_len):
    seg, T = 8, 24
    m = _mixer(_cfg(segment_len=segment_len))
    h = torch.randn(2, T, m.cfg.d_model, requires_grad=True)
    out, _ = m(h, iteration=1)
    out[:, -1].pow(2).sum().backward()  # a loss in the last segment only
    return h.grad[:, : T - seg].abs().max().item(), h.grad[:, T - seg :].abs().max().item()


def test_segment_borders_cut_the_gradient():
    early, late = _early_grad(segment_len=8)
    assert late > 0
    assert early == 0.0  # exactly: no path from a late-segment loss to earlier inputs


def test_without_segments_the_gradient_reaches_back():
    early, _ = _early_grad(segment_len=0)  # the control: the same probe sees the long path
    assert early > 0


def test_segment_values_equal_whole_window():
    h = torch.randn(2, 24, 64)
    a, _ = _mixer(_cfg(segment_len=8))(h, iteration=1)
    b, _ = _mixer(_cfg(segment_len=0))(h, iteration=1)
    assert (a - b).abs().max().item() <= FP32_TOL  # the cut changes gradients, not values


# ---- (d) decoding with the cache ------------------------------------------------------


@pytest.mark.parametrize("segment_len,prefill", [(0, 0), (4, 5)])
def test_decode_byte_by_byte_matches_full_forward(segment_len, prefill):
    T = 12
    m = _mixer(_cfg(segment_len=segment_len), seed=1)
    h = torch.randn(2, T, m.cfg.d_model)
    with torch.no_grad():
        full = [m(h, iteration=it)[0] for it in range(m.max_iter)]
        cache: dict = {}
        steps = [[] for _ in range(m.max_iter)]
        if prefill:
            for it in range(m.max_iter):
                o, cache = m(h[:, :prefill], iteration=it, cache=cache)
                steps[it].append(o)
        for t in range(prefill or 0, T):
            for it in range(m.max_iter):  # ONE dict for the block, every iteration
                o, cache = m(h[:, t : t + 1], iteration=it, cache=cache)
                steps[it].append(o)
    assert sorted(cache) == list(range(m.max_iter))
    assert cache[0]["state"].dtype == torch.float32
    assert cache[0]["conv"].shape == (2, m.cfg.conv_size - 1, 3 * m.d_attn)
    for it in range(m.max_iter):
        err = (torch.cat(steps[it], dim=1) - full[it]).abs().max().item()
        assert err <= FP32_TOL, (it, err)
    assert (full[0] - full[1]).abs().max().item() > 1e-2  # iterations do differ (deltas)


def test_fresh_deltas_are_zero_and_rank0_is_tied():
    torch.manual_seed(0)
    m = KDAMixer(_cfg(rank=8))
    h = torch.randn(1, 9, 64)
    a, b = m(h, iteration=0)[0], m(h, iteration=1)[0]
    assert torch.equal(a, b)  # B is zero-initialised: every iteration starts identical
    m0 = KDAMixer(_cfg(rank=0))
    assert m0.q_delta is None and not any("delta" in n for n, _ in m0.named_parameters())
    with pytest.raises(ValueError, match="max_iter"):
        m(h, iteration=2)


@pytest.mark.parametrize("which", ["q", "k", "v", "o"])
def test_each_delta_acts_on_its_own_iteration(which):
    m = _mixer(_cfg(rank=4), seed=2)
    h = torch.randn(1, 9, 64)
    with torch.no_grad():
        before = [m(h, iteration=it)[0] for it in range(m.max_iter)]
        getattr(m, f"{which}_delta")[1].B.add_(0.5)
        after = [m(h, iteration=it)[0] for it in range(m.max_iter)]
    assert torch.equal(before[0], after[0])  # iteration 0 does not see iteration 1's delta
    assert (before[1] - after[1]).abs().max().item() > 1e-3


def test_params_ndim_for_the_optimizer():
    m = KDAMixer(_cfg())
    shapes = {n: p.shape for n, p in m.named_parameters()}
    for n in ("A_log", "dt_bias", "o_norm.weight", "g_up.bias"):
        assert len(shapes[n]) == 1, n
    for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
        assert len(shapes[n]) == 2, n


# ---- (e) choosing the arm -------------------------------------------------------------


def test_choose_arm_on_cpu():
    arm, reason = choose_arm("kda", "auto", "cpu", torch.float32)
    assert arm == "torch" and "cpu" in reason and "not CUDA" in reason
    assert choose_arm("kda", "torch", "cpu").name == "torch"
    with pytest.raises(ArmError, match="--set kda_impl=torch") as e:
        choose_arm("kda", "fla", "cpu", torch.float32)
    assert "not CUDA" in str(e.value) and isinstance(e.value, RuntimeError)
    with pytest.raises(ValueError, match="kda_impl"):
        choose_arm("kda", "triton", "cpu")
    with pytest.raises(ArmError, match="head_dim=512"):
        choose_arm("kda", "fla", "cpu", torch.float32, {"head_dim": 512})


@pytest.mark.parametrize("sm, dtype, head_dim, fla", [
    ((8, 0), torch.float32, 64, True),
    ((9, 0), torch.bfloat16, 256, True),
    ((7, 5), torch.float32, 64, False),  # Triton kernels need sm_80+
    ((9, 0), torch.float64, 64, False),
    ((9, 0), torch.bfloat16, 512, False),  # chunk_kda's head_dim limit
])  # fmt: skip
def test_mixer_arm_on_described_cards(sm, dtype, head_dim, fla):
    """The mixer's own arm choice (what its forward asks) on cards this machine lacks."""
    m = KDAMixer(_cfg(kda_impl="auto", n_heads=1, head_dim=head_dim, d_model=head_dim))
    assert m.arm(Card("cuda", sm, "card"), dtype).name == ("fla" if fla else "torch")
    assert m.arm(Card("cuda", sm, "card", fla="fla-core is not installed"), dtype).name == "torch"


def test_mixer_refuses_explicit_fla_on_cpu():
    m = KDAMixer(_cfg(kda_impl="fla"))
    with pytest.raises(ArmError, match="kda_impl=torch"):
        m(torch.randn(1, 4, 64))


def test_mixer_logs_its_arm_once(caplog, monkeypatch):
    monkeypatch.setattr(arms, "_SAID", set())
    cfg = replace(_cfg(), kda_impl="auto")
    mixers = [KDAMixer(cfg), KDAMixer(cfg)]
    with caplog.at_level(logging.INFO, logger="dormouse.model.arms"):
        for m in mixers:
            m(torch.randn(1, 3, 64))
            m(torch.randn(1, 3, 64))
    lines = [r.getMessage() for r in caplog.records if r.name == "dormouse.model.arms"]
    assert len(lines) == 1 and "-> torch" in lines[0] and "kda_impl=auto" in lines[0]
    assert all(m.impl == "torch" for m in mixers)


# ---- the fla arm, where it can run ------------------------------------------------------


def _fla_ready() -> bool:
    return torch.cuda.is_available() and choose_arm("kda", "auto", "cuda").name == "fla"


# slow: on a cold Triton cache fla autotunes each kernel on first use; measured on an H200,
# 90 s for the first forward with gradients and over a minute more for the backward


@pytest.mark.slow
@pytest.mark.skipif(not _fla_ready(), reason="fla arm needs CUDA sm_80+ and fla-core")
@pytest.mark.parametrize(
    "dtype,tol_o,tol_S", [(torch.float32, 2e-3, 1e-2), (torch.bfloat16, 1e-2, 5e-2)]
)
def test_fla_arm_matches_naive(dtype, tol_o, tol_S):
    # tolerances: fla's fp32 dots run in TF32 (10-bit mantissa) and bf16 inputs carry an
    # 8-bit one; measured on an H200 (o ~0.3, S ~3): fp32 o 2.6e-4, S 1.5e-3; bf16 o 1.3e-3,
    # S 5.5e-3. The bounds leave ~8x headroom; a wrong scale or decay order is off by >0.1.
    q, k, v, g, beta, S0 = (x.cuda() for x in kda_inputs(2, 100, 2, 64, 64, seed=7))
    o_ref, S_ref = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    cast = [x.to(dtype) for x in (q, k, v, beta)]
    o, S = kda_fla(cast[0], cast[1], cast[2], g, cast[3], initial_state=S0,
                   output_final_state=True)  # fmt: skip
    assert o.dtype == dtype and S.dtype == torch.float32
    assert (o.float() - o_ref).abs().max().item() <= tol_o
    assert (S - S_ref).abs().max().item() <= tol_S


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.slow
@pytest.mark.skipif(not _fla_ready(), reason="fla arm needs CUDA sm_80+ and fla-core")
def test_fla_arm_gradients_match_torch_arm():
    # 1e-2 relative: the Triton backward accumulates in fp32 with TF32 dots (see above)
    base = [x.cuda() for x in kda_inputs(2, 70, 2, 32, 32, seed=13)]
    w = torch.randn(2, 70, 2, 32, device="cuda")

    def grads(fn):
        xs = [x.clone().requires_grad_(True) for x in base]
        q, k, v, g, beta, S0 = xs
        o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        ((o * w).sum() + S.sum()).backward()
        return [x.grad for x in xs]

    for name, a, b in zip(["q", "k", "v", "g", "beta", "S0"], grads(kda_fla), grads(kda_torch)):
        assert _rel_err(a, b) <= 1e-2, (name, _rel_err(a, b))


@pytest.mark.slow
@pytest.mark.skipif(not _fla_ready(), reason="fla arm needs CUDA sm_80+ and fla-core")
def test_mixer_fla_matches_torch_and_decodes():
    cfg = _cfg(segment_len=32)
    m_t = _mixer(cfg, seed=4).cuda()
    m_f = _mixer(replace(cfg, kda_impl="fla"), seed=4).cuda()
    h = torch.randn(2, 64, cfg.d_model, device="cuda")
    with torch.no_grad():
        a, b = m_t(h, iteration=1)[0], m_f(h, iteration=1)[0]
        assert m_f.impl == "fla" and m_t.impl == "torch"
        assert _rel_err(b, a) <= 1e-2, _rel_err(b, a)  # TF32 dots in the kernel
        cache: dict = {}
        steps = [m_f(h[:, t : t + 1], iteration=1, cache=cache)[0] for t in range(16)]
        assert _rel_err(torch.cat(steps, 1), b[:, :16]) <= 1e-2


@pytest.mark.slow
@pytest.mark.skipif(not _fla_ready(), reason="fla arm needs CUDA sm_80+ and fla-core")
def test_mixer_fla_gradients_match_torch_arm():
    """The whole fla-arm mixer (fla's chunk kernel, our conv + SiLU backward and q/k norm,
    the gates, the per-iteration deltas) against the torch arm: the input's gradient and
    every parameter's, two segments, fp32."""
    cfg = _cfg(segment_len=32)
    m_t = _mixer(cfg, seed=4).cuda()
    m_f = _mixer(replace(cfg, kda_impl="fla"), seed=4).cuda()
    gen = torch.Generator().manual_seed(9)
    h0 = torch.randn(2, 64, cfg.d_model, generator=gen).cuda()
    w = torch.randn(2, 64, cfg.d_model, generator=gen).cuda()

    def grads(m):
        h = h0.clone().requires_grad_(True)
        (m(h, iteration=1)[0] * w).sum().backward()
        return {"h": h.grad, **{n: p.grad for n, p in m.named_parameters()}}

    gt, gf = grads(m_t), grads(m_f)
    assert m_f.impl == "fla" and gt.keys() == gf.keys()
    errs = {n: _rel_err(gf[n], gt[n]) for n in gt if gt[n] is not None and gt[n].abs().max() > 0}
    print(
        "mixer fla vs torch, relative grad error:",
        {n: f"{e:.1e}" for n, e in sorted(errs.items(), key=lambda kv: -kv[1])[:6]},
    )
    assert all(gf[n] is not None for n in gt if gt[n] is not None)
    # 1e-2 relative, the kernel-level bound above: fla's fp32 dots run in TF32; a wrong
    # tap, a dropped norm term or a gate's wrong sign moves a gradient by O(1)
    assert max(errs.values()) <= 1e-2, errs


@pytest.mark.slow
@pytest.mark.skipif(not _fla_ready(), reason="fla arm needs CUDA sm_80+ and fla-core")
def test_fused_conv_silu_matches_the_torch_conv():
    """The fla arm's short conv + SiLU (`ShortConv.silu(fused=True)`: fla's causal_conv1d
    forward, our backward kernel) against the torch arm's taps and F.silu: the same output and
    gradients, the same new tail, and the same numbers whether the window arrives whole,
    split, or byte by byte."""
    gen = torch.Generator().manual_seed(3)
    conv = ShortConv(96, 4).cuda()
    x64 = torch.randn(2, 100, 96, generator=gen, dtype=torch.float64).cuda()
    dy = torch.randn(2, 100, 96, generator=gen, dtype=torch.float64).cuda()

    def run(x, fused):
        x = x.detach().clone().requires_grad_(True)
        conv.weight.grad = None
        y, new_tail = conv.silu(x, None, fused=fused)
        (y.double() * dy).sum().backward()
        return y, new_tail, x.grad, conv.weight.grad.clone()

    # fp32: both sum the same four products in the same order in fp32; what differs is the
    # SiLU's rounding (torch's vs Triton's sigmoid), fused multiply-adds and the backward's
    # summation order over B x T for the taps' gradient (per span of up to 128 steps, then
    # the spans): measured on an H200 (2026-12-04, our backward) y 7.9e-8, dx 7.5e-8, dw
    # 1.3e-7 relative, the tail bitwise. A tap applied to the wrong offset, a flipped tap order or a missing SiLU
    # moves every output by O(1).
    got, ref = run(x64.float(), True), run(x64.float(), False)
    for name, a, b in zip(("y", "tail", "dx", "dw"), got, ref):
        assert _rel_err(a, b) <= 1e-5, (name, _rel_err(a, b))
    # the backward is our kernel (conv_silu.py), its blocks planned from the shape: taps 3 and
    # 5, channels that leave a block part-masked (130, 600), fewer steps than taps, a row of
    # several spans whose windows cross the spans' borders, a batch of 3; same bound, same
    # reasons (measured on the H200: dx 5.4e-8..7.6e-8, dw 5.7e-8..1.5e-7)
    for B, T, C, W in ((3, 2, 130, 4), (1, 300, 64, 3), (2, 77, 600, 5)):
        c2 = ShortConv(C, W).cuda()
        xs = torch.randn(B, T, C, generator=gen).cuda().requires_grad_(True)
        dys = torch.randn(B, T, C, generator=gen).cuda()
        out = []
        for fused in (True, False):
            xs.grad = c2.weight.grad = None
            (c2.silu(xs, None, fused=fused)[0] * dys).sum().backward()
            out.append((xs.grad.clone(), c2.weight.grad.clone()))
        for name, a, b in zip(("dx", "dw"), *out):
            assert _rel_err(a, b) <= 1e-5, (name, (B, T, C, W), _rel_err(a, b))
    # bf16: the fused sums round once (fp32 inside), the eager chain after every product
    # and sum: measured against the fp64 truth of the same bf16 inputs, fused 2.8e-3 and the
    # eager chain 6.9e-3 relative (bf16's unit round-off is 3.9e-3); bound 2^-7
    xb = x64.bfloat16()
    with torch.no_grad():
        w64 = conv.weight.detach().bfloat16().double()
        pad = torch.cat([xb.new_zeros(2, 3, 96).double(), xb.double()], 1)
        pre = sum(pad[:, j : j + 100] * w64[:, j] for j in range(4))
        truth = F.silu(pre)
    yb = run(xb, True)[0]
    assert yb.dtype == torch.bfloat16
    assert _rel_err(yb, truth) <= 2**-7, _rel_err(yb, truth)
    # a window split in two (the second half with the first's tail), and byte by byte
    with torch.no_grad():
        whole, tail = conv.silu(xb, None, fused=True)
        first, t1 = conv.silu(xb[:, :37], None, fused=True)
        second, t2 = conv.silu(xb[:, 37:], t1, fused=True)
        assert torch.equal(torch.cat([first, second], 1), whole) and torch.equal(t2, tail)
        t, steps = None, []
        for i in range(20):
            y, t = conv.silu(xb[:, i : i + 1], t, fused=True)
            steps.append(y)
        assert torch.equal(torch.cat(steps, 1), whole[:, :20])
        assert torch.equal(
            conv.silu(xb[:, :2], None, fused=True)[1], conv.silu(xb[:, :2], None, fused=False)[1]
        )  # a tail padded by zeros

    # compiled (the op one node of inductor's graph): the same kernels, the same bits (the
    # factor 2 around it is exact in any dtype)
    def f(x):
        return conv.silu(x, None, fused=True)[0] * 2

    def grads(fn):
        x = xb.detach().clone().requires_grad_(True)
        conv.weight.grad = None
        y = fn(x)
        (y.double() * dy).sum().backward()
        return y.detach(), x.grad, conv.weight.grad.clone()

    for name, a, b in zip(("y", "dx", "dw"), grads(torch.compile(f, dynamic=False)), grads(f)):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.skipif(not _fla_ready(), reason="fla arm needs CUDA sm_80+ and fla-core")
def test_qk_l2norm_op_matches_the_torch_norm():
    """The fla arm's q/k L2-norm (`dormouse::qk_l2norm`, our Triton kernels) against the
    torch arm's `l2norm` on q|k|v's views: outputs, the gradient into q|k|v's layout, v
    passed through bitwise, a zero row, odd widths (head_dim 24: a masked tile), compiled."""
    from dormouse.model.kda import l2norm
    from dormouse.model.qk_norm import qk_l2norm
    from references.short_conv import qk_l2norm as reference_norm

    gen = torch.Generator().manual_seed(5)

    def case(B, T, H, D, dtype):
        x = torch.randn(B, T, 3 * H * D, generator=gen, dtype=torch.float64)
        x[0, 0, :D] = 0  # q's first row: the norm's eps alone under the root
        dys = [torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for _ in range(3)]
        return x.to(dtype).cuda(), [d.to(dtype).cuda() for d in dys]

    def torch_norm(x, H):
        B, T, _ = x.shape
        q, k, v = x.view(B, T, 3, H, -1).unbind(2)
        return l2norm(q), l2norm(k), v

    def run(fn, x, dys, H):
        x = x.detach().clone().requires_grad_(True)
        outs = fn(x, H)
        sum((o.double() * d.double()).sum() for o, d in zip(outs, dys)).backward()
        return [o.detach() for o in outs], x.grad

    for B, T, H, D in ((2, 100, 3, 64), (1, 33, 2, 24), (2, 70, 12, 128)):
        # fp32: the same fp32 sums and root in a different order (Triton's row reduction,
        # torch's), the gradient r (dy - y (y . dy)) where torch's autograd goes through
        # the product chain: both ~1 ulp. A missing eps, a norm over the wrong axis or a
        # dropped y (y . dy) term moves them by O(1)
        x, dys = case(B, T, H, D, torch.float32)
        (q, k, v), dx = run(qk_l2norm, x, dys, H)
        (q0, k0, v0), dx0 = run(torch_norm, x, dys, H)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert torch.equal(v, v0) and not q[0, 0, 0].any()  # the zero row stays zeros
        for name, a, b in (("q", q, q0), ("k", k, k0), ("dx", dx, dx0)):
            assert _rel_err(a, b) <= 1e-6, (name, (B, T, H, D), _rel_err(a, b))
        # bf16 against the fp64 truth of the same bf16 inputs: the outputs round once like
        # the torch chain's; the gradient reads the normalised rows as kept in bf16 (as
        # fla's own in-kernel norm does) where torch's autograd keeps the fp32 input, so its
        # rounding is bf16's, bounded at 2^-7 relative to the largest entry, as the conv's
        xb, dyb = case(B, T, H, D, torch.bfloat16)
        (q, k, v), dx = run(qk_l2norm, xb, dyb, H)
        # the truth in fp64 (`l2norm` computes in fp32 whatever x is)
        (q64, k64, _), dx64 = run(reference_norm, xb.double(), [d.double() for d in dyb], H)
        (q0, k0, _), dx0 = run(torch_norm, xb, dyb, H)
        assert q.dtype == dx.dtype == torch.bfloat16
        for name, a, truth, eager in (("q", q, q64, q0), ("k", k, k64, k0),
                                      ("dx", dx, dx64, dx0)):  # fmt: skip
            assert _rel_err(a, truth) <= 2**-7, (name, _rel_err(a, truth), _rel_err(eager, truth))

    # compiled (the op one node of inductor's graph): the same kernels, the same bits
    def f(x):
        return [o * 2 for o in qk_l2norm(x, 3)]

    x, dys = case(2, 64, 3, 64, torch.bfloat16)
    compiled = torch.compile(f, dynamic=False)
    (outs_c, dx_c), (outs_e, dx_e) = (
        run(lambda x, H: compiled(x), x, dys, 3),
        run(lambda x, H: f(x), x, dys, 3),
    )
    assert all(torch.equal(a, b) for a, b in zip(outs_c, outs_e)) and torch.equal(dx_c, dx_e)


def _op_inputs(B, T, H, D, seed):
    """Inputs as the mixer hands them to the kernel: bf16 q, k (L2-normalised), v, beta; g fp32."""
    q, k, v, g, beta, _ = (x.cuda() for x in kda_inputs(B, T, H, D, D, seed=seed))
    return [q.bfloat16(), k.bfloat16(), v.bfloat16(), g.float(), beta.bfloat16()]


@pytest.mark.slow
@pytest.mark.skipif(not _fla_ready(), reason="fla arm needs CUDA sm_80+ and fla-core")
@pytest.mark.parametrize("keep", [True, False])
def test_kda_op_equals_fla_autograd(keep, monkeypatch):
    # The custom op (compile=true's path) runs fla's own forward and backward kernels on the
    # same inputs: bitwise the autograd path, whether the backward gets the forward's saved
    # intermediates (a known fla-core release: one forward per step) or runs the forward
    # again for them (any other release).
    import fla.ops.kda.chunk as fla_chunk

    from dormouse.model import kda_fla

    if keep and not kda_fla._keeps_intermediates():
        pytest.skip(f"this fla-core release is not in kda_fla._SAVES_KNOWN {kda_fla._SAVES_KNOWN}")
    monkeypatch.setattr(kda_fla, "_keeps", keep)
    calls = []
    real_fwd = fla_chunk.chunk_kda_fwd
    monkeypatch.setattr(fla_chunk, "chunk_kda_fwd", lambda **kw: calls.append(1) or real_fwd(**kw))
    base = _op_inputs(2, 128, 4, 64, seed=21)
    w = torch.randn(2, 128, 4, 64, device="cuda")

    def run(fn):
        xs = [x.clone().requires_grad_(True) for x in base]
        o = fn(*xs)
        (o.float() * w).sum().backward()
        return [o.detach(), *(x.grad for x in xs)]

    eager = run(lambda *a: kda_fla(*a)[0])
    calls.clear()
    op = run(lambda *a: torch.ops.dormouse.kda_chunk(*a, 64**-0.5)[0])
    assert len(calls) == (1 if keep else 2), calls  # forwards per forward + backward
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], op, eager):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, _rel_err(a, b))


@pytest.mark.slow
@pytest.mark.skipif(not _fla_ready(), reason="fla arm needs CUDA sm_80+ and fla-core")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_kda_compiled_matches_eager(mode):
    # torch.compile around kda_fla (the op inside the graph; reduce-overhead: in a CUDA graph)
    # against eager: the kernels are the same, the ops around them fused by inductor, so
    # bf16 round-off of the fused casts and norms is all that differs (measured on an H200:
    # see the assertion's bound).
    base = _op_inputs(2, 128, 4, 64, seed=22)
    w = torch.randn(2, 128, 4, 64, device="cuda")

    def f(q, k, v, g, beta):
        q, k = q * 1.5, k * 0.5  # ops around the kernel, for inductor to fuse
        return kda_fla(q, k, v, g, beta)[0] * 2

    fc = torch.compile(f, mode=mode, dynamic=False)
    outs = []
    for fn in (f, fc, fc):  # the compiled one twice: a replay after the recording
        if fn is fc:
            torch.compiler.cudagraph_mark_step_begin()
        xs = [x.clone().requires_grad_(True) for x in base]
        o = fn(*xs)
        (o.float() * w).sum().backward()
        # a CUDA graph's outputs (o, and the gradients its backward returns) live in its
        # memory pool until the next replay: kept as copies
        outs.append([o.detach().clone(), *(x.grad.clone() for x in xs)])
    for got in outs[1:]:
        for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, outs[0]):
            assert _rel_err(a, b) <= 1e-2, (mode, name, _rel_err(a, b))
