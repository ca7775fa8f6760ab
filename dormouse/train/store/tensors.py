"""What a checkpoint's model tensors must be before they are loaded: dense (strided), of the
model's own dtype, and finite. A tampered or diverged file was loaded as it was: a sparse
`embed.weight` failed deep in eval, int64 weights or NaN ones reached sampling's multinomial,
and a resume of all-NaN weights blamed the learning rate at its first step."""

from __future__ import annotations

import torch

from ..context import local_shard


def tensor_problems(state: dict, mine: dict) -> list[str]:
    """`NAME (what is wrong)` for each tensor in `state` that is not like the model's own
    tensor of that name in `mine` (same keys and shapes, checked before this)."""
    bad = []
    for k, v in state.items():
        want = mine.get(k)
        if not torch.is_tensor(v) or want is None:
            continue
        if v.layout != torch.strided:
            bad.append(
                f"{k} is a {str(v.layout).removeprefix('torch.')} tensor (a model tensor is dense)"
            )
        elif v.dtype != want.dtype:
            bad.append(
                f"{k} is {str(v.dtype).removeprefix('torch.')} (the model's is "
                f"{str(want.dtype).removeprefix('torch.')})"
            )
        elif v.is_floating_point() and not bool(torch.isfinite(local_shard(v)).all()):
            bad.append(f"{k} holds NaN or inf")
    return bad
