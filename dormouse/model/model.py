"""DormouseModel: byte embedding -> Engram -> looped body of blocks -> norm -> head.

A block is a KDA mixer (or softmax attention: `attn_every`, model/attn.py) and an MoE FFN.

Owns the assembly of the network and its two entry points: `forward` (training and
evaluation over whole windows) and `step` (recurrent decoding, one byte at a time,
carrying every module's state in a cache). Parallelism is applied from outside
(`dormouse/train/fleet/parallelize.py`); nothing here imports torch.distributed.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .attn import AttnMixer
from .engram import Engram
from .kda import KDAMixer
from .layers import RMSNorm, at_least_fp32, dropout_for
from .moe import MoE


class Block(nn.Module):
    """Pre-norm mixer (KDA, or attention where `cfg.mixer_of(layer)` says) + pre-norm MoE FFN,
    a residual around each."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model)
        self.mixer = AttnMixer(cfg) if cfg.mixer_of(layer) == "attn" else KDAMixer(cfg)
        self.norm2 = RMSNorm(cfg.d_model)
        self.moe = MoE(cfg)

    def forward(self, h, iteration: int, cache=None, moe_cache=None, drop=None, site: int = 0):
        """`drop` (training only): the keyed dropout on each residual branch's output, at
        sites `site` (mixer) and `site + 1` (FFN)."""
        a, cache = self.mixer(self.norm1(h), iteration=iteration, cache=cache)
        h = h + (a if drop is None else drop(a, site))
        f, aux = self.moe(self.norm2(h), key=iteration, cache=moe_cache)
        return h + (f if drop is None else drop(f, site + 1)), cache, aux


class _QuantizedSaves(torch.autograd.graph.saved_tensors_hooks):
    """Keep floating saved tensors in bf16 (half the memory, approximate by design)."""

    def __init__(self):
        def pack(t):
            if t.is_floating_point() and t.dtype == torch.float32:
                return (t.dtype, t.to(torch.bfloat16))
            return (None, t)

        def unpack(packed):
            dtype, t = packed
            return t if dtype is None else t.to(dtype)

        super().__init__(pack, unpack)


class DormouseModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.engram = Engram(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        # A small head keeps the initial loss near ln(256) (uniform bytes).
        nn.init.normal_(
            self.head.weight, std=cfg.init_std / math.sqrt(2 * cfg.n_layers * cfg.max_iter)
        )

    # ---- training / evaluation --------------------------------------------------
    def _apply_block(self, block: Block, h, iteration: int, drop=None, site: int = 0):
        if not (self.cfg.act_ckpt and self.training and torch.is_grad_enabled()):
            out, _, aux = block(h, iteration, drop=drop, site=site)
            return out, aux
        ctx = _QuantizedSaves() if self.cfg.act_ckpt_quant else nullcontext()
        with ctx:
            # the keyed dropout recomputes the very same mask in the checkpoint's replay
            out, _, aux = checkpoint(block, h, iteration, None, None, drop, site,
                                     use_reentrant=False)  # fmt: skip
        return out, aux

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None,
                keys: torch.Tensor | None = None):  # fmt: skip
        """x, y: int64 [B, T] bytes. Returns (logits [B,T,256], mean CE loss or None, aux).

        `keys` [B] (layers.row_keys: one per window, from seed, step and global row) key the
        dropout masks while training with dropout > 0, so a fleet draws what one process
        draws; without them (a caller outside the loop) the masks are random."""
        drop = dropout_for(self.training, self.cfg.dropout, keys, x.shape[0], x.device)
        h = self.embed(x)
        if drop is not None:
            h = drop(h, 0)
        h, _ = self.engram(h, x, drop=drop)
        quantized = self.cfg.act_ckpt and self.cfg.act_ckpt_quant and self.training
        for block in self.blocks:  # a fresh routing record per forward (see MoE.route)
            block.moe.replay = {} if quantized else None
        loads, dropped = [], 0
        for it in range(self.cfg.max_iter):
            for li, block in enumerate(self.blocks):
                site = 2 + 2 * (it * len(self.blocks) + li)
                h, aux = self._apply_block(block, h, it, drop, site)
                loads.append(aux["load"])
                dropped = dropped + aux.get("dropped", 0)
        logits = self.head(self.norm_f(h))
        loss = None
        if y is not None:
            loss = F.cross_entropy(
                at_least_fp32(logits).reshape(-1, logits.size(-1)), y.reshape(-1)
            )
        aux = {"load": torch.stack(loads).mean(0) if loads else None, "dropped": dropped}
        return logits, loss, aux

    def lfb_update(self, reduce=None, ok=None) -> None:
        """After each optimizer step: move every MoE's load-balancing bias (no-op when off);
        `ok`: only where that device-side verdict holds (MoE.lfb_update)."""
        for block in self.blocks:
            block.moe.lfb_update(reduce=reduce, ok=ok)

    @torch.no_grad()
    def lfb_discard(self) -> None:
        """After a skipped step: forget the routers' counts of the batch that was dropped."""
        for block in self.blocks:
            block.moe.lfb_counts.zero_()

    # ---- recurrent decoding --------------------------------------------------------
    def init_cache(self, row_len: int | None = None) -> dict:
        """An empty decoding cache. `row_len` (default max_seq_len) is the row length the
        capacity MoE's cap is computed for: `step` then drops exactly what `forward` over a
        row of row_len bytes drops (the cap restarts every row_len bytes after that)."""
        row_len = self.cfg.max_seq_len if row_len is None else int(row_len)
        if row_len < 1:
            raise ValueError(f"init_cache(row_len={row_len}): a row holds at least one byte")
        return {"engram": {}, "mix": {}, "moe": {}, "row_len": row_len}

    @torch.no_grad()
    def step(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        """Feed bytes x [B, t] (t >= 1) after what the cache has seen; return last logits.

        Constant cost per byte: the mixers carry their recurrent state, Engram its
        last bytes and conv tail, each MoE (capacity mode) its per-row per-expert counts,
        so nothing is recomputed over the prefix.
        """
        h = self.embed(x)
        h, cache["engram"] = self.engram(h, x, cache=cache["engram"])
        moe = cache.setdefault("moe", {})
        row_len = cache.setdefault("row_len", self.cfg.max_seq_len)
        for it in range(self.cfg.max_iter):
            for li, block in enumerate(self.blocks):
                key = f"{li}.{it}"
                h, cache["mix"][key], _ = block(
                    h, it, cache=cache["mix"].get(key, {}),
                    moe_cache=moe.setdefault(key, {"row_len": row_len}),
                )  # fmt: skip
        return self.head(self.norm_f(h))[:, -1]


def mixer_impl(model: nn.Module) -> str | None:
    """The arms of a dormouse model's mixers as bench tables print them: "fla", "torch",
    "sdpa" (every block attention) or "fla+sdpa" (a hybrid); None before the KDA arm is chosen
    (the first forward, or resolve_arm)."""
    arms = dict.fromkeys(block.mixer.impl for block in model.blocks)  # ordered, unique
    return None if None in arms else "+".join(arms)


def kda_impl(model: nn.Module) -> str | None:
    """The arm of a dormouse model's KDA mixers ("torch" / "fla"; None before it is chosen),
    "none" when every block mixes by attention."""
    for block in model.blocks:
        if isinstance(block.mixer, KDAMixer):
            return block.mixer.impl
    return "none"


def count_params(cfg: ModelConfig) -> int:
    """Parameters of a model with this config, counted on the meta device (no memory)."""
    with torch.device("meta"):
        if cfg.arch == "gpt":
            from .gpt import GPT

            model = GPT(cfg)
        else:
            model = DormouseModel(cfg)
    # A host-RAM Engram store keeps its rows outside the parameter set; count them too.
    store = getattr(getattr(model, "engram", None), "store", None)
    host = getattr(store, "host_numel", lambda: 0)()
    return sum(p.numel() for p in model.parameters()) + host
