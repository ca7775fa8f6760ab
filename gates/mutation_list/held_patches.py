"""The patch functions of gates/mutation_list/held.py: each takes the original and returns
the broken version (scope "source": the gate's process and every fleet rank alike)."""

from __future__ import annotations


def _window_one_key_too_many(orig):
    def __init__(self, cfg):
        orig(self, cfg)
        self.window += 1  # the cache keeps max_seq_len keys, the band reads max_seq_len + 1

    return __init__


def _position_from_cache_length(orig):
    def forward(self, h, iteration=0, cache=None):
        if cache is not None and iteration in cache:  # the keys kept, not the bytes seen
            cache[iteration] = {**cache[iteration], "pos": cache[iteration]["k"].shape[2]}
        return orig(self, h, iteration, cache)

    return forward


def _kda_state_restarts_past_window(orig):
    def step(self, x, cache):
        import torch

        seen = cache.get("seen", 0)
        if seen >= self.cfg.max_seq_len:  # a window where the recurrence has none
            for per_mixer in cache["mix"].values():
                for entry in per_mixer.values():
                    if "state" in entry:
                        entry["state"] = torch.zeros_like(entry["state"])
            seen = 0
        cache["seen"] = seen + x.shape[1]
        return orig(self, x, cache)

    return step


def _gpt_positions_clamped(_orig):
    def step(self, x, cache):
        import torch

        seen = cache["bytes"]
        past = 0 if seen is None else seen.shape[1]
        cache["bytes"] = x if seen is None else torch.cat([seen, x], 1)
        # no slide: past the table every byte takes its last row, the cache grows on
        pos = torch.arange(past, past + x.shape[1]).clamp(max=self.cfg.max_seq_len - 1)
        h = self.embed(x) + self.pos(pos.to(x.device))
        for block, kv in zip(self.blocks, cache["kv"]):
            h = block(h, kv=kv)
        return self._logits(h)[:, -1]

    return step


def _gpt_head_detached(_orig):
    def _logits(self, h):
        import torch.nn.functional as F

        # the tied head reads the embedding but sends it no gradient
        return F.linear(self.norm_f(h), self.embed.weight.detach().to(h.dtype))

    return _logits


def _keys_without_row(orig):
    return lambda seed, step, rows: orig(seed, step, rows * 0)


def _keys_without_step(orig):
    return lambda seed, step, rows: orig(seed, 0, rows)


def _mask_without_site(orig):
    return lambda self, t, site: orig(self, t, 0)


def _wsd_decay_from_the_start(orig):
    def lr_factor(step, cfg):
        if cfg.schedule != "wsd" or (cfg.warmup and step < cfg.warmup) or cfg.steps <= cfg.warmup:
            return orig(step, cfg)
        start = int(cfg.steps * cfg.wsd_decay_frac)  # the fraction read as where decay starts
        if step < start:
            return 1.0
        lo = cfg.min_lr_frac
        return 1.0 - (1.0 - lo) * min(1.0, (step - start) / max(1, cfg.steps - start))

    return lr_factor


def _wsd_decay_start_rounded(orig):
    def lr_factor(step, cfg):
        if cfg.schedule != "wsd" or (cfg.warmup and step < cfg.warmup) or cfg.steps <= cfg.warmup:
            return orig(step, cfg)
        start = cfg.steps - round(cfg.steps * cfg.wsd_decay_frac)  # round, not the floor
        if step < start:
            return 1.0
        lo = cfg.min_lr_frac
        return 1.0 - (1.0 - lo) * min(1.0, (step - start) / max(1, cfg.steps - start))

    return lr_factor


def _cosine_over_all_steps(orig):
    def lr_factor(step, cfg):
        import math

        if (
            cfg.schedule != "cosine"
            or (cfg.warmup and step < cfg.warmup)
            or cfg.steps <= cfg.warmup
        ):
            return orig(step, cfg)
        lo = cfg.min_lr_frac  # the decay's length is the whole run, warm-up included
        progress = min(1.0, (step - cfg.warmup) / cfg.steps)
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))

    return lr_factor


def _scale_without_max(orig):
    import math

    def muon_scale(sf, rows, cols):
        # jordan: sqrt(rows / cols) without max(1, .): wide matrices step less than 1
        return math.sqrt(rows / cols) if sf == "jordan" else orig(sf, rows, cols)

    return muon_scale


def _rms_scale_min_side(orig):
    import math

    def muon_scale(sf, rows, cols):
        return 0.2 * math.sqrt(min(rows, cols)) if sf == "rms" else orig(sf, rows, cols)

    return muon_scale


def _best_on_tie(orig):
    def see(self, step, val, train_loss):
        import math

        if val == self.loss:  # `val <= best`: a tie replaces the best, since-best restarts
            self.loss = math.nextafter(self.loss, math.inf)
        return orig(self, step, val, train_loss)

    return see
