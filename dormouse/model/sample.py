"""Byte generation through the recurrent decode path: constant cost per byte."""

from __future__ import annotations

import math

import torch

from ..errors import UserError


class SampleError(UserError, ValueError):
    """Sampling arguments that mean nothing (a negative length, a NaN temperature)."""


#: The longest sample: decoding runs one forward a byte, and the bytes are held until the
#: end (`sample tiny --bytes 2000` took 26 s on the 2-core CPU box, so 1 MiB is hours there;
#: --bytes 10^9 ran with no output until killed).
MAX_SAMPLE_BYTES = 1 << 20


def check_sample_args(n: int, temperature: float, top_k: int, seed: int = 0) -> None:
    """Refuse arguments that would be silently reinterpreted; temperature 0 means greedy."""
    if n < 0:
        raise SampleError(f"--bytes {n}: cannot generate a negative number of bytes; give N >= 0")
    if n > MAX_SAMPLE_BYTES:
        raise SampleError(f"--bytes {n}: a sample is at most {MAX_SAMPLE_BYTES} bytes (1 MiB; "
                          f"decoding runs one forward a byte); ask for fewer (for a longer "
                          f"text, sample again with its end as --prompt)")  # fmt: skip
    if not math.isfinite(temperature) or temperature < 0:
        raise SampleError(
            f"--temperature {temperature}: must be a finite number >= 0 (0 = greedy, always the "
            f"most likely byte; 0.8 is the default)"
        )
    if not 0 <= seed < 2**64:
        raise SampleError(
            f"--seed {seed}: a seed is an integer from 0 to 2^64-1 (the "
            f"generator's range); give one in it"
        )
    if top_k < 0:
        raise SampleError(f"--top-k {top_k}: must be >= 0 (0 = no top-k cut, K = keep the K most "
                          f"likely bytes)")  # fmt: skip


@torch.no_grad()
def generate(
    model,
    prompt: bytes,
    n: int,
    *,
    temperature: float = 0.8,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    row_len: int | None = None,
) -> bytes:
    """Continue `prompt` by `n` bytes. An empty prompt starts from a newline. `row_len`: the
    training window length, so a capacity MoE drops in decoding what it dropped in training
    (default: the model's max_seq_len)."""
    check_sample_args(n, temperature, top_k)
    device = next(model.parameters()).device
    prompt = prompt or b"\n"
    cache = model.init_cache(row_len)
    x = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    logits = model.step(x, cache)  # the whole prompt in one chunked pass
    out = bytearray()
    for _ in range(n):
        if not bool(torch.isfinite(logits).all()):
            # finite weights can still overflow (scaled by 1e30): multinomial's traceback
            w, name = largest_weight(model)
            raise SampleError(
                f"the model's output is not finite after {len(prompt) + len(out)} bytes (its "
                f"largest weight is {w:.3g}, in {name}): the checkpoint was altered or its run "
                f"diverged; sample another checkpoint (best.pt, an earlier one)"
            )
        nxt = int(sample_next(logits, temperature, top_k, generator))
        out.append(nxt)
        logits = model.step(torch.tensor([[nxt]], dtype=torch.long, device=device), cache)
    return bytes(out)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One byte per row of logits [..., 256]: a draw from softmax(logits / temperature) over
    the top_k largest logits (0: all), or the argmax at temperature 0. Returns [...] int64 on
    the CPU. Gate 32 holds the draws to that distribution (a chi-square test)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1).cpu()
    # shifted by the max first, so a tiny temperature (1e-45) gives 0 and -inf, never
    # inf - inf = NaN: the draw tends to the argmax, as the temperature does
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1).cpu()
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def largest_weight(model: torch.nn.Module) -> tuple[float, str]:
    """(the largest |w| over the model's parameters, its tensor's name): what a refusal says
    when a finite model's output still overflows (weights scaled by 1e30)."""
    best, name = 0.0, ""
    for n, p in model.named_parameters():
        m = float(p.detach().abs().max()) if p.numel() else 0.0
        if m > best:
            best, name = m, n
    return best, name
