"""optim: the optimizer step on a preset's real parameter set, batched Muon vs per matrix.

The preset's own DormouseModel, every parameter given a fixed random gradient; timed:
MixOptimizer.step() with only the Muon parameters holding one (one batched polar per matrix
shape), the same math one [R, C] matrix at a time, and the full step (Muon, AdamW, Engram).

    python -m dormouse bench optim --device cpu --preset medium   # ~2 min on 2 idle cores
    python -m dormouse bench optim --device cuda --preset medium
"""

from __future__ import annotations

import logging
import statistics

import torch

from dormouse.config import Optim

from .common import configure, machine_lines, report, resolve_device, table, timed

log = logging.getLogger(__name__)


def add_args(ap) -> None:
    ap.add_argument("--preset", default="medium", help="whose parameter set (default medium)")
    ap.add_argument(
        "--steps",
        "--repeats",
        dest="steps",
        type=int,
        help="timed steps per arm (default 1 on CPU, 20 on CUDA)",
    )
    ap.add_argument("--warmup", type=int, help="untimed steps per arm (default 1 CPU, 3 CUDA)")
    ap.add_argument("--ns-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--ns-kind", default="quintic", choices=("quintic", "polar_express"))


def per_matrix_muon(opt):
    """(step, matrices): the batched arm's Muon math, one polar per [R, C] matrix (a 3-D
    expert stack: one per expert), with its own momentum; read from MixOptimizer's groups."""
    from ..train.optim.muon import DTYPES, muon_scale, newton_schulz

    items = [
        (g, p, k, torch.zeros(g["matrix"], device=p.device))
        for g in opt.param_groups
        if g["kind"] == "muon"
        for p in g["params"]
        for k in range(p.numel() // (g["matrix"][0] * g["matrix"][1]))
    ]

    @torch.no_grad()
    def step(_i=0) -> None:
        for g, p, k, m in items:
            R, C = g["matrix"]
            view, grad = p.view(-1, R, C)[k], p.grad.view(-1, R, C)[k]
            m.mul_(g["momentum"]).add_(grad)
            u = grad.add(m, alpha=g["momentum"]) if g["nesterov"] else m
            o = newton_schulz(u[None], g["ns_steps"], g["ns_kind"], DTYPES[g["ns_dtype"]])[0]
            view.mul_(1 - g["lr"] * g["weight_decay"])
            view.add_(o.to(view.dtype), alpha=-g["lr"] * muon_scale(g["muon_sf"], R, C))

    return step, len(items)


def run(args, command: str) -> str:
    from ..model import DormouseModel
    from ..train.optim.mix import MixOptimizer

    cfg = configure(args.preset, args.set).model
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    # One CPU step of `medium` is ~2 TFLOP of fp32 polar (~15 s on 2 idle cores): one warm-up
    # (first-touch allocation would otherwise land on whichever arm runs first) and one timed
    # step per arm keep the CPU run near 2 minutes.
    steps = args.steps or (20 if cuda else 1)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    ns_dtype = args.ns_dtype if args.ns_dtype != "auto" else ("bf16" if cuda else "fp32")
    torch.manual_seed(0)
    model = DormouseModel(cfg).to(device)
    grads = {p: torch.randn_like(p) * 1e-3 for p in model.parameters()}  # same work each step
    opt = MixOptimizer(model, Optim(lr=1e-6, wd=0.1, ns_dtype=ns_dtype, ns_kind=args.ns_kind))
    muon = {id(p): p for g in opt.param_groups if g["kind"] == "muon" for p in g["params"]}
    per_matrix, n_mat = per_matrix_muon(opt)
    rows = []
    arms = (
        ("batched Muon", True, opt.step),
        ("per-matrix Muon", True, per_matrix),
        ("full step (batched Muon + AdamW)", False, opt.step),
    )
    for label, muon_only, fn in arms:
        for p, g in grads.items():
            p.grad = None if muon_only and id(p) not in muon else g
        log.info(f"timing {label} ...")
        rows.append((label, timed(lambda _i, fn=fn: fn(), steps, warmup, device)))
    base = statistics.median(rows[1][1])
    cells = [
        [
            label,
            f"{statistics.median(ts):.1f}",
            f"{min(ts):.1f}",
            f"{base / statistics.median(ts):.2f}x",
        ]
        for label, ts in rows
    ]
    groups = sum(g["kind"] == "muon" for g in opt.param_groups)
    n_muon = sum(p.numel() for p in muon.values())
    notes = [
        f"ns_kind={args.ns_kind}, ns_dtype={ns_dtype}, ns_steps=5; Muon: {n_muon / 1e6:.1f}M "
        f"params in {n_mat} matrices, {groups} shape groups; median over {steps} steps "
        f"after {warmup} warm-up"
    ]
    header = ["arm", "step ms (median)", "min ms", "speedup vs per-matrix Muon"]
    return report(
        f"dormouse bench optim: `{args.preset}` parameter set (DormouseModel)",
        machine_lines(device, command),
        table(header, cells),
        notes,
    )
