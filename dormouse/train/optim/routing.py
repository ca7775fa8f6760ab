"""Parameter routing: which optimizer owns each parameter of a model, and why.

`route_params` reads names and shapes only, so it works on a meta-device model (the `--fit`
planner and `dormouse plan --routes` call it there); MixOptimizer builds its groups from it.
`strip_name` is the one rule for a parameter's canonical name under DDP / torch.compile /
checkpoint wrappers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from ...config import ConfigError

_WRAPPER_TOKENS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


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
    parts = [p for p in name.split(".") if p not in _WRAPPER_TOKENS]
    # after the tokens: torch.compile(DDP(model)) names a parameter _orig_mod.module.NAME
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _classify(name: str, shape: tuple[int, ...], kind: str) -> tuple[str, str, bool]:
    """(owner, reason, decay) for one parameter under opt=mix; kind is its module's type."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("store.table"):
        return (
            "engram",
            "Engram table: row-sparse Adam (only rows with a gradient move), "
            "lr x engram_lr_mult, no weight decay",
            False,
        )
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
        kind = (
            "embedding"
            if isinstance(m, nn.Embedding)
            else "conv"
            if isinstance(m, nn.modules.conv._ConvNd)
            else None
        )
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
        lines.append(
            f"{r.name:<{w}}  {shape:<18} {r.owner:<6} {'yes' if r.decay else 'no':<3} {r.reason}"
        )
    lines.append("")
    total_n = sum(r.numel for r in routes)
    lines.append(f"{'owner':<8} {'tensors':>8} {'params':>14} {'share':>7}")
    for owner in ("muon", "adamw", "engram"):
        sel = [r for r in routes if r.owner == owner]
        n = sum(r.numel for r in sel)
        lines.append(f"{owner:<8} {len(sel):>8} {n:>14,} {100 * n / max(1, total_n):>6.1f}%")
    lines.append(f"{'total':<8} {len(routes):>8} {total_n:>14,} {100.0:>6.1f}%")
    return "\n".join(lines)
