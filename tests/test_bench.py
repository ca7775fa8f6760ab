"""`dormouse bench {step,optim,memory}`: each runs on a tiny config on the CPU and prints its
table under the machine lines; --out, the default sub-command, the refusals.

Correctness only. Speed is reported by the bench itself and never asserted here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dormouse.bench import main_bench
from dormouse.bench.memory import HEADER as MEMORY_HEADER
from dormouse.bench.step import HEADER, active_params_per_token, peak_tflops
from dormouse.config import preset
from dormouse.model import DormouseModel
from dormouse.train.fit import GiB, plan_fit


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
    assert row["MFU"].startswith("n/a")
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
    from dormouse.train.optim import MixOptimizer

    opt = MixOptimizer(DormouseModel(preset("tiny").model), lr=1e-3)
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
        assert gpt_params(m.d_model, m.n_layers, m.d_ffn, m.d_attn, m.max_seq_len) == count_params(m)


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
    assert header == [*HEADER, "compile", "dormouse / GPT tokens/s"]
    mine, gpt = (dict(zip(header, r)) for r in rows[2:])
    assert mine["preset"] == "tiny" and gpt["preset"] == "gpt 64 x 3 (twin of tiny)"
    assert mine["batch x seq"] == gpt["batch x seq"] == "4 x 64" and gpt["dtype"] == "fp32"
    assert gpt["KDA arm"] == "- (SDPA attention)" and gpt["compile"] == "off"  # CPU default
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
    assert calls == [{"dynamic": False}]  # the GPT row only
    assert gpt["compile"].startswith("on (") and gpt["compile"].endswith(" s first step)")

    class Broken(torch.nn.Module):
        def forward(self, *a, **kw):
            raise RuntimeError("inductor: no C++ compiler\nmore detail")

    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken())
    assert main_bench(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("bench: torch.compile of gpt 64 x 3 (twin of tiny) failed on cpu "
                       "(RuntimeError: inductor: no C++ compiler); rerun with --compile off")


def test_baseline_refusals(capsys):
    assert main_bench(["tiny", "--device", "cpu", "--compile", "on"]) == 2
    assert "add --baseline gpt" in capsys.readouterr().err
    assert main_bench(["gpt-small", "--baseline", "gpt", "--device", "cpu"]) == 2
    assert "already arch=gpt" in capsys.readouterr().err


def test_step_bench_runs_a_gpt_preset(capsys):
    argv = ["gpt-small", "--device", "cpu", "--steps", "1", "--warmup", "0", "--batch", "2",
            "--seq", "32"]  # fmt: skip
    assert main_bench(argv) == 0
    row = dict(zip(HEADER, _table_rows(capsys.readouterr().out)[2]))
    assert row["preset"] == "gpt-small" and row["MoE arm"] == "- (GELU MLP)"


def test_profile_prints_the_step_and_its_phases(capsys):
    assert main_bench(["profile", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    phases = {line.split("|")[2].strip() for line in out.splitlines() if line.startswith("| tiny |")}
    # the loop's own ranges (loop.PHASES) reach the profile: forward, backward, clip, optimizer
    assert {"forward", "backward", "clip", "optimizer"} <= phases
    assert "GPU busy" in out and "n/a (CPU)" in out


def test_profile_union_of_kernel_intervals():
    from dormouse.bench.profile import _union_us

    # overlapping streams count once; a gap is idle
    assert _union_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert _union_us([]) == 0


def test_fleet_divides_each_fleet_by_the_solo_rates_around_it(capsys):
    # real 2-rank gloo fleets (spawned), kept short: 4 windows of 16 bytes, 4 steps each
    assert main_bench(["fleet", "--world", "2", "--global-batch", "4", "--seq", "16",
                       "--steps", "4", "--every", "2", "--rounds", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    # the solo rates before the first fleet and after each of the three
    for when in ("before the first fleet", "after fleet 1", "after fleet 2", "after fleet 3"):
        assert f"| {when} |" in out
    solo = [sum(float(c.strip().replace(",", "")) for c in ln.split("|")[2:-1])
            for ln in out.splitlines() if ln.startswith(("| before the first", "| after fleet"))]
    rows = [ln for ln in out.splitlines() if ln.startswith("| 1 |")]
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


def test_fleet_refuses_zero_rounds(capsys):
    assert main_bench(["fleet", "--rounds", "0"]) == 2
    assert "--rounds 0" in capsys.readouterr().err
