"""--fit on a fleet: the per-rank estimate (DDP's buckets, FSDP2's shards and gathers), the
per-rank plan and its refusals, `max_share`, and the estimate against what a gloo fleet's
ranks really hold (tests/ spawns it; `python -m dormouse bench shards` is the same at any
preset and world, its table in docs/fleet.md)."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from dormouse.cli import main as cli_main
from dormouse.config import apply_sets, preset
from dormouse.train.plan import fit
from dormouse.train.plan.fit import FitError, estimate, max_share, plan_fleet, usable_bytes


def _sets(run, *sets):
    return apply_sets(run, list(sets))


# ---- the estimate -----------------------------------------------------------------------


def test_fsdp_shards_params_grads_and_state_as_one_over_p():
    """medium's every dim 0 divides by 2 and 4 (docs/fleet.md), so FSDP2's per-rank
    parameters, gradients and optimizer state are exactly 1/P of one process's."""
    run = preset("medium")
    one = estimate(run)
    for p in (2, 4):
        e = estimate(run, world=p, shard="fsdp")
        assert (e.masters * p, e.grads * p) == (one.masters, one.grads)
        assert (e.adamw * p, e.muon * p, e.engram * p) == (one.adamw, one.muon, one.engram)
        assert e.comm > 0 and e.comm_step == 0  # the gathers: forward and backward only
        assert e.act == one.act  # the rank's own micro-batch, as in one process
        assert e.casts == 0  # bf16 params are gathered already cast
    # at world 1 `shard` changes nothing: parallelize leaves one process unwrapped
    assert estimate(run, world=1, shard="fsdp") == replace(one, shard="fsdp")
    assert estimate(run, 8) == one  # the positional call still works


def test_fsdp_rounds_up_per_tensor_as_torch_chunk_does():
    """ceil(D0 / P) rows per tensor: a [8, R, C] expert stack on 3 ranks is 3 experts a rank."""
    run = preset("tiny")
    split = fit.param_split(run)
    want = sum(torch.empty(shape, device="meta").chunk(3)[0].numel()
               for _, _, shape in split.shapes)  # fmt: skip
    lay = fit.layout(split, run.model, 3, "fsdp")
    assert lay.dev == want > math.ceil(split.total / 3)


def test_ddp_counts_its_buckets_and_the_hook_copies():
    run = preset("medium")
    one = estimate(run)
    assert (one.comm, one.comm_step) == (0, 0)
    ddp = estimate(run, world=2, shard="none")
    params = one.params
    # the buckets' flat fp32 copy of every gradient, and auto's bf16 reduce (a bf16 run)
    assert ddp.comm_step == 4 * params
    assert ddp.comm == 4 * params + 2 * params
    assert ddp.step == one.step + 4 * params and ddp.backward == one.backward + 6 * params
    exact = estimate(_sets(run, "dist_reduce=fp32"), world=2)
    assert exact.comm == exact.comm_step == 4 * params
    assert (ddp.masters, ddp.muon) == (one.masters, one.muon)  # whole model on every rank


def test_host_tables_stay_off_the_card_on_a_fleet():
    ram = _sets(preset("medium"), "engram_ram=true")
    tables = fit.param_split(ram).engram
    for shard in ("none", "fsdp"):
        e = estimate(ram, world=2, shard=shard)
        assert e.engram == 0
        assert e.params == estimate(preset("medium"), world=2, shard=shard).params - (
            tables // (2 if shard == "fsdp" else 1)
        )


def test_max_share_is_the_largest_micro_batch_that_fits():
    run = preset("medium")
    for world, shard in ((1, "none"), (2, "none"), (2, "fsdp")):
        usable = usable_bytes(16)
        b = max_share(run, usable, world=world, shard=shard)
        assert b >= 1
        assert estimate(run, b, world=world, shard=shard).total <= usable
        assert estimate(run, b + 1, world=world, shard=shard).total > usable
    assert max_share(preset("b1"), usable_bytes(4), world=2, shard="none") == 0


def test_the_estimate_refuses_a_bad_shard_or_world():
    with pytest.raises(FitError, match=r"--shard 'fdsp' is not one of none, fsdp"):
        estimate(preset("tiny"), world=2, shard="fdsp")
    with pytest.raises(FitError, match=r"--world 0: a fleet has at least one rank"):
        estimate(preset("tiny"), world=0)


# ---- the plan -----------------------------------------------------------------------------


def test_a_mixed_fleet_gives_each_rank_its_card():
    """The smallest card picks the mechanisms (config every rank shares); under DDP each
    rank then takes its share in the largest micro-batch its own card holds."""
    run = _sets(preset("medium"), "dist_shard=none")
    planned, est, engaged, rows = plan_fleet(run, [24.0, 6.0])
    assert [r.gb for r in rows] == [24.0, 6.0] and all(r.fits for r in rows)
    assert engaged and est.total <= usable_bytes(6)
    big, small = rows
    assert big.batch * big.accum == small.batch * small.accum == 8  # equal shares
    assert big.batch > small.batch and small.accum > 1
    assert big.est.total <= usable_bytes(24) and small.est.total <= usable_bytes(6)
    assert fit.capacity_for(planned, rows) == f"{big.batch},{small.batch}*{small.accum}"
    # FSDP2: the same micro-batch count on every rank (the fleet refuses unequal counts)
    fs = plan_fleet(_sets(run, "dist_shard=fsdp"), [24.0, 6.0])[3]
    assert len({r.accum for r in fs}) == 1
    # one GB and a world: N identical cards
    same = plan_fleet(run, [16.0], 3)[3]
    assert [r.gb for r in same] == [16.0] * 3 and len({(r.batch, r.accum) for r in same}) == 1


