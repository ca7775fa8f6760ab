"""SHA-256 over every parameter of a model, in name order: the "ranks are identical" instrument.

Two models have the same fingerprint iff every parameter has the same name, dtype, shape and
bytes. Wrapper prefixes (DDP's `module.`, torch.compile's `_orig_mod.`) are dropped from the
names, so a wrapped fleet model and its single-process twin are comparable. FSDP2's DTensors
are gathered with `full_tensor()`, which is a COLLECTIVE: on a fleet every rank must call
these functions at the same point, in the same order.
"""

from __future__ import annotations

import hashlib

import torch

_PREFIXES = ("module.", "_orig_mod.")


def _clean(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p) :], True
    return name


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "full_tensor"):  # a DTensor (FSDP2 shard): gather the whole tensor
        t = t.full_tensor()
    return t.to("cpu").contiguous()


def _plain_sorted(named) -> dict[str, torch.Tensor]:
    named = sorted(((_clean(n), t) for n, t in named), key=lambda kv: kv[0])
    return {n: _plain(t).clone() for n, t in named}


def plain_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: full CPU copy} for every parameter, sorted by name."""
    return _plain_sorted(model.named_parameters())


def fingerprint_params(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 hex digest of every parameter (name, dtype, shape, bytes) in name order."""
    return fingerprint_params(plain_params(model))
