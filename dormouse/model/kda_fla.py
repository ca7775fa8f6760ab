"""KDA's fla arm: the torch arm's contract (`kda_torch.py`) on fla-core's `chunk_kda` Triton
kernel (CUDA only), eager or as the custom op `dormouse::kda_chunk` inside compiled graphs,
and the announcement of each shape's first call (its kernels autotune then)."""

from __future__ import annotations

import logging
import os
import time

import torch

from dormouse import cache

log = logging.getLogger(__name__)


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
            q.contiguous(),
            k.contiguous().to(dt),
            v.contiguous().to(dt),
            g.float().contiguous(),
            beta.contiguous().to(dt),
            q.shape[-1] ** -0.5 if scale is None else float(scale),
        )[0]
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
        raise RuntimeError(
            "kda: fla-core's ChunkKDAFunction saves another set than the one "
            "dormouse.model.kda._SAVES_KNOWN lists for this release: remove the "
            "release from that list (its backward then recomputes the forward)"
        )
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
        later = (
            f"cached in {cache.triton_dir()}; later runs start in seconds"
            if cache.autotune_cached()
            else f"NOT cached: {cache.TRITON_AUTOTUNE} is not 1, so every run tunes again"
        )
        configs = os.environ.get("FLA_CONFIG_DIR")
        tuned = f"; the kernels whose keys are in {configs} skip it" if configs else ""
        log.info(f"kda: first fla call for {words}; on a fresh machine its kernels autotune for "
                 f"~3 minutes ({later}{tuned})")  # fmt: skip
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
