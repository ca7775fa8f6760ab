"""`dormouse bench`'s plumbing: the table, the machine lines, --out, the refusals.

Correctness only. Speed is reported by the bench itself and never asserted here.
"""

from __future__ import annotations

import torch

from dormouse.bench import HEADER, active_params_per_token, main_bench, peak_tflops
from dormouse.config import preset
from dormouse.model import DormouseModel


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
    assert row["dtype"] == "fp32"  # tiny has bf16=False and dtype=none: the loop's fp32
    assert "Machine: CPU" in printed
    assert "torch threads" in printed and torch.__version__ in printed
    command = next(ln for ln in printed.splitlines() if ln.startswith("- Command: `"))
    assert "python -m dormouse bench tiny --device cpu --steps 2 --warmup 1" in command
    assert out.read_text() == printed


def test_overrides_reach_the_run(capsys):
    rc = main_bench(["tiny", "--device", "cpu", "--steps", "1", "--warmup", "0",
                     "--batch", "2", "--seq", "32"])  # fmt: skip
    assert rc == 0
    row = dict(zip(HEADER, _table_rows(capsys.readouterr().out)[2]))
    assert row["batch x seq"] == "2 x 32"


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
