"""The mutation list: plausible bugs that each gate must catch, applied as monkeypatches.

A gate that cannot fail proves nothing. Each entry plants ONE plausible bug by replacing a
named function, method, property or constant of `dormouse/` (found by name at run time, so
the list survives refactoring as long as the name does), names the gates that must FAIL with
it, and says where the bug lives:

* scope "fleet": inside every fleet rank the harness spawns (and every process a gate
  launches, through a sitecustomize on PYTHONPATH), never in the gate's own process, where
  the single-process references run unpatched;
* scope "process": in the gate's own process (gates that call dormouse functions directly:
  capacity parsing, the device policy, the launch rules, the model's kernel arms);
* scope "source": a bug in code the single process and the fleet share (the loss, the clip,
  the schedule, the optimizer, LFB, the data order, evaluation, resume state): planted in
  the gate's own process AND in every fleet rank, so the fleet and its one-process reference
  carry it alike. Only a gate that holds the trainer to the equations (g32, g33) or to a
  bound of its own (g01: the fixture must learn) can see it.

`python -m gates --mutations` runs every entry against its gates and writes
docs/mutations.md; `pytest -m mutation` does the same as tests. A mutation counts as caught
only when the gate returns a FAIL record by its verdict: a gate that crashed (an exception,
a fleet that died or hung) has not shown that its instrument sees the bug.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

_MISSING = object()
_IN_PROCESS = ("process", "source")


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # the plausible bug, in words
    patches: tuple[tuple[str, Callable[[Any], Any]], ...]  # ("module:Qual.name", make(original))
    gates: tuple[str, ...]  # every one of these must FAIL by verdict
    scope: str = "fleet"  # "fleet", "process" or "source" (see the module docstring)


def _resolve(target: str):
    module, _, qual = target.partition(":")
    owner: Any = importlib.import_module(module)
    *path, attr = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _patch(target: str, make: Callable[[Any], Any]) -> Callable[[], None]:
    owner, attr = _resolve(target)
    if not hasattr(owner, attr):
        raise AttributeError(f"mutation target {target} does not exist (renamed?)")
    own = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr)
    original = getattr(owner, attr) if own is _MISSING else own
    setattr(owner, attr, make(original))

    def undo() -> None:
        if own is _MISSING:
            delattr(owner, attr)  # it was inherited: uncover the base class's again
        else:
            setattr(owner, attr, own)

    return undo


def apply(name: str) -> Callable[[], None]:
    """Plant mutation `name` in this process; returns the function that removes it."""
    m = BY_NAME[name]
    undos = [_patch(target, make) for target, make in m.patches]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


@contextlib.contextmanager
def planted(name: str):
    """Within the block: the gate's fleets (scope "fleet" or "source") and this process
    (scope "process" or "source") run mutation `name`."""
    from gates import harness

    m = BY_NAME[name]
    undo = apply(name) if m.scope in _IN_PROCESS else (lambda: None)
    harness.ACTIVE_MUTATION = name if m.scope in ("fleet", "source") else ""
    try:
        yield m
    finally:
        harness.ACTIVE_MUTATION = ""
        undo()


def apply_from_env() -> None:
    """For processes a gate launches (torchrun's workers): plant $DORMOUSE_MUTATION."""
    name = os.environ.get("DORMOUSE_MUTATION")
    if name:
        apply(name)


# ---- the bugs ------------------------------------------------------------------------------


def _never_last_micro_batch(orig):
    """parallelize whose no_sync hook treats every micro-batch as a non-final one."""
    import dataclasses

    def parallelize(model, ctx):
        w = orig(model, ctx)
        return dataclasses.replace(w, no_sync=lambda last: w.no_sync(False))

    return parallelize


def _prop(fn: Callable[[Any, Any], Any]) -> Callable[[Any], property]:
    """make() for a property: fn(self, original_value) -> mutated value."""
    return lambda orig: property(lambda self: fn(self, orig.fget(self)))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _own_verdict(orig):
    def all_finite(self, finite):
        orig(self, finite)  # every rank still takes part in the collective...
        return finite  # ...and then goes by its own verdict

    return all_finite


def _own_verdict_off_rank0(orig):
    def all_finite(self, finite):
        agreed = orig(self, finite)
        return agreed if self.rank == 0 else finite

    return all_finite


def _own_device_verdict(orig):
    def all_finite_on_device(self, ok):
        orig(self, ok)  # the all-reduce still runs on every rank...
        return ok  # ...and each goes by its own verdict

    return all_finite_on_device


def _transaction_without_restore(orig):
    def _transacted(self, body):
        body()  # the step runs; nothing is copied aside or put back

    return _transacted


def _zg_step(orig):
    return lambda self, *a, **kw: (setattr(self, "_mut_stepped", True), orig(self, *a, **kw))[1]


def _zg_zero(orig):
    def zero_grad(self, set_to_none=True):
        if getattr(self, "_mut_stepped", False):
            self._mut_stepped = False
            orig(self, set_to_none)

    return zero_grad


def _hook_without_division(orig):
    def compress(dtype):
        mean = orig(dtype)

        def hook(state, bucket):
            import torch.distributed as dist

            bucket.buffer().mul_(dist.get_world_size())  # the bug: the hook's division undone
            return mean(state, bucket)

        return hook

    return compress


def _merge_in_rank_order_of(orig):
    def merge(parts, world_size):
        r = _rank() % max(1, len(parts))
        return orig(list(parts[r:]) + list(parts[:r]), world_size)  # each rank starts with its own

    return merge


def _ignore_seq(orig):
    def parse(spec, world_size, batch, seq_len, max_seq_len, rates=None, global_batch=0):
        from dormouse.train.context import RankShape

        shapes = orig(spec, world_size, batch, seq_len, max_seq_len, rates=rates,
                      global_batch=global_batch)  # fmt: skip
        return [RankShape(s.batch, seq_len, s.accum) for s in shapes]

    return parse


def _remainder_to_rank0(orig):
    def split(rates, global_batch):
        orig(rates, global_batch)  # keep its refusals
        total = sum(rates)
        out = [max(1, int(global_batch * r / total)) for r in rates]
        out[0] += global_batch - sum(out)
        return out

    return split


def _unweighted_fleet_loss(_orig):
    def fleet_loss(self, loss):
        import torch
        import torch.distributed as dist

        x = loss.detach().to(device=self.device, dtype=torch.float64).reshape(1)
        dist.all_reduce(x)
        return float(x.item()) / self.world

    return fleet_loss


def _first_copy_only(orig):
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        gx = g.index_select(0, back)
        if ctx.k > 1:
            gx = gx.view(-1, ctx.k, g.shape[-1])[:, 0]
        return gx, None, None, None

    return staticmethod(backward)


def _clip_over_parameters(_orig):
    def clip_grad_norm_(self, max_norm):
        import torch

        owners = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in owners], 2.0)
        torch.nn.utils.clip_grads_with_norm_(owners, max_norm, total)
        return total

    return clip_grad_norm_


