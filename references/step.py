"""Training written again from DESIGN.md §3: layer 2 of the references.

One optimizer step from the equations, and the run around it as the loop documents it. It
shares nothing with dormouse but the parameters: it holds its own copy of them (fp64 by
default), its own optimizer state and LFB buffers, reads its windows straight from the
corpus file, and computes forwards with `references/model.py`. Nothing of dormouse is
imported.

    loss        the mean next-byte cross-entropy over the step's windows; a step of W windows
                runs as k equal micro-batches (the fewest of at most `batch` windows), each
                loss / k backpropagated, the logged loss their mean
    clip        ||g|| over every gradient (the Engram tables' too); with grad_clip > 0 every
                gradient x min(1, grad_clip / (||g|| + 1e-6)); grad_clip = 0: no clip
    skip        a non-finite loss or ||g||: nothing moves, the step's picks are forgotten
    schedule    f(s) = (s + 1) / warmup while s < warmup; then cosine: min_lr_frac + (1 -
                min_lr_frac) (1 + cos(pi min(1, (s - warmup) / (steps - warmup)))) / 2, wsd:
                1 until the last wsd_decay_frac x steps, then linear down to min_lr_frac,
                constant: 1; every group's lr = its base lr x f(s)
    routing     Engram tables (`*store.table`) row Adam at lr x engram_lr_mult, no decay;
                AdamW for 1-D tensors (no decay), the embedding, the head, conv taps and
                [1, n] / [n, 1] matrices (decay); Muon for the other matrices and each expert
                of a 3-D stack (opt=adamw: AdamW with decay instead)
    Muon        per matrix, `references/muon_single.py` (decay with the scheduled lr)
    AdamW       p <- p (1 - lr wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
                p <- p - lr / (1 - b1^t) m / (sqrt(v / (1 - b2^t)) + eps), t its step count
    row Adam    AdamW without decay on the rows whose gradient is not all zero, each with its
                own step count t_r in both bias corrections; other rows and their moments stay
    LFB         after each taken step: bias += coef sign(mean(counts) - counts), counts = 0;
                counts = the picks per expert over the step's training forwards
    dropout     keyed masks (references/model.py) from (seed, step, the window's row)
    data        (dormouse/train/data.py's layout) the file's last val bytes are the val
                split: val_bytes, else ceil(val_frac n), at least one forward's window; the
                rest is read a block of W (seq_len + 1) bytes a step, the blocks of pass p in
                the order default_rng([seed, p]).permutation(n_blocks), from the phase
                default_rng([seed, p, 0x70686173]).integers(0, n), the train bytes a ring
                (shuffle=false: file order from 0)
    evaluation  eval_batches forward-sized batches evenly spaced over the val split, in eval
                mode (no dropout, no counts); the token mean; bpb = nats / ln 2; at step 0,
                every eval_every steps and at the end; the best is the lowest after step 0
                (an untrained model is never kept); early_stop: stop after that many in a
                row without a new best
    eval CKPT   (`dormouse eval`, the whole split) every val byte but the first a target
                once: windows of seq_len targets every seq_len bytes, up to `batch` a
                forward, the last shorter window a forward alone; the token mean

`ReferenceRun.run` returns what a run records (losses, norms, evaluations, the step it
stopped at) and snapshots of the state a checkpoint promises at the steps asked.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from references.model import ReferenceModel, row_keys
from references.muon_single import muon_single_step

#: The loop keeps its last evaluations as (step, val, train loss) for the overfitting line,
#: this many (dormouse/train/loop.py: OVERFIT_EVALS + 1), and saves them in every checkpoint.
HISTORY = 4
CLIP_EPS = 1e-6  # the clip's denominator: grad_clip / (||g|| + 1e-6), torch's rule


def lr_factor(step: int, t) -> float:
    if t.warmup and step < t.warmup:
        return (step + 1) / t.warmup
    if t.schedule == "constant" or t.steps <= t.warmup:
        return 1.0
    lo = t.min_lr_frac
    if t.schedule == "cosine":
        progress = min(1.0, (step - t.warmup) / max(1, t.steps - t.warmup))
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_from = t.steps - int(t.steps * t.wsd_decay_frac)
    if step < decay_from:
        return 1.0
    return 1.0 - (1.0 - lo) * min(1.0, (step - decay_from) / max(1, t.steps - decay_from))


def micro_batches(windows: int, cap: int) -> int:
    """The fewest equal micro-batches of at most `cap` windows that make `windows`."""
    return next(k for k in range(-(-windows // cap), windows + 1) if windows % k == 0)


# ---- data -----------------------------------------------------------------------------------


def split(raw: np.ndarray, t) -> tuple[np.ndarray, np.ndarray]:
    window = t.batch * (t.seq_len + 1)
    n = raw.shape[0]
    want = t.val_bytes if t.val_bytes > 0 else math.ceil(t.val_frac * n)
    n_val = max(want, window) if want else 0
    return raw[: n - n_val], raw[n - n_val :]


def as_windows(raw: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(np.array(raw, dtype=np.int64)).view(-1, seq_len + 1)
    return w[:, :-1], w[:, 1:]


class Blocks:
    """Step s's windows of the train bytes, by the documented layout."""

    def __init__(self, train: np.ndarray, windows: int, seq_len: int, seed: int, shuffle: bool):
        self.train, self.seq_len, self.seed, self.shuffle = train, seq_len, seed, shuffle
        self.stride = windows * (seq_len + 1)
        self.n_blocks = train.shape[0] // self.stride

    def at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.train.shape[0]
        p, i = divmod(step, self.n_blocks)
        if self.shuffle:
            block = int(np.random.default_rng([self.seed, p]).permutation(self.n_blocks)[i])
            phase = int(np.random.default_rng([self.seed, p, 0x70686173]).integers(0, n))
        else:
            block, phase = i, 0
        start = (phase + block * self.stride) % n
        ring = np.concatenate([self.train, self.train])
        return as_windows(ring[start : start + self.stride], self.seq_len)


