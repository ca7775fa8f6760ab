"""Bugs planted inside every fleet rank (scope "fleet"; gates/mutations.py says how): the
fleet's arithmetic (loss scales, reducers, host rows, sharded Muon), its agreed verdicts, its
checkpoints, data slices and splits. The gate's one-process reference runs unpatched.
"""

from __future__ import annotations

from gates.mutation_list.common import Mutation, prop, this_rank
from gates.mutation_list.fleet_patches import (
    _clip_over_parameters,
    _eval_own_share,
    _fp32_reduce_in_bf16,
    _hook_without_division,
    _keys_by_local_row,
    _merge_in_rank_order_of,
    _never_last_micro_batch,
    _own_device_verdict,
    _own_staging_dir,
    _own_verdict,
    _own_verdict_off_rank0,
    _phase_per_rank,
    _polar_of_own_rows,
    _rows_from_zero,
    _save_step_plus_one,
    _scale_on_fp16_ranks_only,
    _shards_in_place,
    _switch_keeps_context,
    _switch_keeps_stream,
    _transaction_without_restore,
    _unscale_off_rank1,
    _unweighted_fleet_loss,
    _zg_step,
    _zg_zero,
)
from gates.mutation_list.process import window_wide_cap

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
        (("dormouse.train.optim.graph:StepGraph._transacted", _transaction_without_restore),),
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
        "compile_never_applied",
        "compile=true trains eagerly on a fleet: the wrapped module is never handed to "
        "torch.compile (an early return), and every trajectory still matches",
        (("dormouse.train.run:compiled", lambda orig: lambda w, run, device, autocast: w),),
        ("g31_compile_fleet",),
    ),
    Mutation(
        "fleet_eval_own_share",
        "each rank evaluates its share of the val batches (r::world) and keeps its own mean: "
        "the sums never meet, rank 0 logs half the split",
        (("dormouse.train.step:evaluate_fleet", _eval_own_share),),
        ("g01_trajectory",),
    ),
]
