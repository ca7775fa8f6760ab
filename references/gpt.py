"""The plain-GPT baseline (dormouse/model/gpt.py) written again from its docstring, nanoGPT's
shape: a layer 2 reference like references/model.py, reading a GPT's state dict and the
config's numbers, importing nothing of dormouse, fp64 by default:

    h   = E[x] + P[0 .. t-1]                         keyed dropout at site 0
    for block i:                                     s = 2 + 2 i
        h += attn_i(ln1(h))                          site s: causal softmax over u <= t,
                                                     scale 1/sqrt(head_dim), qkv one matrix
        h += W_out gelu(W_fc ln2(h))                 site s + 1 (GELU by erf, no biases)
    logits = ln_f(h) E^T                             the head IS the embedding (tied)

Decoding (`GPT.step`) past max_seq_len bytes slides: when a chunk of t new bytes would make
the stream longer than max_seq_len, the window restarts from the stream's last
min(max_seq_len, max(max_seq_len // 2, t)) bytes at positions 0.. (`decode_windows`), and
grows byte by byte from there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from references.model import dropout

LN_EPS = 1e-5  # nn.LayerNorm's default, nanoGPT's


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + LN_EPS) * w
    return y if b is None else y + b


class ReferenceGPT:
    """The equations with a GPT's parameters (`params`: leaf tensors by the state dict's names)."""

    def __init__(self, cfg, state: dict, dtype: torch.dtype = torch.float64):
        self.cfg, self.dtype = cfg, dtype
        self.params = {n: t.detach().to("cpu", dtype).clone().requires_grad_(True)
                       for n, t in state.items()}  # fmt: skip

    def p(self, name: str) -> torch.Tensor | None:
        return self.params.get(name)

    def attn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        B, T, _ = x.shape
        H, Dh = c.n_heads, c.head_dim
        qkv = (x @ self.p(f"blocks.{i}.attn.qkv.weight").t()).reshape(B, T, 3, H, Dh)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = torch.einsum("bthd,buhd->bhtu", q, k) / math.sqrt(Dh)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        w = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
        o = torch.einsum("bhtu,buhd->bthd", w, v).reshape(B, T, H * Dh)
        return o @ self.p(f"blocks.{i}.attn.proj.weight").t()

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, *, training: bool = False,
                keys: torch.Tensor | None = None):  # fmt: skip
        """x, y int64 [B, T] (T <= max_seq_len) -> (logits, loss)."""
        c = self.cfg
        n = x.shape[1]
        if n > c.max_seq_len:
            raise ValueError(f"a window of {n} > max_seq_len {c.max_seq_len}")
        p = c.dropout if training else 0.0

        def drop(t, site):
            return t if p <= 0 else dropout(t, keys, site, p)

        E = self.p("embed.weight")
        h = drop(E[x] + self.p("pos.weight")[:n], 0)
        for i in range(c.n_layers):
            pre = f"blocks.{i}"
            a = self.attn(i, layer_norm(h, self.p(f"{pre}.ln1.weight"), self.p(f"{pre}.ln1.bias")))
            h = h + drop(a, 2 + 2 * i)
            u = layer_norm(h, self.p(f"{pre}.ln2.weight"), self.p(f"{pre}.ln2.bias"))
            f = F.gelu(u @ self.p(f"{pre}.fc.weight").t()) @ self.p(f"{pre}.out.weight").t()
            h = h + drop(f, 3 + 2 * i)
        logits = layer_norm(h, self.p("norm_f.weight"), self.p("norm_f.bias")) @ E.t()
        loss = None
        if y is not None:
            loss = -torch.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).mean()
        return logits, loss

    @torch.no_grad()
    def decode(self, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
        """The logits of each chunk's last byte when x [B, n] is fed in chunks of these
        lengths: each from a whole forward over its window (decode_windows)."""
        out = [
            self.forward(x[:, a:b])[0][:, -1]
            for a, b in decode_windows(chunks, self.cfg.max_seq_len)
        ]
        return torch.stack(out, 1)


def decode_windows(chunks: list[int], limit: int) -> list[tuple[int, int]]:
    """[start, end) of the window each chunk's last byte is computed over (module docstring)."""
    spans, start, end = [], 0, 0
    for t in chunks:
        end += t
        if end - start > limit:
            start = end - min(limit, max(limit // 2, t))
        spans.append((start, end))
    return spans