def _fp32_reduce_in_bf16(orig):
    import torch

    return {**orig, "fp32": torch.bfloat16}


def _gloo_when_nccl_missing(orig):
    def choose(device_type, nccl_available=None):
        if device_type == "cuda" and nccl_available is False:
            return "gloo"
        return orig(device_type, nccl_available)

    return choose


def _accept_dist_without_fleet(orig):
    def check(dist_flag, env):
        if dist_flag and env.get("WORLD_SIZE", "1") in ("", "1"):
            return True
        return orig(dist_flag, env)

    return check


def _save_step_plus_one(orig):
    def save(path, *, step, **kw):
        return orig(path, step=step + 1, **kw)

    return save


def _window_wide_cap(orig):
    def capacity_places(self, experts, cache=None):
        B, T, k = experts.shape
        return orig(self, experts.reshape(1, B * T, k), cache)  # the whole window as one row

    return capacity_places


def _shards_in_place(orig):
    def staging(path):
        import shutil

        import torch

        tmp = orig(path)  # every rank still learns a temporary name...
        ck = torch.load(path, weights_only=True) if path.is_file() else {}
        if not ck.get("shards"):
            return tmp
        shutil.rmtree(tmp, ignore_errors=True)
        return path.parent / ck["shards"]  # ...and writes into the live checkpoint's directory

    return staging


def _own_staging_dir(orig):
    def staging(path):
        import tempfile
        from pathlib import Path

        tmp = orig(path)
        if _rank() == 0:
            return tmp
        return Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                                     suffix=".tmp"))  # each rank its own directory

    return staging


def _polar_of_own_rows(_orig):
    # each rank orthogonalises the rows it holds (its shard, zeros elsewhere: polar([A; 0]) is
    # [polar(A); 0]) instead of the whole matrix; no collective
    def whole(params, U, sizes, R, C):
        import torch

        from dormouse.train.optim.muon import shard_rows

        out = []
        for p, u in zip(params, U.split(sizes)):
            _, first, n = shard_rows(p)
            row = p.numel() // p.shape[0]
            full = u.new_zeros(p.numel())
            full[first * row:(first + n) * row] = u
            out.append(full.view(-1, R, C))
        return torch.cat(out)

    return whole


def _rows_from_zero(orig):
    def shard_rows(p):
        chunk, _first, rows = orig(p)
        return chunk, 0, rows

    return shard_rows


def _switch_keeps_stream(orig):
    def switch(self, split):
        inner = self.inner
        orig(self, split)
        self.inner = inner

    return switch


def _switch_keeps_context(orig):
    def switch(self, split):
        ctx = self.ctx
        orig(self, split)
        self.ctx = ctx

    return switch


def _no_hysteresis(orig):
    def decide(self, *args):
        self.threshold = 0.0
        return orig(self, *args)

    return decide


def _keys_by_local_row(orig):
    import torch

    from dormouse.model.layers import row_keys

    def dropout_keys(model, ctx, seed, step, rows):
        if orig(model, ctx, seed, step, rows) is None:
            return None
        return row_keys(seed, step, torch.arange(rows))  # each rank numbers its rows from 0

    return dropout_keys


def _phase_per_rank(orig):
    def phase(self, n_pass):
        return (orig(self, n_pass) + self.offset) % self.view.shape[0]  # each rank its own

    return phase


