"""MixOptimizer: Muon for hidden matrices, AdamW for the rest, Engram tables in their own group.

Owns four things:

* `route_params(model)` - which optimizer owns each parameter, and why. It reads names and
  shapes only, so it works on a meta-device model (the `--fit` planner calls it there).
* `MixOptimizer` - the training optimizer. Muon runs batched: every parameter whose matrix
  shape is [R, C] (a 2D weight, or one expert of a 3D [E, R, C] stack) joins ONE group whose
  momentum is one stacked [N, R, C] tensor and whose Newton-Schulz polar runs as one batched
  call. The AdamW side is `torch.optim.AdamW` (or bitsandbytes' AdamW8bit), never hand-written.
* `newton_schulz` - the batched polar iteration (quintic or Polar Express).
* The Engram group: a row-sparse Adam (`dormouse.model.engram.row_adam_`, lazy, per-row bias
  correction, no weight decay) over the VRAM tables (`*store.table` parameters) and the
  host-RAM stores (`HostTables`, engram_ram), so both stores follow the same trajectory.

The slow, obviously-right twin of the Muon arm is `references/muon_single.py`; the tests hold
the two together matrix by matrix.

Learning-rate convention for the loop: every param group carries `base_lr` (set once at
construction: `lr`, or `lr * engram_lr_mult` for the Engram group) and `lr`, the value used
by the next `step()`. The loop calls `opt.set_lr_factor(f)` each step, which sets
`group["lr"] = group["base_lr"] * f` on every group (Muon and AdamW alike). Muon's weight
decay uses the scheduled `lr` (p *= 1 - lr*wd), as torch.optim.Muon and AdamW do.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import ConfigError
from ..model.engram import HostTables, row_adam_, touched_rows

logger = logging.getLogger("dormouse.train")

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

_WRAPPER_TOKENS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# /2: the Engram tables left torch AdamW for the row-sparse Adam (state under "engram").
_FORMAT = "dormouse.MixOptimizer/2"
#: Adam's epsilon for the Engram group (torch AdamW's default, as the AdamW groups use).
ENGRAM_EPS = 1e-8


# ---- routing ------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """Which optimizer owns one parameter. `owner` is "muon", "adamw" or "engram"."""

    name: str  # the name with wrapper prefixes stripped
    shape: tuple[int, ...]
    owner: str
    reason: str
    decay: bool = False  # weight decay applies (Muon: always; AdamW: matrices only)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrix(self) -> tuple[int, int]:
        """The [rows, cols] each Muon polar sees (one expert of a 3D stack)."""
        return (self.shape[-2], self.shape[-1])


def strip_name(name: str) -> str:
    """Drop DDP / torch.compile / FSDP1 / checkpoint-wrapper tokens from a parameter name."""
    parts = name.split(".")
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_TOKENS)


def _classify(name: str, shape: tuple[int, ...], kind: str) -> tuple[str, str, bool]:
    """(owner, reason, decay) for one parameter under opt=mix; kind is its module's type."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("store.table"):
        return ("engram", "Engram table: row-sparse Adam (only rows with a gradient move), "
                          "lr x engram_lr_mult, no weight decay", False)
    if len(shape) <= 1:
        return "adamw", "1-D (norm gain / bias / scalar): AdamW, no weight decay", False
    if kind == "embedding" or name == "embed.weight" or name.endswith(".embed.weight"):
        return "adamw", "embedding: AdamW", True
    if name == "head.weight":
        return "adamw", "output head: AdamW", True
    # Conv taps ([C, 1, K] as nn.Conv1d keeps them, or [C, K] as a hand-rolled short conv
    # does) are per-channel filters, not a linear map between spaces: no polar factor to take.
    if kind == "conv" or any("conv" in part for part in name.split(".")[:-1]):
        return "adamw", f"depthwise conv taps {'x'.join(map(str, shape))}: AdamW", True
    if len(shape) > 3:
        return "adamw", f"{len(shape)}-D tensor, not a matrix or a stack of them: AdamW", True
    rows, cols = shape[-2], shape[-1]
    if min(rows, cols) == 1:
        # A polar factor of a vector is its sign-normalised self: Muon adds nothing there.
        return "adamw", f"degenerate matrix {rows}x{cols} (a vector): AdamW", True
    if len(shape) == 3:
        what = "expert stack" if leaf in ("w1", "w2", "w3") else "3-D stack"
        return "muon", f"{what} {shape[0]} x [{rows}x{cols}], orthogonalised per matrix", True
    return "muon", f"hidden matrix [{rows}x{cols}]", True


