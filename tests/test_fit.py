"""The --fit planner: the memory model's arithmetic, the cheapest-first ladder, the loud
refusal and the CLI line. Everything runs on the meta device."""

from __future__ import annotations

import importlib.util
import logging
import re
import resource
from dataclasses import replace

import pytest
import torch

import dormouse.model as dm
from dormouse.cli import main as cli_main
from dormouse.config import ModelConfig, RunConfig, TrainConfig, preset
from dormouse.train.plan import fit
from dormouse.train.plan.fit import FitError, GiB, ParamSplit, estimate, plan_fit

COMPONENTS = ("masters", "grads", "adamw", "muon", "engram", "casts", "act", "opt_work")

# A hand-countable parameter split: what route_params would report for an imaginary model.
SPLIT = ParamSplit(
    total=1110, muon=1000, adamw=100, engram=10, expert=600, body=900, matrices=300,
    muon_groups=(((10, 20), 600), ((20, 20), 400)),
)  # fmt: skip


def _run(**model) -> RunConfig:
    m = ModelConfig(d_model=8, n_heads=2, head_dim=4, d_ffn=16, n_layers=2, max_iter=2,
                    moe_topk=2, kda_impl="fla", moe_impl="grouped", max_seq_len=64)  # fmt: skip
    return RunConfig("hand", replace(m, **model), TrainConfig(batch=2, seq_len=16))


@pytest.fixture
def hand_split(monkeypatch):
    monkeypatch.setattr(fit, "param_split", lambda run: SPLIT)


# ---- the arithmetic -------------------------------------------------------------------


def test_components_on_a_hand_countable_split(hand_split):
    run = _run()
    e = estimate(run)
    assert (e.masters, e.grads) == (4 * 1110, 4 * 1110)
    rows = 10 // run.model.engram_dim  # one int32 step count per table row
    assert (e.adamw, e.muon, e.engram) == (8 * 100, 4 * 1000, 8 * 10 + 4 * rows)
    # bf16: 600 expert elements cast per application (max_iter=2) + 300 other matrices once
    assert e.casts == 2 * (600 * 2 + 300)
    # K by hand (half precision, fla arm, d_attn = d_model = 8, k=2, F=16):
    # 60 + 24 + 2*(7*8 + 8*16)/8 + 25 = 155
    assert e.k_act == pytest.approx(155.0)
    tokens_d = 2 * 16 * 8
    w = fit.BACKWARD_WORKSET  # the backward's working set, in blocks
    assert e.act == int(155 * tokens_d * 4) + int(155 * tokens_d * w)  # 4 applications + work
    # Muon's largest group: 3 matrices of 10x20 (600 elements): 14 B each with a bf16 polar,
    # plus the two 10x10 Gram matrices per matrix in bf16
    assert e.opt_work == 14 * 600 + 2 * 3 * 10 * 10 * 2
    resident = e.masters + e.adamw + e.muon + e.engram
    assert e.step == resident + e.grads + e.opt_work
    assert e.backward == resident + e.casts + e.act
    # halfway through backward (max_iter=2): half the saves gone, the body's 900 grads present
    saved, work = int(155 * tokens_d * 4), int(155 * tokens_d * w)
    assert e.midpoint == resident + int((e.casts + saved) * 0.5) + work + 4 * 900
    assert e.total == max(e.backward, e.midpoint, e.step)


def test_the_dense_moe_saves_every_experts_hidden_units(hand_split):
    """moe_impl=dense (and auto on a CUDA card for a narrow MoE) keeps n_experts' hidden units
    a token instead of moe_topk's, and no gathered copies of x: 60 + 24 + (7*8 + 4*8*16)/8 + 25."""
    assert estimate(_run(moe_impl="dense")).k_act == pytest.approx(60 + 24 + 71 + 25)
    auto = _run(moe_impl="auto")
    assert fit.moe_dense(replace(auto, train=replace(auto.train, device="cuda")))
    assert not fit.moe_dense(replace(auto, train=replace(auto.train, device="cpu")))


