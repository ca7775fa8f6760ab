"""Engram: hashed n-gram memory added to the residual stream.

Owns:

* `engram_indices` — the hash. It maps each position's last n bytes to one row
  per table, from the input bytes alone, so a host-RAM store can fetch exactly
  these rows before the forward runs.
* `TableStore` / `VramTables` / `HostTables` — where the table rows live (device
  Parameter, or host RAM with `engram_ram`), behind one `gather`; a host store also keeps
  its pending row gradient. The tables' optimizer (row-sparse Adam and its state) is the
  trainer's: `dormouse.train.optim.rowadam`.
* `touched_rows` — which rows of a table gradient a step may move.
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
other orders in the config, or on the Python version:

    M[n, j, d] = (r & (2^22 - 1)) | 2^22 | 1,  r = splitmix64(HASH_SEED ^ n << 48 ^ j << 24 ^ d)
    S[n, j]    = splitmix64(HASH_SEED ^ n << 48 ^ j << 24 ^ 0xFFFFFF) & (2^32 - 1)

with Vigna's splitmix64 (add 0x9E3779B97F4A7C15, then x ^= x >> 30, x *= 0xBF58476D1CE4E5B9,
x ^= x >> 27, x *= 0x94D049BB133111EB, x ^= x >> 31, all mod 2^64). Every intermediate stays
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

from dormouse.model.layers import RMSNorm, at_least_fp32

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
    # Traced by torch.compile: built in the graph (inductor folds them to constants), never
    # cached, since a tensor made inside a compiled graph and kept across calls is that
    # graph's output, which a CUDA-graph replay overwrites.
    if key not in _CONSTS or torch.compiler.is_compiling():
        p = max(cfg.engram_orders) - 1
        mult, salt = [], []
        for n in cfg.engram_orders:
            for j in range(cfg.engram_heads):
                # A zero multiplier makes the term 0, the identity of XOR.
                mult.append(
                    [hash_multiplier(n, j, p - c) if p - c < n else 0 for c in range(p + 1)]
                )
                salt.append(hash_salt(n, j))
        made = (torch.tensor(mult, dtype=torch.int64, device=device),
                torch.tensor(salt, dtype=torch.int64, device=device))  # fmt: skip
        if torch.compiler.is_compiling():
            return made
        _CONSTS[key] = made
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
    b, _t = x.shape
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


def touched_rows(grad: torch.Tensor) -> torch.Tensor:
    """Row numbers (LongTensor, ascending) of a [R, dim] gradient whose row is not all zero.

    "Touched" is read from the gradient, not from the gather, in both stores: a row a batch
    gathered but whose gradient is exactly zero (every row at step 0, when the Engram conv
    is still zero) does not step. Under DDP the reduced gradient is the same on every rank,
    so every rank picks the same rows. One rule for both: a host store's pending gradient
    holds these rows only, and the optimizer picks them from a VRAM table's dense gradient.
    """
    # any() reduces the float gradient in place of a full-size `grad != 0` mask (1 B per
    # table entry: 0.4 GB of transient on b1). NaN counts as non-zero, -0.0 as zero.
    return grad.any(1).nonzero().squeeze(1)


class TableStore(nn.Module):
    """Where the Engram rows live. The module talks to its store through `gather` only.

    Contract for any store:
      * attributes `n_tables`, `rows`, `dim`;
      * `gather(idx)`: idx LongTensor [..., n_tables] of rows in [0, rows) ->
        Tensor [..., n_tables, dim] on idx's device, differentiable: the gradient
        of the gathered rows must reach whatever the store updates;
      * `model.state_dict()` holds the rows as `<prefix>table` [n_tables, rows, dim] fp32,
        so a checkpoint loads into either store.

    Two stores exist: `VramTables` (a device Parameter) and `HostTables` (engram_ram: host
    RAM, not a parameter; the optimizer reads its `pending` gradient). The optimizer steps
    both with the same row-sparse Adam, so the two stores train alike.
    """

    n_tables: int
    rows: int
    dim: int

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _check_idx(self, idx: torch.Tensor) -> None:
        if idx.shape[-1] != self.n_tables or idx.is_floating_point():
            raise ValueError(
                f"gather wants integer row numbers [..., {self.n_tables}] (one per table); "
                f"got {idx.dtype} {tuple(idx.shape)}: pass engram_indices(...)"
            )


class VramTables(TableStore):
    """All tables as one device Parameter `table` [n_tables, rows, dim].

    The optimizer routes Engram rows by the qualified-name suffix `store.table`.
    """

    def __init__(self, n_tables: int, rows: int, dim: int, std: float):
        super().__init__()
        self.n_tables, self.rows, self.dim = n_tables, rows, dim
        self.table = nn.Parameter(torch.randn(n_tables, rows, dim) * std)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        self._check_idx(idx)
        # One embedding lookup over the flattened tables; its backward touches only
        # the gathered rows.
        offset = torch.arange(self.n_tables, device=idx.device) * self.rows
        flat = self.table.view(self.n_tables * self.rows, self.dim)
        return F.embedding(idx + offset, flat)


class HostTables(TableStore):
    """engram_ram: the tables in host RAM, outside the parameter set, and their pending
    row gradient.

    `table` [n_tables, rows, dim] fp32 (the rows, the fp32 masters) is a plain tensor
    attribute, not a parameter or buffer, so `model.to(device)`, dtype casts, DDP/FSDP and
    the dense optimizer never see or move it. Its Adam state is the optimizer's
    (MixOptimizer.host_state), in host RAM too.

    One cycle is gather -> backward -> step. `gather(idx)` copies the distinct rows idx
    names (once each, however often they repeat) to idx's device as a leaf that requires
    grad, and returns them per index (an embedding lookup into the leaf, so autograd sums
    the gradients of repeated rows). A cycle may gather several times (gradient
    accumulation, several forwards before one backward): each gather adds a leaf. After
    backward, `pending()` reads the cycle's gradient as (rows, grad): summed per row,
    touched rows only; `replace_pending(rows, grad)` swaps in another (a fleet installs
    the rank-averaged union of its ranks' rows there). The optimizer's step reads
    `pending()`, moves those rows of `table` and ends the cycle with `zero_grad()`, which
    drops every leaf a backward already reached (the loop calls it after step or before
    the forward, never between a forward and its backward). Gathers under torch.no_grad
    (evaluation, byte-by-byte decoding) record nothing.

    Pinned memory: what crosses PCIe is the gathered rows (a contiguous staging buffer,
    pinned when the rows go to a CUDA device, copied non_blocking) and, at step, their
    gradient. The table itself is read row by row by the CPU (an index_select into the
    staging buffer, Adam on the host), so pinning it would only lock gigabytes of RAM
    without speeding any transfer; it stays pageable.

    Checkpoints: `state_dict()` writes `<prefix>table`, the key and shape VramTables
    writes, and `load_state_dict` reads it from either.
    """

    def __init__(self, n_tables: int, rows: int, dim: int, std: float):
        super().__init__()
        self.n_tables, self.rows, self.dim = n_tables, rows, dim
        # The same draw as VramTables, so both stores start a seeded model alike. Built
        # under torch.device("meta") (count_params, the planner) it allocates nothing.
        init = torch.randn(n_tables, rows, dim) * std
        self.table = init.to("meta" if init.is_meta else "cpu")
        self._leaves: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host rows [U], leaf [U, dim])

    def host_numel(self) -> int:
        """Table entries kept outside the parameter set (count_params adds them)."""
        return self.table.numel()

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        self._check_idx(idx)
        offset = torch.arange(self.n_tables, device=idx.device) * self.rows
        uniq, inv = torch.unique((idx + offset).reshape(-1), sorted=True, return_inverse=True)
        rows = uniq.cpu()  # the host needs the row numbers: one small sync per gather
        pin = idx.device.type == "cuda"
        buf = torch.empty((rows.numel(), self.dim), dtype=self.table.dtype, pin_memory=pin)
        torch.index_select(self.table.view(-1, self.dim), 0, rows, out=buf)
        # From a pinned buffer the copy is asynchronous; torch's host allocator keeps the
        # buffer alive until the copy has run.
        leaf = buf.to(idx.device, non_blocking=pin)
        if torch.is_grad_enabled():
            leaf.requires_grad_(True)
            self._leaves.append((rows, leaf))
        return F.embedding(inv.view(idx.shape), leaf)

    @torch.no_grad()
    def consolidate(self) -> torch.Tensor | None:
        """Fold the leaves a backward reached into ONE leaf holding the table's gradient as
        the VRAM store would hold it: summed per row, touched rows only, ascending rows.

        Returns that leaf (its .grad is [K, dim], on the compute device), or None when no
        row has a gradient. MixOptimizer.clip_grad_norm_ reads and scales it, so a clipped
        host gradient is the same numbers as a clipped VRAM one.
        """
        done = [(r, leaf) for r, leaf in self._leaves if leaf.grad is not None]
        if not done:
            return None
        waiting = [(r, leaf) for r, leaf in self._leaves if leaf.grad is None]
        rows = torch.cat([r for r, _ in done])
        grad = torch.cat([leaf.grad for _, leaf in done])
        if len(done) > 1:
            # A row gathered by several forwards: sum its gradients in gather order, the
            # order in which a Parameter's .grad accumulates them.
            rows, inv = torch.unique(rows, sorted=True, return_inverse=True)
            grad = grad.new_zeros(rows.numel(), self.dim).index_add_(0, inv.to(grad.device), grad)
        hit = touched_rows(grad)
        if hit.numel() < rows.numel():
            rows, grad = rows[hit.cpu()], grad.index_select(0, hit)
        holder = torch.empty_like(grad).requires_grad_(True)  # carries .grad; never read
        holder.grad = grad
        self._leaves = [(rows, holder)] + waiting
        return holder

    @torch.no_grad()
    def pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This cycle's gradient so far, consolidated: (rows, grad).

        rows: LongTensor [K] on the CPU, distinct and ascending, numbered across all tables
        (row r of table i is i * self.rows + r); grad: [K, dim], summed per row, on the
        compute device. No gradient yet: rows [0] and grad [0, dim] on the CPU. A fleet reads
        this after backward, combines every rank's set and installs the result with
        `replace_pending`, so every rank steps the same rows by the same gradient.
        """
        holder = self.consolidate()
        if holder is None:
            return (torch.empty(0, dtype=torch.int64),
                    torch.empty(0, self.dim, dtype=self.table.dtype))  # fmt: skip
        return self._leaves[0][0], holder.grad

    @torch.no_grad()
    def replace_pending(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Make (rows, grad) this cycle's whole gradient, in place of what backward left.

        rows and grad as `pending` returns them (rows distinct and ascending, grad [K, dim]
        on any device). Leaves a backward has not reached yet stay pending. K = 0 drops the
        gradient: the next step moves no row.
        """
        rows = rows.to("cpu", torch.int64)
        if rows.dim() != 1 or tuple(grad.shape) != (rows.numel(), self.dim):
            raise ValueError(
                f"replace_pending wants rows [K] and grad [K, {self.dim}]; got rows "
                f"{tuple(rows.shape)} and grad {tuple(grad.shape)}"
            )
        if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= self.n_tables * self.rows
                             or not bool((rows[1:] > rows[:-1]).all())):  # fmt: skip
            raise ValueError(
                f"replace_pending wants distinct ascending rows in [0, {self.n_tables * self.rows})"
                f"; got {rows.numel()} rows from {int(rows.min())} to {int(rows.max())}, "
                f"unsorted or repeated: sum repeated rows first (torch.unique + index_add_)"
            )
        waiting = [(r, leaf) for r, leaf in self._leaves if leaf.grad is None]
        if rows.numel() == 0:
            self._leaves = waiting
            return
        holder = torch.empty_like(grad).requires_grad_(True)  # carries .grad; never read
        holder.grad = grad.detach()
        self._leaves = [(rows, holder)] + waiting

    def zero_grad(self) -> None:
        """End the cycle: drop the leaves a backward reached (their rows are done)."""
        self._leaves = [(r, leaf) for r, leaf in self._leaves if leaf.grad is None]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "table"] = self.table

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):  # fmt: skip
        key = prefix + "table"
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)  # fmt: skip
        if key not in state_dict:
            missing_keys.append(key)
            return
        src = state_dict[key]
        if tuple(src.shape) != tuple(self.table.shape):
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {tuple(src.shape)} from "
                f"checkpoint, the shape in current model is {tuple(self.table.shape)}."
            )
            return
        with torch.no_grad():
            if self.table.is_meta:  # a store built on the meta device has no RAM yet
                self.table = src.detach().to("cpu", torch.float32, copy=True)
            else:
                self.table.copy_(src)


class Engram(nn.Module):
    """Hashed n-gram memory; an exact identity at initialisation.

    gate = sigmoid(<norm_h(h), norm_k(k)> / sqrt(d_model)) per token, with learned
    RMSNorm gains (both start at 1) so training can sharpen or flatten the gate.
    u = gate * v, h_out = h + causal depthwise conv(u). The conv weight starts at
    zero: the output is h exactly, yet the conv weight's gradient (u times the
    upstream gradient) is nonzero, so learning starts there and opens the rest.

    Parameters: store.table [n_tables, rows, dim] (with engram_ram, host state of a
    HostTables, not a parameter, under the same state_dict key); key.weight, value.weight
    [d_model, n_tables * dim]; norm_h.weight, norm_k.weight [d_model];
    conv.weight [d_model, 1, conv_size] (depthwise, Conv1d's layout).
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        nt = n_tables(cfg)
        store = HostTables if cfg.engram_ram else VramTables
        self.store: TableStore = store(nt, cfg.engram_rows, cfg.engram_dim, cfg.init_std)
        self.key = nn.Linear(nt * cfg.engram_dim, d, bias=False)
        self.value = nn.Linear(nt * cfg.engram_dim, d, bias=False)
        nn.init.normal_(self.key.weight, std=cfg.init_std)
        nn.init.normal_(self.value.weight, std=cfg.init_std)
        self.norm_h = RMSNorm(d)
        self.norm_k = RMSNorm(d)
        self.conv = nn.Conv1d(d, d, cfg.conv_size, groups=d, bias=False)
        nn.init.zeros_(self.conv.weight)
        self.hist = max(cfg.engram_orders) - 1

    def forward(self, h: torch.Tensor, x_bytes: torch.Tensor, cache: dict | None = None,
                drop=None):  # fmt: skip
        """h [B, T, d_model], x_bytes [B, T] -> (h_out, new_cache or None). `drop`: the
        model's keyed dropout on this branch's output (site 1), training only."""
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
        s = (at_least_fp32(self.norm_h(h)) * at_least_fp32(self.norm_k(k))).sum(-1, keepdim=True)
        gate = torch.sigmoid(s / math.sqrt(d))
        u = gate.to(v.dtype) * v  # [B, T, d]
        if prev_u is None:
            prev_u = u.new_zeros(b, k_hist, d)
        u_full = torch.cat([prev_u.to(u.dtype), u], dim=1)  # causal left context
        y = F.conv1d(u_full.transpose(1, 2), self.conv.weight.to(u.dtype), groups=d)
        y = y.transpose(1, 2).to(h.dtype)
        h_out = h + (y if drop is None else drop(y, 1))
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
