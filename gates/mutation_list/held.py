"""Bugs of the classes a gate must hold (issue #60): decoding past the training window, the
data phase, the dropout key, the schedule's decay start, what the clip includes, resume
state, Muon's shape scale, the tied head, the best on a tie. Scope "source" (in the gate's
process and every fleet rank): only g32/g33 can see them. The classes and the gates that
hold them: `CLASSES` (docs/mutations.md prints them)."""

from __future__ import annotations

from gates.mutation_list.common import Mutation
from gates.mutation_list.fleet_patches import _clip_over_parameters
from gates.mutation_list.held_patches import (
    _best_on_tie,
    _cosine_over_all_steps,
    _gpt_head_detached,
    _gpt_positions_clamped,
    _kda_state_restarts_past_window,
    _keys_without_row,
    _keys_without_step,
    _mask_without_site,
    _position_from_cache_length,
    _rms_scale_min_side,
    _scale_without_max,
    _window_one_key_too_many,
    _wsd_decay_from_the_start,
    _wsd_decay_start_rounded,
)

G32, G33 = ("g32_reference_model",), ("g33_reference_step",)


def _m(name: str, bug: str, patches: tuple, gates: tuple[str, ...]) -> Mutation:
    return Mutation(name, bug, patches, gates, scope="source")


MUTATIONS: list[Mutation] = [
    _m("attn_window_one_key_too_many",
       "past max_seq_len the attention decode keeps max_seq_len keys and reads a band of "
       "max_seq_len + 1: one key farther back than any training window showed",
       (("dormouse.model.attn:AttnMixer.__init__", _window_one_key_too_many),), G32),
    _m("attn_position_from_cache_length",
       "the attention decode takes a byte's position from its cache's length: past "
       "max_seq_len RoPE turns every new byte by max_seq_len - 1",
       (("dormouse.model.attn:AttnMixer.forward", _position_from_cache_length),), G32),
    _m("kda_state_restarts_past_window",
       "decoding restarts KDA's recurrent state every max_seq_len bytes (attention's window "
       "given to a mixer that has none)",
       (("dormouse.model.model:DormouseModel.step", _kda_state_restarts_past_window),), G32),
    _m("gpt_positions_clamped",
       "the GPT decode does not slide past max_seq_len: every later byte takes the last "
       "learned position and the cache grows",
       (("dormouse.model.gpt:GPT.step", _gpt_positions_clamped),), G32),
    _m("gpt_head_detached",
       "the GPT's tied head reads the embedding detached: the head's gradient never reaches "
       "the embedding",
       (("dormouse.model.gpt:GPT._logits", _gpt_head_detached),), G32),
    _m("dropout_key_without_row",
       "the dropout key drops the window's row: every window of a step draws one mask",
       (("dormouse.train.step:row_keys", _keys_without_row),
        ("dormouse.model.layers:row_keys", _keys_without_row)), G32 + G33),
    _m("dropout_key_without_step",
       "the dropout key drops the step: a window's row draws the same mask every step",
       (("dormouse.train.step:row_keys", _keys_without_step),
        ("dormouse.model.layers:row_keys", _keys_without_step)), G32 + G33),
    _m("dropout_mask_without_site",
       "the dropout mask ignores its site: the embedding, Engram and every block draw one mask",
       (("dormouse.model.layers:KeyedDropout.__call__", _mask_without_site),), G32 + G33),
    _m("phase_of_the_next_pass",
       "pass p reads from pass p + 1's phase (the pass counted from 1)",
       (("dormouse.train.data:ByteStream.phase",
         lambda orig: lambda self, n_pass: orig(self, n_pass + 1)),), G33),
    _m("wsd_decay_from_the_start",
       "WSD's decay starts at wsd_decay_frac x steps, not at (1 - wsd_decay_frac) x steps",
       (("dormouse.train.step:lr_factor", _wsd_decay_from_the_start),), G33),
    _m("wsd_decay_start_rounded",
       "WSD's decay starts at steps - round(steps x frac), not steps - floor(steps x frac)",
       (("dormouse.train.step:lr_factor", _wsd_decay_start_rounded),), G33),
    _m("cosine_over_all_steps",
       "the cosine decays over `steps`, not steps - warmup: it never reaches min_lr_frac",
       (("dormouse.train.step:lr_factor", _cosine_over_all_steps),), G33),
    _m("clip_norm_without_host_tables",
       "the clip's norm is taken over the parameters only: host-RAM Engram tables are left "
       "out of the norm and of the scaling (one process too)",
       (("dormouse.train.optim.mix:MixOptimizer.clip_grad_norm_", _clip_over_parameters),), G33),
    _m("resume_base_lr_from_checkpoint",
       "a resume keeps the checkpoint's base lr: an lr given on resume is recorded, not applied",
       (("dormouse.train.store.checkpoint:RESUME_FROM_CHECKPOINT",
         lambda orig: (*orig, "base_lr")),), G33),
    _m("muon_scale_without_max",
       "Muon's jordan scale is sqrt(rows / cols) without max(1, .): wide matrices step less",
       (("dormouse.train.optim.muon:muon_scale", _scale_without_max),), G33),
    _m("muon_rms_scale_min_side",
       "Muon's rms scale takes 0.2 sqrt(min(rows, cols)): tall and wide matrices step less",
       (("dormouse.train.optim.muon:muon_scale", _rms_scale_min_side),), G33),
    _m("best_replaced_on_tie",
       "a validation loss equal to the best replaces it (val <= best): best.pt moves and "
       "early stop's count restarts on a tie",
       (("dormouse.train.loop:_Best.see", _best_on_tie),), G33),
]  # fmt: skip