def route_params(model: nn.Module, opt: str = "mix") -> list[Route]:
    """One Route per parameter of `model`, in named_parameters order (tied weights once).

    opt="mix": Muon for 2D hidden matrices and 3D stacks ([E, R, C], one polar per [R, C]),
    AdamW for embeddings, the head, 1-D parameters (norms, gains, biases, A_log, dt_bias),
    conv taps (an nn.Conv* weight, or any parameter under a module whose name contains
    "conv") and degenerate [1, n] / [n, 1] matrices; the Engram tables (`*store.table`) in
    their own row-sparse Adam group.
    opt="adamw" (the control arm): what was Muon goes to AdamW; the Engram tables keep their
    own group (the same row-sparse Adam, lr x engram_lr_mult, no weight decay) so the two
    arms differ ONLY in the optimizer of the hidden matrices.
    Host-RAM tables (engram_ram) are not parameters and get no Route; MixOptimizer finds
    them as `HostTables` modules and steps them in the Engram group.
    Weight decay: on every Muon matrix and on every AdamW tensor of 2 or more dims; never on
    1-D parameters or Engram tables (a table row is decayed on every step whether or not a
    batch touched it, which would erase rarely seen n-grams).
    """
    if opt not in ("mix", "adamw"):
        raise ConfigError(f"opt={opt!r} is not one of ('mix', 'adamw')")
    kinds: dict[int, str] = {}
    for m in model.modules():
        kind = ("embedding" if isinstance(m, nn.Embedding)
                else "conv" if isinstance(m, nn.modules.conv._ConvNd) else None)  # fmt: skip
        if kind:
            kinds.update({id(p): kind for p in m.parameters(recurse=False)})
    routes = []
    for raw, p in model.named_parameters():
        name = strip_name(raw)
        shape = tuple(p.shape)
        owner, reason, decay = _classify(name, shape, kinds.get(id(p), ""))
        if opt == "adamw" and owner == "muon":
            owner, reason = "adamw", f"opt=adamw control arm (under mix: {reason})"
        routes.append(Route(name, shape, owner, reason, decay))
    return routes


def format_routes(routes: Iterable[Route]) -> str:
    """A readable table of the routing, then totals per owner (count, parameters)."""
    routes = list(routes)
    w = max([len("parameter")] + [len(r.name) for r in routes])
    lines = [f"{'parameter':<{w}}  {'shape':<18} {'owner':<6} {'wd':<3} reason"]
    for r in routes:
        shape = "x".join(map(str, r.shape)) or "scalar"
        lines.append(f"{r.name:<{w}}  {shape:<18} {r.owner:<6} {'yes' if r.decay else 'no':<3} "
                     f"{r.reason}")  # fmt: skip
    lines.append("")
    total_n = sum(r.numel for r in routes)
    lines.append(f"{'owner':<8} {'tensors':>8} {'params':>14} {'share':>7}")
    for owner in ("muon", "adamw", "engram"):
        sel = [r for r in routes if r.owner == owner]
        n = sum(r.numel for r in sel)
        lines.append(f"{owner:<8} {len(sel):>8} {n:>14,} {100 * n / max(1, total_n):>6.1f}%")
    lines.append(f"{'total':<8} {len(routes):>8} {total_n:>14,} {100.0:>6.1f}%")
    return "\n".join(lines)


# ---- Newton-Schulz --------------------------------------------------------------------


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


# ---- the optimizer ----------------------------------------------------------------------


