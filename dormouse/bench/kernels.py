"""kernels: dormouse's own Triton kernels against what they replace, one mixer call at a preset's shape.

The fla arm's mixer runs two kernels of ours (model/conv_silu.py, model/qk_norm.py). This times
each on random inputs of one mixer call's shape, [batch, seq, 3 x n_heads x head_dim] in the
compute dtype, beside the arm it replaced, and gives each arm's error from the fp64 truth of the
same inputs:
- the short conv + SiLU's backward (dx, dw): ours, and fla's `causal_conv1d_bwd`, whose forward
  stays in use;
- the q/k L2-norm forward + backward: our op, and the torch arm's `kda.l2norm` chain on q|k|v's
  views (eager autograd, then q, k, v made contiguous as fla's kernel takes them).
GB/s counts the bytes each must move at least (conv: x and dy read, dx written; norm: q|k|v
read, q, k, v written, then q, k, dq, dk, dv read and d(q|k|v) written), over the median time.
Needs CUDA with Triton (fla-core for fla's row).

    python -m dormouse bench kernels b1 --batch 32 --seq 2048
    python -m dormouse bench kernels small --batch 64 --seq 256
"""

from __future__ import annotations

import logging
import statistics

import torch
import torch.nn.functional as F

from .common import (
    BenchError,
    check_counts,
    configure,
    machine_lines,
    report,
    resolve_device,
    table,
    timed,
)

log = logging.getLogger(__name__)

HEADER = [
    "kernel",
    "shape",
    "arm",
    "ms (median)",
    "ms (min)",
    "GB/s (least bytes)",
    "error from fp64 (relative)",
]


def add_args(ap) -> None:
    ap.add_argument("preset", nargs="?", default="b1", help="whose mixer shape (default b1)")
    ap.add_argument("--batch", type=int, help="windows a call (default the preset's batch)")
    ap.add_argument("--seq", type=int, help="bytes a window (default the preset's seq_len)")
    ap.add_argument("--steps", type=int, default=20, help="timed calls per arm (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per arm (default 3)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def _row(kernel, shape, arm, ts, nbytes, err) -> list[str]:
    med = statistics.median(ts)
    return [kernel, shape, arm, f"{med:.3f}", f"{min(ts):.3f}", f"{nbytes / med / 1e6:,.0f}", err]


def _conv_rows(x, w, dy, steps, warmup, device, shape) -> list[list[str]]:
    from ..model.conv_silu import conv_silu_bwd

    B, T, C = x.shape
    W = w.shape[1]
    with torch.enable_grad():  # the truth: the taps' chain in fp64, as the torch arm sums it
        xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
        pad = torch.cat([xd.new_zeros(B, W - 1, C), xd], 1)
        z = sum(pad[:, j : j + T] * wd[:, j] for j in range(W))
        (F.silu(z) * dy.double()).sum().backward()
    truth = (xd.grad.detach(), wd.grad.detach())
    del xd, wd, pad, z
    arms = [("ours (model/conv_silu.py)", lambda: conv_silu_bwd(x, w, dy))]
    try:
        from fla.modules.causal_conv1d import causal_conv1d_bwd

        arms.append(
            (
                "fla causal_conv1d_bwd (replaced)",
                lambda: causal_conv1d_bwd(x, dy, None, w, None, None, activation="silu")[:2],
            )
        )
    except ImportError:
        log.info("fla-core not installed: its conv row is left out")
    rows = []
    for arm, fn in arms:
        log.info(f"timing the conv backward: {arm} ...")
        dx, dw = fn()
        err = f"dx {_rel(dx, truth[0]):.2e}, dw {_rel(dw, truth[1]):.2e}"
        ts = timed(lambda _i, fn=fn: fn(), steps, warmup, device)
        rows.append(
            _row("conv + SiLU backward", shape, arm, ts, 3 * x.numel() * x.element_size(), err)
        )
    return rows


def _norm_rows(qkv, dys, heads, steps, warmup, device, shape) -> list[list[str]]:
    from references.short_conv import qk_l2norm as reference_norm

    from ..model.kda import l2norm
    from ..model.qk_norm import qk_l2norm

    B, T, _ = qkv.shape

    def torch_norm(x):
        q, k, v = x.view(B, T, 3, heads, -1).unbind(2)
        return [t.contiguous() for t in (l2norm(q), l2norm(k), v)]

    def fwd_bwd(fn, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            outs = fn(x)
            torch.autograd.backward(outs, [d.to(o.dtype) for d, o in zip(dys, outs)])
        return outs, x.grad

    # the truth: the written-out norm in fp64 (`l2norm` computes in fp32 whatever x is)
    (q64, k64, _), dx64 = fwd_bwd(lambda x: reference_norm(x, heads), qkv.double())
    rows = []
    for arm, fn in (
        ("ours (model/qk_norm.py)", lambda x: list(qk_l2norm(x, heads))),
        ("torch l2norm chain, eager (the torch arm)", torch_norm),
    ):
        log.info(f"timing the q/k norm: {arm} ...")
        (q, k, _), dx = fwd_bwd(fn, qkv)
        err = f"q {_rel(q, q64):.2e}, k {_rel(k, k64):.2e}, d(q|k|v) {_rel(dx, dx64):.2e}"
        ts = timed(lambda _i, fn=fn: fwd_bwd(fn, qkv), steps, warmup, device)
        nbytes = qkv.numel() * qkv.element_size() * (1 + 1 + 5 / 3 + 1)
        rows.append(_row("q/k L2-norm forward + backward", shape, arm, ts, nbytes, err))
    return rows


def run(args, command: str) -> str:
    check_counts(args.steps, args.warmup)
    device = resolve_device(args.device)
    if device.type != "cuda":
        raise BenchError(
            f"bench kernels times Triton kernels on CUDA; this device is {device}: "
            "run it on a card (--device cuda)"
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise BenchError(f"bench kernels needs Triton ({e}); install torch's CUDA build") from e
    run_cfg = configure(args.preset, args.set, args.batch, args.seq)
    m, t = run_cfg.model, run_cfg.train
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    B, T, H, D, W = t.batch, t.seq_len, m.n_heads, m.head_dim, m.conv_size
    C = 3 * H * D
    shape = f"{B} x {T} x {C} {str(dtype).removeprefix('torch.')}, {W} taps, {H} heads of {D}"
    gen = torch.Generator(device=device).manual_seed(0)
    x, dy = (torch.randn(B, T, C, device=device, generator=gen, dtype=dtype) for _ in range(2))
    w = (torch.rand(C, W, device=device, generator=gen) - 0.5).to(dtype)
    rows = _conv_rows(x, w, dy, args.steps, args.warmup, device, shape)
    dys = [torch.randn(B, T, H, D, device=device, generator=gen, dtype=dtype) for _ in range(3)]
    rows += _norm_rows(x, dys, H, args.steps, args.warmup, device, shape)
    notes = [
        (
            f"`{args.preset}`'s mixer shape, random inputs (taps uniform in +-0.5); each arm "
            f"called {args.warmup} times untimed, then {args.steps} times, the device "
            "synchronised around each call"
        ),
        (
            "error: the relative Frobenius distance from the same computation in fp64 on the "
            "same (rounded) inputs"
        ),
    ]
    return report(
        f"dormouse bench kernels: `{args.preset}`'s mixer kernels",
        machine_lines(device, command),
        table(HEADER, rows),
        notes,
    )
