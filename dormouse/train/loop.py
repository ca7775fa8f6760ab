"""The training loop, the same code in one process and on every rank of a fleet.

`train(model, wrapped, opt, ctx, run, autocast, hooks)` runs the steps (`step.train_step`) and
owns what lies between them: the LR schedule's position, logging, evaluation, the best
checkpoint, checkpoints, resume, a graceful stop (on the flag signals.py raises). What differs on a fleet is asked of the data-parallel
context (`context.DPContext`: the identity in one process); the model arrives built and
wrapped (`run.py`), the run folder held (`store/folder.py`). `Callbacks` are observation
points: the gates record runs through them.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from .context import DPContext, OneStream
from .data import DataError, fingerprint_mismatch, open_data
from .optim.scaler import LossScaler, loss_scaled
from .signals import GracefulStop
from .step import (
    LN2,
    Callbacks,
    Deferred,
    Settled,
    Step,
    Wrapped,
    device_verdict,
    evaluate_fleet,
    lr_factor,
    notify,
    train_step,
)
from .store import checkpoint as ckpt
from .store.folder import METRICS, PLOT, RunDir, RunDirError, read_rows
from .store.metrics import Sinks

log = logging.getLogger(__name__)


class TrainingError(UserError, RuntimeError):
    pass


class _Progress:
    """A one-line progress bar on a terminal; nothing otherwise (plain log lines suffice)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and sys.stderr.isatty()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * step / max(1, self.total))
        sys.stderr.write(
            f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} loss={loss:.4f}"
        )
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


