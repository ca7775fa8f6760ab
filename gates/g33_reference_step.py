"""Gate 33: the single-process trainer trains as the equations say (references/step.py).

`train_run` in this process, and the reference written from DESIGN §3 (which shares nothing
with dormouse.train but the starting parameters), run the same steps from the same state on
the same corpus file; every figure a run produces is compared: the logged losses, the
pre-clip norms, the evaluations (loss and bpb), the skipped steps, where an early stop ends
the run, and every field of the checkpoint (parameters, LFB buffers, optimizer state, data
position, the best-validation record with the early-stop counter) at a resume in the middle
and at the end. A bug in code the fleet shares with the single process (loss, clip,
schedule, optimizer, LFB, data order, evaluation, resume state) moves both alike, so the
fleet gates cannot see it; this gate can.

The fixtures are chosen to show such bugs: warm-up, a clip that fires on some steps and not
others (and one run without a clip), LFB on, dropout on, non-default lr multipliers, Adam
betas and epsilon, Muon momentum and Newton-Schulz settings, gradient accumulation, capacity
MoE, non-finite steps (skipped, one of them on an evaluation step), a corpus of a few blocks
(the runs cross passes: phase and order per pass), a validation split the model cannot learn
(random high bytes: the early stop fires, after the resume), and a model whose
zero-initialised parameters (the low-rank deltas' B, the Engram conv) are woken, so every
path learns from step 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from gates.compare import fmt
from gates.fixtures import corpus_path
from gates.recorder import no_plot
from gates.status import Record, environment

CUDA = False

CLAIM = (
    "the single-process trainer equals the training equations step for step "
    "(references/step.py, which shares nothing with dormouse.train)"
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    sets: tuple[str, ...]
    stop_at: int = 0  # > 0: the run stops there and is resumed from its checkpoint
    poison: int = -1  # this 0-based step's loss is made non-finite (the step must be skipped)
    resume_sets: tuple[str, ...] = ()  # given again on the resume (it must apply them)


#: Common to every case: the tiny preset, 32-byte windows, a train split of 7 blocks of 4
#: windows (the runs cross two passes), a val split of random bytes.
COMMON = ("seq_len=32", "log_every=1", "ckpt_every=0", "val_bytes=264", "eval_batches=2",
          "seed=11", "kda_impl=torch", "ns_dtype=fp32")  # fmt: skip
TRAIN_BYTES = 7 * 4 * 33 + 20  # 7 blocks of 4 windows of 33 bytes, 20 never read in a pass

CASES = (
    Case(
        "mix",
        (
            "opt=mix",
            "batch=2",
            "global_batch=4",
            "steps=16",
            "warmup=4",
            "lr=3e-3",
            "min_lr_frac=0.2",
            "wd=0.3",
            "grad_clip=2.0",
            "moe_lb_coef=0.02",
            "dropout=0.1",
            "engram_lr_mult=3",
            "muon_momentum=0.9",
            "adam_betas=0.85,0.98",
            "adam_eps=1e-7",
            "ns_kind=polar_express",
            "ns_steps=4",
            "muon_sf=jordan",
            "muon_variant=nesterov",
            "eval_every=3",
            "early_stop=3",
        ),
        stop_at=6,
        poison=7,
        resume_sets=("lr=2e-3",),  # a new base lr from the resume on, in every group
    ),
    Case(
        "adamw-ram",
        (
            "opt=adamw",
            "engram_ram=true",
            "batch=4",
            "steps=12",
            "warmup=3",
            "schedule=wsd",
            # 12 x 0.3 = 3.6: the decay starts at 12 - 3 = 9, neither at 8 (rounded) nor at 3
            # (the fraction read from the start), which 0.5 could not tell apart
            "wsd_decay_frac=0.3",
            "lr=2e-3",
            "wd=0.2",
            "grad_clip=0",
            "moe_capacity=1.0",
            "moe_lb_coef=0.01",
            "engram_lr_mult=7",
            "adam_betas=0.8,0.99",
            "eval_every=4",
            "ckpt_every=4",
        ),
        stop_at=8,
        poison=3,
    ),  # a skip on an evaluation (and checkpoint) step
    Case(
        "mix-ram",
        (
            "opt=mix",
            "engram_ram=true",
            "batch=2",
            "global_batch=4",
            "steps=10",
            "warmup=2",
            "schedule=constant",
            "lr=2e-3",
            "grad_clip=1.0",
            "dropout=0.2",
            "muon_variant=plain",
            "muon_sf=rms",
            "engram_lr_mult=2",
            "eval_every=5",
        ),
    ),
    Case(
        "adamw",
        (
            "opt=adamw",
            "batch=4",
            "steps=10",
            "warmup=5",
            "lr=2e-3",
            "wd=0.5",
            "grad_clip=1.5",
            "moe_lb_coef=0.03",
            "moe_capacity=0.5",
            "dropout=0.1",
            "engram_lr_mult=4",
            # step 1 skipped between the evaluations at 1 and 2: the two tie, and the first
            # stays the best (a tie is no improvement: best step 1, one evaluation since)
            "eval_every=1",
            # the same 264-byte val split by the fraction rule: ceil(0.2185 x 1208) = 264,
            # where a floor would give 263 (the rule's rounding shows in the train ring)
            "val_bytes=0",
            "val_frac=0.2185",
        ),
        stop_at=2,  # the checkpoint right after the tie holds best step 1, since-best 1
        poison=1,
    ),
)

#: fp32 trainer vs fp64 reference, worst of the four cases (torch 2.13, CPU); each about 5x:
TOL = {
    # logged loss (nats, a mean of 128 tokens of ~5.5): measured <= 1.3e-6
    "loss": 1e-5,
    # evaluation loss and bpb: measured <= 8.2e-7
    "eval": 1e-5,
    # `dormouse eval`'s whole-split loss and bpb of the last checkpoint: measured <= 2.8e-7
    "whole": 1e-5,
    # pre-clip norm, relative: measured <= 3.8e-6 (after 16 steps of fp32 trajectory)
    "gnorm": 2e-5,
    # the worst tensor's update, relative: measured <= 9.6e-5 (1-D AdamW tensors); bugs 1e-2
    "update": 5e-4,
    # optimizer moments and momenta, per tensor relative: measured <= 3.2e-5
    "state": 2e-4,
    # the LFB bias, sums of +-coef held in fp32: measured <= 1.8e-8; a flipped sign is 2 coef
    "lfb": 1e-7,
}


def write_corpus(where: Path) -> Path:
    """The gates' fixture corpus's first TRAIN_BYTES, then 264 random bytes >= 128, which the text
    never holds: the val split, whose loss rises as the model learns the text."""
    text = corpus_path().read_bytes()[:TRAIN_BYTES]
    noise = np.random.default_rng(51).integers(128, 256, 264, dtype=np.uint8).tobytes()
    path = where / "corpus.bin"
    path.write_bytes(text + noise)
    return path


def fixture(case: Case, data: Path, out: Path, resumed: bool = False):
    from dormouse.config import apply_sets, preset, validate

    return validate(apply_sets(preset("tiny"), [f"data={data}", f"out_dir={out}", *COMMON,
                                                *case.sets,
                                                *(case.resume_sets if resumed else ())]))  # fmt: skip


def woken(run) -> torch.nn.Module:
    """The run's seeded model with its zero-initialised parameters drawn small and its router
    weights x8 (routing margins well above fp32 round-off), so every path learns at once."""
    from dormouse.train.run import build_model

    model = build_model(run)
    gen = torch.Generator().manual_seed(run.train.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            if name.endswith("router.weight"):
                p.mul_(8.0)
    return model


def _poisoned(model: torch.nn.Module, at: int) -> None:
    """The `at`-th training forward returns loss + NaN (its gradient finite)."""
    orig, calls = model.forward, [0]

    def forward(x, y=None, **kw):
        logits, loss, aux = orig(x, y, **kw)
        if model.training and loss is not None:
            if calls[0] == at:
                loss = loss + float("nan")
            calls[0] += 1
        return logits, loss, aux

    model.forward = forward


def train(run, model, *, resume: bool = False, stop_at: int | None = None, poison: int = -1,
          start: int = 0) -> dict:  # fmt: skip
    """train_run in this process; what the loop's callbacks saw, by step."""
    from dormouse.train.loop import Callbacks
    from dormouse.train.run import train_run

    if poison >= start:
        micro = (run.train.global_batch or run.train.batch) // run.train.batch
        _poisoned(model, (poison - start) * micro)
    rec = {"losses": {}, "gnorms": {}, "evals": [], "skipped": []}
    at = [start]

    def after_step(info):
        rec["gnorms"][at[0]] = float(info["gnorm"])
        if not info["stepped"]:
            rec["skipped"].append(at[0])
        at[0] += 1

    def on_log(info):
        rec["losses"][at[0] - 1] = float(info["loss"])

    def on_eval(info):
        rec["evals"].append((info["step"], info["val"]["loss"], info["val"]["bpb"]))

    with no_plot():
        report = train_run(run, model=model, resume=resume, stop_at=stop_at,
                           callbacks=Callbacks(after_step=after_step, on_log=on_log,
                                               on_eval=on_eval))  # fmt: skip
    rec["end"] = report["steps"]
    ck = torch.load(Path(run.train.out_dir) / f"{run.train.ckpt_name}.pt", weights_only=True)
    rec["checkpoint"] = ck
    return rec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float((a - b).norm())


