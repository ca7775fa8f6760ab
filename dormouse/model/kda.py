"""Kimi Delta Attention: the mixer of every block, and its two interchangeable arms.

Owns `KDAMixer`: projections, short causal convs (short_conv.py), gates, the recurrence,
output gate and norm, per-iteration low-rank deltas, segment-wise gradient cuts and the decode
cache. The recurrence has two interchangeable arms: `kda_torch.py` (chunked pure PyTorch,
everywhere) and `kda_fla.py` (fla-core's Triton kernel, CUDA); which one runs is
`dormouse.model.arms`' rule.

The per-step recurrence both arms must reproduce is `references/kda_naive.py`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.config import ModelConfig
from dormouse.model.arms import Arm, announce, check_request, choose_arm
from dormouse.model.kda_fla import kda_fla
from dormouse.model.kda_torch import kda_torch
from dormouse.model.layers import LowRankDelta, RMSNorm, at_least_fp32, with_deltas
from dormouse.model.qk_norm import EPS as _L2_EPS
from dormouse.model.qk_norm import qk_l2norm
from dormouse.model.short_conv import ShortConv

log = logging.getLogger(__name__)


_KERNELS = {"torch": kda_torch, "fla": kda_fla}


# ---- the mixer -----------------------------------------------------------------------


@torch.compiler.assume_constant_result
def _arm_name(impl: str, head_dim: int, device: torch.device, dtype: torch.dtype) -> str:
    """KDAMixer.arm's name, announced. A compiled graph calls this once while tracing and keeps
    the answer (asking the card for its name and capability inside the graph would split it)."""
    return announce(choose_arm("kda", impl, device, dtype, {"head_dim": head_dim})).name


def l2norm(x: torch.Tensor, eps: float = _L2_EPS) -> torch.Tensor:
    xf = at_least_fp32(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dt = x.device.type
    if dt in ("cuda", "cpu") and torch.is_autocast_enabled(dt):
        return torch.get_autocast_dtype(dt)
    return x.dtype


class KDAMixer(nn.Module):
    """The token mixer of a block: h [B, T, d_model] -> [B, T, d_model].

    Parameters (2D ones are matrices for Muon, except `qkv_conv.weight`, a [3*d_attn,
    conv_size] stack of depthwise filter taps that belongs with AdamW):
      q_proj, k_proj, v_proj : d_model -> d_attn (no bias)
      qkv_conv.weight        : causal depthwise conv taps over the concatenated q|k|v
      f_down, f_up           : low-rank d_model -> gate_rank -> d_attn feeding the decay
      A_log, dt_bias         : [d_attn] 1D; decay g = -exp(A_log) * softplus(f(x) + dt_bias)
      b_proj                 : d_model -> n_heads; beta = sigmoid(b_proj(x))
      g_down, g_up (+bias)   : low-rank (rank head_dim) output gate, sigmoid
      o_norm.weight          : per-head RMSNorm of the recurrence output [head_dim]
      o_proj                 : d_attn -> d_model (no bias)
      {q,k,v,o}_delta[i]     : per-iteration LowRankDelta (only when rank > 0)

    Cache (decoding): the caller owns one plain dict per mixer (i.e. per block), starts it
    empty (`{}`), and passes the SAME dict at every iteration and every step. The mixer
    keys it by iteration, because the body applies this one module max_iter times and each
    application has its own stream:
        cache[iteration] = {"conv": [B, conv_size-1, 3*d_attn] (pre-conv q|k|v inputs),
                            "state": [B, n_heads, head_dim, head_dim] fp32}
    It is updated in place and also returned; entries are detached. Without a cache the
    mixer returns (out, None) and keeps nothing.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_request("kda", cfg.kda_impl)
        self.cfg = cfg
        d, H, Dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        da = H * Dh
        self.n_heads, self.head_dim, self.d_attn = H, Dh, da
        self.max_iter = cfg.max_iter
        self.segment_len = cfg.segment_len
        self.chunk_size = cfg.kda_chunk

        self.q_proj = nn.Linear(d, da, bias=False)
        self.k_proj = nn.Linear(d, da, bias=False)
        self.v_proj = nn.Linear(d, da, bias=False)
        self.qkv_conv = ShortConv(3 * da, cfg.conv_size)
        if cfg.gate_rank > 0:
            self.f_down = nn.Linear(d, cfg.gate_rank, bias=False)
            self.f_up = nn.Linear(cfg.gate_rank, da, bias=False)
        else:  # gate_rank=0: a learned but input-independent decay per key channel
            self.f_down = self.f_up = None
        # Mamba2-style init: rates A in [1, 16], step dt log-uniform in [1e-3, 1e-1], so the
        # initial per-step decay exp(-A*dt) spans memories from ~1 step to ~1000 steps.
        A = torch.empty(da).uniform_(1.0, 16.0)
        dt = torch.exp(torch.empty(da).uniform_(math.log(1e-3), math.log(1e-1)))
        self.A_log = nn.Parameter(torch.log(A))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.g_down = nn.Linear(d, Dh, bias=False)
        self.g_up = nn.Linear(Dh, da, bias=True)
        self.o_norm = RMSNorm(Dh)
        self.o_proj = nn.Linear(da, d, bias=False)

        for m in (self.q_proj, self.k_proj, self.v_proj, self.f_down, self.f_up, self.b_proj,
                  self.g_down, self.g_up, self.o_proj):  # fmt: skip
            if m is not None:
                nn.init.normal_(m.weight, std=cfg.init_std)
        nn.init.zeros_(self.g_up.bias)

        if cfg.rank > 0:

            def deltas(d_in: int, d_out: int) -> nn.ModuleList:
                return nn.ModuleList(
                    LowRankDelta(d_in, d_out, cfg.rank, std=cfg.init_std)
                    for _ in range(cfg.max_iter)
                )

            self.q_delta = deltas(d, da)
            self.k_delta = deltas(d, da)
            self.v_delta = deltas(d, da)
            self.o_delta = deltas(da, d)
        else:  # rank=0: every iteration runs the same weights (pure tying)
            self.q_delta = self.k_delta = self.v_delta = self.o_delta = None

        self._impl: str | None = None
        self._impl_device: torch.device | None = None

    # -- the arm ------------------------------------------------------------------------

    def arm(self, device, dtype: torch.dtype) -> Arm:
        """The arm this mixer runs on `device` (a torch device or a described `arms.Card`)."""
        return choose_arm("kda", self.cfg.kda_impl, device, dtype, {"head_dim": self.head_dim})

    def resolve_arm(self, dtype: torch.dtype, device: torch.device | None = None) -> str:
        """Choose (and announce) the arm for `device` (default: this mixer's parameters') and
        the forward's compute dtype. The first forward does it when nothing did before;
        torch.compile has it done first (train.run.compiled): a trace that sets `_impl` itself
        guards on `_impl is None`, so the second step recompiled (measured: small's step 2
        took 13.6 s instead of 0.48 s on the H200, reduce-overhead; tiny's 2.3 s instead of
        0.04 s on the CPU with aot_eager)."""
        dev = device if device is not None else self.o_proj.weight.device
        self._impl = _arm_name(self.cfg.kda_impl, self.head_dim, dev, dtype)
        self._impl_device = dev
        return self._impl

    def _kernel(self, x: torch.Tensor):
        if self._impl is None or self._impl_device != x.device:
            self.resolve_arm(_compute_dtype(x), x.device)
        return _KERNELS[self._impl]

    @property
    def impl(self) -> str | None:
        """The arm in use ("torch" / "fla"), None before the first forward (or resolve_arm)."""
        return self._impl

    # -- the pieces around the recurrence (public so references and tests can reuse them) --

    def _small_weights(self, iteration: int) -> tuple[list[torch.Tensor], list[str]]:
        """The narrow weights that read the mixer's input x, in the order of one matmul."""
        ws, names = [], []
        if self.f_down is not None:
            ws.append(self.f_down.weight)
            names.append("f")
        ws += [self.b_proj.weight, self.g_down.weight]
        names += ["b", "gate"]
        return ws, names

    def _project(self, x: torch.Tensor, iteration: int) -> dict[str, torch.Tensor]:
        """x [B, T, d_model] -> every projection of x, from two matmuls against stacked
        weights: q|k|v with this iteration's low-rank deltas folded in (layers.with_deltas),
        and the narrow ones (the decay's down half, beta's, the output gate's down half: N =
        n_heads..gate_rank each, too skinny to fill a matmul alone). The parameters stay
        separate (Muon sees each matrix alone); only the products are fused: x is read twice
        instead of up to nine times, and the backward's input gradient is two matmuls
        instead of a sum of up to nine. Two, not one: the narrow outputs are kept for the
        backward, and a slice keeps its whole base alive, so one product would keep q|k|v's
        columns too (b1 at 32 x 2048 then ran out of the H200's memory)."""
        deltas = None
        if self.q_delta is not None:
            deltas = [getattr(self, f"{n}_delta")[iteration] for n in ("q", "k", "v")]
        w = with_deltas([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], deltas)
        parts = {"qkv": F.linear(x, w)}
        ws, names = self._small_weights(iteration)
        y = F.linear(x, torch.cat(ws))
        parts.update(zip(names, y.split([w.shape[0] for w in ws], dim=-1)))
        return parts

    def _inputs(self, x, iteration, conv_tail, y):
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        qkv = y["qkv"]
        fla = self._impl == "fla"
        qkv, new_tail = self.qkv_conv.silu(qkv, conv_tail, fused=fla)
        if fla:  # one pass each way in our Triton kernels, q, k, v contiguous (qk_norm.py)
            q, k, v = qk_l2norm(qkv, H)
        else:
            q, k, v = qkv.view(B, T, 3, H, Dh).unbind(dim=2)
            q, k = l2norm(q), l2norm(k)

        f = at_least_fp32(self.dt_bias).expand(B, T, -1)
        if self.f_down is not None:
            f = at_least_fp32(self.f_up(y["f"])) + f
        g = (-torch.exp(at_least_fp32(self.A_log)) * F.softplus(f)).view(B, T, H, Dh)
        beta = torch.sigmoid(y["b"])
        return q, k, v, g, beta, new_tail

    def kernel_inputs(
        self, x: torch.Tensor, iteration: int, conv_tail: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """x [B, T, d_model] -> (q, k, v [B,T,H,Dh], g [B,T,H,Dh] fp32, beta [B,T,H], new tail)."""
        return self._inputs(x, iteration, conv_tail, self._project(x, iteration))

    def kernel_output(
        self, o: torch.Tensor, x: torch.Tensor, iteration: int,
        gate_low: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The recurrence output o [B, T, H, Dh] and the input x -> the mixer's output.
        `gate_low`: g_down(x) when the caller has it from `_project` (else computed here)."""
        B, T = x.shape[:2]
        if gate_low is None:
            gate_low = self.g_down(x)
        gate = torch.sigmoid(self.g_up(gate_low)).view(B, T, self.n_heads, self.head_dim)
        o = (self.o_norm(o) * gate.to(o.dtype)).reshape(B, T, self.d_attn)
        deltas = None if self.o_delta is None else [self.o_delta[iteration]]
        return F.linear(o, with_deltas([self.o_proj.weight], deltas))

    # -- forward -------------------------------------------------------------------------

    def _segment(self, x, iteration, carry, kernel, want_state):
        tail, S = (None, None) if carry is None else (carry["conv"], carry["state"])
        y = self._project(x, iteration)
        q, k, v, g, beta, tail = self._inputs(x, iteration, tail, y)
        o, S = kernel(
            q, k, v, g, beta, initial_state=S, output_final_state=want_state,
            chunk_size=self.chunk_size,
        )  # fmt: skip
        return self.kernel_output(o, x, iteration, y["gate"]), {"conv": tail, "state": S}

    def forward(
        self, h: torch.Tensor, iteration: int = 0, cache: dict | None = None
    ) -> tuple[torch.Tensor, dict | None]:
        if not 0 <= iteration < self.max_iter:
            raise ValueError(
                f"iteration={iteration} is outside 0..{self.max_iter - 1}: this mixer was "
                f"built for max_iter={self.max_iter}"
            )
        kernel = self._kernel(h)
        T = h.shape[1]
        if T == 0:
            return h.new_zeros(h.shape), cache
        carry = None if cache is None else cache.get(iteration)
        seg = self.segment_len if 0 < self.segment_len < T else T
        outs = []
        for start in range(0, T, seg):
            if carry is not None and start > 0:
                # carry values over the border, cut the gradient there
                carry = {name: t.detach() for name, t in carry.items()}
            last = start + seg >= T
            o, carry = self._segment(
                h[:, start : start + seg], iteration, carry, kernel,
                want_state=(cache is not None) or not last,
            )  # fmt: skip
            outs.append(o)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if cache is None:
            return out, None
        if T > 0:
            cache[iteration] = {name: t.detach() for name, t in carry.items()}
        return out, cache