def _plot(folder: RunDir) -> None:
    """loss.png from metrics.jsonl. Never the run's end: the checkpoint is written by now,
    so a damaged row or a failed write is a warning naming the file."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("loss curve skipped: matplotlib is not installed (pip install matplotlib)")
        return
    try:
        rows, _ = read_rows(folder.file(METRICS))
    except (RunDirError, OSError) as e:
        log.warning(f"warning: {folder.file(PLOT)} not drawn ({e})")
        return
    tr = [(r["step"], r["loss"]) for _, r in rows if r["kind"] == "train"]
    ev = [(r["step"], r["loss"]) for _, r in rows if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot(*zip(*tr), label="train loss", lw=1)
    if ev:
        ax.plot(*zip(*ev), "o-", label="val loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    if tr or ev:
        ax.legend()
    fig.tight_layout()
    try:
        if folder.write_plot(fig):
            log.info(f"loss curve written to {folder.file(PLOT)}")
    finally:
        plt.close(fig)


class _NoHeartbeat:
    """One process has no peers to watch: where the loop is goes nowhere."""

    def at(self, step: int, what: str, saved: int | None = None) -> None:
        pass

    def settled(self) -> None:
        pass


#: Evaluations in a row with val up and train loss down before the loop says "overfitting".
OVERFIT_EVALS = 3


@dataclass
class _Best:
    """The loop's record of validation: the best so far, evaluations since it, and the last
    few (step, val, train loss) points for the overfitting line. Saved in every checkpoint."""

    step: int | None = None
    loss: float = math.inf
    since: int = 0
    # [(step, val loss, train loss)], the last OVERFIT_EVALS + 1
    history: list = field(default_factory=list)
    train_s: float = 0.0  # seconds spent in training steps (not eval, saves or the 1st step)
    warned: int | None = None  # the best step the overfitting line last spoke of: once each

    def state(self) -> dict:
        return {"best_step": self.step, "best_loss": self.loss if self.step is not None else None,
                "since_best": self.since, "history": [list(h) for h in self.history],
                "train_s": self.train_s}  # fmt: skip

    @classmethod
    def load(cls, extra: dict | None) -> _Best:
        e = extra or {}
        loss = e.get("best_loss")
        return cls(step=e.get("best_step"), loss=math.inf if loss is None else float(loss),
                   since=int(e.get("since_best", 0)),
                   history=[tuple(h) for h in e.get("history", [])],
                   train_s=float(e.get("train_s", 0.0)))  # fmt: skip

    def see(self, step: int, val: float, train_loss: float) -> tuple[bool, str | None]:
        """Record one evaluation: (a new best?, the overfitting line when the streak of val up
        while train loss falls reaches OVERFIT_EVALS, else None)."""
        improved = val < self.loss
        if improved:
            self.step, self.loss, self.since = step, val, 0
        else:
            self.since += 1
        self.history = (self.history + [(step, val, train_loss)])[-(OVERFIT_EVALS + 1) :]
        h = self.history
        if len(h) == OVERFIT_EVALS + 1 and self.warned != self.step and all(
                b[1] > a[1] and b[2] < a[2] for a, b in itertools.pairwise(h)):  # fmt: skip
            self.warned = self.step
            return improved, (
                f"overfitting: val up {OVERFIT_EVALS} evals in a row ({h[0][1]:.4f} -> "
                f"{h[-1][1]:.4f}) while train loss fell ({h[0][2]:.4f} -> {h[-1][2]:.4f}); best "
                f"was step {self.step} (val {self.loss:.4f}, kept in best.pt). More data, "
                f"more dropout (--set dropout=0.4), or --set early_stop=N stops such a run"
            )
        return improved, None


def _say_first_step(t_step: float, device: torch.device) -> None:
    """The cold start in the log: the first step (compile, CUDA-graph capture, kernel
    autotune) and the time since the process imported dormouse."""
    from .. import STARTED

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    now = time.perf_counter()
    log.info(f"first step took {now - t_step:.2f} s (tracing, compiling, autotuning where "
             f"they run; cached for the next run); step 1 reached {now - STARTED:.1f} s after "
             f"start")  # fmt: skip


# ---- the loop -------------------------------------------------------------------------------


@dataclass
class Hooks:
    """What a caller asks of one run beside its config. `resume`: from the run folder's
    checkpoint. `stop_at`: end after that many steps, keeping the full run's schedule (an
    interrupted run, for resume tests; the final checkpoint is written). `progress`: a
    progress bar on a terminal. `callbacks`: observation points (the gates record runs
    there). `folder`: the run folder as the CLI holds it; else opened from out_dir."""

    resume: bool = False
    stop_at: int | None = None
    progress: bool = False
    callbacks: Callbacks = field(default_factory=Callbacks)
    folder: RunDir | None = None


class _Run:
    """One run's state between its steps, and the moves the loop makes with it: resume,
    save, evaluate, settle a step's verdict (log, metrics, skips), stop."""

    def __init__(self, s: Step, run, hooks: Hooks, sinks: Sinks, stream_of=OneStream):
        folder, progress, stop_at = hooks.folder, hooks.progress, hooks.stop_at
        cfg = self.cfg = run.train
        self.s, self.run, self.sinks, self.main = s, run, sinks, s.ctx.is_main
        self.data = open_data(cfg)
        self.stream = stream_of(self.data, s.ctx, run, s.model)
        self.data_print = self.data.fingerprint()
        # a fleet's watchdog (watchdog.Heartbeat) hears where this rank is; one process: nothing
        self.beat = s.ctx.heartbeat or _NoHeartbeat()
        # every rank holds the list and evaluates its share of it (evaluate_fleet)
        self.val = (self.data.val_batches(cfg.eval_batches, cfg.batch, cfg.seq_len)
                    if self.data.has_val else [])  # fmt: skip
        self.folder = folder or RunDir(cfg.out_dir)
        self.path, self.best_file = self.folder.checkpoint(run), self.folder.best(run)
        self.best = _Best()
        self.start = 0
        self.end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
        self.bar = _Progress(cfg.steps, progress and self.main)
        self.skips = self.consecutive = self.tokens = self.since_log = 0
        self.last_loss, self.t_log = math.nan, time.perf_counter()
        self.last_saved: int | None = None
        self.pending: Settled | None = None  # verdict=device: settled behind the next step

    # -- before the first step ---------------------------------------------------------------

    def resume(self) -> None:
        s, cfg, path = self.s, self.cfg, self.folder.resume_path(self.run)
        if not path.exists():
            raise TrainingError(f"--resume: no checkpoint at {path}; start without --resume")
        ck = ckpt.read_checkpoint(path)
        if int(ck["step"]) > cfg.steps:
            raise TrainingError(f"--resume: {path} is at step {ck['step']}, beyond steps="
                                f"{cfg.steps}; raise --steps to continue it")  # fmt: skip
        # The saved optimizer state carries its groups' lr, wd, eps, momentum...: put this
        # run's back, so a hyperparameter given on resume is applied, not only recorded.
        mine = [{k: v for k, v in g.items() if k not in ckpt.RESUME_FROM_CHECKPOINT}
                for g in s.opt.param_groups]  # fmt: skip
        # either format, at any world size (a sharded one is resharded to this fleet's)
        ckpt.load_train_state(s.net, s.opt, ck, path, self.run.model)
        for g, hyper in zip(s.opt.param_groups, mine, strict=True):
            g.update(hyper)
        self.stream.load_state_dict(ck["data"])
        changed = fingerprint_mismatch(ck.get("data_fingerprint") or self.data_print,
                                       self.data_print)  # fmt: skip
        if changed:
            raise DataError(
                f"--resume: {path} was trained on other bytes: {'; '.join(changed)}. Resuming "
                f"would continue the run on data it never saw, at the old data position. Restore "
                f"the file the run was trained on, or train a new run on this one (--overwrite, "
                f"or another --out)"
            )
        ckpt.set_rng_state(ckpt.rank_rng(ck, s.ctx.rank))
        self.best = _Best.load(ck.get("extra"))
        saved_scale = (ck.get("extra") or {}).get("loss_scale")
        if s.scaler is not None and saved_scale is not None:
            s.scaler.load_state_dict(saved_scale)
            log.info(f"loss scale {s.scaler.scale:g} restored ({s.scaler.clean} clean steps "
                     f"since it last moved)")  # fmt: skip
        elif s.scaler is not None:
            log.info(f"loss scale: {path} holds none (it was not trained in fp16): starting at "
                     f"{s.scaler.scale:g}")  # fmt: skip
        self.start = self.last_saved = int(ck["step"])
        log.info(f"resumed from {path} at step {self.start}")
        for change in ckpt.resume_changes(ck["run"], self.run):
            log.info(f"changed on resume: {change}")
        dropped = self.folder.trim_metrics(self.start) if self.main else 0
        if dropped:
            log.info(f"metrics.jsonl: dropped {dropped} row(s) logged after step {self.start} "
                     f"(the run went on past its last checkpoint); they are logged again from "
                     f"here")  # fmt: skip

    def open_folder(self, resumed: bool) -> None:
        """Rank 0 readies the run folder: config.json, a fresh metrics.jsonl, the sinks."""
        if not self.main:
            return
        self.folder.make()
        if not resumed:
            self.folder.start_metrics()
            # a best.pt from the run this one replaces (--overwrite) is not this run's best
            ckpt.remove_checkpoint(self.best_file)
        self.folder.write_config(self.run)
        self.sinks.open(self.folder, self.cfg.tensorboard, self.start if resumed else None)

    # -- between steps -----------------------------------------------------------------------

    def save(self, step: int, where=None) -> None:
        """Every rank takes part: under FSDP2 each writes its shards and rank 0 commits them;
        else the state is gathered (a collective) and rank 0 writes the one file."""
        s, where = self.s, where or self.path
        self.beat.at(step, "save")
        extra = self.best.state()
        if s.scaler is not None:
            extra["loss_scale"] = s.scaler.state_dict()
        refused = None
        try:
            ckpt.save_state(where, s.net, s.opt, run=self.run, step=step,
                            data_state=self.stream.state_dict(),
                            data_fingerprint=self.data_print, main=self.main,
                            extra=extra)  # fmt: skip
        except ckpt.CheckpointError as e:  # NaN parameters, a full disk...
            refused = e
        else:
            if self.main:
                self.beat.at(step, "save", saved=step)
        s.ctx.barrier()
        # one rank's refusal is every rank's: the others would otherwise train on into a
        # collective that rank never joins
        if s.ctx.any_rank(refused is not None):
            if refused is not None:
                raise refused
            raise ckpt.CheckpointError(
                f"{'a rank' if ckpt.sharded(s.net) else 'rank 0'} could not write the "
                f"checkpoint at step {step} (its message names the cause); rank {s.ctx.rank} "
                f"stops with it"
            )
        if where == self.path:
            self.last_saved = step
        self.beat.at(step, "train", saved=step)

    def evaluate(self, step: int, train_loss: float) -> tuple[dict, bool]:
        """Evaluate (the fleet splits the batches), log, keep best.pt; (result, stop?). The
        evaluation before any step is logged, never a best: an untrained model is no
        checkpoint worth keeping."""
        s, cfg, best = self.s, self.cfg, self.best
        self.beat.at(step, "eval")
        res = evaluate_fleet(s.model, self.val, s.ctx, s.autocast)
        tag = (f" dist={s.ctx.rank}/{s.ctx.world} (split over the ranks)" if s.ctx.world > 1
               else "")  # fmt: skip
        log.info(f"eval step={step} loss={res['loss']:.4f} bpb={res['bpb']:.4f} on "
                 f"{res['tokens']} val bytes{tag}")  # fmt: skip
        self.sinks.write("eval", step, {"loss": res["loss"], "bpb": res["bpb"],
                                        "val_bytes": res["tokens"], "bytes": step * s.ctx.stride,
                                        "train_s": round(best.train_s, 3)})  # fmt: skip
        stop = False
        if step > 0:
            improved, overfit = best.see(step, res["loss"], train_loss)
            if overfit:
                log.warning(overfit)
            if improved:
                self.save(step, self.best_file)
                log.info(f"best val so far ({res['loss']:.4f}) at step {step}: "
                         f"{self.best_file}")  # fmt: skip
            if cfg.early_stop and best.since >= cfg.early_stop:
                log.warning(f"early stop at step {step}: {best.since} evaluations without a new "
                            f"best (early_stop={cfg.early_stop}); best was step {best.step} "
                            f"(val {best.loss:.4f}, in {self.best_file})")  # fmt: skip
                stop = True
        notify(s.callbacks.on_eval, step=step, val=res if self.main else {}, **s.seen())
        return res, stop

    def logs(self, done: int) -> bool:
        return bool(self.cfg.log_every and (done % self.cfg.log_every == 0 or done == self.end))

    def settle(self, p: Settled) -> bool:
        """The bookkeeping of step p.step once its verdict is read: the skip count (and the
        divergence stop), the log line and metrics row, the bar. False: skipped."""
        s, cfg, scaler = self.s, self.cfg, self.s.scaler
        stepped, gnorm = p.read()
        moved = p.aux.get("scale_line")
        if not stepped:
            self.skips += 1
            self.consecutive += 1
            log.info(f"step={p.step} skipped: non-finite loss or gradient (skips={self.skips})"
                     + (f"; {moved}" if moved else ""))  # fmt: skip
            if self.consecutive >= cfg.max_skips:
                fp16 = ("" if scaler is None else
                        f"; the fp16 loss scale fell to {scaler.scale:g}, so the forward "
                        f"itself is non-finite (an fp16 overflow past 65504 if fp32 trains): "
                        f"--set dtype=bf16 on sm_80+ or dtype=fp32")  # fmt: skip
                raise TrainingError(
                    f"{self.consecutive} consecutive non-finite steps (max_skips="
                    f"{cfg.max_skips}) at step {p.step}: the run diverged; lower --set lr (now "
                    f"{cfg.lr}) or check the data{fp16}"
                )
            return False
        if moved:
            log.info(f"step={p.step} {moved}")
        self.consecutive = 0
        self.tokens += s.ctx.global_tokens
        self.since_log += 1
        done = p.step + 1
        if self.logs(done):
            self._log_row(p, done, gnorm)
        self.bar.update(done, self.last_loss)
        return True

    def _log_row(self, p: Settled, done: int, gnorm: float) -> None:
        s, cfg, scaler, ctx = self.s, self.cfg, self.s.scaler, self.s.ctx
        fleet, local = p.losses(ctx)
        notify(s.callbacks.on_log, loss=fleet, local_loss=local, **s.seen())
        p.wait()
        now = time.perf_counter()
        ms = 1000 * (now - self.t_log) / max(1, self.since_log)
        tps = ctx.global_tokens * self.since_log / max(1e-9, now - self.t_log)
        self.t_log, self.since_log, self.last_loss = now, 0, fleet
        lr_now = cfg.lr * lr_factor(p.step, cfg)
        self.bar.clear()
        said = "" if scaler is None else f" scale={scaler.scale:g}"
        log.info(f"step={done} loss={fleet:.4f} bpb={fleet / LN2:.4f} lr={lr_now:.3e} "
                 f"gnorm={gnorm:.3f}{said} tok/s={tps:.0f} ms={ms:.1f}")  # fmt: skip
        self.sinks.write(
            "train",
            done,
            {
                "loss": fleet,
                "bpb": fleet / LN2,
                "lr": lr_now,
                "gnorm": gnorm,
                "tok_s": tps,
                "ms": ms,
                "load": p.load(),
                **({} if scaler is None else {"scale": scaler.scale}),
                # a fleet's windows per rank this step (re-balancing moves them)
                **({} if ctx.world == 1 else {"split": [r.windows for r in ctx.shapes]}),
            },
        )

    def flush(self) -> None:
        """Settle the step whose verdict is still on the device, if any."""
        if self.pending is not None:
            p, self.pending = self.pending, None
            self.settle(p)

    def stop_checks(self, step: int, stopper: GracefulStop, every: int) -> None:
        """Before step `step` (`step` steps complete: the one place a stop leaves a resumable
        state): a signal, here or on another rank, or a data file shrunk under the run ends
        the run with a checkpoint. Every rank stops on the same step."""
        ctx = self.s.ctx
        if (step - self.start) % every == 0 and ctx.any_rank(stopper.caught is not None):
            self.flush()  # the checkpoint holds this step's settled state
            why = stopper.caught or "a signal on another rank"
            self.bar.clear()
            log.info(f"stop requested ({why}) at step {step}: writing a checkpoint so --resume "
                     f"continues from here")  # fmt: skip
            self.save(step)
            stopper.stopped = True
            raise KeyboardInterrupt
        try:
            self.stream.check_source()
            shrunk = None
        except DataError as e:  # the file shrank under the run: the model is still at `step`
            shrunk = e
        # ranks may see the shrink a step apart: every rank stops on this step together
        if ctx.any_rank(shrunk is not None):
            self.flush()
            self.save(step)
            log.info(f"checkpoint written at step {step}; restore the data file, then "
                     f"--resume auto continues from there")  # fmt: skip
            raise shrunk or DataError(
                f"another rank found a data file shrunk under the run before step {step} (its "
                f"message names the file); rank {ctx.rank} stops with it"
            )


