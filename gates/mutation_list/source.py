"""Bugs in the source the single process and the fleet share (scope "source": planted in the
gate's process and in every fleet rank alike): the loss, clip, schedule, optimizer, LFB, data
order, evaluation and resume state. Only a gate that holds the trainer to the equations (g32,
g33) or to a bound of its own (g01: the fixture must learn) can see them.
"""

from __future__ import annotations

from gates.mutation_list.common import Mutation


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

        if (
            (cfg.warmup and step < cfg.warmup)
            or cfg.schedule != "cosine"
            or (cfg.steps <= cfg.warmup)
        ):
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


def _eval_per_batch(orig):
    def _sums(model, batches, device, autocast_dtype, pad=None):
        if pad:
            return orig(model, batches, device, autocast_dtype, pad)
        total, count = 0.0, 0
        for b in batches:  # each batch's mean loss counted once, whatever its length
            t, n = orig(model, [b], device, autocast_dtype)
            total, count = total + t / n, count + 1
        return total, count

    return _sums


def _whole_split_without_its_tail(orig):
    def val_all(self, batch, seq_len):
        for x, y in orig(self, batch, seq_len):
            if x.shape[0] == 1 and x.shape[1] < seq_len:
                return  # the last, shorter window (the split's tail) never scored
            yield x, y

    return val_all


def _capacity_rounded_down(orig):
    def capacity_of(self, row_len):
        import math

        # floor, not ceil: a row keeps one assignment fewer per expert than the rule says
        return math.floor(self.capacity * row_len * self.topk / self.n_experts)

    return capacity_of


def _decode_forgets_the_conv_tail(orig):
    def forward(self, h, x_bytes, cache=None, drop=None):
        out, kept = orig(self, h, x_bytes, cache=cache, drop=drop)
        if kept is not None:
            kept = {"bytes": kept["bytes"]}  # the conv's last inputs not carried: zeros next
        return out, kept

    return forward


def _val_split_rounded_down(orig):
    def val_length(n, val_frac, val_bytes, window=1, name="data"):
        import math

        if val_bytes > 0 or val_frac <= 0:
            return orig(n, val_frac, val_bytes, window, name)
        # floor(val_frac x n), not ceil: the split one byte short, the train split one long
        return orig(n, val_frac, max(1, math.floor(val_frac * n)), window, name)

    return val_length


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


def _attention_sees_the_future(_orig):
    def attend(q, k, v, past, window=None):
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(q, k, v)  # the causal mask forgotten

    return attend


def _rope_forgotten(_orig):
    return lambda x, start: x


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
        (("dormouse.model.kda:_l2norm", _k_unnormalised),),
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
