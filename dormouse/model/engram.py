"""Engram: hashed n-gram memory added to the residual stream (DESIGN.md §2).

Owns three things:

* `engram_indices` — the hash. It maps each position's last n bytes to one row
  per table, from the input bytes alone, so a host-RAM store can fetch exactly
  these rows before the forward runs.
* `TableStore` / `VramTables` — where the table rows live, behind one `gather`.
* `Engram` — the module: gather, project to key/value, gate by similarity with
  the hidden state, zero-initialised causal depthwise conv, residual add.

Tables. There is one table per (order, hash head); table `i * engram_heads + j`
belongs to order `engram_orders[i]` and head `j`. Each has `engram_rows` rows of
`engram_dim`.

The hash, for order n, head j and position t. Bytes before the start of the
sequence (or of the decoding cache's history) read as the pad value 256, which
no real byte takes, so "x at t=0" and "0x00 then x" land on different rows.
With v_d the (padded) byte d positions back (d = 0 is byte t itself):

    acc  = XOR over d in [0, n) of (v_d + 1) * M[n, j, d]
    h    = mix32(acc XOR S[n, j])
    row  = h mod engram_rows

`+ 1` keeps a zero byte from erasing its own term. M[n, j, d] are odd constants
in [2^22, 2^23) and S[n, j] 32-bit salts, both drawn from splitmix64 keyed by
(n, j, d) and the fixed `HASH_SEED`, so they never depend on torch's RNG, on the
other orders in the config, or on the Python version. Every intermediate stays
below 2^63, so the int64 arithmetic never overflows and CPU and CUDA agree bit for
bit. mix32 is Thomas Mueller's 32-bit integer finaliser (two rounds of
xor-shift-16 and multiply by 0x45d9f3b, then a last xor-shift), which spreads the
low-entropy XOR over all 32 bits before the modulo.

Decoding cache (a dict; pass `{}` to start a sequence):

    "bytes": LongTensor [B, max(orders) - 1]   the last bytes seen, pad-filled at start
    "u":     Tensor     [B, conv_size - 1, d]  the last conv inputs, zeros at start

These are exactly the left context the hash and the causal conv read, so a
forward over bytes t..t+k with the cache of bytes 0..t-1 equals the same slice
of the full forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.model.layers import RMSNorm

#: Pad value for positions before the start; real bytes are 0..255.
PAD = 256
#: Seed of the hash constants. Changing it re-hashes every table: checkpoints break.
HASH_SEED = 0x0D0E_A5E5_E46A_3A11

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_MIX = 0x45D9F3B  # < 2^27, so (h < 2^32) * _MIX stays below 2^63


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hash_multiplier(order: int, head: int, dist: int) -> int:
    """Odd multiplier in [2^22, 2^23) for the byte `dist` positions back."""
    r = _splitmix64(HASH_SEED ^ (order << 48) ^ (head << 24) ^ dist)
    # (byte + 1) <= 257 times a multiplier < 2^23 is < 2^32: the XOR stays 32-bit.
    return (r & ((1 << 22) - 1)) | (1 << 22) | 1


def hash_salt(order: int, head: int) -> int:
    """32-bit salt of table (order, head)."""
    return _splitmix64(HASH_SEED ^ (order << 48) ^ (head << 24) ^ 0xFFFFFF) & _M32


def n_tables(cfg) -> int:
    return len(cfg.engram_orders) * cfg.engram_heads


_CONSTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(cfg, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[n_tables, P + 1] multipliers (column j reads P - j bytes back; 0 past the order)
    and [n_tables] salts, built once per (orders, heads, device)."""
    key = (tuple(cfg.engram_orders), cfg.engram_heads, str(device))
    if key not in _CONSTS:
        p = max(cfg.engram_orders) - 1
        mult, salt = [], []
        for n in cfg.engram_orders:
            for j in range(cfg.engram_heads):
                # A zero multiplier makes the term 0, the identity of XOR.
                mult.append([hash_multiplier(n, j, p - c) if p - c < n else 0 for c in range(p + 1)])
                salt.append(hash_salt(n, j))
        _CONSTS[key] = (
            torch.tensor(mult, dtype=torch.int64, device=device),
            torch.tensor(salt, dtype=torch.int64, device=device),
        )
    return _CONSTS[key]


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = ((h >> 16) ^ h) * _MIX & _M32
    h = ((h >> 16) ^ h) * _MIX & _M32
    return (h >> 16) ^ h


def engram_indices(x_bytes: torch.Tensor, cfg, prev: torch.Tensor | None = None) -> torch.Tensor:
    """Rows each table reads: LongTensor [B, T, n_tables] on x_bytes' device.

    x_bytes: [B, T] integer bytes in 0..255. prev: [B, max(orders) - 1] bytes that
    precede x_bytes (a decoding cache's history); None means the sequence starts here
    and the missing context reads as PAD.
    """
    if x_bytes.dim() != 2 or x_bytes.is_floating_point():
        raise ValueError(
            f"engram_indices wants integer bytes of shape [B, T]; got {x_bytes.dtype} "
            f"{tuple(x_bytes.shape)}: pass the input byte ids, not embeddings"
        )
    p = max(cfg.engram_orders) - 1
    x = x_bytes.long()
    b, t = x.shape
    if prev is None:
        prev = torch.full((b, p), PAD, dtype=torch.int64, device=x.device)
    xp = torch.cat([prev.long(), x], dim=1)  # [B, P + T]
    win = xp.unfold(1, p + 1, 1) + 1  # [B, T, P + 1]; column P is byte t
    mult, salt = _constants(cfg, x.device)
    terms = win.unsqueeze(2) * mult  # [B, T, N, P + 1]
    acc = terms[..., 0]
    for c in range(1, p + 1):
        acc = acc ^ terms[..., c]
    return _mix32(acc ^ salt) % cfg.engram_rows


