"""DormouseModel's forward written again from DESIGN.md §2: layer 2 of the references.

It reads a DormouseModel's state dict (the parameters and the LFB bias) and the config's
numbers (attributes of any object: a ModelConfig, a namespace) and imports nothing of
dormouse; every piece is the equation, computed in fp64 by default:

    h   = E[x]                                       keyed dropout at site 0
    h  += conv(gate * v)                             Engram, site 1
    for i in 0 .. max_iter-1, for block l:           s = 2 + 2 (i n_layers + l)
        h += mixer_i(rms(h))                         site s
        h += moe(rms(h))                             site s + 1
    logits = rms(h) W_head^T;   loss = mean over tokens of -log softmax(logits)[y]

Engram: each position's rows come from the hash, computed by a Python loop over positions,
tables and bytes (`engram_rows`); k, v = rows W^T; gate = sigmoid(<rms(h), rms(k)> /
sqrt(d)); a causal depthwise conv of gate * v, tap j meeting the input K-1-j steps back.
Mixer: q, k, v = x W^T (+ x A_i^T B_i^T, iteration i's low-rank delta); a causal depthwise
conv and SiLU over q|k|v (`references.short_conv`); q and k L2-normalised per head; decay
g = -exp(A_log) * softplus(f(x) + dt_bias), beta = sigmoid(x W_b^T); the per-step
recurrence (`references.kda_naive`); output = (rms_head(o) * sigmoid(up(down(x)) + b)) W_o^T
(+ its delta). An attention block (`attn_every`): causal softmax attention over RoPE-turned,
RMS-normalised q and k (`ReferenceModel.attn`). `segment_len` cuts the window into segments: the state and the conv's input
tail carried over, their gradient cut. MoE: every expert on every token
(`references.moe_dense.moe_all_experts`), the picks by affinity + LFB bias, the gates the
unbiased affinities renormalised over the picks; capacity by the prefix rule
(`references.moe_capacity.drops_of_row`) per window. Dropout: the keyed mask from its
documented formula (dormouse/model/layers.py, KeyedDropout).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from references.kda_naive import kda_naive
from references.moe_capacity import capacity_of, drops_of_row
from references.moe_dense import moe_all_experts, pick_experts
from references.short_conv import qk_l2norm, short_conv_silu

RMS_EPS = 1e-6  # every RMSNorm of the model; q/k's L2 norm has its own (short_conv.qk_l2norm)

# ---- the Engram hash (DESIGN §2; constants as dormouse/model/engram.py documents them) ------

HASH_SEED = 0x0D0E_A5E5_E46A_3A11
PAD = 256  # what a position before the window's start reads
_M64, _M32 = (1 << 64) - 1, (1 << 32) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix32(h: int) -> int:
    for _ in range(2):
        h = (((h >> 16) ^ h) * 0x45D9F3B) & _M32
    return (h >> 16) ^ h


def multiplier(order: int, head: int, back: int) -> int:
    r = splitmix64(HASH_SEED ^ (order << 48) ^ (head << 24) ^ back)
    return (r & ((1 << 22) - 1)) | (1 << 22) | 1


def salt(order: int, head: int) -> int:
    return splitmix64(HASH_SEED ^ (order << 48) ^ (head << 24) ^ 0xFFFFFF) & _M32


def engram_rows(x: torch.Tensor, orders, heads: int, rows: int) -> torch.Tensor:
    """[B, T, len(orders) * heads] rows: table i * heads + j is order orders[i], head j."""
    consts = [(n, multiplier_row, salt(n, j)) for n in orders for j in range(heads)
              for multiplier_row in [[multiplier(n, j, d) for d in range(n)]]]  # fmt: skip
    out = []
    for window in x.tolist():
        per_pos = []
        for t in range(len(window)):
            per_table = []
            for n, mult, s in consts:
                acc = 0
                for d in range(n):
                    byte = window[t - d] if t - d >= 0 else PAD
                    acc ^= (byte + 1) * mult[d]
                per_table.append(mix32(acc ^ s) % rows)
            per_pos.append(per_table)
        out.append(per_pos)
    return torch.tensor(out, dtype=torch.int64).reshape(x.shape[0], x.shape[1], len(consts))


# ---- keyed dropout (dormouse/model/layers.py, KeyedDropout's documented formula) ----------


def _mix32_t(h: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        h = (((h >> 16) ^ h) * 0x45D9F3B) & _M32
    return (h >> 16) ^ h


def row_keys(seed: int, step: int, rows) -> torch.Tensor:
    """One key per window from (seed, step, the window's row in the global batch)."""
    h = _mix32_t(torch.tensor(seed & _M32, dtype=torch.int64))
    h = _mix32_t(h ^ (step & _M32))
    return _mix32_t(h ^ (torch.as_tensor(rows, dtype=torch.int64) & _M32))


def dropout(t: torch.Tensor, keys: torch.Tensor, site: int, p: float) -> torch.Tensor:
    b, n = t.shape[0], t[0].numel()
    base = _mix32_t(keys.to(torch.int64) ^ ((site * 0x9E3779B + 1) & _M32))
    h = _mix32_t(base.view(b, 1) ^ torch.arange(n, dtype=torch.int64).view(1, n))
    kept = ((h & 0xFFFFFF) >= round(p * 2**24)).view(t.shape)
    return t * kept.to(t.dtype) / (1.0 - p)


# ---- the network ----------------------------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + RMS_EPS) * w


def causal_taps(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[t, c] = sum_j w[c, j] u[t - (K-1) + j, c], zeros before the start (no activation)."""
    T, K = u.shape[1], w.shape[-1]
    padded = torch.cat([u.new_zeros(u.shape[0], K - 1, u.shape[2]), u], dim=1)
    return sum(w[:, j] * padded[:, j : j + T] for j in range(K))


class ReferenceModel:
    """The equations with a DormouseModel's parameters: `params` (leaf tensors, fp64 unless
    told) by the state dict's names, `lfb_bias` by block. `forward` returns (logits, loss,
    aux): aux["counts"][l] the picks per expert of block l's MoE over this forward (what the
    LFB counts add), aux["margin"] the smallest routing margin seen."""

    def __init__(self, cfg, state: dict, dtype: torch.dtype = torch.float64):
        self.cfg = cfg
        self.params: dict[str, torch.Tensor] = {}
        # zero unless the state says otherwise (a state dict without them: no steering yet)
        self.lfb_bias = {l: torch.zeros(cfg.n_experts, dtype=dtype) for l in range(cfg.n_layers)}
        for name, t in state.items():
            if name.endswith("lfb_counts"):
                continue
            if name.endswith("lfb_bias"):
                self.lfb_bias[int(name.split(".")[1])] = t.detach().to("cpu", dtype).clone()
                continue
            self.params[name] = t.detach().to("cpu", dtype).clone().requires_grad_(True)
        self.dtype = dtype
        self.window: int | None = None  # forward's `window`, read by attn

    def p(self, name: str) -> torch.Tensor | None:
        return self.params.get(name)

    # -- Engram --

    def engram(self, h, x):
        c = self.cfg
        idx = engram_rows(x, c.engram_orders, c.engram_heads, c.engram_rows)
        table = self.p("engram.store.table")
        nt = table.shape[0]
        e = table[torch.arange(nt), idx].flatten(-2)  # [B, T, nt * dim]
        k = e @ self.p("engram.key.weight").t()
        v = e @ self.p("engram.value.weight").t()
        sim = rms(h, self.p("engram.norm_h.weight")) * rms(k, self.p("engram.norm_k.weight"))
        gate = torch.sigmoid(sim.sum(-1, keepdim=True) / math.sqrt(c.d_model))
        return causal_taps(gate * v, self.p("engram.conv.weight")[:, 0])

    # -- the mixer --

    def _proj(self, pre: str, what: str, x, it: int, w_name: str):
        y = x @ self.p(f"{pre}.{w_name}.weight").t()
        a = self.p(f"{pre}.{what}_delta.{it}.A")
        if a is not None:
            y = y + (x @ a.t()) @ self.p(f"{pre}.{what}_delta.{it}.B").t()
        return y

    def mixer(self, l: int, x, it: int):
        c, pre = self.cfg, f"blocks.{l}.mixer"
        B, T, _ = x.shape
        H, Dh, K = c.n_heads, c.head_dim, c.conv_size
        seg = c.segment_len if 0 < c.segment_len < T else T
        outs, tail, S = [], None, None
        for a in range(0, T, seg):
            xs = x[:, a : a + seg]
            qkv = torch.cat([self._proj(pre, n, xs, it, f"{n}_proj") for n in "qkv"], dim=-1)
            # a later segment's conv reads the previous one's last inputs, gradient cut there
            full = qkv if tail is None else torch.cat([tail.detach(), qkv], dim=1)
            conv = short_conv_silu(full, self.p(f"{pre}.qkv_conv.weight"))
            conv = conv if tail is None else conv[:, tail.shape[1] :]
            tail = full[:, -(K - 1) :] if K > 1 else full[:, :0]
            q, k, v = qk_l2norm(conv, H)
            f = self.p(f"{pre}.dt_bias").expand(B, xs.shape[1], -1)
            if self.p(f"{pre}.f_down.weight") is not None:
                f = (xs @ self.p(f"{pre}.f_down.weight").t()) @ self.p(f"{pre}.f_up.weight").t() + f
            g = (-torch.exp(self.p(f"{pre}.A_log")) * F.softplus(f)).reshape(B, -1, H, Dh)
            beta = torch.sigmoid(xs @ self.p(f"{pre}.b_proj.weight").t())
            o, S = kda_naive(q, k, v, g, beta, initial_state=None if S is None else S.detach(),
                             output_final_state=True)  # fmt: skip
            gate = torch.sigmoid(
                (xs @ self.p(f"{pre}.g_down.weight").t()) @ self.p(f"{pre}.g_up.weight").t()
                + self.p(f"{pre}.g_up.bias")
            )
            o = rms(o, self.p(f"{pre}.o_norm.weight")) * gate.reshape(B, -1, H, Dh)
            outs.append(self._proj(pre, "o", o.reshape(B, -1, H * Dh), it, "o_proj"))
        return torch.cat(outs, dim=1)

    # -- attention (the blocks attn_every names: every N-th, blocks N-1, 2N-1, ...) --

    def is_attention(self, l: int) -> bool:
        n = getattr(self.cfg, "attn_every", 0)
        return bool(n) and (l + 1) % n == 0

    def attn(self, l: int, x, it: int):
        """softmax(q' k'^T / sqrt(Dh) over u <= t) v, per head; q', k' = RoPE(rms_head(q)),
        RoPE(rms_head(k)): channel pair (i, i + Dh/2) at position t turned by the angle
        t * 10000^(-2i/Dh). With `forward(window=W)` (decoding past max_seq_len) only
        t - W < u <= t, at the stream's own positions t."""
        c, pre = self.cfg, f"blocks.{l}.mixer"
        B, T, _ = x.shape
        H, Dh = c.n_heads, c.head_dim
        half = Dh // 2
        q, k, v = (self._proj(pre, n, x, it, f"{n}_proj").reshape(B, T, H, Dh) for n in "qkv")
        q, k = rms(q, self.p(f"{pre}.q_norm.weight")), rms(k, self.p(f"{pre}.k_norm.weight"))
        i = torch.arange(half, dtype=self.dtype)
        theta = torch.arange(T, dtype=self.dtype)[:, None] * 10000.0 ** (-2.0 * i / Dh)
        cos, sin = torch.cos(theta)[:, None], torch.sin(theta)[:, None]  # [T, 1, half]

        def turn(u):
            a, b = u[..., :half], u[..., half:]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

        q, k = turn(q), turn(k)
        scores = torch.einsum("bthd,buhd->bhtu", q, k) / math.sqrt(Dh)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        if self.window is not None:  # decoding's sliding window: u > t - window too
            future |= torch.ones(T, T, dtype=torch.bool).tril(-self.window)
        weights = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
        o = torch.einsum("bhtu,buhd->bthd", weights, v).reshape(B, T, H * Dh)
        return self._proj(pre, "o", o, it, "o_proj")

    # -- the MoE --

    def moe(self, l: int, x):
        c, pre = self.cfg, f"blocks.{l}.moe"
        B, T, _ = x.shape
        router = self.p(f"{pre}.router.weight")
        bias = self.lfb_bias.get(l)
        _, picked, margin = pick_experts(x, router, c.moe_topk, bias)
        E = router.shape[0]
        dropped = None
        if c.moe_capacity > 0:  # each window is a row of the cap, first come first served
            cap = capacity_of(c.moe_capacity, T, c.moe_topk, E)
            dropped = torch.zeros(B * T, E, dtype=torch.bool)
            for b, row in enumerate(picked.view(B, T, -1).tolist()):
                for t, e in drops_of_row(row, cap, E):
                    dropped[b * T + t, e] = True
        s1 = self.p(f"{pre}.shared.w1.weight")
        shared = None if s1 is None else (s1, self.p(f"{pre}.shared.w3.weight"),
                                          self.p(f"{pre}.shared.w2.weight"))  # fmt: skip
        y = moe_all_experts(x, router, self.p(f"{pre}.w1"), self.p(f"{pre}.w3"),
                            self.p(f"{pre}.w2"), shared=shared, bias=bias, topk=c.moe_topk,
                            dropped=dropped)  # fmt: skip
        counts = torch.bincount(picked.reshape(-1), minlength=E).to(torch.float64)
        return y, counts, margin

    # -- the whole --

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, *, training: bool = False,
                keys: torch.Tensor | None = None, window: int | None = None):  # fmt: skip
        """x, y int64 [B, T]. `training` with dropout > 0 needs `keys` ([B], row_keys).
        `window`: attention sees the last `window` bytes only (what decoding promises past
        max_seq_len; KDA, Engram and the MoE have no window)."""
        c = self.cfg
        self.window = window
        p = c.dropout if training else 0.0
        if p > 0 and keys is None:
            raise ValueError("dropout in training needs the windows' keys (row_keys)")

        def drop(t, site):
            return t if p <= 0 else dropout(t, keys, site, p)

        h = drop(self.p("embed.weight")[x], 0)
        h = h + drop(self.engram(h, x), 1)
        counts = dict.fromkeys(range(c.n_layers), 0.0)
        margin = math.inf
        for it in range(c.max_iter):
            for l in range(c.n_layers):
                site = 2 + 2 * (it * c.n_layers + l)
                pre = f"blocks.{l}"
                mix = self.attn if self.is_attention(l) else self.mixer
                h = h + drop(mix(l, rms(h, self.p(f"{pre}.norm1.weight")), it), site)
                f, n, m = self.moe(l, rms(h, self.p(f"{pre}.norm2.weight")))
                h = h + drop(f, site + 1)
                counts[l] = counts[l] + n
                margin = min(margin, m)
        logits = rms(h, self.p("norm_f.weight")) @ self.p("head.weight").t()
        loss = None
        if y is not None:
            logp = torch.log_softmax(logits, dim=-1)
            loss = -logp.gather(-1, y.unsqueeze(-1)).mean()
        return logits, loss, {"counts": counts, "margin": margin}