def train(model: torch.nn.Module, wrapped: Wrapped, opt, ctx: DPContext, run,
          autocast: torch.dtype | None, hooks: Hooks, stream_of=OneStream) -> dict:  # fmt: skip
    """Train `model` (the forward runs on `wrapped.net`, on ctx.device) as `run` says (a
    validated, resolved run: train_run's) and `hooks` ask; returns a report.
    `stream_of(data, ctx, run, model)`: this rank's stream of training windows (a fleet's
    re-splits on its agreed steps: fleet/balance.py FleetStream)."""
    cfg = run.train
    # fp16 anywhere in the fleet: one loss scale, the same on every rank (optim/scaler.py)
    scaler = LossScaler(cfg.loss_scale_every) if loss_scaled(autocast, ctx) else None
    s = Step(model, wrapped, opt, ctx, cfg, autocast, scaler, hooks.callbacks)
    sinks = Sinks()
    resume = hooks.resume
    try:
        r = _Run(s, run, hooks, sinks, stream_of)
        if resume:
            r.resume()
        r.open_folder(resume)
        log.info(
            f"run {run.source}: {ctx.describe()} steps={cfg.steps} lr={cfg.lr} "
            f"dtype={'fp32' if autocast is None else str(autocast).replace('torch.', '')}"
            + (
                ""
                if scaler is None
                else f" loss_scale={scaler.scale:g} (x2 every {scaler.every} clean steps, /2 and "
                f"a skip on overflow{'; the fleet shares it' if ctx.world > 1 else ''})"
            )
        )
        # every rank enters an evaluation (its barrier), also one holding no val batches
        first_eval = (r.evaluate(r.start, math.nan)[0]
                      if cfg.eval_every and r.start == 0 and r.data.has_val else {})  # fmt: skip
        # verdict=device: a step's verdict is read while the next one runs, except before an
        # evaluation, a checkpoint, a stop and the end, which see a settled state
        s.defer = device_verdict(cfg, ctx, opt, scaler)
        early, last_val = _steps(r)
        r.bar.clear()
        final = last_val if early else {}
        if r.data.has_val and not early:
            final, _ = r.evaluate(r.end, r.last_loss)
        if not early:
            r.save(r.end)
        if r.best.step is not None:
            log.info(f"best val {r.best.loss:.4f} at step {r.best.step}: {r.best_file}")
        if r.main and r.folder.file(METRICS).exists():
            _plot(r.folder)
    finally:
        sinks.close()
    bpb = (final or {}).get("bpb", 0.0)
    if not math.isfinite(bpb):
        raise TrainingError(
            f"the run ended at step {r.end} with validation bpb={bpb} ({r.skips} step(s) "
            f"skipped as non-finite): the model diverged, so {r.path} holds no usable model; "
            f"lower --set lr (now {cfg.lr}) and train again with --overwrite"
        )
    return {
        "steps": r.end, "loss": r.last_loss, "val": final, "val_start": first_eval,
        "skips": r.skips, "tokens": r.tokens, "rank": s.ctx.rank, "world_size": s.ctx.world,
        "checkpoint": str(r.path),
        "best": ({"step": r.best.step, "loss": r.best.loss, "path": str(r.best_file)}
                 if r.best.step is not None else None),
    }  # fmt: skip