def checkpoint_errors(ck: dict, snap: dict, start: dict, run_json: str) -> tuple[dict, list[str]]:
    """A checkpoint file's fields against the reference's snapshot: (figures, mismatches).
    Not compared: the RNG state (training draws no random numbers: dropout is keyed), the
    seconds trained (wall time), the data fingerprint (the file's, not the run's)."""
    bad: list[str] = []
    fig = {"update": 0.0, "state": 0.0, "lfb": 0.0}
    worst = {"update": "", "state": ""}
    model, ref = ck["model"], snap["model"]
    if set(model) != set(ref):
        bad.append(f"model keys differ: {sorted(set(model) ^ set(ref))[:4]}")
    for n in sorted(set(model) & set(ref)):
        a, b = model[n].double(), ref[n]
        if n.endswith(("lfb_bias", "lfb_counts")):
            fig["lfb"] = max(fig["lfb"], float((a - b).abs().max()))
            continue
        e = _rel(a - start[n].double(), b - start[n].double())
        if e > fig["update"]:
            fig["update"], worst["update"] = e, n
    opt = ck["optimizer"]["state"]
    for n, st in snap["optimizer"].items():
        mine = opt.get(n)
        if mine is None or set(mine) != set(st):
            bad.append(f"optimizer state of {n}: {sorted(mine or {})} vs the reference's "
                       f"{sorted(st)}")  # fmt: skip
            continue
        for k, v in st.items():
            if k == "step":
                if not torch.equal(mine[k].double().reshape(v.shape), v.double()):
                    bad.append(f"{n} step counts differ")
                continue
            e = _rel(mine[k], v)
            if e > fig["state"]:
                fig["state"], worst["state"] = e, f"{n}/{k}"
    if set(opt) != set(snap["optimizer"]):
        bad.append(f"optimizer state names differ: {sorted(set(opt) ^ set(snap['optimizer']))[:4]}")
    if ck["step"] != snap["step"]:
        bad.append(f"step {ck['step']}, the reference's {snap['step']}")
    data = {k: ck["data"].get(k) for k in snap["data"]}
    if data != snap["data"]:
        bad.append(f"data position {data}, the reference's {snap['data']}")
    stored, asked = json.loads(ck["config"]), json.loads(run_json)
    # a field left on "auto" is stored as what it resolved to
    differ = [
        k
        for part in ("model", "train")
        for k, v in asked[part].items()
        if v != "auto" and stored[part].get(k) != v
    ]
    if differ or stored["source"] != asked["source"]:
        bad.append(f"the stored run config differs from the run's in {differ or ['source']}")
    extra = ck.get("extra", {})
    for k in ("best_step", "since_best"):
        if extra.get(k) != snap[k]:
            bad.append(f"{k} {extra.get(k)!r}, the reference's {snap[k]!r}")
    if (
        snap["best_loss"] is not None
        and abs((extra.get("best_loss") or math.inf) - snap["best_loss"]) > TOL["eval"]
    ):
        bad.append(f"best_loss {extra.get('best_loss')!r}, the reference's {snap['best_loss']:.6f}")
    hist = extra.get("history") or []
    if [h[0] for h in hist] != [h[0] for h in snap["history"]] or any(
            abs(a[1] - b[1]) > TOL["eval"] or (abs(a[2] - b[2]) > TOL["loss"])
            for a, b in zip(hist, snap["history"]) if math.isfinite(b[2])):  # fmt: skip
        bad.append(
            f"history {[h[0] for h in hist]}, the reference's "
            f"{[h[0] for h in snap['history']]} (or their losses differ)"
        )
    fig["where"] = worst
    return fig, bad


