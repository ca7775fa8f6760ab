"""Unit tests of the distributed layer that need no fleet: capacity, launch, backend, refusals,
the context's arithmetic, the reducer's dtype, and a hypothesis fuzz of parse_capacity.

The fleet claims themselves are gates (tests/test_gates.py, `pytest -m gate`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dormouse.config import preset
from dormouse.train.context import DPContext, RankShape
from dormouse.train.fleet.launch import (
    NCCL_SAFE_ENV,
    DistError,
    LaunchError,
    RefusedError,
    check_launch,
    choose_backend,
    measure_rate,
    parse_capacity,
    refuse_incompatible,
    split_by_rates,
)

TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


# ---- parse_capacity ----------------------------------------------------------------------


def test_empty_capacity_gives_every_rank_the_config_batch():
    assert parse_capacity("", 3, 4, 64, 64) == [RankShape(4, 64)] * 3
    assert parse_capacity("  ", 1, 2, 8, 64) == [RankShape(2, 8)]


def test_explicit_batches_and_shapes():
    assert parse_capacity("4,2", 2, 8, 256, 512) == [RankShape(4, 256), RankShape(2, 256)]
    assert parse_capacity("4x512, 2X128", 2, 8, 256, 512) == [RankShape(4, 512), RankShape(2, 128)]
    assert parse_capacity(" 4 x 512 ,2", 2, 8, 256, 512) == [RankShape(4, 512), RankShape(2, 256)]


@pytest.mark.parametrize(
    "spec, world, fragment",
    [
        ("4,2", 3, "names 2 rank(s) but the fleet has 3"),
        ("4,0", 2, "rank 1 has batch 0"),
        ("4x1024,2", 2, "windows of 1024 bytes"),
        ("4x0,2", 2, "windows of 0 bytes"),
        ("four,2", 2, "not B, BxT, B*K or BxT*K"),
        ("4,,2", 3, "not B, BxT, B*K or BxT*K"),
        ("-4,2", 2, "not B, BxT, B*K or BxT*K"),
        ("4.5,2", 2, "not B, BxT, B*K or BxT*K"),
        ("auto", 2, "measured rate"),
    ],
)
def test_bad_capacity_is_a_valueerror_naming_the_problem(spec, world, fragment):
    with pytest.raises(ValueError) as e:
        parse_capacity(spec, world, 2, 64, 512)
    assert fragment in str(e.value)


def test_window_length_bounds_are_inclusive():
    assert parse_capacity("1x64,1x1", 2, 2, 8, 64) == [RankShape(1, 64), RankShape(1, 1)]
    with pytest.raises(ValueError, match="1..64"):
        parse_capacity("1x65,1", 2, 2, 8, 64)


def test_auto_splits_the_global_batch_by_rates():
    shapes = parse_capacity("auto", 2, 4, 64, 64, rates=[3.0, 1.0])
    assert shapes == [RankShape(6, 64), RankShape(2, 64)]


# ---- split_by_rates ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "rates, total, want",
    [
        ([1, 1], 8, [4, 4]),
        ([4, 1], 10, [8, 2]),
        ([4, 1], 5, [4, 1]),
        ([1000, 1], 4, [3, 1]),  # the minimum of one sample binds
        ([1, 1000, 1], 3, [1, 1, 1]),
        ([1, 2, 3], 12, [2, 4, 6]),
        ([3, 3, 3], 10, [4, 3, 3]),  # the remainder goes to the lower rank on a tie
        ([2.5e12, 6.0e11], 8, [6, 2]),
    ],
)
def test_split_by_rates_table(rates, total, want):
    assert split_by_rates(rates, total) == want


@pytest.mark.parametrize("rates", [[1.0, 0.0], [1.0, -2.0], [1.0, math.nan], [math.inf, 1.0], []])
def test_split_by_rates_refuses_bad_rates(rates):
    with pytest.raises(ValueError, match="rate"):
        split_by_rates(rates, 8)


def test_split_by_rates_refuses_fewer_samples_than_ranks():
    with pytest.raises(ValueError, match="at least one sample"):
        split_by_rates([1, 1, 1], 2)


def _splits(n: int, total: int):
    if n == 1:
        yield (total,)
        return
    for first in range(1, total - n + 2):
        for rest in _splits(n - 1, total - first):
            yield (first, *rest)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=4), st.integers(0, 9))
def test_split_by_rates_is_the_closest_valid_split(rates, extra):
    """Exact total, every rank >= 1, and no valid split is closer (L1) to the proportional
    shares: checked against every split by brute force."""
    total = len(rates) + extra
    got = split_by_rates(rates, total)
    assert sum(got) == total and min(got) >= 1 and len(got) == len(rates)
    ideal = [total * r / sum(rates) for r in rates]

    def dist_(split):
        return sum(abs(g - q) for g, q in zip(split, ideal))

    best = min(dist_(sp) for sp in _splits(len(rates), total))
    assert dist_(got) <= best + 1e-9


# ---- the fuzz: every input either parses into sound shapes or is a ValueError with a message


def _expected_total(spec: str, world: int, batch: int) -> int:
    low = spec.strip().lower()
    if low in ("", "auto"):
        return batch * world
    return sum(int(p.strip().lower().split("x")[0]) for p in spec.split(","))


def _check_parse(spec, world, batch, seq, max_seq, rates=None, expect_total=None):
    try:
        shapes = parse_capacity(spec, world, batch, seq, max_seq, rates=rates)
    except ValueError as e:
        assert str(e).strip(), f"empty message for {spec!r}"
        return "refused"
    total = _expected_total(spec, world, batch) if expect_total is None else expect_total
    assert len(shapes) == world
    assert sum(s.batch for s in shapes) == total
    assert all(s.batch >= 1 and 1 <= s.seq_len <= max_seq for s in shapes)
    return "parsed"


FUZZ = settings(max_examples=500, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip


@FUZZ
@given(
    st.text(max_size=40) | st.text("0123456789xX ,auto\t", max_size=24),
    st.integers(-2, 9),
    st.integers(1, 16),
    st.integers(1, 64),
)
def test_fuzz_parse_capacity_arbitrary_strings(spec, world, batch, seq):
    if world < 1:
        with pytest.raises(ValueError):
            parse_capacity(spec, world, batch, seq, 64)
        return
    _check_parse(spec, world, batch, seq, 64)


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, 50), st.none() | st.integers(0, 80)), min_size=1, max_size=9),
    st.none() | st.integers(1, 9),
    st.sampled_from([",", ", ", " ,"]),
)
def test_fuzz_parse_capacity_well_formed_specs(entries, world, sep):
    world = len(entries) if world is None else world  # mostly the matching fleet size
    spec = sep.join(str(b) if t is None else f"{b}x{t}" for b, t in entries)
    outcome = _check_parse(spec, world, 2, 32, 64, expect_total=sum(b for b, _ in entries))
    sound = len(entries) == world and all(
        b >= 1 and (t is None or 1 <= t <= 64) for b, t in entries
    )
    assert (outcome == "parsed") == sound, spec


@FUZZ
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=9),
       st.integers(1, 64))  # fmt: skip
def test_fuzz_parse_capacity_auto(rates, batch):
    _check_parse("auto", len(rates), batch, 16, 64, rates=rates, expect_total=batch * len(rates))


# ---- launch and backend ---------------------------------------------------------------------


def test_dist_without_a_fleet_is_refused():
    for env in ({}, {"WORLD_SIZE": "1", **TORCHRUN}, {"WORLD_SIZE": "", **TORCHRUN}):
        with pytest.raises(LaunchError) as e:
            check_launch(True, env)
        assert "--dist" in str(e.value) and "torchrun" in str(e.value)


def test_a_fleet_without_dist_is_refused():
    with pytest.raises(LaunchError) as e:
        check_launch(False, {"WORLD_SIZE": "4", **TORCHRUN})
    assert "WORLD_SIZE=4" in str(e.value) and "add --dist" in str(e.value).lower()


def test_consistent_launches_pass():
    assert check_launch(False, {}) is False
    assert check_launch(False, {"WORLD_SIZE": "1"}) is False
    assert check_launch(True, {"WORLD_SIZE": "2", **TORCHRUN}) is True


def test_launch_refuses_garbage_and_missing_rendezvous():
    with pytest.raises(LaunchError, match="not an integer"):
        check_launch(True, {"WORLD_SIZE": "two"})
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        check_launch(True, {"WORLD_SIZE": "2", "RANK": "0"})


def test_backend_choice():
    assert choose_backend("cpu") == "gloo"
    assert choose_backend("cuda", nccl_available=True) == "nccl"
    with pytest.raises(DistError) as e:
        choose_backend("cuda", nccl_available=False)
    assert "NCCL" in str(e.value) and "--device cpu" in str(e.value)
    with pytest.raises(DistError, match="no data-parallel backend"):
        choose_backend("mps")


def test_nccl_safety_env():
    assert NCCL_SAFE_ENV == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                             "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets, cause, escape",
    [
        (["dist_shard=fsdp", "optim_8bit=true"], "optim_8bit", "optim_8bit=false"),
        (
            ["dist_shard=fsdp", "muon_state_dtype=int8"],
            "muon_state_dtype=int8",
            "muon_state_dtype=bf16",
        ),
        (
            ["dist_shard=fsdp", "engram_state_dtype=int8"],
            "engram_state_dtype=int8",
            "dist_shard=none",
        ),
        (
            ["compile=true", "compile_mode=reduce-overhead"],
            "compile_mode=reduce-overhead",
            "compile_mode=default",
        ),
    ],
)
def test_refusals_name_cause_and_escape(sets, cause, escape, tiny_run):
    with pytest.raises(RefusedError) as e:
        refuse_incompatible(tiny_run(*sets), 2)
    assert cause in str(e.value) and escape in str(e.value)
    refuse_incompatible(tiny_run(*sets), 1)  # one process: nothing to refuse


def test_fleet_correct_features_are_allowed(tiny_run):
    refuse_incompatible(tiny_run("moe_lb_coef=0.01"), 2)  # LFB: counts reduced (gate g11)
    refuse_incompatible(tiny_run("dist_shard=fsdp", "opt=adamw"), 2)  # FSDP2 + AdamW (gate g04)
    refuse_incompatible(tiny_run("dist_shard=fsdp"), 2)  # FSDP2 + Muon (gate g24)
    refuse_incompatible(tiny_run("dist_shard=fsdp", "muon_state_dtype=bf16"), 2)  # elementwise
    refuse_incompatible(tiny_run("muon_state_dtype=int8", "engram_state_dtype=int8"), 2)  # DDP
    refuse_incompatible(tiny_run("dist_shard=fsdp", "engram_ram=true"), 3)  # (gate g24)
    refuse_incompatible(tiny_run("engram_ram=true"), 2)  # host rows reduced by hand (gate g14)
    refuse_incompatible(tiny_run("moe_capacity=1.0"), 2)  # per-row drops (gate g23)
    refuse_incompatible(tiny_run("compile=true"), 2)  # DDP, compile_mode=default (gate g31)
    refuse_incompatible(tiny_run("compile=true", "dist_shard=fsdp"), 2)  # FSDP2 too (gate g31)
    refuse_incompatible(tiny_run("data=a.bin,b.bin", "data_weights=1,3"), 4)  # mixture, below


def test_the_mixture_is_rank_consistent():
    """Why a mixture is allowed on a fleet: the source of step s is a pure function of
    (seed, s), so ranks that never talk pick the same source at every step."""
    import numpy as np

    from dormouse.train.data import ByteStream, Mixture

    view = np.arange(4096, dtype=np.uint8)

    def mixture(rank):
        streams = [ByteStream(view, 2, 8, offset=rank * 18, stride=36) for _ in range(3)]
        return Mixture(streams, [1.0, 2.0, 3.0], seed=11)

    a, b = mixture(0), mixture(1)
    picks = [a.source_at(s) for s in range(200)]
    assert picks == [b.source_at(s) for s in range(200)]
    assert len(set(picks)) == 3


# ---- the context's arithmetic and the reducer ------------------------------------------------------


def test_loss_scale_lands_on_the_token_weighted_mean():
    shapes = [RankShape(4, 64), RankShape(2, 64), RankShape(2, 32)]
    parts = [DPContext(torch.device("cpu"), tuple(shapes), rank=r, world=3, backend="gloo")
             for r in range(3)]  # fmt: skip
    total = sum(s.tokens for s in shapes)
    # DDP averages: (1/P) sum_r scale_r g_r must equal sum_r (t_r / total) g_r.
    for p, s in zip(parts, shapes):
        assert p.loss_scale / 3 == pytest.approx(s.tokens / total)
    assert [p.offset for p in parts] == [0, 4 * 65, 6 * 65]
    assert all(p.stride == 4 * 65 + 2 * 65 + 2 * 33 for p in parts)
    assert [p.is_main for p in parts] == [True, False, False]


def test_measure_rate_is_positive():
    rate = measure_rate("cpu", reps=1)
    assert math.isfinite(rate) and rate > 0


def test_the_unused_parameter_probe_leaves_no_trace():
    from dormouse.model import DormouseModel
    from dormouse.train.fleet.parallelize import params_without_grad

    torch.manual_seed(0)
    model = DormouseModel(replace(preset("tiny").model, moe_lb_coef=0.01))
    counts = [m.moe.lfb_counts.clone() for m in model.blocks]
    assert params_without_grad(model, torch.device("cpu")) == []
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(c, m.moe.lfb_counts) for c, m in zip(counts, model.blocks))
    model.embed.weight.requires_grad_(True)
    model.head.weight.register_hook(lambda g: g)  # no effect: the head is used
    frozen = torch.nn.Parameter(torch.zeros(3))
    model.register_parameter("orphan", frozen)
    assert params_without_grad(model, torch.device("cpu")) == ["orphan"]


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_reduce_dtype_reaches_the_gradients(one_rank_group, reduce):
    """dist_reduce=bf16 sends gradients through a bf16 all-reduce (DDP comm hook); fp32 is
    exact. With one rank the reduce is the identity up to that rounding, which shows."""
    from dormouse.model import DormouseModel

    torch.manual_seed(0)
    model = DormouseModel(preset("tiny").model)
    from dormouse.train.fleet.parallelize import parallelize, unwrap

    ctx = DPContext(torch.device("cpu"), (RankShape(2, 16), RankShape(2, 16)), world=2,
                    backend="gloo", reduce=reduce)  # fmt: skip
    # a world of 2 wraps; the one-rank process group runs its collectives (rank 0 of 1)
    net = parallelize(model, ctx).net
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    _, loss, _ = net(x[:, :-1], x[:, 1:])
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    rounded = all(torch.equal(g, g.bfloat16().float()) for g in grads)
    assert rounded == (reduce == "bf16")
    assert unwrap(net) is model and net.find_unused_parameters is False


def test_fleet_collectives_on_one_rank(one_rank_group):
    # world=2 takes the collective path; the process group has one rank, so each
    # collective returns this rank's own value
    ctx = DPContext(torch.device("cpu"), (RankShape(2, 8), RankShape(2, 8)), world=2,
                    backend="gloo")  # fmt: skip
    assert ctx.all_finite(True) is True and ctx.all_finite(False) is False
    assert ctx.any_rank(True) is True and ctx.any_rank(False) is False
    assert ctx.fleet_loss(torch.tensor(2.5)) == pytest.approx(1.25)  # half the fleet's tokens
    counts = torch.tensor([1.0, 2.0])
    ctx.lfb_reduce(counts)
    assert counts.tolist() == [1.0, 2.0]
    ctx.barrier()
    assert ctx.line().startswith("dist rank=0/2 backend=gloo device=cpu shape=2x8 dtype=fp32")


def test_a_world_of_one_never_touches_torch_distributed():
    ctx = DPContext.single(torch.device("cpu"), 2, 8)  # no process group exists here
    assert ctx.all_finite(False) is False and ctx.any_rank(True) is True
    assert ctx.fleet_loss(torch.tensor(2.5)) == 2.5 and ctx.lfb_reduce is None
    assert ctx.loss_scale == 1.0 and ctx.offset == 0 and ctx.stride == 2 * 9
    ctx.barrier()
    ctx.reduce_host_grads(torch.nn.Linear(1, 1))


# ---- the heartbeat, on an in-process store ---------------------------------------------------


def _beat(store, rank: int, n: int, step: int, state: str = "alive") -> None:
    import json
    import os

    store.set(f"t/beat/{rank}", json.dumps({"n": n, "step": step, "phase": "train", "saved": None,
                                             "pid": os.getpid(), "host": "elsewhere",
                                             "state": state, "why": "x"}))  # fmt: skip


def _heartbeat(timeout: float = 0.5):
    import torch.distributed as dist

    from dormouse.train.fleet.watchdog import Heartbeat

    store = dist.HashStore()
    hb = Heartbeat(0, 2, timeout, lambda: store, "t")
    ended: list[str] = []

    def end(reason):  # instead of os._exit: record, and stop the threads
        ended.append(reason)
        hb._halt.set()

    hb._end = end
    return hb, store, ended


def test_the_watchdog_names_a_silent_peer_and_its_last_step():
    import time

    hb, store, ended = _heartbeat()
    _beat(store, 1, 1, 7)
    hb.start()
    hb.at(9, "eval")
    time.sleep(0.3)
    assert not ended  # still within the timeout
    time.sleep(1.0)
    assert ended and "rank 1 has sent no heartbeat" in ended[0], ended
    assert "its last heartbeat: step 7 (train)" in ended[0]


def test_a_beating_peer_is_never_ended():
    import time

    hb, store, ended = _heartbeat()
    hb.start()
    for n in range(15):
        _beat(store, 1, n, n)
        time.sleep(0.1)
    hb.leave("done")
    assert not ended and hb.seen[1]["step"] == 14


def test_a_barrier_refuses_to_wait_for_a_peer_that_left():
    import time

    hb, store, ended = _heartbeat(timeout=5)
    _beat(store, 1, 1, 3, state="failed")
    hb.start()
    time.sleep(0.8)  # a pulse reads it
    with pytest.raises(DistError, match="rank 1 left the fleet .failed: x. at step 3"):
        hb.gather()
    hb.leave("failed")
    assert not ended
