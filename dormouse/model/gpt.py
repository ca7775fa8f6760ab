"""The plain-GPT baseline: the alternative a user would otherwise pick, trained by the same loop.

A standard pre-norm causal transformer (GPT-2's shape: learned token and position embeddings,
LayerNorm, multi-head causal self-attention through `scaled_dot_product_attention`, a GELU
MLP, the head tied to the token embedding). It shares everything else with dormouse's own
model: the data path, the loop, the optimizer routing (Muon for its matrices, AdamW for the
embeddings and gains), checkpoints, eval, sample and the benchmarks, so any corpus can be run
with both and compared curve against curve (`dormouse compare`). Dropout sits on the
embedding and on each residual branch's output, keyed like dormouse's (layers.KeyedDropout).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .layers import at_least_fp32, dropout_for


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_attn, bias=False)
        self.proj = nn.Linear(cfg.d_attn, cfg.d_model, bias=False)

    def forward(self, h: torch.Tensor, kv: dict | None = None) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        past = 0
        if kv is not None:  # decoding: append to this layer's keys and values
            if "k" in kv:
                past = kv["k"].shape[2]
                k, v = torch.cat([kv["k"], k], 2), torch.cat([kv["v"], v], 2)
            kv["k"], kv["v"] = k, v
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif t == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:  # new bytes after a prefix: each sees the prefix and the new bytes before it
            mask = torch.ones(t, past + t, dtype=torch.bool, device=h.device).tril(past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ffn, bias=False)
        self.out = nn.Linear(cfg.d_ffn, cfg.d_model, bias=False)

    def forward(self, h, drop=None, site: int = 0, kv: dict | None = None):
        a = self.attn(self.ln1(h), kv)
        h = h + (a if drop is None else drop(a, site))
        f = self.out(F.gelu(self.fc(self.ln2(h))))
        return h + (f if drop is None else drop(f, site + 1))


class GPT(nn.Module):
    """forward and step as DormouseModel has them, so the trainer takes either (it has no
    router, so no lfb_update: the step balances only a model that has one)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.norm_f = nn.LayerNorm(cfg.d_model)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # GPT-2: residual projections scaled by 1/sqrt(2 * layers)
                scale = (
                    math.sqrt(2 * cfg.n_layers)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 1.0
                )
                nn.init.normal_(p, std=cfg.init_std / scale)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm_f(h), self.embed.weight.to(h.dtype))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None,
                keys: torch.Tensor | None = None):  # fmt: skip
        """x, y: int64 [B, T] bytes -> (logits [B,T,256], mean CE loss or None, aux)."""
        t = x.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"GPT: a window of {t} bytes exceeds max_seq_len="
                             f"{self.cfg.max_seq_len} (its position table)")  # fmt: skip
        drop = dropout_for(self.training, self.cfg.dropout, keys, x.shape[0], x.device)
        h = self.embed(x) + self.pos(torch.arange(t, device=x.device))
        if drop is not None:
            h = drop(h, 0)
        for i, block in enumerate(self.blocks):
            h = block(h, drop, 2 + 2 * i)
        logits = self._logits(h)
        loss = None
        if y is not None:
            loss = F.cross_entropy(at_least_fp32(logits).reshape(-1, logits.size(-1)),
                                   y.reshape(-1))  # fmt: skip
        return logits, loss, {"load": None, "dropped": 0}

    # ---- decoding with a key/value cache ------------------------------------------------
    def init_cache(self, row_len: int | None = None) -> dict:
        return {"kv": [{} for _ in self.blocks], "bytes": None}

    @torch.no_grad()
    def step(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        """Feed bytes x [B, t] after what the cache has seen; return the last logits. Past
        max_seq_len bytes the window slides: the cache is rebuilt from the last half."""
        seen = cache["bytes"]
        allx = x if seen is None else torch.cat([seen, x], 1)
        limit = self.cfg.max_seq_len
        if allx.shape[1] > limit:
            allx = allx[:, -min(limit, max(limit // 2, x.shape[1])) :]
            cache["kv"] = [{} for _ in self.blocks]
            x, past = allx, 0
        else:
            past = 0 if seen is None else seen.shape[1]
        cache["bytes"] = allx
        t = x.shape[1]
        h = self.embed(x) + self.pos(torch.arange(past, past + t, device=x.device))
        for block, kv in zip(self.blocks, cache["kv"]):
            h = block(h, kv=kv)
        return self._logits(h)[:, -1]


# ---- the baseline at equal total parameters ------------------------------------------

#: How far a derived twin's count may sit from the target before the aspect rule gives way to
#: the nearest count: `small`'s twin, gpt-small (384 x 5), is 2.0% under small's 9.34M.
TWIN_TOLERANCE = 0.03
#: GPT-2 small's width per layer (768 / 12), the aspect the twin is steered towards.
TWIN_ASPECT = 64


def gpt_params(d_model: int, n_layers: int, d_ffn: int, d_attn: int, max_seq_len: int,
               vocab: int = 256) -> int:  # fmt: skip
    """Parameters of GPT(cfg) from its shape: token and position tables (the head is tied),
    per layer qkv + proj + the MLP's two matrices + two LayerNorms (gain and bias), and the
    final LayerNorm."""
    layer = 3 * d_model * d_attn + d_attn * d_model + 2 * d_model * d_ffn + 4 * d_model
    return (vocab + max_seq_len) * d_model + n_layers * layer + 2 * d_model


def gpt_twin(cfg: ModelConfig, total: int) -> ModelConfig:
    """The plain GPT of about `total` parameters for a model of `cfg` (the baseline at equal
    total parameters): heads of 64, an MLP of 4 x d_model, cfg's vocab, max_seq_len, init_std
    and dropout. d_model runs over multiples of 64 with the n_layers nearest the count; among
    shapes within TWIN_TOLERANCE of `total` the one nearest GPT-2's aspect (d_model / n_layers
    = 64) wins, else the nearest count. gpt-small is what this gives for `small`."""
    shapes = []
    for d in range(64, 8192 + 1, 64):
        per_layer = gpt_params(d, 1, 4 * d, d, cfg.max_seq_len, cfg.vocab) - \
            gpt_params(d, 0, 4 * d, d, cfg.max_seq_len, cfg.vocab)  # fmt: skip
        fixed = gpt_params(d, 0, 4 * d, d, cfg.max_seq_len, cfg.vocab)
        n = max(1, round((total - fixed) / per_layer))
        off = abs(fixed + n * per_layer - total) / total
        shapes.append((off, abs(math.log(d / n / TWIN_ASPECT)), d, n))
    close = [s for s in shapes if s[0] <= TWIN_TOLERANCE]
    _, _, d, n = min(close, key=lambda s: s[1]) if close else min(shapes)
    return ModelConfig(arch="gpt", vocab=cfg.vocab, d_model=d, n_layers=n, n_heads=d // 64,
                       head_dim=64, d_ffn=4 * d, max_seq_len=cfg.max_seq_len,
                       init_std=cfg.init_std, dropout=cfg.dropout)  # fmt: skip
