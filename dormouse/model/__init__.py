"""The network. Nothing in this package imports torch.distributed."""

from __future__ import annotations

__all__ = ["Block", "DormouseModel", "count_params", "make_model"]


def make_model(cfg):
    """The network `cfg.arch` names: DormouseModel, or the plain-GPT baseline (model/gpt.py)."""
    if cfg.arch == "gpt":
        from .gpt import GPT

        return GPT(cfg)
    from .model import DormouseModel

    return DormouseModel(cfg)


def active_params(model) -> float:
    """Parameters one token's forward multiplies through, the N of the 6N-FLOPs rule: the
    body's shared weights max_iter times (routed expert stacks at moe_topk/n_experts of
    that), each iteration's low-rank delta once; the embedding and Engram tables are
    lookups, not matmuls. Gains, biases and conv taps stay in (a rounding error). The GPT
    baseline: every block once, the tied embedding counted as the head it also is, the
    position table a lookup."""
    import re

    cfg, total = model.cfg, 0.0
    if cfg.arch == "gpt":  # every block once; the tied embedding is the head's matmul
        return float(sum(p.numel() for name, p in model.named_parameters() if name != "pos.weight"))
    for name, p in model.named_parameters():
        if name == "embed.weight" or name.startswith("engram.store."):
            continue
        if not name.startswith("blocks.") or "_delta." in name:
            total += p.numel()
        else:
            share = cfg.moe_topk / cfg.n_experts if re.search(r"\.moe\.w[123]$", name) else 1
            total += p.numel() * cfg.max_iter * share
    return total


def __getattr__(name):
    # Lazy, so importing one module (say dormouse.model.kda) does not build them all.
    if name in __all__:
        from . import model

        return getattr(model, name)
    raise AttributeError(name)