def compare(got: dict, ref: dict) -> tuple[dict, list[str]]:
    """The callbacks' figures of one trainer run against the reference's record."""
    bad = []
    steps = sorted(got["gnorms"])
    fig = {
        "loss": max(
            (abs(got["losses"][s] - ref["losses"][s]) for s in got["losses"] if s in ref["losses"]),
            default=0.0,
        ),
        "gnorm": max(
            (
                abs(got["gnorms"][s] - ref["gnorms"][s]) / ref["gnorms"][s]
                for s in steps
                if s in ref["gnorms"]
            ),
            default=0.0,
        ),
    }
    if set(got["losses"]) != {s for s in ref["losses"] if s >= min(steps, default=0)}:
        bad.append(f"logged steps {sorted(got['losses'])[:3]}.., the reference's differ")
    skipped = [s for s in ref["skipped"] if s in got["gnorms"]]
    if got["skipped"] != skipped:
        bad.append(f"skipped steps {got['skipped']}, the reference's {skipped}")
    evals = ref["evals"]
    if [e[0] for e in got["evals"]] != [e[0] for e in evals]:
        bad.append(
            f"evaluations at {[e[0] for e in got['evals']]}, the reference's at "
            f"{[e[0] for e in evals]}"
        )
    fig["eval"] = max(
        (max(abs(a[1] - b[1]), abs(a[2] - b[2])) for a, b in zip(got["evals"], evals)), default=0.0
    )
    return fig, bad


