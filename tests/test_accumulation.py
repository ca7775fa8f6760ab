"""global_batch and gradient accumulation: the split rule, the --capacity grammar, one process
accumulating, and --fit choosing accumulation before any lossy rung. The fleet claims (any
split of the global batch over ranks and micro-batches trains one trajectory; a resume on
another number of ranks) are gate g26."""

from __future__ import annotations

import pytest
import torch
from trainlog import train

from dormouse.config import apply_sets, preset
from dormouse.train.context import DPContext, RankShape, accumulate
from dormouse.train.fleet.launch import parse_capacity
from references.single import build_model


@pytest.mark.parametrize("share, cap, want", [
    (8, 8, (8, 1)), (8, 2, (2, 4)), (12, 8, (6, 2)), (7, 2, (1, 7)), (9, 4, (3, 3)), (1, 5, (1, 1)),
])  # fmt: skip
def test_the_fewest_equal_micro_batches_that_fit(share, cap, want):
    s = accumulate(share, cap, 32)
    assert (s.batch, s.accum) == want and s.windows == share and s.batch <= cap


def test_capacity_grammar_with_micro_batches():
    assert parse_capacity("4,2*3", 2, 8, 64, 64) == [RankShape(4, 64), RankShape(2, 64, 3)]
    assert parse_capacity("4x32*2, 2", 2, 8, 64, 64) == [RankShape(4, 32, 2), RankShape(2, 64)]
    assert parse_capacity("", 2, 4, 64, 64, global_batch=12) == [RankShape(3, 64, 2)] * 2
    shapes = parse_capacity("auto", 2, 2, 16, 64, rates=[3.0, 1.0], global_batch=8)
    assert shapes == [RankShape(2, 16, 3), RankShape(2, 16)]  # shares 6 and 2, at most 2 each
    assert [s.line() for s in shapes] == ["2x16*3", "2x16"]


@pytest.mark.parametrize("spec, world, total, match", [
    ("4,2*3", 2, 8, "takes 10 windows a step but global_batch=8"),
    ("", 3, 8, "does not split evenly over 3 ranks"),
    ("4,2*0", 2, 0, "needs >= 1"),
    ("4,2**3", 2, 0, "is not B, BxT, B[*]K"),
])  # fmt: skip
def test_capacity_refusals_name_the_cause(spec, world, total, match):
    with pytest.raises(ValueError, match=match.replace("[*]", r"\*")):
        parse_capacity(spec, world, 4, 64, 64, global_batch=total)


def test_fsdp_ranks_must_run_equal_micro_batch_counts():
    from dormouse.train.context import DistError
    from dormouse.train.fleet.launch import refuse_uneven_fsdp

    uneven = parse_capacity("3*2,2", 2, 4, 64, 64)
    refuse_uneven_fsdp(uneven, "none")  # DDP: one reduction per step whatever the counts
    refuse_uneven_fsdp(parse_capacity("3*2,1*2", 2, 4, 64, 64), "fsdp")
    with pytest.raises(DistError, match=r"micro-batch counts \[2, 1\].*dist_shard=none"):
        refuse_uneven_fsdp(uneven, "fsdp")


def test_one_process_context_accumulates():
    ctx = DPContext.single(torch.device("cpu"), 2, 16, global_batch=8)
    assert ctx.shape == RankShape(2, 16, 4) and ctx.global_tokens == 8 * 16
    assert ctx.loss_scale == pytest.approx(1 / 4)  # each micro-batch's mean, four of them
    assert ctx.stride == 8 * 17  # the bytes of the whole global batch each step


def test_accumulating_trains_the_global_batch_trajectory(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"def f(x):\n    return x * 2\n" * 3000)

    def losses(out, *sets):
        run = apply_sets(preset("tiny"), [f"data={corpus}", f"out_dir={tmp_path / out}",
                                          "steps=4", "seq_len=32", "log_every=1", "eval_every=0",
                                          "grad_clip=0", "device=cpu", *sets])  # fmt: skip
        lines: list[str] = []
        train(build_model(run), run, log=lines.append)
        return [float(ln.split("loss=")[1].split()[0]) for ln in lines if ln.startswith("step=")]

    whole = losses("whole", "batch=6")
    assert losses("acc", "batch=2", "global_batch=6") == pytest.approx(whole, abs=1e-4)
    assert losses("acc2", "batch=4", "global_batch=6") == pytest.approx(whole, abs=1e-4)  # 3 x 2


def test_fit_accumulates_before_a_lossy_rung():
    from dormouse.train.plan import fit

    planned, _, engaged = fit.plan_fit(preset("medium"), 8, batch=32, seq=512)
    assert "accumulation" in engaged and not set(engaged) & set(fit.LOSSY)
    t = planned.train
    assert t.global_batch == 32 and t.batch < 32 and 32 % t.batch == 0