def test_each_mechanism_removes_what_it_claims(hand_split):
    base = estimate(_run())
    routed = 2 * (7 * 8 + 8 * 16) / 8  # the routed expert pass's share of K
    td = 2 * 16 * 8

    off = estimate(_run(moe_offload=True))
    assert off.k_act == pytest.approx(base.k_act - routed)
    assert off.casts == 2 * (600 // 2 + 300)  # one block's expert casts stay, transiently

    ram = estimate(_run(engram_ram=True))
    assert (ram.masters, ram.grads, ram.engram) == (4 * 1100, 4 * 1100, 0)

    ck = estimate(_run(act_ckpt=True))
    w = 1 + fit.BACKWARD_WORKSET  # one block recomputed, plus its backward's working set
    assert ck.act == int(4 * td * 4) + int(base.k_act * td * w)  # fp32 inputs of 4 applications
    ckq = estimate(_run(act_ckpt=True, act_ckpt_quant=True))
    assert ckq.act == int(2 * td * 4) + int(base.k_act * td * w)

    run = _run()
    bf = estimate(replace(run, train=replace(run.train, muon_state_dtype="bf16")))
    assert bf.muon == 2 * 1000
    assert bf.opt_work == base.opt_work + 4 * 600  # momentum widened for the update
    i8 = estimate(replace(run, train=replace(run.train, muon_state_dtype="int8",
                                             engram_state_dtype="int8")))  # fmt: skip
    assert i8.muon == 1000 + 4 * 4  # the codes, and an fp32 absmax per 256 values (4 blocks)
    assert i8.engram == 2 * 10 + (4 + 2 * 4) * (10 // run.model.engram_dim)  # + 2 row scales
    assert i8.opt_work == base.opt_work  # the fp32 momentum is freed before the polar
    b8 = estimate(replace(run, train=replace(run.train, optim_8bit=True)))
    assert (b8.adamw, b8.engram) == (2 * 100, base.engram)  # Engram moments are not 8-bit

    fp32 = estimate(replace(run, train=replace(run.train, dtype="fp32")))
    assert fp32.casts == 0


def test_torch_arm_saves_more_and_scales_with_the_chunk(hand_split):
    fla = estimate(_run())
    tor = estimate(_run(kda_impl="torch"))
    assert tor.k_act - fla.k_act == pytest.approx(215 - 24)
    tor32 = estimate(_run(kda_impl="torch", kda_chunk=32))
    assert tor32.k_act - tor.k_act == pytest.approx(215)


def test_param_split_matches_the_real_model():
    run = preset("tiny")
    fit._SPLITS.clear()
    s = fit.param_split(run)
    model = dm.DormouseModel(run.model)
    m = run.model
    assert s.total == sum(p.numel() for p in model.parameters())
    assert s.engram == model.engram.store.table.numel()
    assert s.expert == m.n_layers * 3 * m.n_experts * m.d_model * m.d_ffn
    assert s.muon + s.adamw + s.engram == s.total
    assert s.body == sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks."))


# ---- the ladder -----------------------------------------------------------------------


def _gb_for(total: int) -> float:
    """The smallest budget (GB) whose usable share holds `total` bytes."""
    return total / (fit.FIT_HEADROOM * GiB) * (1 + 1e-9)


def test_mechanisms_engage_cheapest_first():
    run = replace(preset("small"), train=replace(preset("small").train, seq_len=512))
    run = replace(run, model=replace(run.model, kda_impl="fla"))
    e0 = estimate(run)
    r1 = fit.engage(run, "moe_offload")
    e1 = estimate(r1)
    e2 = estimate(fit.engage(r1, "engram_ram"))
    assert e0.total > e1.total > e2.total  # each rung must gain for this to test the order

    for gb, want in ((_gb_for(e0.total), []), (_gb_for(e1.total), ["moe_offload"]),
                     (_gb_for(e2.total), ["moe_offload", "engram_ram"])):  # fmt: skip
        planned, est, engaged = plan_fit(run, gb)
        assert engaged == want, gb
        assert est.total <= fit.usable_bytes(gb)
        assert [m for m in fit.MECHANISM_NAMES if fit.mechanism_on(planned, m)] == want


def test_8bit_only_where_bitsandbytes_is_found(hand_split, monkeypatch):
    # An AdamW-heavy split: only the 8-bit moments can bring it under the budget.
    heavy = replace(SPLIT, total=10**6 + 1110, adamw=10**6 + 100)
    monkeypatch.setattr(fit, "param_split", lambda run: heavy)
    run = _run()
    want = estimate(fit.engage(run, "optim_8bit"))
    gb = _gb_for(want.total)
    real = importlib.util.find_spec

    monkeypatch.setattr(fit.importlib.util, "find_spec",
                        lambda n: None if n == "bitsandbytes" else real(n))  # fmt: skip
    with pytest.raises(FitError, match="optim_8bit skipped: bitsandbytes is not installed"):
        plan_fit(run, gb)

    monkeypatch.setattr(fit.importlib.util, "find_spec",
                        lambda n: object() if n == "bitsandbytes" else real(n))  # fmt: skip
    planned, _est, engaged = plan_fit(run, gb)
    assert "optim_8bit" in engaged and planned.train.optim_8bit


def test_int8_state_is_a_rung_after_bf16_and_replaces_it(hand_split, monkeypatch):
    names = fit.MECHANISM_NAMES
    for knob in ("muon_state_dtype", "engram_state_dtype"):
        assert names.index(f"{knob}=bf16") < names.index(f"{knob}=int8") < names.index(
            "optim_8bit")  # fmt: skip
        assert f"{knob}=int8" in fit.LOSSY
    # A Muon-heavy split: after accumulation and bf16 momentum only int8 momentum fits it.
    heavy = replace(SPLIT, total=10**6 + 1110, muon=10**6 + 1000)
    monkeypatch.setattr(fit, "param_split", lambda run: heavy)
    run = _run()
    one = replace(run, train=replace(run.train, batch=1, global_batch=2))
    gb = _gb_for(estimate(fit.engage(one, "muon_state_dtype=int8")).total)
    assert estimate(fit.engage(one, "muon_state_dtype=bf16")).total > fit.usable_bytes(gb)
    planned, est, engaged = plan_fit(run, gb)
    assert planned.train.muon_state_dtype == "int8" and est.total <= fit.usable_bytes(gb)
    assert "muon_state_dtype=int8" in engaged and "muon_state_dtype=bf16" not in engaged
    assert all(fit.mechanism_on(planned, m) for m in engaged)
    # released, an int8 rung goes back to bf16, the rung it replaced
    assert fit.disengage(planned, "muon_state_dtype=int8").train.muon_state_dtype == "bf16"
    # the command the fleet table prints names the field once
    two = [fit.RankPlan(r, gb, 1, 1, est) for r in range(2)]
    line = next(x for x in fit.format_fleet_table(planned, two) if "train it" in x)
    assert line.count("muon_state_dtype") == 1 and "muon_state_dtype=int8" in line
    fsdp = replace(run, train=replace(run.train, dist_shard="fsdp"))
    assert "FSDP2" in fit.unavailable("muon_state_dtype=int8", fsdp, world=2)
    assert fit.unavailable("muon_state_dtype=int8", fsdp, world=1) is None


def test_printed_arithmetic_multiplies_out_to_the_estimate():
    # each optimizer-state line's "bytes x count" terms give the GiB printed beside them, which
    # is the estimate's (they once disagreed: the Engram rows' step counts were not printed)
    term = re.compile(r"(\(1 B \+ 4 B / 256\)|\d+ B) x ([\d.]+)M")
    for sets in ({}, {"muon_state_dtype": "bf16", "engram_state_dtype": "bf16"},
                 {"muon_state_dtype": "int8", "engram_state_dtype": "int8"}):  # fmt: skip
        run = replace(preset("small"), train=replace(preset("small").train, **sets))
        est = estimate(run)
        lines = {ln.split()[0]: ln for ln in fit.format_arithmetic(run, est)[1:]}
        for name in ("adamw", "muon", "engram"):
            terms = term.findall(lines[name])
            per = [1 + 4 / 256 if b.startswith("(") else float(b.split()[0]) for b, _ in terms]
            total = sum(b * float(n) * 1e6 for b, (_, n) in zip(per, terms))
            # the counts are printed to 0.01M: 0.005M of error a term, times its bytes
            slack = sum(0.005e6 * b for b in per)
            assert terms and abs(total - getattr(est, name)) <= slack, (name, sets, lines[name])
            assert lines[name].endswith(f"= {getattr(est, name) / GiB:.2f} GiB"), lines[name]


def test_b1_on_4gb_is_loud_and_never_allocated(monkeypatch):
    real = dm.DormouseModel

    class MetaOnly(real):
        def __init__(self, cfg):
            assert torch.empty(0).device.type == "meta", "the planner built a model off meta"
            super().__init__(cfg)

    monkeypatch.setattr(dm, "DormouseModel", MetaOnly)
    fit._SPLITS.clear()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(FitError) as err:
        plan_fit(preset("b1"), 4)
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grew_mib < 512  # b1's Engram tables alone are 1.5 GiB in fp32
    msg = str(err.value)
    for c in COMPONENTS:
        assert re.search(rf"\b{c}=\d+\.\d\d\b", msg), c
    assert "90% of 4 GiB" in msg
    assert "smaller preset" in msg and "a card of >=" in msg
    assert "--batch" in msg or "no batch size fits" in msg


def test_medium_on_4gb_needs_mechanisms_because_of_activations():
    """Medium does not fit 4 GB with no mechanism: the un-checkpointed body keeps ~330 B per
    token x d_model per block application (measured on an H200: implied K 326-357), 12
    applications of 4096 x 768 -> ~11.7 GiB, while everything else together fits. The global
    batch in smaller micro-batches (exact) fits it before any lossy rung."""
    usable = fit.usable_bytes(4)
    none = estimate(preset("medium"))
    assert none.total > usable
    assert none.total - none.act - none.casts <= usable  # the activations are the reason
    planned, est, engaged = plan_fit(preset("medium"), 4)
    assert "accumulation" in engaged and est.total <= usable
    assert not set(engaged) & set(fit.LOSSY)
    assert planned.train.global_batch == preset("medium").train.batch > planned.train.batch


# ---- the CLI and train --fit ------------------------------------------------------------


def test_cli_plan_prints_the_line(capsys, caplog):
    with caplog.at_level(logging.INFO, logger=fit.__name__):
        assert cli_main(["plan", "medium", "--fit", "4"]) == 0
    out = "\n".join(r.getMessage() for r in caplog.records if r.name == fit.__name__)
    line = [ln for ln in out.splitlines() if ln.startswith("fit=4GB")]
    assert line, out
    assert "usable=3.60GiB" in line[0] and "est_peak=" in line[0] and "engaged=" in line[0]
    for c in COMPONENTS:
        assert f"{c}=" in line[0]
    assert "  act " in out and "  peak = max(" in out  # the arithmetic above the line

    assert cli_main(["plan", "b1", "--fit", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dormouse: --fit 4GB:") and "opt_work=" in err


def test_apply_fit_sets_the_mechanisms_and_logs_the_same_line(caplog):
    run = replace(preset("medium"), train=replace(preset("medium").train, fit_gb=8.0, device="cpu"))
    with caplog.at_level(logging.INFO, logger=fit.__name__):
        planned = fit.apply_fit(run)
    _, est, engaged = plan_fit(run, 8.0)
    assert caplog.records[-1].getMessage() == fit.format_fit_line(8.0, est, engaged)
    assert engaged and all(fit.mechanism_on(planned, m) for m in engaged)
    unset = replace(run, train=replace(run.train, fit_gb=0.0))
    assert fit.apply_fit(unset) is unset


def test_the_kda_arm_is_the_models_rule():
    """Pinned arms as pinned; auto as the model's rule decides: torch on a CPU run, and on a
    run for an unseen CUDA card whatever this machine's fla-core allows."""
    run = preset("small")
    assert fit.kda_arm(_run()).name == "fla"
    cpu = replace(run, train=replace(run.train, device="cpu"))
    assert fit.kda_arm(cpu).name == "torch"
    if not torch.cuda.is_available():
        installed = importlib.util.find_spec("fla") is not None
        assert fit.kda_arm(run).name == ("fla" if installed else "torch")
        wide = replace(run, model=replace(run.model, n_heads=1, head_dim=512, d_model=512))
        assert fit.kda_arm(wide).name == "torch"  # beyond chunk_kda's head_dim limit
