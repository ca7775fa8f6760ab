"""`dormouse bench {step,optim,memory}`: each runs on a tiny config on the CPU and prints its
table under the machine lines; --out, the default sub-command, the refusals; bench step's FLOP
counters against hand counts, --peak-tflops and --parts.

Correctness only. Speed is reported by the bench itself and never asserted here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dormouse.bench import main_bench
from dormouse.bench.memory import HEADER as MEMORY_HEADER
from dormouse.bench.step import HEADER, active_params_per_token, peak_tflops
from dormouse.config import Optim, preset
from dormouse.model import DormouseModel
from dormouse.train.plan.fit import GiB, plan_fit


@pytest.fixture(autouse=True)
def _log_to_stderr():
    """The logger as `python -m dormouse bench` sets it (cli.main: stderr, the table alone on
    stdout); main_bench called directly would otherwise inherit an earlier test's stdout
    handler in the same worker and print its progress lines into the table's stdout."""
    from dormouse.cli import setup_logging

    setup_logging("stderr")


def _table_rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_tiny_on_cpu_prints_the_table_and_writes_it(tmp_path, capsys):
    out = tmp_path / "sub" / "bench.md"
    rc = main_bench(["tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                     "--out", str(out)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    rows = _table_rows(printed)
    assert rows[0] == list(HEADER)
    assert all(set(c) <= set("-:") for c in rows[1])  # the markdown separator
    body = rows[2:]
    assert len(body) == 1
    row = dict(zip(HEADER, body[0]))
    assert row["preset"] == "tiny"
    assert row["batch x seq"] == "4 x 64"  # the preset's shape
    assert float(row["tokens/s"].replace(",", "")) > 0
    assert float(row["step ms (median)"]) > 0
    assert row["MFU (datasheet)"].startswith("n/a")
    # no peak on the CPU unless --peak-tflops gives one; the step's FLOPs are counted anyway
    assert row["MFU (measured peak)"].startswith("n/a") and row["HFU (measured peak)"].startswith(
        "n/a"
    )
    assert "Peak (MFU and HFU, measured peak): none on the CPU" in printed
    assert row["peak memory"].endswith("RSS")
    assert row["KDA arm"] == "torch"
    assert row["dtype"] == "fp32"  # tiny has dtype=fp32
    assert "Machine: CPU" in printed
    assert "torch threads" in printed and torch.__version__ in printed
    command = next(ln for ln in printed.splitlines() if ln.startswith("- Command: `"))
    assert "python -m dormouse bench step tiny --device cpu --steps 2 --warmup 1" in command
    assert out.read_text() == printed


def test_overrides_reach_the_run(capsys):
    rc = main_bench(["step", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0",
                     "--batch", "2", "--seq", "32", "--set", "dtype=bf16"])  # fmt: skip
    assert rc == 0
    row = dict(zip(HEADER, _table_rows(capsys.readouterr().out)[2]))
    assert row["batch x seq"] == "2 x 32"
    assert row["dtype"] == "bf16"  # PEAK_TFLOPS' key, so a listed card gets its MFU


def test_a_global_batch_is_timed_whole(capsys):
    # global_batch=8 in micro-batches of batch=2: the step is all four, as train runs it, and
    # tokens/s and the 6N FLOPs count its 8 windows (the harness used to time one micro-batch
    # and say batch x seq, silently)
    from dormouse.bench.common import configure, harness, windows

    rc = main_bench(["step", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0",
                     "--batch", "2", "--set", "global_batch=8"])  # fmt: skip
    assert rc == 0
    row = dict(zip(HEADER, _table_rows(capsys.readouterr().out)[2]))
    assert row["batch x seq"] == "8 x 64 (2 x 4 micro)"
    ms, tok_s = float(row["step ms (median)"]), float(row["tokens/s"].replace(",", ""))
    assert abs(tok_s - 8 * 64 / (ms / 1000)) <= 0.01 * tok_s  # ms rounded to 0.1
    run = configure("tiny", ["global_batch=8"], batch=2)
    h = harness(run, torch.device("cpu"))
    assert (h.ctx.shape.batch, h.ctx.shape.accum) == (2, 4) and windows(run, 1)[0].shape[0] == 8
    tflop = 6 * active_params_per_token(h.model) * 8 * 64 / 1e12
    assert row["TFLOP/step: 6N + mixer + polar"].startswith(f"{tflop:.3g} + ")


def test_unknown_preset_is_refused_with_the_config_error(capsys):
    assert main_bench(["nope", "--device", "cpu"]) == 2
    err = capsys.readouterr()
    assert "unknown preset 'nope'" in err.err
    assert "|" not in err.out  # nothing was timed


def test_bad_device_and_step_counts_are_refused(capsys):
    assert main_bench(["tiny", "--device", "gpu"]) == 2
    assert "--device 'gpu'" in capsys.readouterr().err
    assert main_bench(["tiny", "--device", "cpu", "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main_bench(["tiny", "--device", "cuda"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err


def test_kernels_is_refused_off_cuda_and_with_no_steps(capsys):
    # `bench kernels` times our Triton kernels against fla's and the torch arm's: CUDA only
    assert main_bench(["kernels", "tiny", "--device", "cpu"]) == 2
    err = capsys.readouterr()
    assert "bench kernels times Triton kernels on CUDA; this device is cpu" in err.err
    assert err.err.count("\n") == 1 and "Traceback" not in err.err and "|" not in err.out
    assert main_bench(["kernels", "tiny", "--device", "cpu", "--steps", "0"]) == 2
    assert "--steps 0 --warmup 3: steps must be >= 1" in capsys.readouterr().err


def test_optim_times_the_real_models_parameter_set(capsys):
    from dormouse.cli import main  # through the CLI: `dormouse bench optim ...`

    assert main(["bench", "optim", "--preset", "tiny", "--device", "cpu", "--steps", "1"]) == 0
    printed = capsys.readouterr().out
    assert "`tiny` parameter set (DormouseModel)" in printed and "Machine: CPU" in printed
    rows = _table_rows(printed)
    assert [r[0] for r in rows[2:]] == ["batched Muon", "per-matrix Muon",
                                        "full step (batched Muon + AdamW)"]  # fmt: skip
    assert rows[3][3] == "1.00x"  # the per-matrix arm is the baseline
    # the real model's Muon matrices (a 3-D expert stack counts once per expert), no copy
    from dormouse.train.optim.mix import MixOptimizer

    opt = MixOptimizer(DormouseModel(preset("tiny").model), Optim(wd=0.0, ns_dtype="fp32", lr=1e-3))
    mats = sum(p.numel() // (g["matrix"][0] * g["matrix"][1])
               for g in opt.param_groups if g["kind"] == "muon" for p in g["params"])  # fmt: skip
    assert f"in {mats} matrices" in printed


def test_memory_dry_prints_the_planners_estimates(tmp_path, capsys):
    out = tmp_path / "memory.md"
    argv = ["memory", "--dry", "--presets", "small,b1", "--budgets", "4", "--calibrate",
            "--out", str(out)]  # fmt: skip
    assert main_bench(argv) == 0
    printed = capsys.readouterr().out
    rows = _table_rows(printed)
    assert rows[0] == MEMORY_HEADER
    body = {(r[0], r[1], r[2]): dict(zip(MEMORY_HEADER, r)) for r in rows[2:]}
    assert ("small", "- (calibration)", "none") in body
    assert ("small", "- (calibration)", "act_ckpt") in body
    assert all(r["measured GiB"] == "-" for r in body.values())  # --dry measures nothing
    small = next(r for k, r in body.items() if k[:2] == ("small", "4"))
    b1 = next(r for k, r in body.items() if k[:2] == ("b1", "4"))
    assert "does not fit" in b1["notes"] and "does not fit" not in small["notes"]
    small512 = replace(preset("small"), train=replace(preset("small").train, batch=8, seq_len=512))
    want = plan_fit(small512, 4)[1]  # the same numbers `plan --fit` prints
    assert float(small["estimate GiB"]) == pytest.approx(want.total / GiB, abs=0.005)
    assert "estimates only" in printed and out.read_text() == printed
    assert "Command: `python -m dormouse bench memory --dry --presets small,b1" in printed


def test_memory_without_cuda_names_the_escape(capsys):
    assert main_bench(["memory", "--device", "cpu", "--presets", "tiny", "--seq", "32"]) == 2
    assert "--dry" in capsys.readouterr().err


def test_active_params_count_each_application():
    cfg = preset("tiny").model
    model = DormouseModel(cfg)
    by_name = dict(model.named_parameters())
    lookups = by_name["embed.weight"].numel() + by_name["engram.store.table"].numel()
    experts = sum(p.numel() for n, p in by_name.items() if n.split(".")[-1] in ("w1", "w2", "w3")
                  and ".moe." in n and "shared" not in n)  # fmt: skip
    deltas = sum(p.numel() for n, p in by_name.items() if "_delta." in n)
    body = sum(p.numel() for n, p in by_name.items() if n.startswith("blocks."))
    rest = sum(p.numel() for p in model.parameters()) - body - lookups
    shared_body = body - experts - deltas
    want = (rest + deltas + cfg.max_iter * shared_body
            + cfg.max_iter * experts * cfg.moe_topk / cfg.n_experts)  # fmt: skip
    assert active_params_per_token(model) == want


def test_peak_table_matches_listed_cards_only():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H200", "fp32") == 67.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bf16") == 165.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") is None  # lower clocks: not guessed
    assert peak_tflops("NVIDIA GeForce GTX 1650", "fp32") is None


# ---- --baseline gpt: the plain GPT at equal total parameters -------------------------------


def test_gpt_params_formula_counts_the_built_model():
    from dormouse.model import count_params
    from dormouse.model.gpt import gpt_params

    for name in ("gpt-small", "gpt-small-ne"):
        m = preset(name).model
        assert gpt_params(m.d_model, m.n_layers, m.d_ffn, m.d_attn, m.max_seq_len) == count_params(
            m
        )


@pytest.mark.parametrize("name", ["tiny", "small", "medium", "b1"])
def test_gpt_twin_has_the_presets_total_parameters(name):
    from dormouse.model import count_params
    from dormouse.model.gpt import TWIN_TOLERANCE, gpt_twin

    cfg = preset(name).model
    total = count_params(cfg)
    twin = gpt_twin(cfg, total)
    assert twin.arch == "gpt" and twin.d_model % 64 == 0 and twin.head_dim == 64
    assert twin.d_attn == twin.d_model and twin.d_ffn == 4 * twin.d_model
    assert twin.max_seq_len == cfg.max_seq_len and twin.dropout == cfg.dropout
    assert abs(count_params(twin) / total - 1) <= TWIN_TOLERANCE
    if name == "small":  # the learning runs' baseline is what the rule gives
        assert twin == replace(preset("gpt-small").model, dropout=cfg.dropout)


def test_active_params_of_the_gpt_count_every_matrix_once():
    from dormouse.model.gpt import GPT

    model = GPT(preset("gpt-small").model)
    total = sum(p.numel() for p in model.parameters())
    assert active_params_per_token(model) == total - model.pos.weight.numel()


def test_baseline_prints_both_rows_and_the_ratio(capsys):
    rc = main_bench(["tiny", "--baseline", "gpt", "--device", "cpu", "--steps", "1",
                     "--warmup", "0"])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    rows = _table_rows(printed)
    header = rows[0]
    assert header == [*HEADER, "dormouse / GPT tokens/s"]
    mine, gpt = (dict(zip(header, r)) for r in rows[2:])
    assert mine["preset"] == "tiny" and gpt["preset"] == "gpt 64 x 3 (twin of tiny)"
    assert mine["batch x seq"] == gpt["batch x seq"] == "4 x 64" and gpt["dtype"] == "fp32"
    assert gpt["KDA arm"] == "- (SDPA attention)" and gpt["compile"] == "off"  # CPU default
    assert mine["compile"] == "off" and float(mine["first step s"]) >= 0  # the cold start
    tok = [float(r["tokens/s"].replace(",", "")) for r in (mine, gpt)]
    assert mine["dormouse / GPT tokens/s"] == f"{tok[0] / tok[1]:.2f}x"
    assert gpt["dormouse / GPT tokens/s"] == "-" and float(gpt["step ms (median)"]) > 0
    assert "Baseline (--baseline gpt)" in printed


def test_baseline_compile_is_timed_apart_and_a_failure_names_the_escape(monkeypatch, capsys):
    calls = []

    def fake_compile(model, **kw):  # the eager model stands in for the compiled one
        calls.append(kw)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    argv = ["tiny", "--baseline", "gpt", "--device", "cpu", "--steps", "1", "--warmup", "0",
            "--compile", "on"]  # fmt: skip
    assert main_bench(argv) == 0
    rows = _table_rows(capsys.readouterr().out)
    gpt = dict(zip(rows[0], rows[3]))
    assert calls == [{"dynamic": False, "mode": "default"}]  # the GPT row only
    assert gpt["compile"] == "default" and float(gpt["first step s"]) >= 0

    class Broken(torch.nn.Module):
        def forward(self, *a, **kw):
            raise RuntimeError("inductor: no C++ compiler\nmore detail")

    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken())
    assert main_bench(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "bench: torch.compile of gpt 64 x 3 (twin of tiny) failed on cpu "
        "(RuntimeError: inductor: no C++ compiler); rerun with --set "
        "compile=false"
    )


def test_baseline_refusals(capsys):
    assert main_bench(["tiny", "--device", "cpu", "--compile", "on"]) == 2
    assert "add --baseline gpt" in capsys.readouterr().err
    assert main_bench(["gpt-small", "--baseline", "gpt", "--device", "cpu"]) == 2
    assert "already arch=gpt" in capsys.readouterr().err


@pytest.mark.slow
def test_step_bench_runs_a_gpt_preset(capsys):
    argv = ["gpt-small", "--device", "cpu", "--steps", "1", "--warmup", "0", "--batch", "2",
            "--seq", "32"]  # fmt: skip
    assert main_bench(argv) == 0
    row = dict(zip(HEADER, _table_rows(capsys.readouterr().out)[2]))
    assert row["preset"] == "gpt-small" and row["MoE arm"] == "- (GELU MLP)"


def test_profile_prints_the_step_and_its_phases(capsys):
    assert main_bench(["profile", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    phases = {
        line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| tiny |")
    }
    # the loop's own ranges (loop.PHASES) reach the profile: forward, backward, clip, optimizer
    assert {"forward", "backward", "clip", "optimizer"} <= phases
    assert "GPU busy" in out and "n/a (CPU)" in out
    # the same steps timed again without the profiler: a number in its own column
    head = next(ln for ln in out.splitlines() if ln.startswith("| preset | batch x seq"))
    row = next(ln for ln in out.splitlines() if ln.startswith("| tiny | "))
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in row.split("|")]))
    assert float(cells["step ms (unprofiled)"]) > 0
    assert cells["GPU busy (unprofiled wall)"] == "n/a (CPU)"


def test_profile_union_of_kernel_intervals():
    from dormouse.bench.profile import _union_us

    # overlapping streams count once; a gap is idle
    assert _union_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert _union_us([]) == 0


@pytest.mark.slow
def test_fleet_divides_each_fleet_by_the_solo_rates_around_it(capsys):
    # real 2-rank gloo fleets (spawned), kept short: 4 windows of 16 bytes, 4 steps each
    assert main_bench(["fleet", "--world", "2", "--global-batch", "4", "--seq", "16",
                       "--steps", "4", "--every", "2", "--rounds", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    # the solo rates before the first fleet and after each of the three
    for when in ("before the first fleet", "after fleet 1", "after fleet 2", "after fleet 3"):
        assert f"| {when} |" in out
    solo = [
        sum(float(c.strip().replace(",", "")) for c in ln.split("|")[2:-1])
        for ln in out.splitlines()
        if ln.startswith(("| before the first", "| after fleet"))
    ]
    rows = [ln for ln in out.splitlines() if ln.startswith("| 1 |") and ln.count("|") > 12]
    assert [r.split("|")[2].strip() for r in rows] == ["equal", "start-up auto",
                                                       "re-balanced auto"]  # fmt: skip
    for i, r in enumerate(rows):  # fleet i+1's sum: the mean of the solo rates around it
        cells = [c.strip() for c in r.split("|")[1:-1]]
        # each printed rate rounds by 0.5 tokens/s, two ranks, two measurements
        assert float(cells[6].replace(",", "")) == pytest.approx((solo[i] + solo[i + 1]) / 2,
                                                                 abs=2.5)  # fmt: skip
        tok, total, frac = (float(cells[5].replace(",", "")), float(cells[6].replace(",", "")),
                            float(cells[8]))  # fmt: skip
        # printed to whole tokens/s and 3 decimals: that rounding is the tolerance
        assert frac == pytest.approx(tok / total, abs=(tok / total) * (0.5 / tok + 0.5 / total)
                                     + 5e-4 + 1e-9)  # fmt: skip
    assert "| equal | 1 |" in out  # the per-split summary over the rounds
    for r in rows:  # every fleet has its side-by-side blocks (every 2 steps, 4 steps)
        assert "(n=" in r.split("|")[-2]
    # where the step goes: only the re-balanced fleet, whose ranks all time themselves
    where = [ln for ln in out.splitlines() if ln.startswith("| 1 |") and ln.count("|") == 9]
    assert [w.split("|")[2].strip() for w in where] == ["re-balanced auto"]
    cells = [c.strip() for c in where[0].split("|")[1:-1]]
    assert float(cells[3]) > 0 and float(cells[4]) > 0 and "(n=" in cells[7]


def test_fleet_where_the_step_goes_from_each_rank_s_own_compute():
    from dormouse.bench.fleet import _where

    # 5 steps; walls of steps 1-4 (step 0 has none); rank 0 holds 6 windows, rank 1 2
    walls = [None, 1.0, 1.2, 1.0, 0.9]
    splits = ["6,2"] * 5
    # rank 0 times 0.8 s for 6 windows, rank 1 0.9 s for 2 (a slow rank, emulated); step 4
    # has no compute (never stopped)
    computes = [{1: 0.8, 2: 0.8, 3: 0.8}, {1: 0.9, 2: 1.0, 3: 0.9}]
    got = _where(walls, splits, computes, half=2)
    assert got["where_n"] == 2  # steps 2 and 3: the second half, with both ranks' compute
    assert got["wall_ms"] == pytest.approx(1100)  # median of 1.2 and 1.0
    assert got["floor_ms"] == pytest.approx(950)  # the slower rank each step: 1.0, 0.9
    assert got["own_ms"] == pytest.approx(150)  # 1.2 - 1.0 and 1.0 - 0.9
    # rates 7.5 and 2.105 windows/s (medians of 2/1.0 and 2/0.9): 8 windows / 9.605
    assert got["ideal_ms"] == pytest.approx(1000 * 8 / (7.5 + (2 / 1.0 + 2 / 0.9) / 2))
    # a fleet whose rank 0 never timed itself (no re-balancing): nothing to say
    assert _where(walls, splits, [{}, computes[1]], half=2) == {"where_n": 0}


def test_fleet_side_by_side_walls_leave_out_the_blocks_and_divide_by_the_blocks_around():
    from types import SimpleNamespace

    from dormouse.bench.fleet import _side_fractions, _walls

    # steps end at 1, 2, 3 | block after 3 steps, resumed at 10 | steps end at 11, 12, 13.5 |
    # block after 6 steps, resumed at 20 | steps end at 22, 24
    stamps = [1.0, 2.0, 3.0, 11.0, 12.0, 13.5, 22.0, 24.0]
    blocks = [
        {"after": 0, "rate": 10.0, "resume": None},
        {"after": 3, "rate": 20.0, "resume": 10.0},
        {"after": 6, "rate": 40.0, "resume": 20.0},
    ]
    walls = _walls(stamps, blocks)
    # step 3 starts when the block after step 2 ended (10), not at step 2's end (3)
    assert walls == [None, 1.0, 1.0, 1.0, 1.0, 1.5, 2.0, 2.0]
    other = [{"after": 0, "rate": 30.0}, {"after": 3, "rate": 60.0}, {"after": 6, "rate": 120.0}]
    args = SimpleNamespace(global_batch=4, seq=25)  # 100 tokens a step
    got = _side_fractions(args, walls, [blocks, other], half=3)
    # only the segment of steps 3-5 starts in the second half: median wall 1.0 s -> 100
    # tokens/s, over the mean of the two blocks' summed rates ((20 + 60) + (40 + 120)) / 2
    assert got == {"side_sum": 120.0, "side": pytest.approx(100 / 120), "side_n": 1}
    # steps 6-7 have no block after them: no segment
    assert _side_fractions(args, walls, [blocks, other], half=6)["side_n"] == 0


def test_fleet_refuses_zero_rounds(capsys):
    assert main_bench(["fleet", "--rounds", "0"]) == 2
    assert "--rounds 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--micro", "25"), ("--micro", "-1"), ("--side", "-1"),
                                         ("--side", "nan")])  # fmt: skip