def _scale_on_fp16_ranks_only(_orig):
    import torch

    return lambda autocast, ctx: autocast == torch.float16  # the fleet's dtypes unread


def _unscale_off_rank1(orig):
    def unscale_(self, inverse):
        if _rank() != 1:  # rank 1 is the gate's fp16 rank
            orig(self, inverse)

    return unscale_


def _keep_orig_mod(orig):
    def strip_name(name):
        out = orig(name)
        return f"_orig_mod.{out}" if name.startswith("_orig_mod.") else out

    return strip_name


def _strip_module_first(orig):
    """The name rule that peels a leading 'module' before the wrapper tokens: under
    torch.compile(DDP(model)) '_orig_mod.module.head.weight' keeps 'module.' and the head
    falls to Muon."""
    from dormouse.train.optim.routing import _WRAPPER_TOKENS

    def strip_name(name):
        parts = name.split(".")
        while parts and parts[0] == "module":
            parts = parts[1:]
        return ".".join(p for p in parts if p not in _WRAPPER_TOKENS)

    return strip_name


# ---- bugs in the shared source (scope "source"): the single process carries them too ------------


def _muon_decay_base_lr(orig):
    def muon_step_(g, buf, offsets, absmax=None, lr_t=None):
        import torch

        if g["weight_decay"]:
            with torch.no_grad():
                for p in g["params"]:
                    if p.grad is not None:
                        p.mul_(1.0 - g["base_lr"] * g["weight_decay"])  # the unscheduled lr
        return orig({**g, "weight_decay": 0.0}, buf, offsets, absmax, lr_t)

    return muon_step_


def _cosine_from_step_zero(orig):
    def lr_factor(step, cfg):
        import math

        if (cfg.warmup and step < cfg.warmup) or cfg.schedule != "cosine" or (
                cfg.steps <= cfg.warmup):
            return orig(step, cfg)
        lo = cfg.min_lr_frac  # progress counted from step 0, the warm-up forgotten
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, cfg.steps))))

    return lr_factor


def _eval_in_train_mode(orig):
    def _sums(model, batches, device, autocast_dtype, pad=None):
        model.__dict__["eval"] = lambda: model  # model.eval() forgotten: a no-op
        try:
            return orig(model, batches, device, autocast_dtype, pad)
        finally:
            model.__dict__.pop("eval", None)

    return _sums


def _clip_zero_clips_all(orig):
    def clip_grad_norm_(self, max_norm):
        import math

        # the loop's `grad_clip > 0` read as `>= 0`: grad_clip=0 clips to a norm of 0
        return orig(self, 0.0 if math.isinf(max_norm) else max_norm)

    return clip_grad_norm_


def _clip_not_clamped(orig):
    def clip_grad_norm_(self, max_norm):
        import math

        import torch

        total = orig(self, math.inf)  # the norm; nothing scaled
        if math.isfinite(max_norm):
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            grads += [h.grad for h in (s.consolidate() for _, s in self._host) if h is not None]
            # clip / norm without min(1, .): a step under the threshold is scaled UP to it
            torch._foreach_mul_(grads, max_norm / (float(total) + 1e-6))
        return total

    return clip_grad_norm_


def _from_config_dropping(field: str, default):
    def make(orig):
        fn = orig.__func__

        def from_config(cls, model, train_cfg, device_type):
            import dataclasses

            return fn(cls, model, dataclasses.replace(train_cfg, **{field: default}), device_type)

        return classmethod(from_config)

    return make


def _skip_zeroes_bias(_orig):
    def lfb_discard(self):
        import torch

        with torch.no_grad():
            for block in self.blocks:
                block.moe.lfb_bias.zero_()  # the bias, not the counts

    return lfb_discard


def _k_unnormalised(orig):
    calls = [0]

    def _l2norm(x, *args, **kw):
        calls[0] += 1
        return orig(x, *args, **kw) if calls[0] % 2 else x  # q, k = _l2norm(q), k

    return _l2norm


def _without_since_best(orig):
    return lambda self: {k: v for k, v in orig(self).items() if k != "since_best"}


def _times_temperature(orig):
    def sample_next(logits, temperature, top_k=0, generator=None):
        if temperature > 0:
            logits = logits.float() * temperature * temperature  # then / T: x T in all
        return orig(logits, temperature, top_k, generator)

    return sample_next


def _loss_on_byte_after_next(orig):
    def forward(self, x, y=None, keys=None):
        import torch.nn.functional as F

        logits, loss, aux = orig(self, x, y, keys=keys)
        if y is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                   y[:, 1:].reshape(-1))  # fmt: skip
        return logits, loss, aux

    return forward


def _gates_not_renormalised(orig):
    def route(self, x, key=None):
        s, experts, _ = orig(self, x, key)
        return s, experts, s.gather(1, experts)

    return route


def _decay_ignores_input(orig):
    def _inputs(self, x, iteration, conv_tail, y):
        import torch

        q, k, v, g, beta, tail = orig(self, x, iteration, conv_tail, y)
        g = (-torch.exp(self.A_log.to(g.dtype))).expand(*g.shape[:2], -1).reshape(g.shape)
        return q, k, v, g, beta, tail

    return _inputs


