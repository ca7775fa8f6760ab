"""The device layer: the policy table over synthetic cards, one real probe, the refusals."""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from dormouse.train.plan import device as dv
from dormouse.train.plan.device import (
    BUDGET_RESERVE,
    DeviceRecord,
    DtypeError,
    GiB,
    format_probe_table,
    memory_budget,
    policy_for,
    probe,
    resolve_dtype,
)


def card(sm, name="synthetic", free=8 * GiB, total=12 * GiB) -> DeviceRecord:
    return DeviceRecord(index=0, name=name, kind="cuda", sm=sm, total_mem=total, free_mem=free,
                        pcie_gen_max=3, pcie_width_max=16, multiprocessors=40)  # fmt: skip


# sm -> (bf16, fp16, ladder rung, what auto runs, fla_kda, grouped_mm on torch 2.11)
TABLE = {
    (12, 0): (1, 1, "bf16", "bf16", 1, 1),  # RTX 5060 Ti
    (8, 9): (1, 1, "bf16", "bf16", 1, 1),  # RTX 4090
    (8, 6): (1, 1, "bf16", "bf16", 1, 1),  # RTX 3090
    (8, 0): (1, 1, "bf16", "bf16", 1, 1),  # A100
    # below sm_80 auto runs the fp16 rung: the fp16 forward with its loss scale (scaler.py)
    # replaced the counted fp32 fallback these rows had
    (7, 5): (0, 1, "fp16", "fp16", 0, 0),  # GTX 1650
    (7, 0): (0, 1, "fp16", "fp16", 0, 0),  # V100
    (6, 1): (0, 1, "fp16", "fp16", 0, 0),  # GTX 1080 Ti
    (5, 2): (0, 0, "fp32", "fp32", 0, 0),  # Maxwell GM20x: before fp16 arithmetic
}


@pytest.mark.parametrize("sm", list(TABLE), ids=lambda sm: f"sm_{sm[0]}{sm[1]}")
def test_policy_table(sm):
    bf16, fp16, rung, auto, fla, gmm = TABLE[sm]
    p = policy_for(card(sm), torch_version="2.11.0")
    got = (p.bf16, p.fp16, p.rung, p.auto, p.fla_kda, p.grouped_mm)
    assert got == (bool(bf16), bool(fp16), rung, auto, bool(fla), bool(gmm))
    assert not p.fallback  # auto runs every card's rung
    # every illegal arm carries its reason
    for arm, legal in (("fla_kda", fla), ("grouped_mm", gmm)):
        assert legal or any(w.startswith(arm) for w in p.why), (arm, p.why)


@pytest.mark.parametrize("sm", list(TABLE), ids=lambda sm: f"sm_{sm[0]}{sm[1]}")
def test_auto_resolves_per_table(sm, caplog):
    _, _, rung, auto, *_ = TABLE[sm]
    before = dv.fallback_count()
    with caplog.at_level(logging.INFO, logger=dv.__name__):
        dtype, line = resolve_dtype("auto", card(sm, name="Card X"))
    assert dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[auto]
    assert [r.getMessage() for r in caplog.records if r.name == dv.__name__] == [line]
    p = policy_for(card(sm))
    assert f"sm={sm[0]}.{sm[1]} bf16={int(p.bf16)} fp16={int(p.fp16)} ->" in line  # the reading
    assert "device=Card X" in line and "budget=7.5GiB (free-512MiB)" in line
    assert dv.fallback_count() == before  # no rung falls back any more
    assert line.split(" -> ")[1].startswith(auto)
    if rung == "fp16":  # the reason is in the line
        assert "no bf16 below sm_80" in line and "loss scale" in line


def test_grouped_mm_follows_the_torch_version():
    cpu = DeviceRecord(0, "cpu", "cpu", None, GiB, GiB, None, None, 2)
    # torch 2.8: Hopper only on CUDA, no CPU kernel
    assert policy_for(card((9, 0)), "2.8.0").grouped_mm
    assert not policy_for(card((12, 0)), "2.8.0").grouped_mm
    assert not policy_for(card((8, 0)), "2.8.0").grouped_mm
    assert not policy_for(cpu, "2.8.0").grouped_mm
    # 2.9+: sm_80+ on CUDA (fused only on 9.x/10.x), and a CPU kernel
    assert policy_for(cpu, "2.9.1").grouped_mm
    assert policy_for(card((9, 0)), "2.11.0").grouped_mm_fused
    assert policy_for(card((10, 0)), "2.11.0").grouped_mm_fused
    assert not policy_for(card((12, 0)), "2.11.0").grouped_mm_fused
    assert not policy_for(card((8, 6)), "2.11.0").grouped_mm_fused
    # before 2.8 the op does not exist
    assert not policy_for(card((9, 0)), "2.7.1").grouped_mm