def _is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch built without distributed has no DTensor to meet
        return False
    return isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _like_param(state: Tensor, p: Tensor) -> Tensor:
    """Wrap a shard-local state tensor as a DTensor placed like p (plain p: unchanged)."""
    if not _is_dtensor(p):
        return state
    from torch.distributed.tensor import DTensor

    shape = tuple(p.shape[: state.dim()])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(state, p.device_mesh, p.placements, run_check=False,
                              shape=shape, stride=stride)  # fmt: skip


def _shard_like(full: Tensor, p: Tensor, local: Tensor) -> Tensor:
    """The part of a full (single-file) state tensor that p's shard holds."""
    if _is_dtensor(full):
        full = full.full_tensor()
    if not _is_dtensor(p):
        return full
    from torch.distributed.tensor import distribute_tensor

    # Every rank holds the same full tensor: split locally, no communication.
    return distribute_tensor(full.to(local.device), p.device_mesh, p.placements,
                             src_data_rank=None).to_local()  # fmt: skip


def _resolve_ns_dtype(ns_dtype: str, device_type: str, say: Callable[[str], None]) -> str:
    if ns_dtype != "auto":
        return ns_dtype
    chosen = "bf16" if device_type == "cuda" else "fp32"
    why = "tensor cores run the polar in bf16" if chosen == "bf16" else (
        f"device {device_type!r}: bf16 matmuls are slower than fp32 there")
    say(f"ns_dtype=auto -> {chosen} ({why})")
    return chosen


def _check(name: str, value, options: tuple) -> None:
    if value not in options:
        raise ConfigError(f"{name}={value!r} is not one of {options}")