def _mix32_one_round(_orig):
    return lambda h: ((h >> 16) ^ h) * 0x45D9F3B & 0xFFFFFFFF


def _decay_every_adamw_tensor(orig):
    def _classify(name, shape, kind):
        owner, reason, decay = orig(name, shape, kind)
        return owner, reason, decay or owner == "adamw"

    return _classify


def _row_adam_one_correction(_orig):
    def _adam_rows(p, m, v, k, g, lr, betas, eps):
        import torch

        b1, b2 = betas
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size = (lr / (1 - torch.pow(b1, k.to(torch.float64)))).to(p.dtype).unsqueeze(1)
        return p + (-step_size) * m / (v.sqrt() + eps)  # no second bias correction

    return _adam_rows


def _lfb_toward_the_busy(orig):
    def lfb_update(self, reduce=None, ok=None):
        self.lfb_counts.neg_()  # sign(counts - mean): the bias moves toward the busy experts
        return orig(self, reduce, ok)

    return lfb_update


def _bias_not_persistent(orig):
    def __init__(self, cfg):
        orig(self, cfg)
        self._non_persistent_buffers_set.add("lfb_bias")

    return __init__


MUTATIONS: list[Mutation] = [
    Mutation("loss_scale_world_squared",
             "the loss scale is world_size^2 * t_r / sum(t): every fleet gradient is world_size "
             "times too large (the clip used to rescale it away)",
             (("dormouse.train.context:DPContext.loss_scale",
               _prop(lambda self, v: v * self.world)),),
             ("g01_trajectory", "g03_unequal", "g04_fsdp", "g14_engram_ram_fleet", "g16_clip")),
    Mutation("loss_scale_unweighted",
             "every rank's loss scaled by 1: the reducer's mean is the mean of the ranks' means, "
             "not the token-weighted mean",
             (("dormouse.train.context:DPContext.loss_scale", _prop(lambda self, v: 1.0)),),
             ("g03_unequal", "g14_engram_ram_fleet")),
    Mutation("ranks_read_the_same_bytes",
             "every rank's window starts at the fleet block's first byte (offset 0): the ranks "
             "train on copies of one window",
             (("dormouse.train.context:DPContext.offset", _prop(lambda self, v: 0)),),
             ("g01_trajectory", "g20_data")),
    Mutation("mixture_source_per_rank",
             "the mixture's source for a step is drawn with a rank-dependent key: ranks read "
             "different corpora in one step",
             (("dormouse.train.data:Mixture.source_at",
               lambda orig: lambda self, step: orig(self, step + _rank())),),
             ("g20_data",)),
    Mutation("bf16_reduce_without_division",
             "the bf16 comm hook all-reduces the SUM: the gradient is world_size times too large",
             (("dormouse.train.fleet.parallelize:compress_hook", _hook_without_division),),
             ("g17_bf16_reduce",)),
    Mutation("own_verdict_off_rank0",
             "ranks other than 0 act on their local finiteness verdict instead of the agreed one",
             (("dormouse.train.context:DPContext.all_finite", _own_verdict_off_rank0),),
             ("g05_nonfinite",)),
    Mutation("own_verdict_everywhere",
             "every rank acts on its local finiteness verdict (the collective's result unused)",
             (("dormouse.train.context:DPContext.all_finite", _own_verdict),),
             ("g02_identical", "g05_nonfinite")),
    Mutation("own_device_verdict",
             "verdict=device: every rank steps by its local verdict tensor (the device "
             "all-reduce's result unused)",
             (("dormouse.train.context:DPContext.all_finite_on_device", _own_device_verdict),),
             ("g05_nonfinite",)),
    Mutation("device_skip_restores_nothing",
             "verdict=device: the optimizer's copy aside is never put back, so a refused step "
             "is taken",
             (("dormouse.train.optim.mix:_StepGraph._transacted", _transaction_without_restore),),
             ("g05_nonfinite",)),
    Mutation("device_lfb_ignores_verdict",
             "verdict=device: the LFB bias moves on a refused step (its mask dropped)",
             (("dormouse.model.moe:MoE.lfb_update",
               lambda orig: lambda self, reduce=None, ok=None: orig(self, reduce)),),
             ("g05_nonfinite",)),
    Mutation("skip_keeps_gradient",
             "zero_grad only after a taken step: a skipped step's gradient leaks into the next",
             (("dormouse.train.optim.mix:MixOptimizer.step", _zg_step),
              ("dormouse.train.optim.mix:MixOptimizer.zero_grad", _zg_zero)),
             ("g05_nonfinite",)),
    Mutation("skip_keeps_lfb_counts",
             "a skipped step's router counts stay in lfb_counts and steer the next bias update",
             (("dormouse.model.model:DormouseModel.lfb_discard",
               lambda orig: lambda self: None),),
             ("g05_nonfinite",)),
    Mutation("host_rows_rank_order",
             "host Engram rows merged starting from the rank's own rows (a rank-dependent "
             "summation order: equal at world 2, a+b == b+a)",
             (("dormouse.train.context:merge_row_grads", _merge_in_rank_order_of),),
             ("g14_engram_ram_fleet",)),
    Mutation("host_rows_not_reduced",
             "the host Engram rows are never reduced: each rank steps its own rows",
             (("dormouse.train.context:DPContext.reduce_host_grads",
               lambda orig: lambda self, model: None),),
             ("g14_engram_ram_fleet", "g24_fsdp_muon")),
    Mutation("capacity_ignores_window_length",
             "--capacity B x T: the per-rank window length T is dropped (every rank gets seq_len)",
             (("dormouse.train.fleet.launch:parse_capacity", _ignore_seq),),
             ("g09_capacity",), scope="process"),
    Mutation("capacity_remainder_to_rank0",
             "capacity auto: floor shares, the whole remainder to rank 0",
             (("dormouse.train.fleet.launch:split_by_rates", _remainder_to_rank0),),
             ("g09_capacity",), scope="process"),
    Mutation("capacity_shares_not_packed",
             "capacity auto under global_batch: the rates' split as it is, a prime share run "
             "as micro-batches of one window",
             (("dormouse.train.fleet.launch:packed_split", lambda orig: lambda split, *a, **k: tuple(split)),),
             ("g09_capacity",), scope="process"),
    Mutation("fleet_loss_unweighted",
             "the logged fleet loss is the plain mean of the ranks' losses (not token-weighted)",
             (("dormouse.train.context:DPContext.fleet_loss", _unweighted_fleet_loss),),
             ("g10_torchrun", "g21_multinode")),
    Mutation("one_rank_gradient_1pct",
             "rank 1's gradient 1% too large (a per-rank scale slightly off)",
             (("dormouse.train.context:DPContext.loss_scale",
               _prop(lambda self, v: v * 1.01 if self.rank == 1 else v)),),
             ("g12_fsdp_checkpoint",)),
    Mutation("fsdp_reduces_in_bf16",
             "dist_reduce=fp32 maps to a bf16 reduce dtype in FSDP2's mixed-precision policy: the "
             "'exact' reduce rounds every gradient to bf16",
             (("dormouse.train.fleet.parallelize:REDUCE_DTYPES", _fp32_reduce_in_bf16),),
             ("g04_fsdp", "g16_clip")),
    Mutation("nccl_falls_back_to_gloo",
             "a CUDA fleet without NCCL quietly runs on gloo",
             (("dormouse.train.fleet.launch:choose_backend", _gloo_when_nccl_missing),),
             ("g06_nccl",), scope="process"),
    Mutation("dist_without_fleet_accepted",
             "--dist with WORLD_SIZE unset or 1 is accepted (a one-rank 'fleet')",
             (("dormouse.train.fleet.launch:check_launch", _accept_dist_without_fleet),),
             ("g07_launch",), scope="process"),
    Mutation("every_rank_is_main",
             "every rank believes it is rank 0: all write checkpoints, metrics and log lines",
             (("dormouse.train.context:DPContext.is_main", _prop(lambda self, v: True)),),
             ("g08_rank0",)),
    Mutation("lfb_counts_not_reduced",
             "each rank moves its LFB bias by its own counts (no all-reduce)",
             (("dormouse.train.context:DPContext.lfb_reduce", _prop(lambda self, v: None)),),
             ("g11_lfb",)),
    Mutation("accum_scale_whole_rank",
             "each micro-batch's loss scaled by the rank's whole share (world * t_rank / sum(t)) "
             "instead of the micro-batch's: an accumulating rank's gradient is k times too large",
             (("dormouse.train.context:DPContext.loss_scale",
               _prop(lambda self, v: self.world * self.shape.tokens / self.global_tokens)),),
             ("g26_accumulation",)),
    Mutation("accum_last_microbatch_unsynced",
             "the last micro-batch's backward also runs under no_sync: no gradient is ever "
             "reduced, each rank steps on its own windows",
             (("dormouse.train.fleet.parallelize:parallelize", _never_last_micro_batch),),
             ("g26_accumulation",)),
    Mutation("muon_polar_of_own_rows",
             "FSDP2 Muon: each rank runs the polar on the rows it holds (its shard) instead of "
             "the all-gathered whole matrix",
             (("dormouse.train.optim.muon:_whole_matrices", _polar_of_own_rows),),
             ("g24_fsdp_muon",)),
    Mutation("muon_rows_from_row_zero",
             "FSDP2 Muon: each rank applies the whole polar's first rows (its shard's offset "
             "forgotten), not its own",
             (("dormouse.train.optim.muon:shard_rows", _rows_from_zero),),
             ("g24_fsdp_muon",)),
    Mutation("sharded_save_in_place",
             "a sharded save writes its shards straight into the live checkpoint's directory "
             "(no temporary one): a save killed midway leaves the previous checkpoint torn",
             (("dormouse.train.store.checkpoint:_staging_dir", _shards_in_place),),
             ("g25_sharded_ckpt",)),
    Mutation("sharded_save_own_dirs",
             "each rank makes its own temporary directory for the shards (rank 0's name is not "
             "shared): the committed directory lacks the other ranks' shards",
             (("dormouse.train.store.checkpoint:_staging_dir", _own_staging_dir),),
             ("g25_sharded_ckpt",)),
    Mutation("kda_fla_from_sm70",
             "the KDA arm's minimum sm set to (7, 0): fla's Triton kernel chosen on cards that "
             "cannot run it",
             (("dormouse.model.arms:FLA_MIN_SM", lambda orig: (7, 0)),),
             ("g13_policy",), scope="process"),
    Mutation("checkpoint_step_off_by_one",
             "the checkpoint records step + 1: a resume skips a step",
             (("dormouse.train.store.checkpoint:save_checkpoint", _save_step_plus_one),),
             ("g15_signal_stop", "g22_elastic")),
    Mutation("clip_misses_host_rows",
             "the clip's norm is taken over the parameters only (torch's clip over "
             "param_groups): host-RAM Engram rows are left out",
             (("dormouse.train.optim.mix:MixOptimizer.clip_grad_norm_", _clip_over_parameters),),
             ("g16_clip",)),
    Mutation("capacity_cut_window_wide",
             "the capacity MoE's cap and arrival order span the whole window (all rows) again: "
             "later bytes and other rows decide which earlier assignments drop",
             (("dormouse.model.moe:MoE.capacity_places", _window_wide_cap),),
             ("g18_causal",), scope="process"),
    Mutation("capacity_cut_window_wide_on_ranks",
             "the same window-wide capacity cut, on a fleet's ranks: each rank's drops then "
             "depend on which rows it holds",
             (("dormouse.model.moe:MoE.capacity_places", _window_wide_cap),),
             ("g23_capacity_fleet",)),
    Mutation("capacity_cap_off_by_one",
             "the per-row cap is one too large (rank <= cap kept instead of rank < cap)",
             (("dormouse.model.moe:MoE.capacity_of",
               lambda orig: lambda self, row_len: orig(self, row_len) + 1),),
             ("g19_kernels",), scope="process"),
    Mutation("moe_backward_first_copy_only",
             "the MoE dispatch's backward reads back only each token's first assignment: the "
             "gradient into a token misses its other k-1 experts' shares",
             (("dormouse.model.moe:_GatherRows.backward", _first_copy_only),),
             ("g19_kernels",), scope="process"),
    Mutation("dropout_keys_by_local_row",
             "dropout masks keyed by a rank's own row number (rows 0.. on every rank) instead of "
             "the row's place in the global batch",
             (("dormouse.train.step:dropout_keys", _keys_by_local_row),),
             ("g29_dropout",)),
    Mutation("phase_per_rank",
             "each rank draws its own pass phase (shifted by its offset): the ranks' slices no "
             "longer tile the single process's block",
             (("dormouse.train.data:ByteStream.phase", _phase_per_rank),),
             ("g29_dropout",)),
    Mutation("resplit_keeps_old_stream",
             "a re-split replaces the context but keeps reading the old slice (the stream is not "
             "rebuilt at the new offset and size)",
             (("dormouse.train.fleet.balance:FleetStream._switch", _switch_keeps_stream),),
             ("g27_resplit",)),
    Mutation("resplit_keeps_old_context",
             "a re-split rebuilds the stream but keeps the old DPContext: the loss scale and the "
             "fleet loss weigh the new windows by the old shares",
             (("dormouse.train.fleet.balance:FleetStream._switch", _switch_keeps_context),),
             ("g27_resplit",)),
    Mutation("resume_forgets_split",
             "a resume ignores the split stored in the checkpoint and continues in join's",
             (("dormouse.train.fleet.balance:FleetStream.load_state_dict",
               lambda orig: lambda self, sd: orig(self, {k: v for k, v in sd.items()
                                                         if k != "split"})),),
             ("g27_resplit",)),
    Mutation("rebalance_without_hysteresis",
             "the re-balancer takes any split its noisy rates predict to be faster (threshold 0)",
             (("dormouse.train.fleet.balance:Balancer.decide", _no_hysteresis),),
             ("g28_rebalance",), scope="process"),
    Mutation("rebalance_by_time",
             "the split is proportional to each rank's step time instead of its rate",
             (("dormouse.train.fleet.balance:split_capped",
               lambda orig: lambda rates, total, caps=None: orig([1 / r for r in rates], total,
                                                                 caps)),),
             ("g28_rebalance",), scope="process"),
    Mutation("loss_scale_on_fp16_ranks_only",
             "only a rank computing fp16 carries the loss scale: beside it a bf16 rank's gradient "
             "enters DDP's average unscaled, 2**16 times smaller than the fp16 rank's",
             (("dormouse.train.loop:loss_scaled", _scale_on_fp16_ranks_only),),
             ("g30_mixed_dtype",)),
    Mutation("fp16_rank_forgets_unscale",
             "the fp16 rank steps on the scaled gradient (no division by the scale before the "
             "clip and the optimizer)",
             (("dormouse.train.optim.mix:MixOptimizer.unscale_", _unscale_off_rank1),),
             ("g30_mixed_dtype",)),
    Mutation("compiled_ddp_names_keep_module",
             "parameter names under torch.compile(DDP(model)) keep 'module.' (the rule peels it "
             "before dropping _orig_mod): the head is routed to Muon instead of AdamW",
             (("dormouse.train.optim.routing:strip_name", _strip_module_first),),
             ("g31_compile_fleet",)),
    Mutation("compiled_names_keep_orig_mod",
             "the name rule forgets torch.compile's _orig_mod. prefix (DDP and FSDP2 alike): "
             "'_orig_mod.head.weight' is no head, and the head falls to Muon",
             (("dormouse.train.optim.routing:strip_name", _keep_orig_mod),),
             ("g31_compile_fleet",)),

    # ---- source: planted in the code the single process shares with the fleet ----
    Mutation("muon_decay_base_lr",
             "Muon's decoupled weight decay uses the base lr, not the scheduled one (too strong "
             "in warm-up and at the cosine floor)",
             (("dormouse.train.optim.mix:muon_step_", _muon_decay_base_lr),),
             ("g33_reference_step",), scope="source"),
    Mutation("cosine_from_step_zero",
             "the cosine's progress is counted from step 0, ignoring the warm-up (the lr drops "
             "at the end of warm-up)",
             (("dormouse.train.step:lr_factor", _cosine_from_step_zero),),
             ("g33_reference_step",), scope="source"),
    Mutation("eval_in_train_mode",
             "model.eval() dropped before validation: dropout in every evaluation, and its "
             "forwards move the LFB counts",
             (("dormouse.train.step:_sums", _eval_in_train_mode),),
             ("g33_reference_step",), scope="source"),
    Mutation("clip_zero_clips_all",
             "`grad_clip >= 0` instead of `> 0`: grad_clip=0 (off) clips to norm 0, zeroing "
             "every gradient; the run learns nothing",
             (("dormouse.train.optim.mix:MixOptimizer.clip_grad_norm_", _clip_zero_clips_all),),
             ("g01_trajectory", "g33_reference_step"), scope="source"),
    Mutation("clip_not_clamped",
             "the clip coefficient grad_clip / norm is not capped at 1: every step's gradient "
             "is scaled to the clip norm, small ones up",
             (("dormouse.train.optim.mix:MixOptimizer.clip_grad_norm_", _clip_not_clamped),),
             ("g33_reference_step",), scope="source"),
    Mutation("engram_lr_mult_dropped",
             "MixOptimizer.from_config drops engram_lr_mult: --set engram_lr_mult is silently "
             "ignored (the default 5 runs)",
             (("dormouse.train.optim.mix:MixOptimizer.from_config",
               _from_config_dropping("engram_lr_mult", 5.0)),),
             ("g33_reference_step",), scope="source"),
    Mutation("adam_eps_dropped",
             "MixOptimizer.from_config drops adam_eps: --set adam_eps is silently ignored "
             "(torch's 1e-8 runs)",
             (("dormouse.train.optim.mix:MixOptimizer.from_config",
               _from_config_dropping("adam_eps", 1e-8)),),
             ("g33_reference_step",), scope="source"),
    Mutation("skip_zeroes_lfb_bias",
             "a skipped step zeroes lfb_bias instead of lfb_counts: every non-finite skip "
             "erases the balancing bias",
             (("dormouse.model.model:DormouseModel.lfb_discard", _skip_zeroes_bias),),
             ("g33_reference_step",), scope="source"),
    Mutation("kda_k_unnormalised",
             "the torch KDA arm skips k's L2 norm (q is normalised, k is not)",
             (("dormouse.model.kda:_l2norm", _k_unnormalised),),
             ("g32_reference_model",), scope="source"),
    Mutation("kda_decay_ignores_input",
             "the KDA decay drops its input-dependent softplus term: g = -exp(A_log)",
             (("dormouse.model.kda:KDAMixer._inputs", _decay_ignores_input),),
             ("g32_reference_model",), scope="source"),
    Mutation("since_best_not_saved",
             "the early-stop counter (since_best) is not saved: patience restarts at every "
             "resume",
             (("dormouse.train.loop:_Best.state", _without_since_best),),
             ("g33_reference_step",), scope="source"),
    Mutation("sampling_times_temperature",
             "sampling multiplies the logits by the temperature: T=0.8 samples at 1.25, a low "
             "T gives near-uniform text",
             (("dormouse.model.sample:sample_next", _times_temperature),),
             ("g32_reference_model",), scope="source"),
    Mutation("loss_on_byte_after_next",
             "the loss is taken on logits[:, :-1] against y[:, 1:]: the model learns the byte "
             "after next",
             (("dormouse.model.model:DormouseModel.forward", _loss_on_byte_after_next),),
             ("g32_reference_model", "g33_reference_step"), scope="source"),
    Mutation("moe_gates_not_renormalised",
             "the MoE's top-k gates are the raw affinities, not renormalised over the picks",
             (("dormouse.model.moe:MoE.route", _gates_not_renormalised),),
             ("g32_reference_model",), scope="source"),
    Mutation("engram_hash_one_round",
             "the Engram hash's finaliser runs one multiply-xorshift round and no last shift: "
             "other rows (the tables of a checkpoint no longer line up)",
             (("dormouse.model.engram:_mix32", _mix32_one_round),),
             ("g32_reference_model",), scope="source"),
    Mutation("adamw_decays_1d",
             "AdamW decays every tensor it steps, norm gains, biases and the decay's dt_bias "
             "and A_log included",
             (("dormouse.train.optim.routing:_classify", _decay_every_adamw_tensor),),
             ("g33_reference_step",), scope="source"),
    Mutation("row_adam_one_correction",
             "the Engram row Adam drops its second bias correction (sqrt(v) for sqrt(v / (1 - "
             "b2^t)))",
             (("dormouse.train.optim.rowadam:_adam_rows", _row_adam_one_correction),),
             ("g33_reference_step",), scope="source"),
    Mutation("lfb_toward_the_busy",
             "the LFB update's sign is flipped: the bias steers more tokens to the busiest "
             "experts",
             (("dormouse.model.moe:MoE.lfb_update", _lfb_toward_the_busy),),
             ("g33_reference_step",), scope="source"),
    Mutation("lfb_bias_not_persistent",
             "lfb_bias is a non-persistent buffer: no checkpoint holds it, a resume restarts "
             "the balancing from zero",
             (("dormouse.model.moe:MoE.__init__", _bias_not_persistent),),
             ("g33_reference_step",), scope="source"),
    Mutation("phase_drawn_once",
             "the data phase is pass 0's in every pass: each later pass reads the same windows",
             (("dormouse.train.data:ByteStream.phase",
               lambda orig: lambda self, n_pass: orig(self, 0)),),
             ("g33_reference_step",), scope="source"),
    Mutation("block_order_drawn_once",
             "the block order is pass 0's permutation in every pass",
             (("dormouse.train.data:ByteStream.block",
               lambda orig: lambda self, step: orig(self, step % self.n_blocks)),),
             ("g33_reference_step",), scope="source"),
    Mutation("resume_restarts_data",
             "a resume does not restore the data position: the run reads its first blocks again",
             (("dormouse.train.data:ByteStream.load_state_dict",
               lambda orig: lambda self, sd: orig(self, {**sd, "step": 0})),),
             ("g33_reference_step",), scope="source"),
]