def one(case: Case, work: Path) -> tuple[dict, list[str], str]:
    """Train the case (stopped and resumed when it says so) and its reference; compare."""
    from references.step import ReferenceRun

    data = write_corpus(work)
    run = fixture(case, data, work / case.name)
    model = woken(run)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # engram_ram's tables are no parameters: the state dict has them all the same
    again = fixture(case, data, work / case.name, resumed=True)
    ref = ReferenceRun(run, start, data).run(
        poison=(case.poison,) if case.poison >= 0 else (),
        snapshots=(case.stop_at,) if case.stop_at else (),
        retrain=(case.stop_at, again.train) if case.resume_sets else None,
    )
    figs, bad = {}, []
    if case.stop_at:
        first = train(run, model, stop_at=case.stop_at, poison=case.poison)
        f, b = checkpoint_errors(
            first["checkpoint"], ref["snapshots"][case.stop_at], start, run.to_json()
        )
        bad += [f"at the resume ({case.stop_at}): {x}" for x in b]
        second = train(again, woken(run), resume=True, poison=case.poison, start=case.stop_at)
        got = {
            k: ({**first[k], **second[k]} if isinstance(first[k], dict) else first[k])
            for k in ("losses", "gnorms")
        }
        got["skipped"] = first["skipped"] + second["skipped"]
        got["evals"] = first["evals"] + [e for e in second["evals"] if e[0] > case.stop_at]
        got["end"], got["checkpoint"] = second["end"], second["checkpoint"]
        figs.update({f"resume {k}": v for k, v in f.items() if k != "where"})
    else:
        got = train(run, model, poison=case.poison)
    f, b = compare(got, ref)
    figs.update(f)
    bad += b
    if got["end"] != ref["end"]:
        bad.append(f"the run ended at step {got['end']}, the reference at {ref['end']}")
    f, b = checkpoint_errors(got["checkpoint"], ref["final"], start, again.to_json())
    bad += [f"at the end: {x}" for x in b]
    where = f.pop("where")
    figs.update(f)
    if "whole" in ref:  # `dormouse eval` of the last checkpoint: every val byte once
        from dormouse.cli import score_checkpoint

        mine = score_checkpoint(Path(run.train.out_dir) / f"{run.train.ckpt_name}.pt")
        theirs = ref["whole"]
        figs["whole"] = max(abs(mine["loss"] - theirs["loss"]), abs(mine["bpb"] - theirs["bpb"]))
        if figs["whole"] > TOL["whole"] and ref["whole_margin"] < MARGIN:
            bad.append(f"whole: the reference's routing margin {fmt(ref['whole_margin'])} < "
                       f"{fmt(MARGIN)}: fp32 and fp64 may pick other experts there")  # fmt: skip
        if mine["tokens"] != theirs["tokens"]:
            bad.append(f"dormouse eval scored {mine['tokens']} val bytes, the reference "
                       f"{theirs['tokens']}")  # fmt: skip
    figs["margin"] = ref["margin"]
    text = (
        f"{case.name}: {len(got['gnorms'])} steps (end {got['end']}, skipped "
        f"{got['skipped'] or 'none'}, evals at {[e[0] for e in got['evals']]}"
        + (f", resumed at {case.stop_at}" if case.stop_at else "")
        + "): "
        + ", ".join(f"{k} {fmt(v)}" for k, v in figs.items() if k != "margin")
        + f" (worst update {where['update']}, state {where['state']}); routing margin "
        f"{fmt(ref['margin'])}"
    )
    return figs, bad, text


