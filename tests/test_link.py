"""The ring all-reduce arithmetic and the `link` command's named inputs."""

from __future__ import annotations

import pytest

from dormouse.train.fleet.link import (
    LINK_EFFICIENCY,
    LinkError,
    allreduce_bytes_per_rank,
    allreduce_seconds,
    bucket_mb_for,
    lane_rate,
    link_rate,
    main_link,
)
from dormouse.train.plan.device import DeviceRecord

MiB = 1 << 20


def test_ring_bytes_per_rank():
    assert allreduce_bytes_per_rank(1000, 2) == 1000  # P=2: exactly one payload
    assert allreduce_bytes_per_rank(1000, 4) == 1500  # 2*3/4
    assert allreduce_bytes_per_rank(1000, 1) == 0  # nothing to agree with
    with pytest.raises(LinkError):
        allreduce_bytes_per_rank(1000, 0)


def test_pcie_table():
    # per-lane GB/s after line coding; the references are quoted to 3-4 significant digits
    ref = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
    for gen, gbs in ref.items():
        assert lane_rate(gen) / 1e9 == pytest.approx(gbs, rel=1e-3)  # rounding of the quotes
    assert link_rate(3, 16) / 1e9 == pytest.approx(15.75, rel=1e-3)
    with pytest.raises(LinkError, match="gen9"):
        link_rate(9, 16)
    with pytest.raises(LinkError):
        link_rate(3, 0)


def test_seconds_reproduce_the_design_table():
    # (params, gen, width) -> (ms at 2 ranks, ms at 4 ranks), bf16 payload
    table = {
        (138e6, 3, 16): (21.9, 32.8),
        (1.07e9, 3, 16): (170, 255),
        (138e6, 5, 8): (11.0, 16.4),
        (1.07e9, 5, 8): (85, 128),
    }
    for (params, gen, width), (ms2, ms4) in table.items():
        assert allreduce_seconds(params, 2, 2, gen, width) * 1e3 == pytest.approx(ms2, rel=6e-3)
        assert allreduce_seconds(params, 2, 4, gen, width) * 1e3 == pytest.approx(ms4, rel=6e-3)
    # rel 6e-3: the design table rounds to 2-3 significant digits (85 vs 84.9)
    assert LINK_EFFICIENCY == 0.8
    # fp32 on the wire costs exactly twice bf16
    assert allreduce_seconds(1e6, 4, 2, 4, 16) == 2 * allreduce_seconds(1e6, 2, 2, 4, 16)


def test_bucket_clamp():
    assert bucket_mb_for(0) == 4.0
    assert bucket_mb_for(8 * MiB) == 4.0
    assert bucket_mb_for(276e6) == pytest.approx(276e6 / 8 / MiB)
    assert bucket_mb_for(2.14e9) == 128.0


def test_main_link_names_its_inputs(capsys):
    assert main_link(["--params", "138000000", "--gen", "3", "--width", "16", "--world", "8"]) == 0
    out = capsys.readouterr().out
    for part in ("138,000,000", "(--params)", "bf16 = 2 B", "276.0 MB", "PCIe gen3 x16",
                 "15.75 GB/s", "given (--gen/--width)", "0.80", "an assumption",
                 "bucket_mb_for", "2(P-1)/P"):  # fmt: skip
        assert part in out, part
    table = [line.split() for line in out.splitlines() if line[:8].strip().isdigit()]
    rows = {cells[0]: cells for cells in table}
    assert set(rows) == {"2", "4", "8"}
    assert rows["2"][1] == "1.00" and rows["2"][-1] == "21.9"
    assert rows["4"][1] == "1.50" and rows["4"][-1] == "32.8"


def test_main_link_says_when_the_link_is_assumed(monkeypatch, capsys):
    cpu = DeviceRecord(0, "cpu", "cpu", None, 1, 1, None, None, 1)
    import dormouse.train.plan.device as dv

    monkeypatch.setattr(dv, "probe", lambda memory=True: [cpu])
    assert main_link(["--params", "1000000", "--reduce", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "ASSUMED gen4 x16" in out and "could not be read" in out and "no CUDA device" in out
    assert "fp32 = 4 B" in out


def test_main_link_reads_the_slowest_card(monkeypatch, capsys):
    def gpu(i, gen, width):
        return DeviceRecord(i, f"GPU{i}", "cuda", (8, 6), 1, -1, gen, width, 1)

    import dormouse.train.plan.device as dv

    monkeypatch.setattr(dv, "probe", lambda memory=True: [gpu(0, 5, 8), gpu(1, 3, 16)])
    assert main_link(["--params", "1000000"]) == 0
    out = capsys.readouterr().out
    assert "PCIe gen3 x16" in out and "cuda:1 GPU1 via NVML" in out and "slowest of 2" in out


def test_main_link_preset_count_or_a_loud_nominal(monkeypatch, capsys):
    # a stand-in counter: importing the real model costs seconds on the CI box, and the
    # claim here is the wiring (preset -> ModelConfig -> count_params), not the count
    import dormouse.model as model_pkg
    from dormouse.config import preset

    seen = []
    monkeypatch.setattr(model_pkg, "count_params", lambda cfg: seen.append(cfg) or 1234567,
                        raising=False)  # fmt: skip
    assert main_link(["--preset", "small", "--gen", "4", "--width", "16"]) == 0
    out = capsys.readouterr().out
    assert seen == [preset("small").model]
    assert "1,234,567" in out and "preset small, counted by count_params" in out

    # the model cannot be counted: the design's nominal size, said loudly
    def broken(cfg):
        raise RuntimeError("model not built yet")

    monkeypatch.setattr(model_pkg, "count_params", broken)
    assert main_link(["--preset", "small", "--gen", "4", "--width", "16"]) == 0
    out = capsys.readouterr().out
    assert "NOMINAL size" in out and "model not built yet" in out and "9,500,000" in out
    # no nominal size either: refused, naming the escape
    assert main_link(["--preset", "tiny", "--gen", "4", "--width", "16"]) == 2
    assert "--params N" in capsys.readouterr().out


def test_main_link_refusals(capsys):
    assert main_link([]) == 2
    assert "--preset P" in capsys.readouterr().out
    assert main_link(["--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().out
    assert main_link(["--params", "10", "--gen", "9", "--width", "16"]) == 2
    assert "gen9" in capsys.readouterr().out
