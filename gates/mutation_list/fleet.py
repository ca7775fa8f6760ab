"""Bugs planted inside every fleet rank (scope "fleet"; gates/mutations.py says how): the
fleet's arithmetic (loss scales, reducers, host rows, sharded Muon), its agreed verdicts, its
checkpoints, data slices and splits. The gate's one-process reference runs unpatched.
"""

from __future__ import annotations

import os

from gates.mutation_list.common import Mutation, prop, this_rank
from gates.mutation_list.process import window_wide_cap


def _never_last_micro_batch(orig):
    """parallelize whose no_sync hook treats every micro-batch as a non-final one."""
    import dataclasses

    def parallelize(model, ctx):
        w = orig(model, ctx)
        return dataclasses.replace(w, no_sync=lambda last: w.no_sync(False))

    return parallelize


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
        r = this_rank() % max(1, len(parts))
        return orig(list(parts[r:]) + list(parts[:r]), world_size)  # each rank starts with its own

    return merge


def _unweighted_fleet_loss(_orig):
    def fleet_loss(self, loss):
        import torch
        import torch.distributed as dist

        x = loss.detach().to(device=self.device, dtype=torch.float64).reshape(1)
        dist.all_reduce(x)
        return float(x.item()) / self.world

    return fleet_loss


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


def _save_step_plus_one(orig):
    def save(path, *, step, **kw):
        return orig(path, step=step + 1, **kw)

    return save


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
        if this_rank() == 0:
            return tmp
        return Path(
            tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
        )  # each rank its own directory

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
            full[first * row : (first + n) * row] = u
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
        if this_rank() != 1:  # rank 1 is the gate's fp16 rank
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