def test_cpu_policy():
    cpu = DeviceRecord(0, "cpu", "cpu", None, GiB, GiB, None, None, 2)
    p = policy_for(cpu)
    assert (p.bf16, p.fp16, p.auto, p.fla_kda, p.grouped_mm_fused) == (
        True,
        True,
        "fp32",
        False,
        False,
    )
    # explicit bf16 and fp16 on the CPU are honoured (CPU autocast runs both); auto stays fp32
    assert resolve_dtype("bf16", cpu)[0] is torch.bfloat16
    assert resolve_dtype("fp16", cpu)[0] is torch.float16
    assert resolve_dtype("auto", cpu)[0] is torch.float32


def test_real_probe():
    records = probe()
    assert records
    for r in records:
        assert r.total_mem > 0
        assert r.free_mem == -1 or 0 < r.free_mem <= r.total_mem
        p = policy_for(r)
        if torch.cuda.is_available():
            assert r.kind == "cuda" and r.sm is not None and r.multiprocessors > 0
            assert p.bf16 == (r.sm >= (8, 0))
        else:
            assert r.kind == "cpu" and r.sm is None and r.pcie_gen_max is None
        dtype, line = resolve_dtype("auto", r)
        assert dtype in (torch.bfloat16, torch.float16, torch.float32) and r.name in line
    if torch.cuda.is_available():
        # metadata only: the probe allocated nothing through torch's allocator
        assert torch.cuda.memory_allocated() == 0
    assert dv.probe_device("cpu").kind == "cpu"


def test_explicit_bf16_below_sm80_is_refused_loudly():
    with pytest.raises(DtypeError) as e:
        resolve_dtype("bf16", card((7, 5), name="NVIDIA GeForce GTX 1650"))
    msg = str(e.value)
    for part in ("NVIDIA GeForce GTX 1650", "sm_75", "sm_80", "--set dtype=auto", "dtype=fp32"):
        assert part in msg, (part, msg)
    assert isinstance(e.value, ValueError)


def test_explicit_fp16_from_sm53_and_refused_below():
    # the fp16 forward exists (the loop carries its loss scale): honoured wherever the card
    # computes fp16, bf16 cards included
    for sm in ((7, 5), (6, 1), (9, 0)):
        dtype, line = resolve_dtype("fp16", card(sm))
        assert dtype is torch.float16 and "fp16 (explicit) with a dynamic loss scale" in line
    with pytest.raises(DtypeError) as e:
        resolve_dtype("fp16", card((5, 2), name="GTX 980"))
    msg = str(e.value)
    for part in ("GTX 980", "sm_52", "sm_53", "dtype=fp32", "dtype=auto"):
        assert part in msg, (part, msg)


def test_explicit_fp32_and_bf16_where_legal():
    assert resolve_dtype("fp32", card((5, 2)))[0] is torch.float32
    assert resolve_dtype("bf16", card((8, 0)))[0] is torch.bfloat16
    with pytest.raises(DtypeError, match="not one of"):
        resolve_dtype("int8", card((8, 0)))


def test_dtype_none_is_gone():
    with pytest.raises(DtypeError, match="not one of"):
        resolve_dtype("none", card((8, 0)))


def test_unknown_free_memory_gives_unknown_budget():
    busy = card((8, 6), free=-1)
    assert memory_budget(busy) is None
    _, line = resolve_dtype("auto", busy)
    assert "budget=unknown" in line and "GiB (free" not in line
    assert "unknown" in format_probe_table([busy])
    assert memory_budget(card((8, 6), free=4 * GiB)) == 4 * GiB - BUDGET_RESERVE
    assert memory_budget(card((8, 6), free=100)) == 0


def _fake_cuda(monkeypatch, mem_get_info, **extra):
    props = SimpleNamespace(name="NVIDIA Fake 1650", major=7, minor=5, total_memory=4 * GiB,
                            multi_processor_count=14, pci_domain_id=0, pci_bus_id=0x2b,
                            pci_device_id=0, **extra)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)


def test_a_held_card_reports_unknown_free_memory(monkeypatch):
    def refuse(i):
        raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable")

    _fake_cuda(monkeypatch, refuse)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: not installed
    (r,) = probe()
    assert (r.free_mem, r.total_mem, r.sm) == (-1, 4 * GiB, (7, 5))
    assert "free memory unreadable" in r.note and "pynvml" in r.note
    assert r.pcie_gen_max is None


def test_pcie_is_read_through_nvml_by_pci_address(monkeypatch):
    _fake_cuda(monkeypatch, lambda i: (3 * GiB, 4 * GiB))
    asked = []
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetHandleByPciBusId_v2 = lambda addr: asked.append(addr) or "h"
    fake.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 3
    fake.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    (r,) = probe()
    assert (r.pcie_gen_max, r.pcie_width_max, r.free_mem) == (3, 16, 3 * GiB)
    assert asked == ["00000000:2B:00.0"]
    assert "gen3 x16" in format_probe_table([r])


def test_probe_table_and_main(capsys):
    rows = [card((12, 0), name="RTX 5060 Ti"), card((7, 5), name="GTX 1650", free=-1)]
    table = format_probe_table(rows)
    assert "RTX 5060 Ti" in table and "GTX 1650" in table
    assert "fp32 (fp16 rung)" not in table and "no fp16 path" not in table
    assert dv.main_probe([]) == 0
    out = capsys.readouterr().out
    assert "device" in out and "budget" in out
