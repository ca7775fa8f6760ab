"""The network. Nothing in this package imports torch.distributed."""

from __future__ import annotations

__all__ = ["Block", "DormouseModel", "count_params"]


def __getattr__(name):
    # Lazy, so importing one module (say dormouse.model.kda) does not build them all.
    if name in __all__:
        from . import model

        return getattr(model, name)
    raise AttributeError(name)
