"""Bugs in the source the single process and the fleet share (scope "source": planted in the
gate's process and in every fleet rank alike): the loss, clip, schedule, optimizer, LFB, data
order, evaluation and resume state. Only a gate that holds the trainer to the equations (g32,
g33) or to a bound of its own (g01: the fixture must learn) can see them.
"""

from __future__ import annotations

from gates.mutation_list.common import Mutation
from gates.mutation_list.source_patches import (
    _attention_sees_the_future,
    _bias_not_persistent,
    _capacity_rounded_down,
    _clip_not_clamped,
    _clip_zero_clips_all,
    _cosine_from_step_zero,
    _decay_every_adamw_tensor,
    _decay_ignores_input,
    _decode_forgets_the_conv_tail,
    _eval_in_train_mode,
    _eval_per_batch,
    _from_config_dropping,
    _gates_not_renormalised,
    _k_unnormalised,
    _lfb_toward_the_busy,
    _loss_on_byte_after_next,
    _mix32_one_round,
    _muon_decay_base_lr,
    _prompt_loses_its_last_byte,
    _rope_forgotten,
    _row_adam_one_correction,
    _skip_zeroes_bias,
    _times_temperature,
    _val_split_rounded_down,
    _whole_split_without_its_tail,
    _without_since_best,
)


def _single_without_delta(orig):
    return lambda weights, deltas: orig(weights, None if len(weights) == 1 else deltas)


