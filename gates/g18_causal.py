"""Gate 18: the model is causal in every arm and mode.

No fleet: the `tiny` model, its zero-initialised paths woken (Engram conv, the low-rank
deltas' B, the output gate's bias; the LFB bias randomised so it steers routing), a batch of
3 rows of 64 bytes, byte 37 of row 0 replaced. Every logit before position 37 in row 0 and
every logit of rows 1 and 2 must not move: bitwise on the CPU; on CUDA within 2x the spread
of two unperturbed forwards (both recorded). For every KDA arm that runs here (torch; fla
on CUDA where it imports), every MoE mode (dropless; capacity 1.0 and 0.5, which must drop
something or the case proves nothing), each dispatch arm (grouped where it runs, batched),
in train and eval mode; and the softmax-attention mixer (`attn_every=1`) in each MoE case.
Controls: the logit AT 37 must move (a model that ignores its
input fails), and capacity modes must drop assignments.
"""

from __future__ import annotations

import torch

from gates.compare import fmt
from gates.fixtures import threads
from gates.status import Record, environment

#: Not a fleet claim: `--cuda-fleet` runs it as it is.
CUDA = False
#: A one-card GPU claim: `python -m gates --cuda` runs it with cuda=True.
SINGLE_CUDA = True

B, T, AT = 3, 64, 37  # AT sits inside a KDA chunk (kda_chunk 16), not on a border
SEED = 18
MODES = {"dropless": 0.0, "cap1.0": 1.0, "cap0.5": 0.5}
DISPATCH = ("grouped", "batched", "dense")
# small enough to keep the tiny model's activations O(1), large enough to carry signal
WAKE_STD = 0.05

CLAIM = (
    "the model is causal in every arm and mode: a byte never changes an earlier logit "
    "or another row"
)
INSTRUMENT = (f"tiny, {B} rows x {T} bytes, zero-init params and the LFB bias woken (std "
              f"{WAKE_STD}); byte {AT} of row 0 replaced: max |dlogit| over row 0 before {AT} and "
              f"over rows 1-2, per mixer arm (KDA's, attention) x MoE mode (dropless, capacity 1.0, 0.5) x dispatch "
              f"(grouped, batched, dense) x train/eval; controls: the logit at {AT} moves, capacity "
              f"modes drop")  # fmt: skip


def build(kda: str, capacity: float, dispatch: str, device: str):
    """The tiny model for one case; the same seed gives every case the same weights."""
    from dormouse.config import apply_sets, preset
    from dormouse.model import DormouseModel

    # moe_lb_coef=0: a train-mode forward must not move the LFB counts between the two runs
    # "attn": the softmax-attention mixer (attn_every=1) in place of KDA (model/attn.py)
    mixer = ["attn_every=1"] if kda == "attn" else [f"kda_impl={kda}"]
    run = apply_sets(preset("tiny"), [*mixer, f"moe_capacity={capacity}",
                                      f"moe_impl={dispatch}", "moe_lb_coef=0"])  # fmt: skip
    torch.manual_seed(SEED)
    model = DormouseModel(run.model)
    wake(model)
    return model.to(device)


def wake(model) -> list[str]:
    """Give every all-zero parameter (and the LFB bias) small random values; returns their names.

    Zero-init paths are exact identities at step 0, so a leak through them would be invisible
    to a fresh model: the Engram conv, every LowRankDelta's B, the KDA output gate's bias.
    """
    gen = torch.Generator().manual_seed(SEED + 1)
    woken = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * WAKE_STD)
                woken.append(name)
        for name, b in model.named_buffers():
            if name.endswith("lfb_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * WAKE_STD)
                woken.append(name)
    return woken


def inputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 2)
    x = torch.randint(0, 256, (B, T), generator=gen)
    xp = x.clone()
    xp[0, AT] = (x[0, AT] + 97) % 256  # a different byte, deterministically
    return x.to(device), xp.to(device)