MUTATIONS: list[Mutation] = [
    Mutation(
        "loss_scale_world_squared",
        "the loss scale is world_size^2 * t_r / sum(t): every fleet gradient is world_size "
        "times too large (the clip used to rescale it away)",
        (("dormouse.train.context:DPContext.loss_scale", prop(lambda self, v: v * self.world)),),
        ("g01_trajectory", "g03_unequal", "g04_fsdp", "g14_engram_ram_fleet", "g16_clip"),
    ),
    Mutation(
        "loss_scale_unweighted",
        "every rank's loss scaled by 1: the reducer's mean is the mean of the ranks' means, "
        "not the token-weighted mean",
        (("dormouse.train.context:DPContext.loss_scale", prop(lambda self, v: 1.0)),),
        ("g03_unequal", "g14_engram_ram_fleet"),
    ),
    Mutation(
        "ranks_read_the_same_bytes",
        "every rank's window starts at the fleet block's first byte (offset 0): the ranks "
        "train on copies of one window",
        (("dormouse.train.context:DPContext.offset", prop(lambda self, v: 0)),),
        ("g01_trajectory", "g20_data"),
    ),
    Mutation(
        "mixture_source_per_rank",
        "the mixture's source for a step is drawn with a rank-dependent key: ranks read "
        "different corpora in one step",
        (
            (
                "dormouse.train.data:Mixture.source_at",
                lambda orig: lambda self, step: orig(self, step + this_rank()),
            ),
        ),
        ("g20_data",),
    ),
    Mutation(
        "bf16_reduce_without_division",
        "the bf16 comm hook all-reduces the SUM: the gradient is world_size times too large",
        (("dormouse.train.fleet.parallelize:compress_hook", _hook_without_division),),
        ("g17_bf16_reduce",),
    ),
    Mutation(
        "own_verdict_off_rank0",
        "ranks other than 0 act on their local finiteness verdict instead of the agreed one",
        (("dormouse.train.context:DPContext.all_finite", _own_verdict_off_rank0),),
        ("g05_nonfinite",),
    ),
    Mutation(
        "own_verdict_everywhere",
        "every rank acts on its local finiteness verdict (the collective's result unused)",
        (("dormouse.train.context:DPContext.all_finite", _own_verdict),),
        ("g02_identical", "g05_nonfinite"),
    ),
    Mutation(
        "own_device_verdict",
        "verdict=device: every rank steps by its local verdict tensor (the device "
        "all-reduce's result unused)",
        (("dormouse.train.context:DPContext.all_finite_on_device", _own_device_verdict),),
        ("g05_nonfinite",),
    ),
    Mutation(
        "device_skip_restores_nothing",
        "verdict=device: the optimizer's copy aside is never put back, so a refused step is taken",
        (("dormouse.train.optim.mix:_StepGraph._transacted", _transaction_without_restore),),
        ("g05_nonfinite",),
    ),
    Mutation(
        "device_lfb_ignores_verdict",
        "verdict=device: the LFB bias moves on a refused step (its mask dropped)",
        (
            (
                "dormouse.model.moe:MoE.lfb_update",
                lambda orig: lambda self, reduce=None, ok=None: orig(self, reduce),
            ),
        ),
        ("g05_nonfinite",),
    ),
    Mutation(
        "skip_keeps_gradient",
        "zero_grad only after a taken step: a skipped step's gradient leaks into the next",
        (
            ("dormouse.train.optim.mix:MixOptimizer.step", _zg_step),
            ("dormouse.train.optim.mix:MixOptimizer.zero_grad", _zg_zero),
        ),
        ("g05_nonfinite",),
    ),
    Mutation(
        "skip_keeps_lfb_counts",
        "a skipped step's router counts stay in lfb_counts and steer the next bias update",
        (("dormouse.model.model:DormouseModel.lfb_discard", lambda orig: lambda self: None),),
        ("g05_nonfinite",),
    ),
    Mutation(
        "host_rows_rank_order",
        "host Engram rows merged starting from the rank's own rows (a rank-dependent "
        "summation order: equal at world 2, a+b == b+a)",
        (("dormouse.train.context:merge_row_grads", _merge_in_rank_order_of),),
        ("g14_engram_ram_fleet",),
    ),
    Mutation(
        "host_rows_not_reduced",
        "the host Engram rows are never reduced: each rank steps its own rows",
        (
            (
                "dormouse.train.context:DPContext.reduce_host_grads",
                lambda orig: lambda self, model: None,
            ),
        ),
        ("g14_engram_ram_fleet", "g24_fsdp_muon"),
    ),
    Mutation(
        "fleet_loss_unweighted",
        "the logged fleet loss is the plain mean of the ranks' losses (not token-weighted)",
        (("dormouse.train.context:DPContext.fleet_loss", _unweighted_fleet_loss),),
        ("g10_torchrun", "g21_multinode"),
    ),
    Mutation(
        "one_rank_gradient_1pct",
        "rank 1's gradient 1% too large (a per-rank scale slightly off)",
        (
            (
                "dormouse.train.context:DPContext.loss_scale",
                prop(lambda self, v: v * 1.01 if self.rank == 1 else v),
            ),
        ),
        ("g12_fsdp_checkpoint",),
    ),
    Mutation(
        "fsdp_reduces_in_bf16",
        "dist_reduce=fp32 maps to a bf16 reduce dtype in FSDP2's mixed-precision policy: the "
        "'exact' reduce rounds every gradient to bf16",
        (("dormouse.train.fleet.parallelize:REDUCE_DTYPES", _fp32_reduce_in_bf16),),
        ("g04_fsdp", "g16_clip"),
    ),
    Mutation(
        "every_rank_is_main",
        "every rank believes it is rank 0: all write checkpoints, metrics and log lines",
        (("dormouse.train.context:DPContext.is_main", prop(lambda self, v: True)),),
        ("g08_rank0",),
    ),
    Mutation(
        "lfb_counts_not_reduced",
        "each rank moves its LFB bias by its own counts (no all-reduce)",
        (("dormouse.train.context:DPContext.lfb_reduce", prop(lambda self, v: None)),),
        ("g11_lfb",),
    ),
    Mutation(
        "accum_scale_whole_rank",
        "each micro-batch's loss scaled by the rank's whole share (world * t_rank / sum(t)) "
        "instead of the micro-batch's: an accumulating rank's gradient is k times too large",
        (
            (
                "dormouse.train.context:DPContext.loss_scale",
                prop(lambda self, v: self.world * self.shape.tokens / self.global_tokens),
            ),
        ),
        ("g26_accumulation",),
    ),
    Mutation(
        "accum_last_microbatch_unsynced",
        "the last micro-batch's backward also runs under no_sync: no gradient is ever "
        "reduced, each rank steps on its own windows",
        (("dormouse.train.fleet.parallelize:parallelize", _never_last_micro_batch),),
        ("g26_accumulation",),
    ),
    Mutation(
        "muon_polar_of_own_rows",
        "FSDP2 Muon: each rank runs the polar on the rows it holds (its shard) instead of "
        "the all-gathered whole matrix",
        (("dormouse.train.optim.muon:_whole_matrices", _polar_of_own_rows),),
        ("g24_fsdp_muon",),
    ),
    Mutation(
        "muon_rows_from_row_zero",
        "FSDP2 Muon: each rank applies the whole polar's first rows (its shard's offset "
        "forgotten), not its own",
        (("dormouse.train.optim.muon:shard_rows", _rows_from_zero),),
        ("g24_fsdp_muon",),
    ),
    Mutation(
        "sharded_save_in_place",
        "a sharded save writes its shards straight into the live checkpoint's directory "
        "(no temporary one): a save killed midway leaves the previous checkpoint torn",
        (("dormouse.train.store.checkpoint:_staging_dir", _shards_in_place),),
        ("g25_sharded_ckpt",),
    ),
    Mutation(
        "sharded_save_own_dirs",
        "each rank makes its own temporary directory for the shards (rank 0's name is not "
        "shared): the committed directory lacks the other ranks' shards",
        (("dormouse.train.store.checkpoint:_staging_dir", _own_staging_dir),),
        ("g25_sharded_ckpt",),
    ),
    Mutation(
        "checkpoint_step_off_by_one",
        "the checkpoint records step + 1: a resume skips a step",
        (("dormouse.train.store.checkpoint:save_checkpoint", _save_step_plus_one),),
        ("g15_signal_stop", "g22_elastic"),
    ),
    Mutation(
        "clip_misses_host_rows",
        "the clip's norm is taken over the parameters only (torch's clip over "
        "param_groups): host-RAM Engram rows are left out",
        (("dormouse.train.optim.mix:MixOptimizer.clip_grad_norm_", _clip_over_parameters),),
        ("g16_clip",),
    ),
    Mutation(
        "capacity_cut_window_wide_on_ranks",
        "the same window-wide capacity cut, on a fleet's ranks: each rank's drops then "
        "depend on which rows it holds",
        (("dormouse.model.moe:MoE.capacity_places", window_wide_cap),),
        ("g23_capacity_fleet",),
    ),
    Mutation(
        "dropout_keys_by_local_row",
        "dropout masks keyed by a rank's own row number (rows 0.. on every rank) instead of "
        "the row's place in the global batch",
        (("dormouse.train.step:dropout_keys", _keys_by_local_row),),
        ("g29_dropout",),
    ),
    Mutation(
        "phase_per_rank",
        "each rank draws its own pass phase (shifted by its offset): the ranks' slices no "
        "longer tile the single process's block",
        (("dormouse.train.data:ByteStream.phase", _phase_per_rank),),
        ("g29_dropout",),
    ),
    Mutation(
        "resplit_keeps_old_stream",
        "a re-split replaces the context but keeps reading the old slice (the stream is not "
        "rebuilt at the new offset and size)",
        (("dormouse.train.fleet.balance:FleetStream._switch", _switch_keeps_stream),),
        ("g27_resplit",),
    ),
    Mutation(
        "resplit_keeps_old_context",
        "a re-split rebuilds the stream but keeps the old DPContext: the loss scale and the "
        "fleet loss weigh the new windows by the old shares",
        (("dormouse.train.fleet.balance:FleetStream._switch", _switch_keeps_context),),
        ("g27_resplit",),
    ),
    Mutation(
        "resume_forgets_split",
        "a resume ignores the split stored in the checkpoint and continues in join's",
        (
            (
                "dormouse.train.fleet.balance:FleetStream.load_state_dict",
                lambda orig: (
                    lambda self, sd: orig(self, {k: v for k, v in sd.items() if k != "split"})
                ),
            ),
        ),
        ("g27_resplit",),
    ),
    Mutation(
        "loss_scale_on_fp16_ranks_only",
        "only a rank computing fp16 carries the loss scale: beside it a bf16 rank's gradient "
        "enters DDP's average unscaled, 2**16 times smaller than the fp16 rank's",
        (("dormouse.train.loop:loss_scaled", _scale_on_fp16_ranks_only),),
        ("g30_mixed_dtype",),
    ),
    Mutation(
        "fp16_rank_forgets_unscale",
        "the fp16 rank steps on the scaled gradient (no division by the scale before the "
        "clip and the optimizer)",
        (("dormouse.train.optim.mix:MixOptimizer.unscale_", _unscale_off_rank1),),
        ("g30_mixed_dtype",),
    ),
    Mutation(
        "compiled_ddp_names_keep_module",
        "parameter names under torch.compile(DDP(model)) keep 'module.' (the rule peels it "
        "before dropping _orig_mod): the head is routed to Muon instead of AdamW",
        (("dormouse.train.optim.routing:strip_name", _strip_module_first),),
        ("g31_compile_fleet",),
    ),
    Mutation(
        "compiled_names_keep_orig_mod",
        "the name rule forgets torch.compile's _orig_mod. prefix (DDP and FSDP2 alike): "
        "'_orig_mod.head.weight' is no head, and the head falls to Muon",
        (("dormouse.train.optim.routing:strip_name", _keep_orig_mod),),
        ("g31_compile_fleet",),
    ),
]
