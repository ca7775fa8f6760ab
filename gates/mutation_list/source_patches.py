"""The patch functions of the source-scope mutations (gates/mutation_list/source.py): each
takes the original and returns the broken version that the gate's process and every fleet
rank run alike."""

from __future__ import annotations


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

    def l2norm(x, *args, **kw):
        calls[0] += 1
        return orig(x, *args, **kw) if calls[0] % 2 else x  # q, k = l2norm(q), k

    return l2norm


def _without_since_best(orig):
    return lambda self: {k: v for k, v in orig(self).items() if k != "since_best"}


def _times_temperature(orig):
    def sample_next(logits, temperature, top_k=0, generator=None):
        if temperature > 0:
            logits = logits.float() * temperature * temperature  # then / T: x T in all
        return orig(logits, temperature, top_k, generator)

    return sample_next


def _prompt_loses_its_last_byte(orig):
    def generate(model, prompt, n, **kw):
        return orig(model, prompt[:-1] or prompt, n, **kw)

    return generate


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