def val_batches(val: np.ndarray, count: int, batch: int, seq_len: int) -> list:
    window = batch * (seq_len + 1)
    starts = [(i * (len(val) - window)) // (count - 1) if count > 1 else 0 for i in range(count)]
    return [as_windows(val[s : s + window], seq_len) for s in starts]


def whole_split(val: np.ndarray, batch: int, seq_len: int) -> list:
    """`dormouse eval`'s forwards over the whole val split (the module docstring's layout)."""
    targets = len(val) - 1
    full = targets // seq_len
    rows = [val[i * seq_len : (i + 1) * seq_len + 1] for i in range(full)]
    out = [as_rows(rows[i : i + batch]) for i in range(0, full, batch)]
    if targets % seq_len:
        out.append(as_rows([val[full * seq_len :]]))
    return out


def as_rows(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(np.stack(rows).astype(np.int64))
    return w[:, :-1], w[:, 1:]


# ---- routing and the optimizers ---------------------------------------------------------------


def owner(name: str, shape: tuple[int, ...], opt: str) -> tuple[str, bool]:
    """(optimizer, weight decay?) of one parameter."""
    if name.endswith("store.table"):
        return "engram", False
    if len(shape) <= 1:
        return "adamw", False
    if name in ("embed.weight", "head.weight") or any(
        "conv" in part for part in name.split(".")[:-1]
    ):
        return "adamw", True
    if len(shape) > 3 or min(shape[-2:]) == 1:
        return "adamw", True
    return ("muon" if opt == "mix" else "adamw"), True


class Optimizer:
    """Muon, AdamW and the Engram row Adam over a dict of parameters, state by name."""

    def __init__(self, params: dict[str, torch.Tensor], t):
        self.t = t
        self.kind = {n: owner(n, tuple(p.shape), t.opt) for n, p in params.items()}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for n, p in params.items():
            kind = self.kind[n][0]
            if kind == "muon":
                self.state[n] = {"momentum_buffer": torch.zeros_like(p)}
            elif kind == "adamw":
                self.state[n] = {
                    "step": torch.zeros((), dtype=p.dtype),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
            else:
                self.state[n] = {
                    "step": torch.zeros(p.shape[:-1], dtype=torch.int64),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], factor: float) -> None:
        t = self.t
        lr = t.lr * factor
        b1, b2 = t.adam_betas
        for n, p in params.items():
            g, st = p.grad, self.state[n]
            if g is None:
                continue
            kind, decay = self.kind[n]
            wd = t.wd if decay else 0.0
            if kind == "muon":
                mats = (
                    [(p, g, st["momentum_buffer"])]
                    if p.dim() == 2
                    else [(p[e], g[e], st["momentum_buffer"][e]) for e in range(p.shape[0])]
                )
                for pm, gm, mm in mats:
                    new_p, new_m = muon_single_step(
                        pm, gm, mm, lr, wd, t.muon_momentum, t.muon_variant == "nesterov",
                        t.ns_steps, t.ns_kind, t.muon_sf, dtype=p.dtype)  # fmt: skip
                    pm.copy_(new_p)
                    mm.copy_(new_m)
            elif kind == "adamw":
                st["step"] += 1
                p.mul_(1 - lr * wd)
                _adam(p, g, st["exp_avg"], st["exp_avg_sq"], st["step"], lr, b1, b2, t.adam_eps)
            else:
                gv = g.reshape(-1, g.shape[-1])
                rows = gv.ne(0).any(-1).nonzero().squeeze(1)  # the touched rows, no others
                pv = p.view(-1, p.shape[-1])
                m, v = st["exp_avg"].view(pv.shape), st["exp_avg_sq"].view(pv.shape)
                count = st["step"].view(-1)
                count[rows] += 1
                pr, mr, vr = pv[rows], m[rows], v[rows]
                _adam(
                    pr,
                    gv[rows],
                    mr,
                    vr,
                    count[rows].to(p.dtype).unsqueeze(1),
                    lr * t.engram_lr_mult,
                    b1,
                    b2,
                    t.adam_eps,
                )
                pv[rows], m[rows], v[rows] = pr, mr, vr


def _adam(p, g, m, v, count, lr, b1, b2, eps) -> None:
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).add_(g * g, alpha=1 - b2)
    denom = (v / (1 - b2**count)).sqrt() + eps
    p.sub_(lr / (1 - b1**count) * m / denom)


# ---- the run --------------------------------------------------------------------------------


class ReferenceRun:
    """A run of `run` (an object with .model and .train, as a RunConfig) from the model state
    `state` (a DormouseModel's state dict) on the corpus file `corpus`."""

    def __init__(self, run, state: dict, corpus: str | Path, dtype: torch.dtype = torch.float64):
        self.m, self.t = run.model, run.train
        self.model = ReferenceModel(self.m, state, dtype)
        self.params = self.model.params
        self.opt = Optimizer(self.params, self.t)
        self.counts = {b: torch.zeros_like(v) for b, v in self.model.lfb_bias.items()}
        raw = np.fromfile(Path(corpus), dtype=np.uint8)
        train, self.val = split(raw, self.t)
        self.windows = self.t.global_batch or self.t.batch
        self.blocks = Blocks(train, self.windows, self.t.seq_len, self.t.seed, self.t.shuffle)
        self.val_list = (val_batches(self.val, self.t.eval_batches, self.t.batch, self.t.seq_len)
                         if len(self.val) else [])  # fmt: skip
        self.best_step: int | None = None
        self.best_loss = math.inf
        self.since = 0
        self.history: list[tuple] = []
        self.margin = math.inf  # the smallest routing margin any forward saw

    # -- one step --

    def train_step(self, step: int, poison: bool = False) -> dict:
        """Step `step` (0-based). `poison`: its loss is non-finite (a gate's injected NaN)."""
        t = self.t
        x, y = self.blocks.at(step)
        k = micro_batches(self.windows, t.batch)
        keys = row_keys(t.seed, step, range(self.windows)) if self.m.dropout > 0 else None
        for p in self.params.values():
            p.grad = None
        losses, counts = [], {b: torch.zeros_like(c) for b, c in self.counts.items()}
        for j in range(k):
            sl = slice(j * (self.windows // k), (j + 1) * (self.windows // k))
            _, loss, aux = self.model.forward(
                x[sl], y[sl], training=True, keys=None if keys is None else keys[sl]
            )
            (loss / k).backward()
            losses.append(float(loss.detach()))
            self.margin = min(self.margin, aux["margin"])
            for b, c in aux["counts"].items():
                counts[b] += c
        loss = float(np.mean(losses)) if not poison else math.nan
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return {"loss": loss, "gnorm": norm, "stepped": False}
        if t.grad_clip > 0:
            coef = min(1.0, t.grad_clip / (norm + CLIP_EPS))
            for g in grads:
                g.mul_(coef)
        self.opt.step(self.params, lr_factor(step, t))
        if self.m.moe_lb_coef:
            for b, bias in self.model.lfb_bias.items():
                c = counts[b]
                bias += self.m.moe_lb_coef * torch.sign(c.mean() - c)
        return {"loss": loss, "gnorm": norm, "stepped": True}

    @torch.no_grad()
    def evaluate(self, batches: list | None = None) -> dict:
        """The token mean over `batches` (the run's eval batches unless given)."""
        total = count = 0.0
        for x, y in self.val_list if batches is None else batches:
            _, loss, aux = self.model.forward(x, y)
            self.margin = min(self.margin, aux["margin"])
            total += float(loss) * y.numel()
            count += y.numel()
        nats = total / count
        return {"loss": nats, "bpb": nats / math.log(2), "tokens": int(count)}

    def _see(self, step: int, val: float, train_loss: float) -> None:
        if val < self.best_loss:
            self.best_step, self.best_loss, self.since = step, val, 0
        else:
            self.since += 1
        self.history = (self.history + [(step, val, train_loss)])[-HISTORY:]

    # -- the run --

    def run(self, poison: tuple[int, ...] = (), snapshots: tuple[int, ...] = (),
            retrain: tuple[int, object] | None = None) -> dict:  # fmt: skip
        """Steps 0 .. steps-1 as the loop runs them: evaluations, early stop, skips.
        `poison`: steps whose loss is non-finite; `snapshots`: steps after which (and after
        their evaluation) the checkpoint's state is copied; `retrain` (step, train config):
        from that step on, the hyperparameters of that config (a resume given new ones:
        every group's base lr becomes the new lr)."""
        t = self.t
        rec = {"losses": {}, "gnorms": {}, "evals": [], "skipped": [], "snapshots": {}}
        has_val = len(self.val_list) > 0
        if t.eval_every and has_val:
            res = self.evaluate()  # logged, never a best: the model is untrained
            rec["evals"].append((0, res["loss"], res["bpb"]))
        end, early, last_loss = t.steps, False, math.nan
        for step in range(t.steps):
            out = self.train_step(step, poison=step in poison)
            rec["gnorms"][step] = out["gnorm"]
            done = step + 1
            if not out["stepped"]:
                rec["skipped"].append(step)  # a step all the same: the cadence below holds
            else:
                rec["losses"][step] = out["loss"]
                if t.log_every and (done % t.log_every == 0 or done == end):
                    last_loss = out["loss"]
            if t.eval_every and done % t.eval_every == 0 and done != end and has_val:
                res = self.evaluate()
                self._see(done, res["loss"], last_loss)
                rec["evals"].append((done, res["loss"], res["bpb"]))
                if t.early_stop and self.since >= t.early_stop:
                    end, early = done, True
            if done in snapshots:
                rec["snapshots"][done] = self.snapshot(done)
            if retrain is not None and done == retrain[0]:
                self.t = self.opt.t = retrain[1]
            if early:
                break
        if has_val and not early:
            res = self.evaluate()
            self._see(end, res["loss"], last_loss)
            rec["evals"].append((end, res["loss"], res["bpb"]))
        rec["end"] = end
        rec["final"] = self.snapshot(end)
        if has_val:  # what `dormouse eval` of the last checkpoint scores (its own margin)
            kept, self.margin = self.margin, math.inf
            rec["whole"] = self.evaluate(whole_split(self.val, t.batch, t.seq_len))
            rec["whole_margin"], self.margin = self.margin, kept
        rec["margin"] = self.margin
        return rec

    def snapshot(self, step: int) -> dict:
        """What a checkpoint after `step` steps holds, as plain copies."""
        model = {n: p.detach().clone() for n, p in self.params.items()}
        for b, bias in self.model.lfb_bias.items():
            model[f"blocks.{b}.moe.lfb_bias"] = bias.clone()
            model[f"blocks.{b}.moe.lfb_counts"] = torch.zeros_like(bias)
        opt = {n: {k: v.clone() for k, v in st.items()} for n, st in self.opt.state.items()}
        data = {
            "step": step,
            "n_bytes": int(self.blocks.train.shape[0]),
            "stride": self.blocks.stride,
            "shuffle_seed": self.t.seed if self.t.shuffle else None,
        }
        return {
            "step": step,
            "model": model,
            "optimizer": opt,
            "data": data,
            "best_step": self.best_step,
            "best_loss": self.best_loss if self.best_step is not None else None,
            "since_best": self.since,
            "history": [list(h) for h in self.history],
        }