MUTATIONS: list[Mutation] = [
    Mutation(
        "output_delta_forgotten",
        "the mixers' output projection is folded without its per-iteration low-rank delta "
        "(layers.with_deltas given one weight drops the delta)",
        (
            ("dormouse.model.kda:with_deltas", _single_without_delta),
            ("dormouse.model.attn:with_deltas", _single_without_delta),
        ),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "muon_decay_base_lr",
        "Muon's decoupled weight decay uses the base lr, not the scheduled one (too strong "
        "in warm-up and at the cosine floor)",
        (("dormouse.train.optim.mix:muon_step_", _muon_decay_base_lr),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "cosine_from_step_zero",
        "the cosine's progress is counted from step 0, ignoring the warm-up (the lr drops "
        "at the end of warm-up)",
        (("dormouse.train.step:lr_factor", _cosine_from_step_zero),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "eval_in_train_mode",
        "model.eval() dropped before validation: dropout in every evaluation, and its "
        "forwards move the LFB counts",
        (("dormouse.train.step:_sums", _eval_in_train_mode),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "eval_per_batch",
        "the evaluation averages its batches' mean losses, not their bytes: `dormouse "
        "eval`'s whole split weighs its last, shorter window as a full batch",
        (("dormouse.train.step:_sums", _eval_per_batch),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "whole_split_without_its_tail",
        "`dormouse eval` stops at the last full window: the val split's tail (fewer than "
        "seq_len bytes) is never scored",
        (("dormouse.train.data:DataSource.val_all", _whole_split_without_its_tail),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "val_split_rounded_down",
        "the val split by val_frac takes floor(val_frac x n) bytes, not ceil: the split and "
        "every train window after the cut move by a byte",
        (("dormouse.train.data:val_length", _val_split_rounded_down),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "clip_zero_clips_all",
        "`grad_clip >= 0` instead of `> 0`: grad_clip=0 (off) clips to norm 0, zeroing "
        "every gradient; the run learns nothing",
        (("dormouse.train.optim.mix:MixOptimizer.clip_grad_norm_", _clip_zero_clips_all),),
        ("g01_trajectory", "g33_reference_step"),
        scope="source",
    ),
    Mutation(
        "clip_not_clamped",
        "the clip coefficient grad_clip / norm is not capped at 1: every step's gradient "
        "is scaled to the clip norm, small ones up",
        (("dormouse.train.optim.mix:MixOptimizer.clip_grad_norm_", _clip_not_clamped),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "engram_lr_mult_dropped",
        "MixOptimizer.from_config drops engram_lr_mult: --set engram_lr_mult is silently "
        "ignored (the default 5 runs)",
        (
            (
                "dormouse.train.optim.mix:MixOptimizer.from_config",
                _from_config_dropping("engram_lr_mult", 5.0),
            ),
        ),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "adam_eps_dropped",
        "MixOptimizer.from_config drops adam_eps: --set adam_eps is silently ignored "
        "(torch's 1e-8 runs)",
        (
            (
                "dormouse.train.optim.mix:MixOptimizer.from_config",
                _from_config_dropping("adam_eps", 1e-8),
            ),
        ),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "skip_zeroes_lfb_bias",
        "a skipped step zeroes lfb_bias instead of lfb_counts: every non-finite skip "
        "erases the balancing bias",
        (("dormouse.model.model:DormouseModel.lfb_discard", _skip_zeroes_bias),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "kda_k_unnormalised",
        "the torch KDA arm skips k's L2 norm (q is normalised, k is not)",
        (("dormouse.model.kda:l2norm", _k_unnormalised),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "kda_decay_ignores_input",
        "the KDA decay drops its input-dependent softplus term: g = -exp(A_log)",
        (("dormouse.model.kda:KDAMixer._inputs", _decay_ignores_input),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "attention_sees_the_future",
        "the attention mixer drops its causal mask: a byte reads the bytes after it",
        (("dormouse.model.attn:attend", _attention_sees_the_future),),
        ("g18_causal", "g32_reference_model"),
        scope="source",
    ),
    Mutation(
        "attention_without_positions",
        "the attention mixer forgets RoPE: its scores ignore where the bytes sit",
        (("dormouse.model.attn:rope", _rope_forgotten),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "since_best_not_saved",
        "the early-stop counter (since_best) is not saved: patience restarts at every resume",
        (("dormouse.train.loop:_Best.state", _without_since_best),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "sampling_times_temperature",
        "sampling multiplies the logits by the temperature: T=0.8 samples at 1.25, a low "
        "T gives near-uniform text",
        (("dormouse.model.sample:sample_next", _times_temperature),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "loss_on_byte_after_next",
        "the loss is taken on logits[:, :-1] against y[:, 1:]: the model learns the byte "
        "after next",
        (("dormouse.model.model:DormouseModel.forward", _loss_on_byte_after_next),),
        ("g32_reference_model", "g33_reference_step"),
        scope="source",
    ),
    Mutation(
        "moe_gates_not_renormalised",
        "the MoE's top-k gates are the raw affinities, not renormalised over the picks",
        (("dormouse.model.moe:MoE.route", _gates_not_renormalised),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "capacity_rounded_down",
        "the MoE capacity cap = floor(capacity x T x k / E), not ceil: capacity mode drops "
        "assignments the rule keeps",
        (("dormouse.model.moe:MoE.capacity_of", _capacity_rounded_down),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "decode_forgets_the_conv_tail",
        "decoding keeps Engram's last bytes but not its conv's last inputs: every sampled "
        "byte after the prefill sees a conv started from zeros",
        (("dormouse.model.engram:Engram.forward", _decode_forgets_the_conv_tail),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "prompt_loses_its_last_byte",
        "sampling feeds the prompt less its last byte: every sampled byte continues another "
        "text (every test passed it; the decoding check steps the cache, not generate)",
        (("dormouse.model.sample:generate", _prompt_loses_its_last_byte),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "engram_hash_one_round",
        "the Engram hash's finaliser runs one multiply-xorshift round and no last shift: "
        "other rows (the tables of a checkpoint no longer line up)",
        (("dormouse.model.engram:_mix32", _mix32_one_round),),
        ("g32_reference_model",),
        scope="source",
    ),
    Mutation(
        "adamw_decays_1d",
        "AdamW decays every tensor it steps, norm gains, biases and the decay's dt_bias "
        "and A_log included",
        (("dormouse.train.optim.routing:_classify", _decay_every_adamw_tensor),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "row_adam_one_correction",
        "the Engram row Adam drops its second bias correction (sqrt(v) for sqrt(v / (1 - b2^t)))",
        (("dormouse.train.optim.rowadam:_adam_rows", _row_adam_one_correction),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "lfb_toward_the_busy",
        "the LFB update's sign is flipped: the bias steers more tokens to the busiest experts",
        (("dormouse.model.moe:MoE.lfb_update", _lfb_toward_the_busy),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "lfb_bias_not_persistent",
        "lfb_bias is a non-persistent buffer: no checkpoint holds it, a resume restarts "
        "the balancing from zero",
        (("dormouse.model.moe:MoE.__init__", _bias_not_persistent),),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "phase_drawn_once",
        "the data phase is pass 0's in every pass: each later pass reads the same windows",
        (
            (
                "dormouse.train.data:ByteStream.phase",
                lambda orig: lambda self, n_pass: orig(self, 0),
            ),
        ),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "block_order_drawn_once",
        "the block order is pass 0's permutation in every pass",
        (
            (
                "dormouse.train.data:ByteStream.block",
                lambda orig: lambda self, step: orig(self, step % self.n_blocks),
            ),
        ),
        ("g33_reference_step",),
        scope="source",
    ),
    Mutation(
        "resume_restarts_data",
        "a resume does not restore the data position: the run reads its first blocks again",
        (
            (
                "dormouse.train.data:ByteStream.load_state_dict",
                lambda orig: lambda self, sd: orig(self, {**sd, "step": 0}),
            ),
        ),
        ("g33_reference_step",),
        scope="source",
    ),
]
