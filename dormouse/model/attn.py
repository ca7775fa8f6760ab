"""Causal softmax attention: the mixer of a hybrid body's attention blocks (`attn_every`).

Owns `AttnMixer`, the drop-in alternative to `KDAMixer` for the blocks `ModelConfig.mixer_of`
names "attn": q, k, v projections (with the same per-iteration low-rank deltas as KDA's, so a
looped body keeps one matrix per role), an RMS norm on each head of q and k (learned gains),
rotary positions (RoPE, base `ROPE_BASE`, the two halves of each head rotated together), causal
`scaled_dot_product_attention` at scale 1/sqrt(head_dim), and the output projection. The body
has no position table (KDA's recurrence and convs know the order); RoPE gives attention its own.

The equations, written again without this file: `references/model.py` (`ReferenceModel.attn`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.config import ModelConfig
from dormouse.model.layers import LowRankDelta, RMSNorm, at_least_fp32, with_deltas

#: RoPE's base: channel pair i turns by position x ROPE_BASE^(-2i / head_dim) radians
ROPE_BASE = 10000.0


def rope(x: torch.Tensor, start: int) -> torch.Tensor:
    """x [B, T, H, Dh] at positions start .. start+T-1 -> x rotated: channels i and i + Dh/2
    of each head turn together by position x base^(-2i/Dh) (fp32 inside, at least)."""
    T, Dh = x.shape[1], x.shape[-1]
    half = Dh // 2
    xf = at_least_fp32(x)
    inv = ROPE_BASE ** (-torch.arange(half, device=x.device, dtype=xf.dtype) * 2 / Dh)
    ang = torch.arange(start, start + T, device=x.device, dtype=xf.dtype)[:, None] * inv
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
           window: int | None = None) -> torch.Tensor:  # fmt: skip
    """Causal attention of q [B, H, T, Dh] over k, v [B, H, past + T, Dh]: the query at key
    index past + t sees the keys at indices <= past + t, and with a `window` only the last
    `window` of them (itself included)."""
    T, n = q.shape[2], k.shape[2]
    if window is None or n <= window:
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if T == 1:
            return F.scaled_dot_product_attention(q, k, v)
    # new bytes after a prefix, or a band: each sees what precedes it, back to the window
    at = torch.arange(past, past + T, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    mask = (j <= at) & (j > at - window) if window is not None else j <= at
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class AttnMixer(nn.Module):
    """The token mixer of an attention block: h [B, T, d_model] -> [B, T, d_model].

    Parameters: q_proj, k_proj, v_proj (d_model -> d_attn), o_proj (d_attn -> d_model), all
    without bias (Muon's matrices); q_norm, k_norm ([head_dim] gains, AdamW); {q,k,v,o}_delta[i]
    per iteration when rank > 0.

    Cache (decoding), as KDAMixer's: one dict per mixer, keyed by iteration;
    cache[iteration] = {"k", "v": [B, n_heads, <= max_seq_len - 1, head_dim] (k rotated at its
    position), "pos": the bytes seen}. Decoding reads back a sliding window of max_seq_len
    bytes: inside it, exactly the training forward; past it, no distance a training window
    never showed RoPE. A byte costs the window's length, where KDA's state costs a constant.
    """

    impl = "sdpa"  # what bench tables print for a mixer's arm

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, H, Dh = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.d_attn = H, Dh, H * Dh
        self.max_iter = cfg.max_iter
        self.window = cfg.max_seq_len
        self.q_proj = nn.Linear(d, self.d_attn, bias=False)
        self.k_proj = nn.Linear(d, self.d_attn, bias=False)
        self.v_proj = nn.Linear(d, self.d_attn, bias=False)
        self.q_norm = RMSNorm(Dh)
        self.k_norm = RMSNorm(Dh)
        self.o_proj = nn.Linear(self.d_attn, d, bias=False)
        for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(m.weight, std=cfg.init_std)
        if cfg.rank > 0:

            def deltas(d_in: int, d_out: int) -> nn.ModuleList:
                return nn.ModuleList(LowRankDelta(d_in, d_out, cfg.rank, std=cfg.init_std)
                                     for _ in range(cfg.max_iter))  # fmt: skip

            self.q_delta = deltas(d, self.d_attn)
            self.k_delta = deltas(d, self.d_attn)
            self.v_delta = deltas(d, self.d_attn)
            self.o_delta = deltas(self.d_attn, d)
        else:
            self.q_delta = self.k_delta = self.v_delta = self.o_delta = None

    def resolve_arm(self, dtype: torch.dtype, device: torch.device | None = None) -> str:
        """KDAMixer's hook, for callers that prepare every mixer alike: one arm, SDPA's
        (torch picks flash, memory-efficient or the math kernel per call)."""
        return self.impl

    def forward(
        self, h: torch.Tensor, iteration: int = 0, cache: dict | None = None
    ) -> tuple[torch.Tensor, dict | None]:
        if not 0 <= iteration < self.max_iter:
            raise ValueError(f"iteration={iteration} is outside 0..{self.max_iter - 1}: this "
                             f"mixer was built for max_iter={self.max_iter}")  # fmt: skip
        B, T, _ = h.shape
        H, Dh = self.n_heads, self.head_dim
        if T == 0:
            return h.new_zeros(h.shape), cache
        deltas = None
        if self.q_delta is not None:  # folded into the weights (layers.with_deltas)
            deltas = [getattr(self, f"{n}_delta")[iteration] for n in ("q", "k", "v")]
        w = with_deltas([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], deltas)
        qkv = F.linear(h, w)
        q, k, v = qkv.view(B, T, 3, H, Dh).unbind(dim=2)
        past_kv = None if cache is None else cache.get(iteration)
        pos = 0 if past_kv is None else past_kv["pos"]  # the bytes this stream has seen
        q = rope(self.q_norm(q), pos).transpose(1, 2)
        k = rope(self.k_norm(k), pos).transpose(1, 2)
        v = v.transpose(1, 2)
        past = 0
        if past_kv is not None:
            past = past_kv["k"].shape[2]
            k = torch.cat([past_kv["k"], k], dim=2)
            v = torch.cat([past_kv["v"], v], dim=2)
        # decoding reads back at most max_seq_len bytes, the farthest a training window sees
        window = None if cache is None else self.window
        o = attend(q, k, v, past, window).transpose(1, 2).reshape(B, T, self.d_attn)
        out = F.linear(o, with_deltas([self.o_proj.weight], None if self.o_delta is None
                                      else [self.o_delta[iteration]]))  # fmt: skip
        if cache is None:
            return out, None
        keep = self.window - 1  # what the next byte can still see besides itself
        cache[iteration] = {"k": k[:, :, -keep:].detach() if keep else k[:, :, :0].detach(),
                            "v": v[:, :, -keep:].detach() if keep else v[:, :, :0].detach(),
                            "pos": pos + T}  # fmt: skip
        return out, cache