#: (class, the gate and case that hold it, the mutations planted in it): issue #60's classes,
#: each caught by a gate's verdict, not only by a unit test. docs/mutations.md prints them.
CLASSES: list[tuple[str, str, tuple[str, ...]]] = [
    ("decoding past the training window: attention",
     "g32 `batched hybrid attention past the window` (max_seq_len 12, 32 bytes decoded)",
     ("attn_window_one_key_too_many", "attn_position_from_cache_length")),
    ("decoding past the training window: KDA", "g32 the same case (its KDA block)",
     ("kda_state_restarts_past_window",)),
    ("decoding past the training window: the GPT's learned positions",
     "g32 `gpt past the window` (16 positions, 32 bytes decoded; references/gpt.py)",
     ("gpt_positions_clamped",)),
    ("the head's tie to the embedding", "g32 `gpt past the window` (every gradient)",
     ("gpt_head_detached",)),
    ("the data phase of each pass", "g33 (every case crosses passes)",
     ("phase_drawn_once", "phase_of_the_next_pass")),
    ("the dropout mask's key (step, row, site)",
     "g32 (the reference's own row_keys) and g33 (dropout cases)",
     ("dropout_key_without_step", "dropout_key_without_row", "dropout_mask_without_site")),
    ("the schedule's decay start (WSD and cosine)",
     "g33 `adamw-ram` (WSD, frac 0.3) and `mix` (cosine after warm-up)",
     ("wsd_decay_from_the_start", "wsd_decay_start_rounded", "cosine_from_step_zero",
      "cosine_over_all_steps")),
    ("what the clip norm includes (Engram tables on the host too)",
     "g33 `mix-ram` (one process), g16 (the fleet)",
     ("clip_norm_without_host_tables", "clip_misses_host_rows")),
    ("the eval split's batches on a fleet",
     "g01 (the fleet's evaluations vs one process's of the same list), g33 (one process)",
     ("fleet_eval_own_share", "eval_per_batch", "whole_split_without_its_tail")),
    ("resume of the state that changes the next step (base lr, since-best, LFB, data)",
     "g33 `mix` (resumed at 6 with a new lr) and `adamw-ram` (resumed at 8)",
     ("resume_base_lr_from_checkpoint", "since_best_not_saved", "lfb_bias_not_persistent",
      "resume_restarts_data")),
    ("Muon's shape scale for tall and wide matrices",
     "g33 `mix` (jordan) and `mix-ram` (rms): tiny's experts are tall and wide",
     ("muon_scale_without_max", "muon_rms_scale_min_side")),
    ("the best checkpoint on a tie", "g33 `adamw` (a skipped step between two evaluations)",
     ("best_replaced_on_tie",)),
]  # fmt: skip
