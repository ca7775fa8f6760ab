"""Kimi Delta Attention: the mixer of every block, and its two interchangeable arms.

Owns:
- `kda_torch`: the chunked pure-PyTorch form of the KDA recurrence (runs everywhere,
  autograd-friendly; the CPU path).
- `kda_fla`: the same contract on fla-core's `chunk_kda` Triton kernel (CUDA only).
- `KDAMixer`: projections, short causal convs, gates, the recurrence, output gate and
  norm, per-iteration low-rank deltas, segment-wise gradient cuts and the decode cache.
  Which arm it runs is `dormouse.model.arms`' rule.

The per-step recurrence both arms must reproduce is `references/kda_naive.py`.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from dormouse import cache
from dormouse.config import ModelConfig
from dormouse.model.arms import Arm, announce, check_request, choose_arm
from dormouse.model.layers import LowRankDelta, RMSNorm, at_least_fp32
from dormouse.model.qk_norm import EPS as _L2_EPS
from dormouse.model.qk_norm import qk_l2norm

log = logging.getLogger(__name__)


# ---- the torch arm -------------------------------------------------------------------


def _to_chunks(x: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """[B, T, H, *] (T = n*c) -> [B, H, n, c, *]."""
    B, _, H = x.shape[:3]
    x = x.reshape(B, n, c, H, *x.shape[3:])
    return x.movedim(3, 1)


def _unit_lower_inverse(A: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], as a product of squarings.

    A is nilpotent (A^C = 0), so (I + A)^-1 = sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...
    with ceil(log2 C) factors: a handful of small batched matmuls instead of a batched
    triangular solve, which on the CPU costs ~1 s per call at the `small` shape (measured,
    torch 2.13) because it loops over thousands of 16x16 systems one by one.
    """
    inv = eye - A
    power = A
    span = 2
    while span < A.shape[-1]:
        power = power @ power
        inv = inv + inv @ power
        span *= 2
    return inv


def kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA. Shapes as in `references/kda_naive.py`; returns (o in q's dtype, state).

    Inside a chunk of length C, with G the within-chunk cumulative log decay (G_r = sum of
    g over positions <= r), the delta-rule writes D (one row per position) solve the unit
    lower-triangular system

        (I + A) D = diag(beta) (V - (exp(G) * K) S0)
        A_rs = beta_r sum_d k_rd k_sd exp(G_rd - G_sd)        for s < r

    (the UT/WY form: D = U - W S0), the outputs are

        O = (Q * exp(G)) S0 + Aqk D
        Aqk_rs = sum_d q_rd k_sd exp(G_rd - G_sd)             for s <= r

    and the state handed to the next chunk is
        S = exp(G_C) * S0 + (K * exp(G_C - G))^T D.

    Every exponent is a difference G_r - G_s with s <= r, hence <= 0: the decay never
    overflows however strong it is (the upper triangle is masked BEFORE the exp). The cost is
    a [C, C, K] decay tensor per chunk, which is why the chunk stays small (16).
    Computes in fp32 (fp64 stays fp64, for gradient checks).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    out_dtype = q.dtype
    cdt = torch.promote_types(q.dtype, torch.float32)
    if T == 0:
        S = q.new_zeros(B, H, K, V, dtype=cdt) if initial_state is None else initial_state.to(cdt)
        return q.new_zeros(B, 0, H, V), (S if output_final_state else None)

    C = max(1, min(chunk_size, T))  # a short input needs no padding up to a full chunk
    N = -(-T // C)
    pad = N * C - T

    def prep(x: torch.Tensor) -> torch.Tensor:
        x = x.to(cdt)
        if pad:
            # zero g (no decay), zero k and beta (no write): padded steps leave the state alone
            x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
        return _to_chunks(x, N, C)

    q, k, v, g, beta = (prep(x) for x in (q, k, v, g, beta))  # [B,H,N,C,*]
    q = q * scale

    G = g.cumsum(dim=-2)  # [B,H,N,C,K]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # s <= r
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B,H,N,C(r),C(s),K] = G_r - G_s
    decay = diff.masked_fill(~incl.unsqueeze(-1), float("-inf")).exp()
    k_dec = decay * k.unsqueeze(-3)  # k_s * e^(G_r - G_s)
    Akk = torch.einsum("bhnrsk,bhnrk->bhnrs", k_dec, k)
    Aqk = torch.einsum("bhnrsk,bhnrk->bhnrs", k_dec, q)
    Akk = (Akk * beta.unsqueeze(-1)).tril(-1)
    eye = torch.eye(C, dtype=cdt, device=q.device)

    b = beta.unsqueeze(-1)
    rhs = torch.cat([b * v, b * (G.exp() * k)], dim=-1)  # [B,H,N,C,V+K]
    UW = _unit_lower_inverse(Akk, eye) @ rhs
    U, W = UW.split([V, K], dim=-1)

    q_dec = q * G.exp()  # reads the chunk-start state through the decay so far
    G_end = G[..., -1, :]  # [B,H,N,K]
    k_end = k * (G_end.unsqueeze(-2) - G).exp()  # [B,H,N,C,K], exponent <= 0
    a_end = G_end.exp().unsqueeze(-1)  # [B,H,N,K,1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(cdt)
    outs = []
    for n in range(N):
        D = U[:, :, n] - W[:, :, n] @ S  # [B,H,C,V] the delta-rule writes of this chunk
        outs.append(q_dec[:, :, n] @ S + Aqk[:, :, n] @ D)
        S = a_end[:, :, n] * S + k_end[:, :, n].transpose(-1, -2) @ D
    o = torch.stack(outs, dim=2)  # [B,H,N,C,V]
    o = o.movedim(1, 3).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), (S if output_final_state else None)