def test_fleet_refuses_a_micro_batch_over_the_global_batch_and_a_negative_side(capsys, flag,
                                                                              value):  # fmt: skip
    assert main_bench(["fleet", "--global-batch", "24", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and len(err.strip().splitlines()) == 1


# ---- bench step: the FLOPs beyond 6N, the peak, the parts ------------------------------------


def _tiny_after_a_forward():
    model = DormouseModel(preset("tiny").model)
    x = torch.randint(0, 256, (2, 32))
    _, loss, _ = model(x, x)  # the forward chooses the KDA arm (torch here), hence the chunk
    return model, loss


def test_kda_flops_match_a_hand_count_for_tiny():
    from dormouse.bench.flops import kda_chunk_flops, kda_forward_flops

    model, _ = _tiny_after_a_forward()
    assert model.blocks[0].mixer.impl == "torch"
    # tiny: 4 heads of 16 (K = V = 16), one block applied twice (max_iter 2); the torch arm's
    # chunk kda_chunk = 16, so P = 16 * 17 / 2 = 136 causal pairs a chunk. Per head and chunk:
    per_chunk = (
        2 * 16 * 16 * 16  # the scores Aqk and Akk: 256 pairs of 16
        + 16 * 255 // 3  # (I + A)^-1 by substitution: 1360
        + 2 * 136 * 32  # [U | W] = (I + A)^-1 [beta V | beta exp(G) K]: 8704
        + 2 * 136 * 16  # Aqk D: 4352
        + 6 * 16 * 16 * 16
    )  # W S0, (Q exp G) S0, K'^T D: 24576
    assert per_chunk == 47184 == kda_chunk_flops(16, 16, 16)
    # the preset's 4 x 64 windows: 4 chunks each, x 4 heads x 2 applications
    assert kda_forward_flops(model, 4, 64) == 4 * 4 * 2 * 4 * 47184
    assert kda_forward_flops(model, 1, 40) == 1 * 4 * 2 * 3 * 47184  # the last chunk padded
    # fla runs chunks of 64 whatever kda_chunk says: one chunk of a 64-byte window
    model.blocks[0].mixer._impl = "fla"
    assert kda_forward_flops(model, 4, 64) == 4 * 4 * 2 * 1 * kda_chunk_flops(64, 16, 16)
    # the arm not yet chosen: refused, not guessed
    with pytest.raises(ValueError, match="first forward"):
        kda_forward_flops(DormouseModel(preset("tiny").model), 4, 64)


def test_polar_flops_match_a_hand_count_and_the_counted_step():
    from torch.utils.flop_counter import FlopCounterMode

    from dormouse.bench.flops import polar_flops, step_flops
    from dormouse.train.optim.mix import MixOptimizer

    model, loss = _tiny_after_a_forward()
    opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=1e-3))
    # tiny's Muon matrices (train/routing.py), oriented wide [r <= c], and how many of each
    hand = {(64, 64): 4,  # q, k, v, o projections
            (32, 64): 2,  # the Engram key and value [64, 32]
            (8, 64): 18,  # f_down, f_up; 4 deltas x 2 iterations x (A [8, 64], B [64, 8])
            (4, 64): 2,  # b_proj, the router
            (16, 64): 5,  # g_down, g_up; the shared expert's w1, w3, w2
            (64, 128): 12}  # the experts: w1, w3 [4, 64, 128], w2 [4, 128, 64]  # fmt: skip
    per_iter = sum(n * (2 * r * r * c + 2 * r**3 + 2 * r * r * c) for (r, c), n in hand.items())
    assert per_iter == 39_094_528
    assert polar_flops(opt) == 5 * per_iter  # ns_steps 5
    # torch's own FLOP counter over a real optimizer step: the polar's matmuls are all of it
    loss.backward()
    with FlopCounterMode(display=False) as counted:
        opt.step()
    assert counted.get_total_flops() == polar_flops(opt)
    work = step_flops(model, opt, 4, 64, active_params_per_token(model))
    assert work == {"6N": 6 * active_params_per_token(model) * 256,
                    "KDA": 3 * 4 * 4 * 2 * 4 * 47184, "attention": 0,
                    "polar": 5 * per_iter}  # fmt: skip