def run(cuda: bool = False) -> Record:
    del cuda  # one process on the CPU: the claim is about arithmetic, not a device
    parts, bad = [], []
    with tempfile.TemporaryDirectory(prefix="dormouse-g33-") as tmp:
        for case in CASES:
            figs, b, text = one(case, Path(tmp))
            for k, v in figs.items():
                key = k.removeprefix("resume ")
                if key in TOL and not v <= TOL[key]:
                    b.append(f"{k} {fmt(v)} > {fmt(TOL[key])}")
            if figs["margin"] < MARGIN:
                b.append(
                    f"routing margin {fmt(figs['margin'])} < {fmt(MARGIN)}: fp32 and fp64 "
                    f"may pick other experts (the fixture, not the trainer)"
                )
            parts.append(text)
            bad += [f"{case.name}: {x}" for x in b]
    measured = "; ".join(parts)
    if bad:
        measured += f"; {len(bad)} MISMATCH(ES): " + " | ".join(bad[:8])
    instrument = ("tiny, 4 runs from a woken seeded model on a 7-block corpus with a random-byte "
                  "val split: " + "; ".join(
                      f"{c.name} [{' '.join(c.sets)}"
                      + (f", resumed at {c.stop_at}" if c.stop_at else "")
                      + (f" with {' '.join(c.resume_sets)}" if c.resume_sets else "")
                      + (f", step {c.poison} non-finite" if c.poison >= 0 else "") + "]"
                      for c in CASES)
                  + ". train_run in this process (fp32) vs references/step.py (fp64): logged "
                  "losses, pre-clip norms, evaluations, skips, the end step, every "
                  "checkpoint field at the resume and at the end, and `dormouse eval`'s "
                  "whole-split score of the last checkpoint (whole)")  # fmt: skip
    tol = (", ".join(f"{k} <= {fmt(v)}" for k, v in TOL.items())
           + "; steps, skips, evaluation steps, step counts, data position, best step and "
           "early-stop counter exact (fp32 round-off against fp64; update: the worst tensor's "
           "relative error, Adam amplifies round-off on small gradients)")  # fmt: skip
    return Record(
        "g33_reference_step",
        CLAIM,
        instrument,
        measured,
        tol,
        not bad,
        environment("none", "cpu"),
        details={"mismatches": bad},
    )


#: Below this, fp32 affinities (exact to ~1e-7) may route unlike fp64; woken routers stay above.
MARGIN = 1e-5