# ---- the fla arm ---------------------------------------------------------------------


def kda_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda_torch`'s contract on fla-core's `chunk_kda` (CUDA, Triton).

    Eager: fla's own autograd Function (`_kda_fla_eager`). Under torch.compile (compile=true)
    the training call (no state in, none out) goes through the custom op
    `dormouse::kda_chunk` instead, which the compiled graph holds as one opaque call, so
    compile_mode=reduce-overhead captures fla's kernels in the same CUDA graph as the ops
    around them (fla marks its own entry point torch.compiler.disable, which would split the
    graph at every layer)."""
    if torch.compiler.is_compiling() and initial_state is None and not output_final_state:
        dt = q.dtype
        o = torch.ops.dormouse.kda_chunk(
            q.contiguous(), k.contiguous().to(dt), v.contiguous().to(dt), g.float().contiguous(),
            beta.contiguous().to(dt), q.shape[-1] ** -0.5 if scale is None else float(scale))[0]
        return o, None
    return _kda_fla_eager(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)


@torch.compiler.disable  # fla's kernels run eager; compiled code stops around this call
def _kda_fla_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda_torch`'s contract on fla-core's `chunk_kda` (CUDA, Triton).

    `chunk_size` is accepted for symmetry and ignored: the kernel picks its own (64).
    fla wants the state in fp32; the decay is handed over in fp32 too, since its cumulative
    sum is the precision-critical part. Only keywords that every fla-core release with KDA
    accepts are passed (q/k are already L2-normalised by the mixer).
    """
    from fla.ops.kda import chunk_kda  # lazy: fla (and Triton) exist on GPU boxes only

    del chunk_size
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    q_in = q.contiguous()
    first = _FirstCall.begin(q_in, v)
    o, S = chunk_kda(
        q_in,
        k.contiguous().to(q.dtype),
        v.contiguous().to(q.dtype),
        g.float().contiguous(),
        beta.contiguous().to(q.dtype),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    if first is not None:
        first.end(q_in, o)
    return o.to(q.dtype), (S if output_final_state else None)


# ---- fla's kernel as a custom op, for compiled graphs --------------------------------------
#
# A custom op's outputs must be tensors of shapes its fake can say before the kernel runs, so
# what fla's forward saves for its backward crosses from `dormouse::kda_chunk` to
# `dormouse::kda_chunk_bwd` only where that set is known: for the fla-core releases in
# `_SAVES_KNOWN`, ChunkKDAFunction.forward (no state in or out, no in-kernel norm, gate or
# sigmoid) keeps the inputs, the chunk-local cumulative decay (fp32, g's shape) and the
# within-chunk scores Aqk and Akk ([B, T, H, 64], the compute dtype), and recomputes the rest
# (w, u, h) in its backward. The op returns those three beside o, and the backward hands them
# to fla's backward as fla's own autograd path does: one forward per step, not two. The
# decay is kept in place of g (fla's backward reads g itself only with its in-kernel gate),
# so the memory added over the inputs is Aqk and Akk alone. Any other release: the backward
# runs fla's forward again for them (the saved set unknown), as it did before.

_SAVES_KNOWN = ("0.6.0",)
_CHUNK = 64  # fla's chunk length for KDA (chunk_kda's default; our calls never change it)
_keeps: bool | None = None
#: The attributes fla's forward set on its ctx (its flags and autocast's), from this process's
#: first forward of the kept layout: its backward reads them.
_ctx_attrs: dict | None = None


def _keeps_intermediates() -> bool:
    """Whether the installed fla-core's saved set is the known one (decided once)."""
    global _keeps
    if _keeps is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            _keeps = version("fla-core") in _SAVES_KNOWN
        except PackageNotFoundError:  # fla from a source tree: its saved set is unknown
            _keeps = False
        log.debug(f"kda: fla's forward intermediates kept for its backward: {_keeps}")
    return _keeps