def probe(model, x, xp, train: bool, spread: bool) -> dict:
    """Forward x and xp (and x again when `spread`): the figures of one case."""
    model.train(train)
    # train mode runs with gradients on, as the training forward does
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx:
        base, _, aux = model(x)
        pert, _, aux_p = model(xp)
        again = model(x)[0] if spread else base
    base, pert, again = (t.detach().float() for t in (base, pert, again))
    d = (pert - base).abs()
    return {
        "leak": max(d[0, :AT].max().item(), d[1:].max().item()),
        "at": d[0, AT].max().item(),
        "spread": (again - base).abs().max().item(),
        "drops": int(aux["dropped"]),
        "drops_pert": int(aux_p["dropped"]),
    }


def _arms(cuda: bool) -> list[str]:
    if not cuda:
        return ["torch", "attn"]
    from dormouse.model.arms import choose_arm

    fla = ["fla"] if choose_arm("kda", "auto", "cuda").name == "fla" else []
    return ["torch", *fla, "attn"]


def _dispatch(device: str) -> list[str]:
    from dormouse.model.arms import why_not

    cfg = __import__("dormouse.config", fromlist=["preset"]).preset("tiny").model
    shape = {"d_model": cfg.d_model, "d_ffn": cfg.d_ffn}
    return [d for d in DISPATCH if not why_not("moe", d, torch.device(device), shape=shape)]


def cases(cuda: bool):
    device = "cuda" if cuda else "cpu"
    for kda in _arms(cuda):
        for mode, capacity in MODES.items():
            for dispatch in _dispatch(device):
                yield kda, mode, capacity, dispatch, device


def run(cuda: bool = False) -> Record:
    # One CPU thread, as `timed` gives every gate: these are tiny matmuls, and two threads on
    # a busy two-core machine measured 13 s for g18 against 0.6 s with one.
    with threads(1):
        return _run(cuda)


def _run(cuda: bool) -> Record:
    device = "cuda" if cuda else "cpu"
    x, xp = inputs(device)
    bad, parts, worst_leak, worst_spread, n = [], [], 0.0, 0.0, 0
    for kda, mode, capacity, dispatch, dev in cases(cuda):
        model = build(kda, capacity, dispatch, dev)
        for train in (True, False):
            r = probe(model, x, xp, train, spread=cuda)
            n += 1
            # CPU: bitwise (same shapes, same kernels, exact zeros for masked terms). CUDA:
            # 2x the measured run-to-run spread of the unperturbed forward (0 if deterministic).
            tol = 2 * r["spread"] if cuda else 0.0
            name = f"{kda}/{mode}/{dispatch}/{'train' if train else 'eval'}"
            if r["leak"] > tol:
                bad.append(f"{name}: earlier/other-row logits moved {fmt(r['leak'])} > {fmt(tol)}")
            if not r["at"] > tol:
                bad.append(f"{name}: control: the logit at {AT} moved only {fmt(r['at'])}")
            if capacity > 0 and r["drops"] == 0:
                bad.append(f"{name}: capacity {capacity} dropped nothing (the case proves nothing)")
            worst_leak, worst_spread = max(worst_leak, r["leak"]), max(worst_spread, r["spread"])
            text = f"{name} {fmt(r['leak'])}"
            if capacity > 0:
                text += f" ({r['drops']}->{r['drops_pert']} drops)"
            if cuda:
                text += f" spread {fmt(r['spread'])}"
            parts.append(text)
    measured = (
        f"{n - len({b.split(':')[0] for b in bad})}/{n} cases causal; max change before "
        f"{AT} / other rows {fmt(worst_leak)}"
        + (f", max spread of two unperturbed forwards {fmt(worst_spread)}" if cuda else "")
        + "; per case (max change, drops unperturbed->perturbed): "
        + "; ".join(parts)
    )
    if bad:
        measured += f"; {len(bad)} FAILURE(S): " + " | ".join(bad[:6])
    tolerance = ("CPU: 0, bitwise (same shapes and kernels; masked terms are exact zeros); "
                 "CUDA: <= 2x the spread of two unperturbed forwards; the logit at "
                 f"{AT} must move; each capacity case must drop > 0 assignments")  # fmt: skip
    env = environment("none", torch.cuda.get_device_name(0) if cuda else "cpu")
    return Record("g18_causal", CLAIM, INSTRUMENT, measured, tolerance, not bad, env,
                  details={"failures": bad})  # fmt: skip
