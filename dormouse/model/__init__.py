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


def __getattr__(name):
    # Lazy, so importing one module (say dormouse.model.kda) does not build them all.
    if name in __all__:
        from . import model

        return getattr(model, name)
    raise AttributeError(name)
