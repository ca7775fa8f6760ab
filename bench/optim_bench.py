"""Optimizer step time for a preset's parameter set: batched Muon vs one polar per matrix.

A benchmark, not a test: it reports speed and asserts nothing. It times

* batched Muon   - MixOptimizer's Muon groups (one stacked momentum and one batched
                   Newton-Schulz call per matrix shape),
* per-matrix Muon - the same math, one [R, C] matrix at a time (the shape of a naive loop),
* full step      - MixOptimizer.step(): batched Muon plus the AdamW and Engram groups,

on the `medium` preset by default, and prints a markdown table.

    python bench/optim_bench.py --device cpu      # ~2 min on 2 idle cores: 1 step per arm
    python bench/optim_bench.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dormouse.config import ModelConfig, preset  # noqa: E402
from dormouse.train.optim import MixOptimizer, muon_scale, newton_schulz  # noqa: E402


def synthetic_model(m: ModelConfig) -> nn.Module:
    """Parameters shaped like DormouseModel's (names and shapes only), for when it won't import."""
    d, da, E = m.d_model, m.d_attn, m.n_experts
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (256, d),
        "engram.store.table": (m.engram_heads * len(m.engram_orders), m.engram_rows, m.engram_dim),
        "engram.key.weight": (d, m.engram_heads * len(m.engram_orders) * m.engram_dim),
        "engram.value.weight": (d, m.engram_heads * len(m.engram_orders) * m.engram_dim),
        "engram.conv.weight": (d, 1, m.conv_size),
        "norm_f.weight": (d,),
        "head.weight": (256, d),
    }
    for b in range(m.n_layers):
        x = f"blocks.{b}."
        shapes.update({
            x + "norm1.weight": (d,), x + "norm2.weight": (d,),
            x + "mixer.A_log": (da,), x + "mixer.dt_bias": (da,),
            x + "mixer.qkv_conv.weight": (3 * da, m.conv_size),
            x + "mixer.b_proj.weight": (m.n_heads, d),
            x + "mixer.f_down.weight": (m.gate_rank, d), x + "mixer.f_up.weight": (da, m.gate_rank),
            x + "mixer.g_down.weight": (m.gate_rank, d), x + "mixer.g_up.weight": (da, m.gate_rank),
            x + "mixer.g_up.bias": (da,), x + "mixer.o_norm.weight": (m.head_dim,),
            x + "moe.router.weight": (E, d),
            x + "moe.w1": (E, d, m.d_ffn), x + "moe.w3": (E, d, m.d_ffn),
            x + "moe.w2": (E, m.d_ffn, d),
            x + "moe.shared.w1.weight": (m.shared_rank, d),
            x + "moe.shared.w3.weight": (m.shared_rank, d),
            x + "moe.shared.w2.weight": (d, m.shared_rank),
        })  # fmt: skip
        for proj in "qkvo":
            shapes[x + f"mixer.{proj}_proj.weight"] = (d, d)
            for it in range(m.max_iter if m.rank else 0):
                shapes[x + f"mixer.{proj}_delta.{it}.A"] = (m.rank, d)
                shapes[x + f"mixer.{proj}_delta.{it}.B"] = (d, m.rank)

    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.randn(shape) * 0.02))
    return root


def build(preset_name: str, device: torch.device, synthetic: bool) -> tuple[nn.Module, str]:
    cfg = preset(preset_name).model
    if synthetic:
        with device:
            return synthetic_model(cfg), "synthetic shapes"
    try:
        from dormouse.model import DormouseModel
    except ImportError as e:
        print(f"DormouseModel does not import ({e}); using synthetic shapes", file=sys.stderr)
        with device:
            return synthetic_model(cfg), "synthetic shapes"
    with device:
        return DormouseModel(cfg), "DormouseModel"


class PerMatrixMuon:
    """The batched arm's math, one polar per [R, C] matrix (3D stacks: per expert)."""

    def __init__(self, opt: MixOptimizer):
        self.items = []
        for g in opt._muon_groups:
            R, C = g["matrix"]
            for p in g["params"]:
                for view in p.view(-1, R, C):
                    self.items.append((g, p, view, torch.zeros(R, C, device=p.device)))

    @torch.no_grad()
    def step(self) -> None:
        for g, p, view, m in self.items:
            R, C = g["matrix"]
            grad = p.grad.view(-1, R, C)[self._index(p, view)]
            m.mul_(g["momentum"]).add_(grad)
            u = grad.add(m, alpha=g["momentum"]) if g["nesterov"] else m
            o = newton_schulz(u[None], g["ns_steps"], g["ns_kind"], _DT[g["ns_dtype"]])[0]
            view.mul_(1 - g["lr"] * g["weight_decay"])
            view.add_(o.to(view.dtype), alpha=-g["lr"] * muon_scale(g["muon_sf"], R, C))

    @staticmethod
    def _index(p: torch.Tensor, view: torch.Tensor) -> int:
        return (view.data_ptr() - p.data_ptr()) // (view.numel() * view.element_size())


_DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn, repeats: int, warmup: int, device: torch.device) -> list[float]:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(1000 * (time.perf_counter() - t))
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--repeats", type=int, default=0, help="timed steps (0: 20 cuda, 1 cpu)")
    ap.add_argument("--warmup", type=int, default=-1, help="untimed steps (-1: 3 cuda, 1 cpu)")
    ap.add_argument("--ns-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--ns-kind", default="quintic", choices=("quintic", "polar_express"))
    ap.add_argument("--synthetic", action="store_true", help="shapes from the config, no model")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    repeats = args.repeats or (20 if cuda else 1)
    # One CPU step of `medium` is ~2 TFLOP of fp32 polar (~15 s on 2 idle cores): one warm-up
    # (first-touch allocation would otherwise land on whichever arm runs first) and one timed
    # step per arm keep the CPU run near 2 minutes.
    warmup = args.warmup if args.warmup >= 0 else (3 if cuda else 1)
    ns_dtype = args.ns_dtype if args.ns_dtype != "auto" else ("bf16" if cuda else "fp32")

    torch.manual_seed(0)
    model, source = build(args.preset, device, args.synthetic)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3  # kept across steps: every step does the same work
    opt = MixOptimizer(model, lr=1e-6, wd=0.1, ns_dtype=ns_dtype, ns_kind=args.ns_kind)
    per = PerMatrixMuon(opt)
    n_mat = len(per.items)
    muon_params = sum(p.numel() for g in opt._muon_groups for p in g["params"])

    def batched():
        with torch.no_grad():
            for g, st in zip(opt._muon_groups, opt.muon_state):
                opt._muon_step(g, st)

    rows = []
    for label, fn in (("batched Muon", batched), ("per-matrix Muon", per.step),
                      ("full step (batched Muon + AdamW)", opt.step)):  # fmt: skip
        print(f"timing {label} ...", file=sys.stderr, flush=True)
        rows.append((label, timed(fn, repeats, warmup, device)))

    base = statistics.median(rows[1][1])
    print(f"\n### Optimizer step, `{args.preset}` parameter set ({source})\n")
    print(f"device: {device_name(device)}; torch {torch.__version__}; ns_kind={args.ns_kind}, "
          f"ns_dtype={ns_dtype}, ns_steps=5; Muon: {muon_params / 1e6:.1f}M params in "
          f"{n_mat} matrices, {len(opt._muon_groups)} shape groups; "
          f"median over {repeats} steps after {warmup} warm-up\n")  # fmt: skip
    print("| arm | step ms (median) | min ms | speedup vs per-matrix Muon |")
    print("|---|---:|---:|---:|")
    for label, ts in rows:
        med = statistics.median(ts)
        print(f"| {label} | {med:.1f} | {min(ts):.1f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