def test_attention_flops_of_the_gpt_twin_count_the_causal_pairs():
    from dormouse.bench.flops import attention_forward_flops, kda_forward_flops
    from dormouse.bench.step import twin
    from dormouse.model.gpt import GPT

    m = twin(preset("tiny")).model  # gpt 64 x 3: d_attn 64
    gpt = GPT(m)
    # per layer and window: Q K^T and A V over the 64 * 65 / 2 causal pairs, 64 wide, 2 FLOPs
    assert attention_forward_flops(gpt, 4, 64) == 4 * 3 * 2 * (2 * 64 * 64 * 65 // 2)
    assert kda_forward_flops(gpt, 4, 64) == 0


def _cell(row: dict, key: str) -> float:
    return float(row[key].rstrip("%x").replace(",", ""))


def test_a_given_peak_prints_mfu_and_hfu_on_the_cpu(capsys):
    argv = ["tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--peak-tflops", "0.01"]
    assert main_bench(argv) == 0
    printed = capsys.readouterr().out
    row = dict(zip(HEADER, _table_rows(printed)[2]))
    assert "0.01 TFLOP/s fp32, given by --peak-tflops (not measured)" in printed
    assert row["MFU (datasheet)"] == "n/a (CPU)"  # no datasheet for a CPU
    # printed to 3 significant digits: that rounding (0.5%) is the tolerance
    assert _cell(row, "MFU (measured peak)") == pytest.approx(
        100 * _cell(row, "model TFLOP/s") / 0.01, rel=1e-2, abs=0.05
    )
    parts, total = row["TFLOP/step: 6N + mixer + polar"].split(" = ")
    six_n, kda, polar = (float(v) for v in parts.split(" + "))
    assert sum((six_n, kda, polar)) == pytest.approx(float(total), rel=1e-2)
    active = active_params_per_token(DormouseModel(preset("tiny").model))
    assert six_n * 1e12 == pytest.approx(6 * active * 4 * 64, rel=1e-2)
    assert kda * 1e12 == pytest.approx(3 * 4 * 4 * 2 * 4 * 47184, rel=1e-2)
    hfu = 100 * float(total) / (_cell(row, "step ms (median)") / 1000) / 0.01
    assert _cell(row, "HFU (measured peak)") == pytest.approx(hfu, rel=1e-2, abs=0.05)


def test_bad_peaks_are_refused(capsys):
    from dormouse.bench.common import BenchError
    from dormouse.bench.step import _peaks

    for bad in ("0", "-790", "nan", "inf"):
        assert main_bench(["tiny", "--device", "cpu", "--peak-tflops", bad]) == 2
        err = capsys.readouterr()
        assert err.err.strip().splitlines()[-1].startswith(f"bench: --peak-tflops {float(bad)}: "
                                                           f"a peak is a positive")  # fmt: skip
        assert "|" not in err.out  # refused before anything was timed
    with pytest.raises(BenchError, match="one peak, but these rows compute in bf16 and fp32"):
        _peaks(["bf16", "fp32"], torch.device("cpu"), 790.0)


def test_parts_table_sums_the_parts_and_sets_them_beside_the_step(capsys):
    argv = ["tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--parts"]
    assert main_bench(argv) == 0
    printed = capsys.readouterr().out
    rows = _table_rows(printed)
    step_row = dict(zip(HEADER, rows[2]))
    at = next(i for i, r in enumerate(rows) if r[:2] == ["preset", "part"])
    from dormouse.bench.step import PARTS_HEADER

    assert rows[at] == PARTS_HEADER
    parts = {r[1].split(" (")[0]: dict(zip(PARTS_HEADER, r)) for r in rows[at + 2 :]}
    assert list(parts) == ["forward + backward", "forward", "backward", "clip", "optimizer",
                           "lfb", "sum of parts", "step", "step / sum of parts"]  # fmt: skip
    ms = {k: float(v["ms (median)"].rstrip("x")) for k, v in parts.items()}
    # printed to 0.01 ms: each cell rounds by 0.005
    assert ms["backward"] == pytest.approx(ms["forward + backward"] - ms["forward"], abs=0.011)
    assert ms["sum of parts"] == pytest.approx(
        sum(ms[k] for k in ("forward", "backward", "clip", "optimizer", "lfb")), abs=0.03
    )
    assert ms["step"] == pytest.approx(_cell(step_row, "step ms (median)"), abs=0.051)
    assert ms["step / sum of parts"] == pytest.approx(ms["step"] / ms["sum of parts"], abs=0.006)
    assert _cell(parts["optimizer"], "share of the step") == pytest.approx(
        100 * ms["optimizer"] / ms["step"], abs=0.06
    )
    assert all(ms[k] > 0 for k in ("forward", "forward + backward", "optimizer"))
    assert "Parts (--parts, parts.py)" in printed


def test_parts_step_the_optimizer_on_gradients_and_mark_graph_steps(monkeypatch):
    from dormouse.bench.common import harness, windows
    from dormouse.bench.parts import time_parts

    run = preset("tiny")
    h = harness(run, torch.device("cpu"))
    h.step(0, windows(run, 1)[0])  # grads dropped by the step's zero_grad, as after the bench's
    seen = []
    real = h.opt.step

    def step():  # the optimizer alone must find every gradient the backward made
        seen.append(all(p.grad is not None for g in h.opt.param_groups for p in g["params"]
                        if g["kind"] == "muon"))  # fmt: skip
        real()

    monkeypatch.setattr(h.opt, "step", step)
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    got = time_parts(h, windows(run, 1)[0], 2, 1, torch.device("cpu"))
    assert seen == [True] * 3  # 1 untimed + 2 timed, each on gradients
    assert marks == []  # no CUDA graphs: no step marks
    assert {k: len(v) for k, v in got.items()} == {"forward": 2, "forward + backward": 2,
                                                   "clip": 2, "optimizer": 2, "lfb": 2,
                                                   "backward": 1}  # fmt: skip
    # compile_mode=reduce-overhead: every forward (alone or before its backward) is a new
    # CUDA-graph step, as in train_step (the eager net stands in for the compiled one here)
    h.s.wrapped = replace(h.s.wrapped, graphs=True)
    time_parts(h, windows(run, 1)[0], 2, 1, torch.device("cpu"))
    assert len(marks) == 3 + 3


@pytest.mark.slow
def test_race_trains_both_models_for_the_same_seconds(tmp_path, capsys):
    """bench race: each model's steps fill the budget at its own step time; both runs train
    and are scored from their run folders; a second race into the same folders is refused
    unless --overwrite."""
    data = tmp_path / "c.txt"
    data.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 4000)
    argv = ["race", "tiny", "--seconds", "2", "--evals", "2", "--data", str(data),
            "--device", "cpu", "--runs", str(tmp_path / "r")]  # fmt: skip
    assert main_bench(argv) == 0
    rows = _table_rows(capsys.readouterr().out)
    got = {r[0]: dict(zip(rows[0], r)) for r in rows[2:]}
    assert set(got) == {"tiny", "gpt 64 x 3 (twin of tiny)"}
    for r in got.values():
        steps, ms = int(r["steps"]), float(r["step ms"])
        # the budget over the timed step; the table prints ms to 0.1, so the count it implies
        # sits within the rounding of that figure (11.76 ms prints 11.8: 170 steps, not 169)
        assert int(2000 / (ms + 0.05)) <= steps <= max(1, int(2000 / (ms - 0.05)))
        assert (Path(r["run folder"]) / "metrics.jsonl").exists()
    assert main_bench(argv) == 2 and "already holds a run" in capsys.readouterr().err


def test_race_names_the_model_fields_a_set_changed():
    """A race of `tiny --set attn_every=1` is labelled so; a train-only --set is not."""
    from dormouse.bench.common import configure
    from dormouse.bench.race import label

    assert label(configure("tiny", ["attn_every=1"]), "tiny") == "tiny (attn_every=1)"
    assert label(configure("tiny", ["batch=4", "lr=1e-3"]), "tiny") == "tiny"