class MixOptimizer(torch.optim.Optimizer):
    """Muon (batched by matrix shape) + torch AdamW, behind one torch.optim.Optimizer surface.

    `param_groups` holds the Muon groups first (kind="muon", one per matrix shape/dtype/device),
    then the AdamW groups (kind "adamw", "adamw_nodecay"), then one Engram group (kind
    "engram"); the AdamW dicts are the SAME objects the inner torch optimizer steps, so
    setting group["lr"] reaches it. See the module docstring for the lr convention
    (`base_lr`, `set_lr_factor`).

    The Engram group's "params" are the VRAM tables; its "names" also list the host-RAM
    tables (`HostTables` modules, found at construction), whose rows are not parameters.
    Both are stepped by `row_adam_`: only rows whose gradient is non-zero move (their m, v,
    step count and the row itself), with lr = group lr (base lr x engram_lr_mult, scheduled
    by set_lr_factor), betas = adam_betas, eps = ENGRAM_EPS, no weight decay. A VRAM table's
    Adam state lives here (`engram_state`, on the table's device); a host table's lives in
    its store. Either way state_dict() keeps it under the table's name, so a state saved
    with engram_ram on loads with it off and back.

    Muon per matrix, with g its gradient and m its momentum:
        m <- mu*m + g;  u <- g + mu*m (nesterov) or m (plain)
        O <- NS(u)  (quintic or Polar Express, in ns_dtype)
        p <- p*(1 - lr*wd) - lr*scale(R, C)*O
    A parameter whose grad is None does not move and its momentum does not change.
    `muon_state_dtype="bf16"` stores the stacked momentum in bf16: half the memory, and
    APPROXIMATE by design (the update is computed in fp32 from the rounded buffer and the
    new buffer is rounded again, so it drifts from the fp32 trajectory by bf16 round-off).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        wd: float = 0.0,
        opt: str = "mix",
        ns_steps: int = 5,
        ns_kind: str = "quintic",
        ns_dtype: str = "fp32",
        muon_state_dtype: str = "fp32",
        muon_variant: str = "nesterov",
        muon_sf: str = "rms",
        momentum: float = 0.95,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        engram_lr_mult: float = 5.0,
        optim_8bit: bool = False,
        log: Callable[[str], None] | None = None,
    ):
        say = log or logger.info
        _check("opt", opt, ("mix", "adamw"))
        _check("ns_kind", ns_kind, ("quintic", "polar_express"))
        _check("ns_dtype", ns_dtype, ("auto", "fp32", "bf16"))
        _check("muon_state_dtype", muon_state_dtype, ("fp32", "bf16"))
        _check("muon_variant", muon_variant, ("nesterov", "plain"))
        _check("muon_sf", muon_sf, ("rms", "jordan"))
        if ns_steps < 1:
            raise ConfigError(f"ns_steps={ns_steps} must be >= 1")
        self.opt = opt
        self.muon_state_dtype = _DTYPES[muon_state_dtype]
        self.optim_8bit = optim_8bit
        self.routes = route_params(model, opt)
        named = [(r, p) for r, (_, p) in zip(self.routes, model.named_parameters(), strict=True)]

        muon = [(r, p) for r, p in named if r.owner == "muon"]
        if muon and ns_dtype == "auto":
            ns_dtype = _resolve_ns_dtype(ns_dtype, muon[0][1].device.type, say)
        for r, p in muon:
            if _is_dtensor(p):
                raise ConfigError(
                    f"Muon cannot step FSDP2-sharded parameters: {r.name} is a DTensor "
                    f"(placements {tuple(p.placements)}). The batched Muon keeps one stacked "
                    f"plain tensor per shape group and needs each full matrix for its polar; "
                    f"mixing it with DTensor grads fails in _foreach_add_ ('got mixed "
                    f"torch.Tensor and DTensor'). Use --set dist_shard=none (DDP) for the "
                    f"Muon arm, or --set opt=adamw to keep FSDP2"
                )

        # ---- Muon groups: one per (matrix shape, dtype, device) ----
        buckets: dict[tuple, list[tuple[Route, Tensor]]] = {}
        for r, p in muon:
            buckets.setdefault((r.matrix, p.dtype, str(p.device)), []).append((r, p))
        groups: list[dict] = []
        for (mat, _dt, _dev), members in buckets.items():
            groups.append({
                "params": [p for _, p in members],
                "names": [r.name for r, _ in members],
                "kind": "muon",
                "lr": lr,
                "base_lr": lr,
                "weight_decay": wd,
                "momentum": momentum,
                "nesterov": muon_variant == "nesterov",
                "ns_steps": ns_steps,
                "ns_kind": ns_kind,
                "ns_dtype": ns_dtype,
                "muon_sf": muon_sf,
                "matrix": mat,
            })  # fmt: skip

        # ---- AdamW groups ----
        adam_specs = (
            ("adamw", lambda r: r.owner == "adamw" and r.decay, lr, wd),
            ("adamw_nodecay", lambda r: r.owner == "adamw" and not r.decay, lr, 0.0),
        )
        adam_groups = []
        for kind, pick, glr, gwd in adam_specs:
            sel = [(r, p) for r, p in named if pick(r)]
            if sel:
                adam_groups.append({
                    "params": [p for _, p in sel], "names": [r.name for r, _ in sel],
                    "kind": kind, "lr": glr, "base_lr": glr, "weight_decay": gwd,
                })  # fmt: skip
        self.adamw = self._make_adamw(adam_groups, lr, tuple(adam_betas)) if adam_groups else None
        self._adamw_flags = (
            {k: v for k, v in self.adamw.param_groups[0].items() if k in ("fused", "foreach")}
            if self.adamw is not None else {}
        )  # fmt: skip

        # ---- the Engram group: VRAM tables (parameters) and host stores (not) ----
        vram = [(r, p) for r, p in named if r.owner == "engram"]
        self._host: list[tuple[str, HostTables]] = [
            (strip_name(n) + ".table", m) for n, m in model.named_modules()
            if isinstance(m, HostTables)
        ]  # fmt: skip
        engram = []
        if vram or self._host:
            glr = lr * engram_lr_mult
            engram = [{
                "params": [p for _, p in vram],
                "names": [r.name for r, _ in vram] + [n for n, _ in self._host],
                "kind": "engram", "lr": glr, "base_lr": glr, "weight_decay": 0.0,
                "betas": tuple(adam_betas), "eps": ENGRAM_EPS,
            }]  # fmt: skip

        self._muon_groups = groups
        all_groups = groups + (self.adamw.param_groups if self.adamw is not None else []) + engram
        if not all_groups:
            raise ConfigError("the model has no parameters to optimise")
        super().__init__(all_groups, {"lr": lr})
        self._sealed = True  # Optimizer.__init__ used add_param_group; nobody else may
        self._engram_group = self.param_groups[-1] if engram else None
        self._build_muon_state()
        self._build_engram_state()

    # ---- construction helpers ----

    def _make_adamw(self, groups: list[dict], lr: float, betas: tuple[float, float]):
        params = [p for g in groups for p in g["params"]]
        if self.optim_8bit:
            try:
                import bitsandbytes as bnb
            except ImportError as e:
                raise ConfigError(
                    f"optim_8bit=true needs bitsandbytes, which does not import here ({e}); "
                    f"install it with `pip install bitsandbytes` (CUDA only) or run with "
                    f"--set optim_8bit=false"
                ) from None
            off = sorted({p.device.type for p in params if p.device.type != "cuda"})
            if off:
                raise ConfigError(
                    f"optim_8bit=true: bitsandbytes' AdamW8bit (package bitsandbytes) steps "
                    f"CUDA tensors only, but AdamW parameters live on {off}; run on a CUDA "
                    f"device or use --set optim_8bit=false"
                )
            return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas)
        all_cuda = all(p.device.type == "cuda" for p in params)
        # fused on CUDA (one kernel for all; FSDP2's DTensor shards too: AdamW is elementwise,
        # and one process and a sharded fleet then run the same arithmetic, which gate g12
        # measured apart by 10x its round-off spread with foreach on the fleet, on an H200);
        # foreach on the CPU.
        if all_cuda:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)

    def _build_muon_state(self) -> None:
        self.muon_state: list[dict] = []
        for g in self._muon_groups:
            R, C = g["matrix"]
            counts = [p.numel() // (R * C) for p in g["params"]]
            starts = [sum(counts[:i]) for i in range(len(counts))]
            p0 = g["params"][0]
            buf = torch.zeros((sum(counts), R, C), dtype=self.muon_state_dtype, device=p0.device)
            self.muon_state.append({"step": 0, "momentum_buffer": buf,
                                    "counts": counts, "starts": starts})  # fmt: skip

    def _build_engram_state(self) -> None:
        """Row-sparse Adam state of each VRAM table, shaped like its local data (an FSDP2
        shard holds its own rows' state)."""
        self.engram_state: dict[str, dict[str, Tensor]] = {}
        g = self._engram_group
        if g is None:
            return
        for name, p in zip(g["names"], g["params"]):  # the VRAM names come first
            local = _local(p)
            self.engram_state[name] = {
                "step": torch.zeros(local.shape[:-1], dtype=torch.int32, device=local.device),
                "exp_avg": torch.zeros_like(local, memory_format=torch.contiguous_format),
                "exp_avg_sq": torch.zeros_like(local, memory_format=torch.contiguous_format),
            }

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_sealed", False):
            raise NotImplementedError(
                "MixOptimizer routes parameters itself; build a new one from the model instead"
            )
        super().add_param_group(param_group)

    # ---- public surface ----

    @classmethod
    def from_config(cls, model: nn.Module, train_cfg, device_type: str,
                    log: Callable[[str], None] | None = None) -> MixOptimizer:  # fmt: skip
        """Build from a TrainConfig; ns_dtype="auto" -> bf16 on cuda, fp32 elsewhere (logged)."""
        say = log or logger.info
        t = train_cfg
        ns_dtype = _resolve_ns_dtype(t.ns_dtype, device_type, say) if t.opt == "mix" else (
            "fp32" if t.ns_dtype == "auto" else t.ns_dtype)
        return cls(
            model, lr=t.lr, wd=t.wd, opt=t.opt, ns_steps=t.ns_steps, ns_kind=t.ns_kind,
            ns_dtype=ns_dtype, muon_state_dtype=t.muon_state_dtype, muon_variant=t.muon_variant,
            muon_sf=t.muon_sf, momentum=t.muon_momentum, adam_betas=tuple(t.adam_betas),
            engram_lr_mult=t.engram_lr_mult, optim_8bit=t.optim_8bit, log=log,
        )  # fmt: skip

    def set_lr_factor(self, factor: float) -> None:
        """group["lr"] = group["base_lr"] * factor on every group (the loop's schedule)."""
        for g in self.param_groups:
            g["lr"] = g["base_lr"] * factor

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, st in zip(self._muon_groups, self.muon_state, strict=True):
            self._muon_step(g, st)
        if self.adamw is not None:
            self.adamw.step()
        if self._engram_group is not None:
            self._engram_step(self._engram_group)
        return loss

    def _engram_step(self, g: dict) -> None:
        hyper = (g["lr"], tuple(g["betas"]), g["eps"])
        for name, p in zip(g["names"], g["params"]):
            if p.grad is None:
                continue
            local, st = _local(p), self.engram_state[name]
            dim = local.shape[-1]
            grad = _local(p.grad).reshape(-1, dim)
            rows = touched_rows(grad)
            if rows.numel():
                row_adam_(local.view(-1, dim), st["exp_avg"].view(-1, dim),
                          st["exp_avg_sq"].view(-1, dim), st["step"].view(-1),
                          rows, grad.index_select(0, rows), *hyper)  # fmt: skip
        for _, store in self._host:
            store.step(*hyper)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad over every group, and the end of the host stores' cycle."""
        super().zero_grad(set_to_none)
        for _, store in self._host:
            store.zero_grad()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """torch.nn.utils.clip_grad_norm_ (2-norm) over every gradient this optimizer steps,
        host-table rows included; returns the total norm, as torch does.

        The loop should clip through this rather than over model.parameters(): that list
        misses the host rows, and even with them the two stores would sum the table's
        squares differently (a dense table gradient with its zero rows against a compact
        one), so a clip that fires would round differently and the runs drift apart. Here
        every Engram table enters the norm as its touched rows, summed per row, in
        ascending order: the same numbers in the same order in both stores. Everything
        else (all other gradients, the clip coefficient, the scaling) is torch's own code.
        An FSDP2-sharded table enters whole (its gradient is a DTensor; the norm must be
        the fleet's), as it would in torch's clip.
        """
        eg = self._engram_group
        tables = {id(p) for p in eg["params"]} if eg is not None else set()
        owners = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm_of = [p.grad for p in owners if id(p) not in tables]
        for p in owners:
            if id(p) in tables:
                if _is_dtensor(p.grad):
                    norm_of.append(p.grad)
                else:
                    flat = p.grad.reshape(-1, p.shape[-1])
                    norm_of.append(flat.index_select(0, touched_rows(flat)))
        for _, store in self._host:
            holder = store.consolidate()
            if holder is not None:
                owners.append(holder)
                norm_of.append(holder.grad)
        total = torch.nn.utils.get_total_norm(norm_of, 2.0)
        torch.nn.utils.clip_grads_with_norm_(owners, max_norm, total)
        return total

    def _muon_step(self, g: dict, st: dict) -> None:
        params = g["params"]
        have = [i for i, p in enumerate(params) if p.grad is not None]
        if not have:
            return
        R, C = g["matrix"]
        mu = g["momentum"]
        buf: Tensor = st["momentum_buffer"]
        grads = [params[i].grad.reshape(-1, R, C) for i in have]
        G = (torch.cat(grads) if len(grads) > 1 else grads[0]).to(torch.float32)
        if len(have) == len(params):
            idx = None
            M = buf if buf.dtype == torch.float32 else buf.float()  # fp32 state: in place
        else:
            # Only the slots of parameters that have a gradient take part; the others'
            # momentum is neither decayed nor touched.
            idx = torch.cat([
                torch.arange(st["starts"][i], st["starts"][i] + st["counts"][i])
                for i in have
            ]).to(buf.device)  # fmt: skip
            M = buf.index_select(0, idx).float()
        M.mul_(mu).add_(G)
        U = G.add(M, alpha=mu) if g["nesterov"] else M
        if idx is not None:
            buf.index_copy_(0, idx, M.to(buf.dtype))
        elif M is not buf:
            buf.copy_(M)
        O = newton_schulz(U, g["ns_steps"], g["ns_kind"], _DTYPES[g["ns_dtype"]])
        lr, wd = g["lr"], g["weight_decay"]
        views = [params[i].view(-1, R, C) for i in have]
        if wd:
            torch._foreach_mul_(views, 1.0 - lr * wd)
        O = O.to(views[0].dtype).split([st["counts"][i] for i in have])
        torch._foreach_add_(views, list(O), alpha=-lr * muon_scale(g["muon_sf"], R, C))
        st["step"] += 1

    def state_dict(self) -> dict:
        """Everything a bit-exact resume needs.

        The tensors are the live ones, as in torch: torch.save it (or deepcopy it) before
        stepping again if it must stay a snapshot.
        """
        muon = []
        for g, st in zip(self._muon_groups, self.muon_state, strict=True):
            hyper = {k: v for k, v in g.items() if k != "params"}
            muon.append({**hyper, "step": st["step"], "momentum_buffer": st["momentum_buffer"]})
        return {
            "format": _FORMAT,
            "opt": self.opt,
            "optim_8bit": self.optim_8bit,
            "muon": muon,
            "adamw": self.adamw.state_dict() if self.adamw is not None else None,
            "adamw_names": [g["names"] for g in self.adamw.param_groups] if self.adamw else [],
            "engram": self._engram_state_dict(),
        }

    def _engram_state_dict(self) -> dict | None:
        g = self._engram_group
        if g is None:
            return None
        state = {}
        for name, p in zip(g["names"], g["params"]):
            st = self.engram_state[name]
            # An FSDP2 table's state is its shard's: hand it out as a DTensor like the
            # parameter, so the fleet's state gathering sees the whole table.
            state[name] = {k: _like_param(v, p) for k, v in st.items()}
        for name, store in self._host:
            state[name] = dict(store.adam_state())
        hyper = {k: v for k, v in g.items() if k != "params"}
        return {**hyper, "state": state}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state saved by state_dict(); refuse one saved for another routing.

        As in torch, the saved group hyperparameters (lr, base_lr, wd, ...) win over the
        constructor's; the loop's next set_lr_factor recomputes lr from base_lr.
        """
        sd = state_dict
        if not isinstance(sd, dict) or sd.get("format") != _FORMAT:
            raise ConfigError(
                f"optimizer state has format {sd.get('format') if isinstance(sd, dict) else sd!r}"
                f", expected {_FORMAT!r}: the checkpoint was written by another optimizer"
            )
        if sd["opt"] != self.opt or bool(sd["optim_8bit"]) != self.optim_8bit:
            raise ConfigError(
                f"optimizer state is for opt={sd['opt']} optim_8bit={sd['optim_8bit']}, this run "
                f"has opt={self.opt} optim_8bit={self.optim_8bit}; resume with the same --set "
                f"opt/optim_8bit or start fresh"
            )
        mine = [g["names"] for g in self._muon_groups]
        theirs = [m["names"] for m in sd["muon"]]
        a_mine = [g["names"] for g in self.adamw.param_groups] if self.adamw else []
        e_mine = [self._engram_group["names"]] if self._engram_group is not None else []
        e_theirs = [sd["engram"]["names"]] if sd.get("engram") is not None else []
        if mine != theirs or a_mine != sd["adamw_names"] or e_mine != e_theirs:
            diff = _first_difference(mine + a_mine + e_mine, theirs + sd["adamw_names"] + e_theirs)
            raise ConfigError(
                f"optimizer state does not match this model's routing ({diff}); the checkpoint "
                f"is from a different model shape or dormouse version"
            )
        for g, st, saved in zip(self._muon_groups, self.muon_state, sd["muon"], strict=True):
            sbuf = saved["momentum_buffer"]
            if tuple(sbuf.shape) != tuple(st["momentum_buffer"].shape):
                raise ConfigError(
                    f"Muon momentum for {g['names'][0]}...: saved shape {tuple(sbuf.shape)}, "
                    f"this model needs {tuple(st['momentum_buffer'].shape)}"
                )
            if sbuf.dtype != st["momentum_buffer"].dtype:
                mine_dt = st["momentum_buffer"].dtype
                logger.info(f"Muon momentum saved as {sbuf.dtype}, kept as {mine_dt} "
                            f"(muon_state_dtype): converted on load")  # fmt: skip
            st["momentum_buffer"].copy_(sbuf)  # a copy: the caller's dict stays untouched
            st["step"] = int(saved["step"])
            for k, v in saved.items():
                if k not in ("params", "names", "step", "momentum_buffer", "matrix"):
                    g[k] = v
        if self.adamw is not None:
            # As torch does, AdamW may adopt the given moment tensors without a copy (a copy
            # of b1's Engram moments would be GBs): do not step a run from the same dict twice.
            self.adamw.load_state_dict(sd["adamw"])
            # torch replaces its group dicts on load: re-share them, and keep this machine's
            # kernel choice (fused/foreach), which is a property of the device, not the run.
            for ag in self.adamw.param_groups:
                ag.update(self._adamw_flags)
            if self._adamw_flags.get("fused"):
                # A state saved by a foreach AdamW (a CPU or an FSDP2 run) keeps its step
                # counters on the CPU, and torch moves them only for a group that was fused
                # when saved; the fused kernel wants them as fp32 beside the parameters (a GPU
                # resume of an FSDP2 checkpoint crashed here, measured on an H200).
                for p, st in self.adamw.state.items():
                    step = st.get("step")
                    if torch.is_tensor(step) and step.device != p.device:
                        st["step"] = step.to(device=p.device, dtype=torch.float32)
            n = len(self._muon_groups)
            self.param_groups[n:n + len(self.adamw.param_groups)] = self.adamw.param_groups
        if self._engram_group is not None:
            self._load_engram_state(sd["engram"])

    def _load_engram_state(self, saved: dict) -> None:
        g = self._engram_group
        for name, p in zip(g["names"], g["params"]):
            for k, t in self.engram_state[name].items():
                src = saved["state"][name][k]
                if tuple(src.shape) != tuple(p.shape[: t.dim()]):
                    raise ConfigError(
                        f"Engram Adam state {k!r} of {name}: saved shape {tuple(src.shape)}, "
                        f"this model needs {tuple(p.shape[: t.dim()])}"
                    )
                t.copy_(_shard_like(src, p, t))  # a copy: the caller's dict stays untouched
        for name, store in self._host:
            try:
                store.load_adam_state(saved["state"][name])
            except ValueError as e:
                raise ConfigError(str(e)) from None
        for k, v in saved.items():
            if k not in ("params", "names", "state"):
                g[k] = v


def _first_difference(a: list[list[str]], b: list[list[str]]) -> str:
    fa = [n for grp in a for n in grp]
    fb = [n for grp in b for n in grp]
    for i, (x, y) in enumerate(zip(fa, fb)):
        if x != y:
            return f"parameter #{i}: this model has {x!r}, the state has {y!r}"
    if len(fa) != len(fb):
        return f"this model routes {len(fa)} parameters, the state {len(fb)}"
    return "the same parameters are grouped differently"


# ---- python -m dormouse.train.optim PRESET : the routing table -------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="print the optimizer routing of a preset model")
    ap.add_argument("preset")
    ap.add_argument("--opt", default="mix", choices=("mix", "adamw"))
    args = ap.parse_args(argv)
    from ..config import preset
    from ..model import DormouseModel

    with torch.device("meta"):
        model = DormouseModel(preset(args.preset).model)
    print(format_routes(route_params(model, args.opt)))


if __name__ == "__main__":
    main()