class _SavedCtx:
    """What fla's ChunkKDAFunction.forward/backward expect of their ctx: a place for the
    saved tensors and the attributes they set (autocast's included)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _chunk_forward(q, k, v, g, beta, scale: float):
    """fla's forward as its autograd Function runs it, with a plain ctx: (ctx, o)."""
    from fla.ops.kda.chunk import ChunkKDAFunction

    first = _FirstCall.begin(q, v)
    ctx = _SavedCtx()
    # positional: A_log, dt_bias, scale, initial_state, output_final_state; the rest at
    # chunk_kda's defaults (no in-kernel norm, gate or sigmoid; chunk 64)
    o, _ = ChunkKDAFunction.forward(ctx, q, k, v, g, beta, None, None, scale, None, False)
    if first is not None:
        first.end(q, o)
    return ctx, o


#: Positions in fla 0.6.0's saved tuple: q, q_rstd, k, k_rstd, v, g_cumsum, g_input, beta_raw,
#: beta, A_log, dt_bias, Aqk, Akk, w, u, qg, kg, v_new, h, initial_state, cu_seqlens,
#: chunk_indices, chunk_offsets.
_N_SAVED, _GC, _AQK, _AKK = 23, 5, 11, 12


def _kept(ctx, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(g_cumsum, Aqk, Akk) out of fla's saved tuple, the layout checked first: a release
    listed in `_SAVES_KNOWN` whose saves differ is a bug in that list, said loudly."""
    s = ctx.saved_tensors
    want = {0: q, 2: k, 4: v, 6: g, 7: beta, 8: beta}
    ok = (len(s) == _N_SAVED and all(s[i] is t for i, t in want.items())
          and all(s[i] is None for i in (1, 3, 9, 10, *range(13, 23)))
          and s[_GC].shape == g.shape and s[_GC].dtype == torch.float32
          and all(s[i].shape == (*q.shape[:-1], _CHUNK) and s[i].dtype == k.dtype
                  for i in (_AQK, _AKK)))  # fmt: skip
    if not ok:
        raise RuntimeError("kda: fla-core's ChunkKDAFunction saves another set than the one "
                           "dormouse.model.kda._SAVES_KNOWN lists for this release: remove the "
                           "release from that list (its backward then recomputes the forward)")
    global _ctx_attrs
    if _ctx_attrs is None:
        _ctx_attrs = {n: a for n, a in vars(ctx).items() if n not in ("saved_tensors", "scale")}
    return s[_GC], s[_AQK], s[_AKK]


@torch.library.custom_op("dormouse::kda_chunk", mutates_args=())
def _kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, torch.Tensor]:  # fmt: skip
    """(o, g_cumsum, Aqk, Akk) of chunk_kda(q, k, v, g, beta) with no state in or out (q, k, v,
    beta in the compute dtype, g fp32; all contiguous). The last three are fla's saved
    intermediates for the backward (empty where the release's saved set is unknown)."""
    ctx, o = _chunk_forward(q, k, v, g, beta, scale)
    if _keeps_intermediates():
        return o, *_kept(ctx, q, k, v, g, beta)
    empty = q.new_empty(0)
    return o, empty, empty.clone(), empty.clone()


@_kda_chunk.register_fake
def _(q, k, v, g, beta, scale):
    if _keeps_intermediates():
        scores = (*q.shape[:-1], _CHUNK)
        return (q.new_empty(v.shape), g.new_empty(g.shape, dtype=torch.float32),
                k.new_empty(scores), k.new_empty(scores))  # fmt: skip
    return q.new_empty(v.shape), q.new_empty(0), q.new_empty(0), q.new_empty(0)


@torch.library.custom_op("dormouse::kda_chunk_bwd", mutates_args=())
def _kda_chunk_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, aqk: torch.Tensor, akk: torch.Tensor, do: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta) of `dormouse::kda_chunk`. With the forward's intermediates
    (`aqk` non-empty; `g` is then fla's cumulative decay, not the op's g) fla's backward runs
    on them directly; without, fla's forward runs again first for what it saves."""
    from fla.ops.kda.chunk import ChunkKDAFunction

    if aqk.numel():
        if _ctx_attrs is None:  # set by this process's forward, which always runs first
            raise RuntimeError("kda: dormouse::kda_chunk_bwd ran before any kda_chunk forward")
        ctx = _SavedCtx()
        vars(ctx).update(_ctx_attrs, scale=scale)
        saved: list = [None] * _N_SAVED
        # g_input = the decay too: fla's backward takes only its dtype (fp32 both) from it
        for i, t in ((0, q), (2, k), (4, v), (_GC, g), (6, g), (7, beta), (8, beta),
                     (_AQK, aqk), (_AKK, akk)):  # fmt: skip
            saved[i] = t
        ctx.saved_tensors = tuple(saved)
    else:
        ctx, _ = _chunk_forward(q, k, v, g, beta, scale)
    grads = ChunkKDAFunction.backward(ctx, do, None)[:5]
    return tuple(t.clone() if any(t is x for x in (q, k, v, g, beta, aqk, akk, do)) else t
                 for t in grads)  # fmt: skip


@_kda_chunk_bwd.register_fake
def _(q, k, v, g, beta, aqk, akk, do, scale):
    return tuple(torch.empty_like(t) for t in (q, k, v, g, beta))


def _kda_chunk_setup(ctx, inputs, output):
    q, k, v, g, beta, ctx.scale = inputs
    _, g_cumsum, aqk, akk = output
    if aqk.numel():  # kept: the decay replaces g (fla's backward never reads g itself)
        ctx.save_for_backward(q, k, v, g_cumsum, beta, aqk, akk)
    else:
        ctx.save_for_backward(q, k, v, g, beta, aqk, akk)


def _kda_chunk_backward(ctx, do, *_unused):
    q, k, v, g, beta, aqk, akk = ctx.saved_tensors
    return (*torch.ops.dormouse.kda_chunk_bwd(q, k, v, g, beta, aqk, akk, do.contiguous(),
                                              ctx.scale),
            None)  # fmt: skip


_kda_chunk.register_autograd(_kda_chunk_backward, setup_context=_kda_chunk_setup)


class _FirstCall:
    """The first fla call of a process per shape, said before it runs and timed after.

    Triton autotunes fla's kernels for each new shape: 178-209 s before the first step on a
    fresh H200 (issue #16), silent unless said. Whether a call will tune cannot be known
    cheaply (the winners may sit in Triton's cache), so the first call per shape is announced
    and, when it took longer than SLOW_S, its forward and its backward are reported. The
    device is synchronised on these first calls only."""

    SLOW_S = 5.0
    seen: set[tuple] = set()
    clock = staticmethod(time.perf_counter)  # tests replace it

    def __init__(self, words: str, device: torch.device):
        self.words, self.device, self.t0 = words, device, self.now(device)

    def now(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return self.clock()

    @classmethod
    def begin(cls, q: torch.Tensor, v: torch.Tensor) -> _FirstCall | None:
        B, T, H, D = q.shape
        key = (B, T, H, D, v.shape[-1], q.dtype, q.device)
        if key in cls.seen:
            return None
        cls.seen.add(key)
        dt = str(q.dtype).replace("torch.", "")
        words = f"shape {B} x {T} x {H} x {D} ({dt})"
        cache.say_kernel_cache()
        later = (f"cached in {cache.triton_dir()}; later runs start in seconds"
                 if cache.autotune_cached() else
                 f"NOT cached: {cache.TRITON_AUTOTUNE} is not 1, so every run tunes again")
        log.info(f"kda: first fla call for {words}; on a fresh machine its kernels autotune for "
                 f"~3 minutes ({later})")  # fmt: skip
        return cls(words, q.device)

    def _took(self, what: str, t0: float) -> float:
        took = self.now(self.device) - t0
        if took > self.SLOW_S:
            log.info(f"kda: first fla {what} for {self.words} took {took:.1f} s")
        return took

    def end(self, q_in: torch.Tensor, o: torch.Tensor) -> None:
        """After the forward: report it; hook the backward (from o's gradient arriving to
        q's leaving chunk_kda, its only consumer) so the first backward is timed too."""
        self._took("forward", self.t0)
        if not (torch.is_grad_enabled() and o.requires_grad and q_in.requires_grad):
            return
        start: list[float] = []

        def grad_in(_g):
            start.append(self.now(self.device))

        def grad_out(_g):
            if start:
                self._took("backward", start.pop())

        o.register_hook(grad_in)
        q_in.register_hook(grad_out)


_KERNELS = {"torch": kda_torch, "fla": kda_fla}


# ---- the mixer -----------------------------------------------------------------------


@torch.compiler.assume_constant_result
def _arm_name(impl: str, head_dim: int, device: torch.device, dtype: torch.dtype) -> str:
    """KDAMixer.arm's name, announced. A compiled graph calls this once while tracing and keeps
    the answer (asking the card for its name and capability inside the graph would split it)."""
    return announce(choose_arm("kda", impl, device, dtype, {"head_dim": head_dim})).name


# ---- the short conv and its SiLU, fused (the fla arm) ----------------------------------
# The forward is fla's causal_conv1d kernel, each output the taps' products summed in fp32 in
# tap order (tap 0 x the oldest input .. tap W-1 x the current byte, zeros before the window)
# and rounded once; the backward is our own kernel (conv_silu.py), which recomputes the
# pre-activation from x in registers rather than keeping it. Custom ops, as kda_chunk: fla's
# functions are compiler-disabled, and an op is one opaque node in a compiled graph. Measured
# on an H200 at b1 32 x 2048 (docs/performance.md): the eager chain it replaces (padded cat,
# W products and sums, SiLU, each a pass over [B, T, 3 x d_attn]) ran ~110 ms of the 842 GPU
# ms of a step, compiled, at ~1.25 TB/s.


@torch.library.custom_op("dormouse::conv_silu", mutates_args=())
def _conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv of x [B, T, C] by the taps w [C, W]), x's dtype."""
    from fla.modules.causal_conv1d import causal_conv1d_fwd

    y, _ = causal_conv1d_fwd(x, w, None, None, activation="silu")
    return y


@_conv_silu.register_fake
def _(x, w):
    return torch.empty_like(x)


@torch.library.custom_op("dormouse::conv_silu_bwd", mutates_args=())
def _conv_silu_bwd(x: torch.Tensor, w: torch.Tensor,
                   dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx, dw) of `dormouse::conv_silu` (dw in w's dtype, summed over B and T in fp32)."""
    from .conv_silu import conv_silu_bwd

    return conv_silu_bwd(x, w, dy)


@_conv_silu_bwd.register_fake
def _(x, w, dy):
    return torch.empty_like(x), torch.empty_like(w)


def _conv_silu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_silu_backward(ctx, dy):
    x, w = ctx.saved_tensors
    return torch.ops.dormouse.conv_silu_bwd(x, w, dy.contiguous())


_conv_silu.register_autograd(_conv_silu_backward, setup_context=_conv_silu_setup)


class ShortConv(nn.Module):
    """Causal depthwise conv over time; `tail` holds the previous conv_size-1 inputs."""

    def __init__(self, channels: int, size: int):
        super().__init__()
        self.size = size
        bound = 1.0 / math.sqrt(size)  # nn.Conv1d's default range for a depthwise filter
        self.weight = nn.Parameter(torch.empty(channels, size).uniform_(-bound, bound))

    def forward(
        self, x: torch.Tensor, tail: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C], tail [B, size-1, C] or None (zeros) -> (y [B, T, C], new tail)."""
        B, T, Ch = x.shape
        if tail is None:
            tail = x.new_zeros(B, self.size - 1, Ch)
        xt = torch.cat([tail.to(x.dtype), x], dim=1)
        w = self.weight.to(x.dtype)
        # a sum over the taps, not F.conv1d: each output is the same few ops whatever T is,
        # so a byte-by-byte decode reproduces the full forward
        y = xt[:, 0:T] * w[:, 0]
        for j in range(1, self.size):
            y = y + xt[:, j : j + T] * w[:, j]
        return y, xt[:, T:]

    def silu(
        self, x: torch.Tensor, tail: torch.Tensor | None, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(silu(conv(x)), new tail), as forward + F.silu. `fused` (the fla arm, CUDA): both
        in fla's kernel (`dormouse::conv_silu`), fp32 sums rounded once; a given tail is
        put before x and its outputs cut off, so a byte-by-byte decode runs the same sums."""
        if not fused:
            y, new_tail = self(x, tail)
            return F.silu(y), new_tail
        B, T, Ch = x.shape
        w = self.weight.to(x.dtype)
        if tail is None:
            y = torch.ops.dormouse.conv_silu(x.contiguous(), w)
            keep = self.size - 1
            new_tail = (x[:, T - keep:] if T >= keep else
                        torch.cat([x.new_zeros(B, keep - T, Ch), x], dim=1))  # fmt: skip
            return y, new_tail
        xt = torch.cat([tail.to(x.dtype), x], dim=1)
        y = torch.ops.dormouse.conv_silu(xt, w)[:, tail.shape[1]:]
        return y, xt[:, T:]


def _l2norm(x: torch.Tensor, eps: float = _L2_EPS) -> torch.Tensor:
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
        if self.q_delta is not None:
            ws += [getattr(self, f"{n}_delta")[iteration].A for n in ("q", "k", "v")]
            names += ["qa", "ka", "va"]
        if self.f_down is not None:
            ws.append(self.f_down.weight)
            names.append("f")
        ws += [self.b_proj.weight, self.g_down.weight]
        names += ["b", "gate"]
        return ws, names

    def _project(self, x: torch.Tensor, iteration: int) -> dict[str, torch.Tensor]:
        """x [B, T, d_model] -> every projection of x, from two matmuls against stacked
        weights: q|k|v, and the narrow ones (the deltas' down halves, the decay's down half,
        beta's, the output gate's down half: N = n_heads..gate_rank each, too skinny to fill
        a matmul alone). The parameters stay separate (Muon sees each matrix alone); only
        the products are fused: x is read twice instead of up to nine times, and the
        backward's input gradient is two matmuls instead of a sum of up to nine. Two, not
        one: the narrow outputs are kept for the backward, and a slice keeps its whole base
        alive, so one product would keep q|k|v's columns too (b1 at 32 x 2048 then ran out
        of the H200's memory)."""
        parts = {"qkv": F.linear(x, torch.cat(
            [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))}  # fmt: skip
        ws, names = self._small_weights(iteration)
        y = F.linear(x, torch.cat(ws))
        parts.update(zip(names, y.split([w.shape[0] for w in ws], dim=-1)))
        return parts

    def _inputs(self, x, iteration, conv_tail, y):
        B, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        qkv = y["qkv"]
        if self.q_delta is not None:
            dl = torch.cat(
                [y[f"{n}a"] @ getattr(self, f"{n}_delta")[iteration].B.t().to(qkv.dtype)
                 for n in ("q", "k", "v")], dim=-1,
            )  # fmt: skip
            qkv = qkv + dl
        fla = self._impl == "fla"
        qkv, new_tail = self.qkv_conv.silu(qkv, conv_tail, fused=fla)
        if fla:  # one pass each way in our Triton kernels, q, k, v contiguous (qk_norm.py)
            q, k, v = qk_l2norm(qkv, H)
        else:
            q, k, v = qkv.view(B, T, 3, H, Dh).unbind(dim=2)
            q, k = _l2norm(q), _l2norm(k)

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
        out = self.o_proj(o)
        if self.o_delta is None:
            return out
        return out + self.o_delta[iteration](o)

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
