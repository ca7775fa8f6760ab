"""Byte generation through the recurrent decode path: constant cost per byte."""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, prompt: bytes, n: int, *, temperature: float = 0.8, top_k: int = 0,
             generator: torch.Generator | None = None) -> bytes:
    """Continue `prompt` by `n` bytes. An empty prompt starts from a newline."""
    device = next(model.parameters()).device
    prompt = prompt or b"\n"
    cache = model.init_cache()
    x = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    logits = model.step(x, cache)  # the whole prompt in one chunked pass
    out = bytearray()
    for _ in range(n):
        logits = logits.float()
        if temperature <= 0:
            nxt = int(logits.argmax(-1))
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1, None]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, -1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        logits = model.step(torch.tensor([[nxt]], dtype=torch.long, device=device), cache)
    return bytes(out)
