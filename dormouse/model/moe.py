"""The MoE FFN: routed SwiGLU experts, their dispatch, the LFB controller, the shared expert.

Owns `MoE`, the FFN half of a block. Per token: sigmoid affinities over `n_experts`
(fp32), top-`moe_topk` selection by affinity + `lfb_bias`, gate weights = the selected
(unbiased) affinities renormalised to sum 1, output = sum of gated expert SwiGLUs plus an
always-on low-rank shared SwiGLU. Its slow, obviously-right twin is
`references/moe_dense.py`; `tests/test_moe.py` holds them together.

Parameter layout (x is a row vector, so every expert weight is used as `x @ W`):
  router.weight [E, D]           (nn.Linear convention: logits = x @ router.weight^T)
  w1, w3        [E, D, F]        gate and up projections of expert e: x @ w1[e]
  w2            [E, F, D]        down projection: (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]
  shared.w1.weight, shared.w3.weight [R, D], shared.w2.weight [D, R]   (absent when R = 0)
[E, D, F] is what the grouped matmul consumes directly (mat_b of shape [groups, K, N]),
so no transpose is materialised per step.

Dispatch arms (`moe_impl`):
  grouped  sort the assignments by expert, one `grouped_mm` per projection over the
           jagged groups (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`).
           No host sync.
  batched  scatter the assignments into a zero-padded [E, P+1, D] buffer and run `bmm`;
           works for every device and dtype (fp64 too). P = the largest expert load
           (dropless; one host sync) or rows * cap (capacity: each row owns cap slots).
  dense    every expert on every token: one matmul for all experts' gate and up projections,
           the SwiGLU scaled by a [N, E] weight that is the gate where the token picked the
           expert and zero elsewhere, one matmul down. The same function and gradient (a zero
           weight passes nothing either way) in ~6 kernels instead of sorts, gathers and
           copies; E/k times the experts' arithmetic. No sort, no host sync.
  triton   not built: refused at construction, naming the arms that exist.
  auto     dense on CUDA for narrow MoEs (n_experts * d_ffn <= arms.DENSE_MAX_WIDTH, 0 until
           measured on a card), else grouped where it runs AND is the fast choice, else
           batched; the rule is `dormouse.model.arms`', each distinct verdict logged once.

Capacity (`moe_capacity > 0`): a ROW (h[b] of an input [B, T, D]; a 2-D input [N, D] is one
row) may send cap = ceil(capacity * T * k / E) assignments to each expert. They are kept
first come, first served in position order (a token's k assignments go to distinct
experts, so there are no ties); the rest are dropped. A drop therefore depends only on the
row's own prefix: the forward is causal, and rows are independent, so a batch split across
ranks drops exactly what the whole batch drops. (A window-wide lowest-affinity rule let
later bytes and other rows decide earlier drops: 3.7e-3..1.1e-2 of logit change before the
perturbed byte on `tiny`.) The reference is `references/moe_capacity.py`. A dropped
assignment contributes exactly zero and passes no gradient; the token's other gate
weights are NOT renormalised again (the token simply loses that share), which keeps a
drop a pure subtraction from the dropless output.

Decoding (`forward(h, cache=...)`, capacity mode): the cache carries each row's assignments
per expert so far and the position, so byte-by-byte steps drop exactly what the forward
over a row of `cache["row_len"]` bytes drops; after row_len bytes the counts restart, as a
new window's would in training.

LFB (loss-free balancing, `moe_lb_coef`): `lfb_counts` accumulates selected assignments
per expert in training forwards (not in eval, not when the coef is 0, and not in an
activation-checkpoint recompute inside backward); `lfb_update(reduce)` moves
`lfb_bias += coef * sign(mean(counts) - counts)` and zeroes the counts. `reduce` is how
a fleet steers with the fleet's counts; this module never imports torch.distributed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dormouse.config import ModelConfig
from dormouse.model.arms import Arm, announce, check_request, choose_arm, moe_shape
from dormouse.model.layers import at_least_fp32

#: The grouped matmul this torch provides: the public name (present in 2.11 and 2.13) or
#: the private op it wraps. Same (mat_a, mat_b, *, offs) contract for 2D x 3D; both
#: differentiable (checked forward + backward on 2.13 CPU and 2.11 CUDA H200).
_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def expert_order(flat_e: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inv) of the assignments' stable sort by expert, counted instead of sorted: slot
    inv[i] = (assignments to lower experts) + (earlier assignments to i's expert), and order is
    its inverse. The same permutation as `torch.sort(flat_e, stable=True)`, from a one-hot
    column scan, a gather and a scatter: a radix sort is several kernels and copies per call
    (small's CUDA profile: 64 radix-sort launches and 349 small copies a step)."""
    E = counts.shape[0]
    onehot = (flat_e.unsqueeze(1) == torch.arange(E, device=flat_e.device)).to(torch.int32)
    rank = onehot.cumsum(0).gather(1, flat_e.unsqueeze(1)).squeeze(1) - 1
    inv = (torch.cumsum(counts, 0) - counts)[flat_e] + rank
    order = torch.empty_like(inv).scatter_(0, inv, torch.arange(inv.numel(), device=inv.device))
    return order, inv