def _steps(r: _Run) -> tuple[bool, dict]:
    """The steps from r.start to r.end: (stopped early?, the last evaluation)."""
    s, cfg = r.s, r.cfg
    # a fleet must stop on the same step on every rank: the ranks agree every 10 steps
    every = 1 if s.ctx.world == 1 else 10
    stopper = GracefulStop()
    stopper.install()
    last_val, step = {}, r.start
    try:
        for step in range(r.start, r.end):
            r.beat.at(step, "train")
            stopper.keep_installed()
            r.stop_checks(step, stopper, every)
            t_step = time.perf_counter()
            x, y = r.stream.next()
            s.ctx = r.stream.ctx  # a fleet's re-split replaces its context
            loss, aux, ok = train_step(s, x, y, lr_factor(step, cfg), step)
            if step == r.start:  # the first step may be long on one rank (kernel autotune)
                r.beat.settled()
                _say_first_step(t_step, s.ctx.device)
            done = step + 1
            evals = bool(cfg.eval_every and done % cfg.eval_every == 0 and done != r.end
                         and r.data.has_val)  # fmt: skip
            saves = bool(cfg.ckpt_every and done % cfg.ckpt_every == 0 and done != r.end)
            # (a step decided on the host anyway, e.g. a reference's dropped batch: settled)
            this = (
                Deferred(step, loss, aux, ok, want_load=r.logs(done))
                if s.defer and torch.is_tensor(ok)
                else Settled(step, loss, aux, ok)
            )
            r.flush()  # the step before, read while this one runs
            if s.defer and not (evals or saves or done == r.end):
                r.pending = this
            else:
                # a skipped step is a step all the same: evaluations and checkpoints keep
                # their cadence (a skip at step 499 used to drop the checkpoint at 500)
                r.settle(this)
            if evals and s.ctx.device.type == "cuda":
                torch.cuda.synchronize(s.ctx.device)  # this step's kernels count as training
            if step > r.start:  # the first step of a process holds kernel autotune / compile
                r.best.train_s += time.perf_counter() - t_step
            if evals:
                last_val, early = r.evaluate(done, r.last_loss)
                if early:
                    r.save(done)
                    r.end = done
                    return True, last_val
            if saves:
                r.save(done)
        r.flush()
        return False, last_val
    except KeyboardInterrupt:
        if not stopper.stopped:
            r.bar.clear()
            where = f"step {r.last_saved}" if r.last_saved is not None else "none yet"
            log.info(f"interrupted during step {step + 1}: no checkpoint written, since the "
                     f"state is mid-step (last checkpoint: {where}; one Ctrl-C, or SIGTERM, "
                     f"stops cleanly)")  # fmt: skip
        raise
    finally:
        stopper.restore()