class TableStore(nn.Module):
    """Where the Engram rows live. The module talks to its store through `gather` only.

    Contract for any store:
      * attributes `n_tables`, `rows`, `dim`;
      * `gather(idx)`: idx LongTensor [..., n_tables] of rows in [0, rows) ->
        Tensor [..., n_tables, dim] on idx's device, differentiable: the gradient
        of the gathered rows must reach whatever the store updates.

    The host-RAM store (engram_ram, a later issue) must additionally provide:
      * the tables and their Adam moments in pinned host memory, NOT as module
        parameters (so DDP/FSDP and the dense optimizer never see them);
      * `gather` that copies only the rows named by idx to the device (it may be
        handed the same idx earlier through a prefetch call, since
        `engram_indices` needs only the input bytes) and returns a leaf that
        requires grad;
      * an optimizer hook, e.g. `step(lr, betas, eps, wd)`, that takes the
        gradient of the last gathered rows, sums duplicates per (table, row),
        applies Adam to those rows only, writes them back and clears the grad;
      * state_dict / load_state_dict carrying the rows and moments, so a
        checkpoint is the same whichever store wrote it.
    """

    n_tables: int
    rows: int
    dim: int

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class VramTables(TableStore):
    """All tables as one device Parameter `table` [n_tables, rows, dim].

    The optimizer routes Engram rows by the qualified-name suffix `store.table`.
    """

    def __init__(self, n_tables: int, rows: int, dim: int, std: float):
        super().__init__()
        self.n_tables, self.rows, self.dim = n_tables, rows, dim
        self.table = nn.Parameter(torch.randn(n_tables, rows, dim) * std)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        # One embedding lookup over the flattened tables; its backward touches only
        # the gathered rows.
        offset = torch.arange(self.n_tables, device=idx.device) * self.rows
        flat = self.table.view(self.n_tables * self.rows, self.dim)
        return F.embedding(idx + offset, flat)


class Engram(nn.Module):
    """Hashed n-gram memory; an exact identity at initialisation.

    gate = sigmoid(<norm_h(h), norm_k(k)> / sqrt(d_model)) per token, with learned
    RMSNorm gains (both start at 1) so training can sharpen or flatten the gate.
    u = gate * v, h_out = h + causal depthwise conv(u). The conv weight starts at
    zero: the output is h exactly, yet the conv weight's gradient (u times the
    upstream gradient) is nonzero, so learning starts there and opens the rest.

    Parameters: store.table [n_tables, rows, dim]; key.weight, value.weight
    [d_model, n_tables * dim]; norm_h.weight, norm_k.weight [d_model];
    conv.weight [d_model, 1, conv_size] (depthwise, Conv1d's layout).
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        nt = n_tables(cfg)
        self.store: TableStore = VramTables(nt, cfg.engram_rows, cfg.engram_dim, cfg.init_std)
        self.key = nn.Linear(nt * cfg.engram_dim, d, bias=False)
        self.value = nn.Linear(nt * cfg.engram_dim, d, bias=False)
        nn.init.normal_(self.key.weight, std=cfg.init_std)
        nn.init.normal_(self.value.weight, std=cfg.init_std)
        self.norm_h = RMSNorm(d)
        self.norm_k = RMSNorm(d)
        self.conv = nn.Conv1d(d, d, cfg.conv_size, groups=d, bias=False)
        nn.init.zeros_(self.conv.weight)
        self.hist = max(cfg.engram_orders) - 1

    def forward(self, h: torch.Tensor, x_bytes: torch.Tensor, cache: dict | None = None):
        """h [B, T, d_model], x_bytes [B, T] -> (h_out, new_cache or None)."""
        b, t, d = h.shape
        if tuple(x_bytes.shape) != (b, t):
            raise ValueError(
                f"Engram: x_bytes has shape {tuple(x_bytes.shape)} but h is {tuple(h.shape)}; "
                f"pass the [B, T] bytes that produced h"
            )
        k_hist = self.cfg.conv_size - 1
        prev_bytes = prev_u = None
        if cache is not None:
            prev_bytes = cache.get("bytes")
            prev_u = cache.get("u")
        idx = engram_indices(x_bytes, self.cfg, prev_bytes)
        e = self.store.gather(idx).flatten(-2)  # [B, T, n_tables * dim]
        k = self.key(e)
        v = self.value(e)
        s = (self.norm_h(h).float() * self.norm_k(k).float()).sum(-1, keepdim=True)
        gate = torch.sigmoid(s / math.sqrt(d))
        u = gate.to(v.dtype) * v  # [B, T, d]
        if prev_u is None:
            prev_u = u.new_zeros(b, k_hist, d)
        u_full = torch.cat([prev_u.to(u.dtype), u], dim=1)  # causal left context
        y = F.conv1d(u_full.transpose(1, 2), self.conv.weight.to(u.dtype), groups=d)
        h_out = h + y.transpose(1, 2).to(h.dtype)
        if cache is None:
            return h_out, None
        if prev_bytes is None:
            prev_bytes = torch.full((b, self.hist), PAD, dtype=torch.int64, device=h.device)
        all_bytes = torch.cat([prev_bytes.long(), x_bytes.long()], dim=1)
        new_cache = {
            "bytes": all_bytes[:, all_bytes.shape[1] - self.hist :],
            "u": u_full[:, u_full.shape[1] - k_hist :],
        }
        return h_out, new_cache