class _GatherRows(torch.autograd.Function):
    """out = x[fwd] where every row of x is read exactly k times (the k assignments of a
    token, or k = 1: a permutation), and `back` lists, for row r of x, its k readers in
    order: x.grad[r] = sum_c g[back[r * k + c]]. Autograd's own backward of x[fwd] is an
    index_put with accumulation (a sort, then a kernel that adds duplicates serially); this
    is one gather and a fixed-order sum, deterministic. (Its own saving on the H200 was not
    timed apart: the compiled profile's 3.3 ms accumulating kernel was the expert counts.)"""

    @staticmethod
    def forward(ctx, x, fwd, back, k: int):
        ctx.save_for_backward(back)
        ctx.k = k
        return x.index_select(0, fwd)

    @staticmethod
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        gx = g.index_select(0, back)
        if ctx.k > 1:
            gx = gx.view(-1, ctx.k, g.shape[-1]).sum(1)
        return gx, None, None, None


def _experts_grouped(xs, counts, w1, w3, w2):
    """xs [A, D] sorted by expert, counts [E] -> [A, D]: one grouped GEMM per projection."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = F.silu(_GMM(xs, w1, offs=offs)) * _GMM(xs, w3, offs=offs)
    return _GMM(h, w2, offs=offs)


def _experts_dense(x, weight, w1, w3, w2):
    """x [N, D], weight [N, E] (a token's gate for the experts it picked, 0 elsewhere) -> [N, D].

    sum_e weight[:, e] * swiglu_e(x) with every expert applied to every row: the gate and up
    projections of all E experts are one [D, E*2F] matmul, the down projections one [E*F, D]
    matmul over the weighted activations. A zero weight zeroes that expert's share of the
    output and of every gradient, so the result is the dispatch arms' function."""
    n, (E, D, F_) = x.shape[0], w1.shape
    w13 = torch.cat([w1, w3], dim=2).transpose(0, 1).reshape(D, E * 2 * F_)
    a, b = (x @ w13).view(n, E, 2, F_).unbind(2)
    h = F.silu(a) * b * weight.to(x.dtype).unsqueeze(-1)
    return h.reshape(n, E * F_) @ w2.reshape(E * F_, D)


def _experts_batched(xs, slot, n_experts, width, w1, w3, w2):
    """xs [A, D] (dropped rows already zero), slot [A] into a [E, width, D] buffer -> [A, D].

    Padding rows are zero, and a zero row stays zero through a bias-free SwiGLU, so the
    padding adds nothing and receives no gradient. Dropped assignments all share their
    expert's last (trash) slot; their rows are zero, so which write wins is irrelevant.
    """
    d = xs.shape[1]
    buf = xs.new_zeros(n_experts * width, d).index_put((slot,), xs).view(n_experts, width, d)
    h = F.silu(torch.bmm(buf, w1)) * torch.bmm(buf, w3)
    return torch.bmm(h, w2).view(n_experts * width, d)[slot]


#: Under torch.compile (compile=true) these run eager, between compiled regions: the grouped
#: matmul's CPU kernel takes fp32 where inductor's lowering asks for bf16 ("Expected inputs
#: of BF16", torch 2.13 CPU), and the dropless batched arm's width is the batch's largest
#: expert load, read to the host, on which a compiled graph would specialise and recompile at
#: every new width (measured: past torch's recompile limit within 5 steps of tiny).
_experts_grouped_eager = torch.compiler.disable(_experts_grouped)


@torch.compiler.disable
def _experts_dropless_batched(xs, counts, e_sorted, n_experts, w1, w3, w2):
    """The batched arm without capacity: each expert's buffer is as wide as the batch's
    largest expert load (+1 trash slot, unused here)."""
    a = xs.shape[0]
    width = int(counts.max().item()) if a else 0
    start = torch.cumsum(counts, 0) - counts
    place = torch.arange(a, device=xs.device) - start[e_sorted]
    slot = e_sorted * (width + 1) + place
    return _experts_batched(xs, slot, n_experts, width + 1, w1, w3, w2)


@torch.compiler.assume_constant_result
def _arm_name(
    impl: str, d_model: int, d_ffn: int, n_experts: int, device: torch.device, dtype: torch.dtype
) -> str:
    """MoE.arm's name, announced. A compiled graph calls this once while tracing and keeps the
    answer (asking the card for its name and capability inside the graph would split it)."""
    shape = {"d_model": d_model, "d_ffn": d_ffn, "n_experts": n_experts}
    return announce(choose_arm("moe", impl, device, dtype, shape)).name


class SharedExpert(nn.Module):
    """The always-on SwiGLU of hidden width `rank` (a low-rank FFN every token passes)."""

    def __init__(self, d_model: int, rank: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, rank, bias=False)
        self.w3 = nn.Linear(d_model, rank, bias=False)
        self.w2 = nn.Linear(rank, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # w1 and w3 read x in one matmul (x read once, one input-gradient product); the
        # parameters stay separate matrices for Muon
        a, b = F.linear(x, torch.cat([self.w1.weight, self.w3.weight])).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_request("moe", cfg.moe_impl)
        if not 1 <= cfg.moe_topk <= cfg.n_experts:
            raise ValueError(
                f"moe_topk={cfg.moe_topk} with n_experts={cfg.n_experts}: a token picks between "
                f"1 and n_experts experts; change --set moe_topk or --set n_experts"
            )
        E, D, Fh = cfg.n_experts, cfg.d_model, cfg.d_ffn
        self.n_experts, self.d_model, self.d_ffn, self.topk = E, D, Fh, cfg.moe_topk
        self.capacity = float(cfg.moe_capacity)
        self.lb_coef = float(cfg.moe_lb_coef)
        self.impl = cfg.moe_impl
        self.arm_shape = moe_shape(cfg)  # the dims the arm rule reads
        self.offload = bool(cfg.moe_offload)
        self.replay: dict | None = None  # routing replay for quantized checkpoints (route())
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, D, Fh))
        self.w3 = nn.Parameter(torch.empty(E, D, Fh))
        self.w2 = nn.Parameter(torch.empty(E, Fh, D))
        self.shared = SharedExpert(D, cfg.shared_rank) if cfg.shared_rank > 0 else None
        self.register_buffer("lfb_counts", torch.zeros(E))
        self.register_buffer("lfb_bias", torch.zeros(E))
        self.reset_parameters(cfg.init_std, depth=cfg.n_layers * cfg.max_iter)

    def reset_parameters(self, std: float, depth: int = 1) -> None:
        # Output projections write into the residual stream once per applied block
        # (n_layers * max_iter times); GPT-2's std / sqrt(2 * depth) keeps the stream's
        # variance from growing with depth at init.
        out_std = std / math.sqrt(2 * max(depth, 1))
        with torch.no_grad():
            for w in (self.router.weight, self.w1, self.w3):
                w.normal_(0.0, std)
            self.w2.normal_(0.0, out_std)
            if self.shared is not None:
                self.shared.w1.weight.normal_(0.0, std)
                self.shared.w3.weight.normal_(0.0, std)
                self.shared.w2.weight.normal_(0.0, out_std)

    # ---- routing -----------------------------------------------------------------

    def route(self, x: torch.Tensor, key=None):
        """x [N, D] -> (affinity s [N, E] fp32, experts [N, k], gates [N, k] fp32).

        The bias steers which experts are picked; the gates are the picked experts'
        unbiased affinities, renormalised to sum 1.

        With `self.replay` set (a dict; the model sets it while act_ckpt_quant checkpoints
        blocks) and a `key`, the forward records its choice and the recompute inside
        backward reuses it: the recompute sees a bf16-rounded input, and re-choosing there
        sent near-tie tokens' gradients to other experts (measured: 27% error on the
        expert weights; a crash on the batched arm, whose widths then changed).
        """
        with torch.autocast(device_type=x.device.type, enabled=False):
            xf = at_least_fp32(x)
            s = torch.sigmoid(F.linear(xf, self.router.weight.to(xf.dtype)))
        replay = self.replay if key is not None else None
        if replay is not None and torch._C._current_graph_task_id() != -1:
            experts = replay.pop(key)  # the recompute: the forward's choice
        else:
            experts = torch.topk(s.detach() + self.lfb_bias.to(s.dtype), self.topk, dim=-1).indices
            if replay is not None:
                replay[key] = experts
        picked = s.gather(1, experts)
        return s, experts, picked / picked.sum(-1, keepdim=True)

    def capacity_of(self, row_len: int) -> int:
        """Assignments one expert may take from one row of row_len tokens (capacity mode)."""
        return math.ceil(self.capacity * row_len * self.topk / self.n_experts)

    def _first_come(self, experts: torch.Tensor, cap: int, prior: torch.Tensor | None):
        """experts [B, T, k] -> (place [B*T*k], seen [B, E]): the capacity rule for B rows.

        place = row * cap + (the assignment's arrival rank in its (row, expert), counting
        `prior` earlier ones) where that rank is < cap, else B * cap (dropped). Arrival order
        is the flat order: position-major, then the k picks. seen = prior + this chunk's
        assignments per (row, expert).
        """
        B, _T, _k = experts.shape
        E, dev = self.n_experts, experts.device
        grp = (torch.arange(B, device=dev).view(B, 1, 1) * E + experts).reshape(-1)
        # A stable sort by (row, expert) keeps each group in arrival order: rank = offset in it.
        order = torch.sort(grp, stable=True).indices
        sizes = grp.new_zeros(B * E).index_add_(0, grp, torch.ones_like(grp))  # = bincount
        start = torch.cumsum(sizes, 0) - sizes
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=dev) - start[grp[order]]
        seen = sizes.view(B, E)
        if prior is not None:
            rank = rank + prior.reshape(-1)[grp]
            seen = seen + prior
        row = grp // E
        place = torch.where(rank < cap, row * cap + rank, torch.full_like(rank, B * cap))
        return place, seen

    def capacity_places(self, experts: torch.Tensor, cache: dict | None = None):
        """experts [B, T, k] -> (place [B*T*k], width): each assignment's slot among its
        expert's `width` slots, or `width` itself where the capacity rule drops it.

        Without a cache the rows are whole: cap = capacity_of(T), width = B * cap. With a
        decoding cache (a dict this MoE application owns, holding "row_len") the chunk
        continues the rows the cache has seen: cap = capacity_of(row_len), the counts carry
        over and restart every row_len bytes; a chunk crossing that border is cut there and
        each piece gets its own B * cap slots, so the pieces never share a slot.
        """
        B, T, _ = experts.shape
        if cache is None:
            cap = self.capacity_of(T)
            place = self._first_come(experts, cap, None)[0]
            return place, B * cap
        row_len = int(cache["row_len"])
        cap = self.capacity_of(row_len)
        pos, seen = cache.get("pos", 0), cache.get("seen")
        pieces, j = [], 0
        while j < T:
            if pos % row_len == 0:
                seen = None  # a new row of the cap begins
            n = min(T - j, row_len - pos % row_len)
            place, seen = self._first_come(experts[:, j : j + n], cap, seen)
            pieces.append(place.view(B, n, -1))
            j, pos = j + n, pos + n
        cache["pos"], cache["seen"] = pos, seen
        width = len(pieces) * B * cap
        for i, place in enumerate(pieces):
            pieces[i] = torch.where(place < B * cap, place + i * B * cap, width)
        place = torch.cat(pieces, 1).reshape(-1) if pieces else experts.new_empty(0)
        return place, width

    def arm(self, device, dtype: torch.dtype) -> Arm:
        """The dispatch arm on `device` (a torch device or a described `arms.Card`) at `dtype`."""
        return choose_arm("moe", self.impl, device, dtype, self.arm_shape)

    # ---- forward -----------------------------------------------------------------

    def forward(self, h: torch.Tensor, key=None, cache: dict | None = None):
        """h [B, T, D] (B rows) or [N, D] (one row) -> (out, aux). `cache`: see capacity_places."""
        shape = h.shape
        rows, row_len = (shape[0], shape[1]) if h.dim() == 3 else (1, shape[0])
        x = h.reshape(-1, self.d_model)
        n, k, E = x.shape[0], self.topk, self.n_experts
        _s, experts, gates = self.route(x, key)
        flat_e = experts.reshape(-1)
        # bincount's length depends on the data (max(E, largest id + 1)) and splits a
        # compiled graph. Not an index_add either: under inductor an accumulating index_put,
        # whose sorted kernel adds each expert's thousands of ones serially (the H200's
        # compiled profile of small: `indexing_backward_kernel_stride_1`, 8 calls a step =
        # one per MoE call, 3.3 of 22 GPU ms; absent from the eager profile). A compare
        # against the E ids and a column sum: the same integers, one fused reduction.
        counts = (flat_e.unsqueeze(1) == torch.arange(E, device=flat_e.device)).sum(0)
        # An activation-checkpoint recompute runs this forward again inside backward; the
        # controller must see each token once.
        if self.training and self.lb_coef != 0 and torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                self.lfb_counts += counts.to(self.lfb_counts.dtype)

        place = width = None
        if self.capacity > 0:
            place, width = self.capacity_places(experts.view(rows, row_len, k), cache)
        ctx = (
            torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            if self.offload
            else contextlib.nullcontext()
        )
        with ctx:
            routed = self._routed(x, flat_e, gates.reshape(-1), counts, place, width)
        out = routed.to(h.dtype)
        if self.shared is not None:
            out = out + self.shared(x).to(h.dtype)
        if place is None:
            dropped = torch.zeros((), dtype=torch.long, device=x.device)
        else:
            dropped = (place == width).sum()
        aux = {
            "load": (counts.float() / max(n * k, 1)).detach(),
            "dropped": dropped,
        }
        return out.reshape(shape), aux

    def _routed(self, x, flat_e, flat_g, counts, place, width):
        """The routed experts' sum per token; `place`/`width` from the capacity rule or None."""
        n, k, E = x.shape[0], self.topk, self.n_experts
        dev = x.device
        if torch.is_autocast_enabled(dev.type):
            cdt = torch.get_autocast_dtype(dev.type)
        else:
            cdt = x.dtype
        arm = _arm_name(self.impl, self.d_model, self.d_ffn, E, dev, cdt)
        if place is not None:  # a dropped assignment passes nothing
            flat_g = torch.where(place < width, flat_g, torch.zeros((), device=dev))
        w1, w3, w2 = (w.to(cdt) for w in (self.w1, self.w3, self.w2))
        if arm == "dense":
            # picked experts are distinct per token, so a scatter (not an add) places the gates
            weight = flat_g.new_zeros(n, E).scatter(1, flat_e.view(n, k), flat_g.view(n, k))
            return at_least_fp32(_experts_dense(x.to(cdt), weight, w1, w3, w2))
        order, inv = expert_order(flat_e, counts)
        e_sorted = flat_e[order]
        # sorted slot j holds assignment order[j] of token order[j] // k; token t's k
        # assignments sit at slots inv[t*k : t*k+k]
        xs = _GatherRows.apply(x, order // k, inv, k).to(cdt)
        if place is not None:
            place = place[order]
            keep = place < width
            xs = torch.where(keep[:, None], xs, torch.zeros((), dtype=cdt, device=dev))

        if arm == "grouped":
            grouped = _experts_grouped if dev.type == "cuda" else _experts_grouped_eager
            ys = grouped(xs, counts, w1, w3, w2)
        elif place is None:
            ys = _experts_dropless_batched(xs, counts, e_sorted, E, w1, w3, w2)
        else:
            # Each row owns `cap` slots of each expert (capacity) and slot `width` is the
            # trash slot for dropped assignments, so no slot depends on another row.
            slot = e_sorted * (width + 1) + place
            ys = _experts_batched(xs, slot, E, width + 1, w1, w3, w2)

        # Undo the sort (a permutation: gather, not scatter) and sum each token's k
        # contributions in a fixed order, so the forward is deterministic on any device.
        contrib = at_least_fp32(_GatherRows.apply(ys, inv, order, 1)) * flat_g[:, None]
        return contrib.view(n, k, self.d_model).sum(1)

    # ---- LFB controller ------------------------------------------------------------

    @torch.no_grad()
    def lfb_update(self, reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                   ok: torch.Tensor | None = None):  # fmt: skip
        """After an optimizer step: bias += coef * sign(mean(counts) - counts); counts = 0.

        `reduce` (e.g. an all-reduce-sum) turns this process's counts into the fleet's, so
        every rank moves its bias identically. It may return the result or work in place
        and return None (torch.distributed.all_reduce does the latter). `ok` (a bool tensor:
        the step's verdict kept on the device): the bias moves only where it holds, the
        counts are forgotten either way (as lfb_discard forgets a skipped step's).
        """
        if self.lb_coef == 0:
            return
        counts = self.lfb_counts.clone()
        if reduce is not None:
            out = reduce(counts)
            if out is not None:
                counts = out
        move = self.lb_coef * torch.sign(counts.mean() - counts)
        self.lfb_bias += move if ok is None else move * ok.to(move.dtype)
        self.lfb_counts.zero_()