def test_the_fleet_refusals_name_cause_and_escape():
    run = preset("medium")
    with pytest.raises(FitError, match=r"names 3 cards but --world is 2: give one GB per rank"):
        plan_fleet(run, [16.0, 8.0, 8.0], 2)
    with pytest.raises(
        FitError,
        match=r"global_batch=9 does not split over 2 ranks; .*"
        r"--set global_batch=8",
    ):
        plan_fleet(_sets(run, "global_batch=9"), [16.0], 2)
    with pytest.raises(
        FitError,
        match=r"rank 1's 12 GB card of a fleet of 2 \(DDP\) does not "
        r"fit\..*Escapes:.*--shard fsdp \(est",
    ):
        plan_fleet(_sets(preset("b1"), "dist_shard=none"), [80.0, 12.0])
    with pytest.raises(FitError, match=r"'x' is not a card size"):
        fit.parse_budgets("8,x")


def test_optim_8bit_is_never_planned_for_fsdp(monkeypatch):
    real = fit.importlib.util.find_spec
    monkeypatch.setattr(fit.importlib.util, "find_spec",
                        lambda n: object() if n == "bitsandbytes" else real(n))  # fmt: skip
    run = _sets(preset("b1"), "dist_shard=fsdp")
    assert fit.unavailable("optim_8bit", run, 2).startswith("bitsandbytes' AdamW8bit steps plain")
    assert fit.unavailable("optim_8bit", run, 1) is None
    _, est, engaged = fit.ladder(run, usable_bytes(1), 2)
    assert "optim_8bit" not in engaged
    assert any(n.startswith("optim_8bit skipped: bitsandbytes' AdamW8bit") for n in est.notes)


def test_train_fit_plans_with_the_runs_shard_and_world(caplog):
    run = _sets(preset("medium"), "fit_gb=12", "device=cpu", "dist_shard=fsdp")
    with caplog.at_level(logging.INFO, logger=fit.__name__):
        planned = fit.apply_fit(run, 2)
    want = estimate(planned, world=2, shard="fsdp")
    assert (
        caplog.records[-1]
        .getMessage()
        .startswith(f"fit=12GB usable=10.80GiB est_peak={want.total / fit.GiB:.2f}GiB")
    )
    # the one-process plan of the same card is another plan (DDP's, too)
    assert estimate(planned).total != want.total
    assert estimate(planned, world=2, shard="none").total > want.total


# ---- the CLI ------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_plan_b1_on_two_16gb_cards_sharded():
    out = subprocess.run([sys.executable, "-m", "dormouse", "plan", "b1", "--fit", "16",
                          "--world", "2", "--shard", "fsdp"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("rank "))
    rows = [ln.split() for ln in lines[head + 1 : head + 3]]
    assert [r[0] for r in rows] == ["0", "1"] and all(r[1] == "16" for r in rows)
    assert all(r[-1] == "yes" for r in rows)
    assert "FSDP2, per-rank shards" in out.stdout and "--set dist_shard=fsdp" in out.stdout


@pytest.mark.parametrize("argv, fact", [
    (["--fit", "16", "--world", "2", "--shard", "fdsp"], "--shard 'fdsp' is not one of"),
    (["--fit", "16,8,8", "--world", "2"], "names 3 cards but --world is 2"),
    (["--world", "2"], "--world/--shard plan a fleet's memory and need --fit GB"),
])  # fmt: skip
def test_cli_plan_fleet_errors_are_one_line(argv, fact, capsys):
    assert cli_main(["plan", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dormouse: ") and fact in err


# ---- measured: what a gloo fleet's ranks hold -----------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_the_estimate_is_what_the_ranks_hold():
    """tiny on 2 gloo ranks, DDP and FSDP2, one step: parameters, gradients and DDP's buckets
    exactly as estimated (rank 0 holds the full ceil(D0 / P) chunk of every tensor; the
    others at most that); the optimizer state up to what the estimate leaves out."""
    from dormouse.bench import shards

    run = shards.configure("tiny", [])
    adamw_params = sum(1 for _, owner, _ in fit.param_split(run).shapes if owner == "adamw")
    # the estimate leaves out AdamW's step counter: one fp32 scalar per AdamW parameter
    state_tol = 4 * adamw_params
    rows = shards.measure_fleet("tiny", 2, ["none", "fsdp"])
    assert len(rows) == 4
    for r in rows:
        est = shards.estimated(run, 2, r["shard"])
        exact = r["rank"] == 0
        for k in ("params", "grads"):
            assert r[k] == est[k] if exact else r[k] <= est[k], (r, k)
        assert (
            0 <= r["optimizer"] - est["optimizer"] <= state_tol
            if exact
            else (r["optimizer"] <= est["optimizer"] + state_tol)
        ), r
        assert r["buckets"] == est["buckets"], r  # DDP: 4 B a gradient; FSDP2: none
        assert r["host"] == 0
    fsdp0 = next(r for r in rows if r["shard"] == "fsdp" and r["rank"] == 0)
    ddp0 = next(r for r in rows if r["shard"] == "none" and r["rank"] == 0)
    assert fsdp0["params"] < 0.55 * ddp0["params"]  # tiny's odd dims: a little over half
