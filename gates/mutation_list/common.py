"""What an entry of the mutation list is, and the helpers its bugs share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # the plausible bug, in words
    patches: tuple[tuple[str, Callable[[Any], Any]], ...]  # ("module:Qual.name", make(original))
    gates: tuple[str, ...]  # every one of these must FAIL by verdict
    scope: str = "fleet"  # "fleet", "process" or "source" (see gates/mutations.py)


def prop(fn: Callable[[Any, Any], Any]) -> Callable[[Any], property]:
    """make() for a property: fn(self, original_value) -> mutated value."""
    return lambda orig: property(lambda self: fn(self, orig.fget(self)))


def this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