BY_NAME = {m.name: m for m in MUTATIONS}


# ---- running them ---------------------------------------------------------------------------


def run_one(m: Mutation, gate: str, cuda: bool = False) -> dict:
    """Run `gate` with `m` planted: one row of the table (caught only by a FAIL verdict)."""
    from gates import harness

    before = set(harness._memory)
    with _isolated_cache(m), planted(m.name):
        rec = harness.timed(gate, lambda: harness.load(gate).run(cuda=cuda))
    if m.scope in _IN_PROCESS:  # references computed while the bug sat in this process
        for key in set(harness._memory) - before:
            harness._memory.pop(key, None)
    crashed = rec.claim == "(gate crashed)"
    outcome = "caught" if not rec.passed and not crashed else ("crashed" if crashed else "MISSED")
    return {"mutation": m.name, "bug": m.bug, "scope": m.scope, "gate": gate,
            "outcome": outcome, "measured": rec.measured, "tolerance": rec.tolerance,
            "seconds": rec.seconds}


def run_named(mutation: str, gate: str) -> dict:
    """run_one by the mutation's name: what a worker process of `python -m gates --mutations
    --jobs N` is sent (a name pickles; the Mutation's patch functions need not)."""
    return run_one(BY_NAME[mutation], gate)


@contextlib.contextmanager
def _isolated_cache(m: Mutation):
    """A process-scope bug may change what a reference computes here: keep such results out
    of the cache that unmutated gates share (fleets are keyed by their mutation anyway)."""
    if m.scope not in _IN_PROCESS or "DORMOUSE_GATE_CACHE" not in os.environ:
        yield
        return
    old = os.environ.pop("DORMOUSE_GATE_CACHE")
    try:
        yield
    finally:
        os.environ["DORMOUSE_GATE_CACHE"] = old


def write_table(rows: list[dict], path) -> None:
    from pathlib import Path

    import torch

    caught = sum(r["outcome"] == "caught" for r in rows)
    lines = [
        "# Mutations: every gate must be able to fail",
        "",
        ("Generated by `python -m gates --mutations` (do not edit by hand). Each row plants one "
         "plausible bug (`gates/mutations.py`: a monkeypatch of a named function) and runs the "
         "gate that must catch it. `caught` = the gate returned FAIL by its own verdict; "
         "`crashed` or `MISSED` would be a gate without the power to fail. Scope: where the "
         "bug is planted: `fleet` inside every fleet rank, `process` in the gate's own process, "
         "`source` in both (the single-process reference carries it too: docs/references.md)."),
        "",
        f"torch {torch.__version__}, gloo on the CPU. {caught}/{len(rows)} caught.",
        "",
        "| mutation | the bug | scope | gate | outcome | measured (with the bug) | tolerance |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["mutation"], r["bug"], r["scope"], r["gate"], r["outcome"], r["measured"],
                 r["tolerance"]]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ")
                                        for c in cells) + " |")  # fmt: skip
    lines.append("")
    Path(path).write_text("\n".join(lines))
