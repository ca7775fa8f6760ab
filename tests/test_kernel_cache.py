"""The first-run autotune, said and cached (issue #16 item 5): Triton's cache under dormouse's
folder unless the user placed it, the first fla call per shape announced and timed, and
`bench warm` (nothing to warm on the CPU)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dormouse import cache
from dormouse.bench import main_bench
from dormouse.model import kda_fla, kda_torch

ROOT = Path(__file__).resolve().parents[1]


def test_placement_fills_only_what_the_user_left_unset(tmp_path):
    env = {"DORMOUSE_CACHE": str(tmp_path)}
    assert cache.place_kernel_caches(env) == {
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "TRITON_CACHE_AUTOTUNING": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "FLA_CACHE_MODE": "strict",
    }
    mine = {"DORMOUSE_CACHE": str(tmp_path), "TRITON_CACHE_DIR": "/mine",
            "TRITON_CACHE_AUTOTUNING": "0", "TORCHINDUCTOR_CACHE_DIR": "/ind",
            "FLA_CACHE_MODE": "disabled"}  # fmt: skip
    assert cache.place_kernel_caches(mine) == {}
    assert mine["TRITON_CACHE_DIR"] == "/mine" and mine["TRITON_CACHE_AUTOTUNING"] == "0"
    empty = {"TRITON_CACHE_DIR": "", "HOME": str(tmp_path)}  # empty = unset, as for Triton
    cache.place_kernel_caches(empty)
    assert empty["TRITON_CACHE_DIR"].endswith(os.path.join(".cache", "dormouse", "triton"))
    assert cache.cache_dir({"DORMOUSE_CACHE": "~/x"}) == Path(os.path.expanduser("~/x"))


def _imported_env(env: dict) -> list[str]:
    """TRITON_CACHE_DIR, TRITON_CACHE_AUTOTUNING and the cache line after `import dormouse` in
    a fresh interpreter: the placement runs at import, before anything can import Triton."""
    code = ("import os, dormouse; from dormouse.cache import kernel_cache_line; "
            "print(os.environ['TRITON_CACHE_DIR']); print(os.environ['TRITON_CACHE_AUTOTUNING']); "
            "print(kernel_cache_line())")  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "DORMOUSE_"))}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.splitlines()


def test_import_places_the_cache_and_respects_a_user_set_one(tmp_path):
    where, tune, line = _imported_env({"DORMOUSE_CACHE": str(tmp_path)})
    assert (where, tune) == (str(tmp_path / "triton"), "1")
    assert "dormouse's cache folder" in line and "autotune results cached on disk" in line
    where, tune, line = _imported_env({"DORMOUSE_CACHE": str(tmp_path),
                                       "TRITON_CACHE_DIR": str(tmp_path / "own"),
                                       "TRITON_CACHE_AUTOTUNING": "0"})  # fmt: skip
    assert (where, tune) == (str(tmp_path / "own"), "0")
    assert "TRITON_CACHE_DIR from the environment" in line and "NOT cached" in line


# ---- the first fla call per shape ------------------------------------------------------


@pytest.fixture
def fake_fla(monkeypatch):
    """fla's `chunk_kda` contract served by the torch arm, so the first-call bookkeeping runs on
    the CPU; a clock that advances 10 s a reading makes every first call 'slow'."""

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        return kda_torch.kda_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)  # fmt: skip

    mods = {n: types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.kda")}
    mods["fla.ops.kda"].chunk_kda = chunk_kda
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    ticks = iter(range(0, 10_000, 10))
    monkeypatch.setattr(kda_fla._FirstCall, "clock", staticmethod(lambda: float(next(ticks))))
    monkeypatch.setattr(kda_fla._FirstCall, "seen", set())
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")


def _inputs(B=2, T=16, H=2, D=8, grad=True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    gate = -torch.rand(B, T, H, D, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v, gate, beta)]


def test_first_fla_call_per_shape_is_said_and_timed(fake_fla, caplog):
    caplog.set_level(logging.INFO, logger="dormouse")
    o, _ = kda_fla.kda_fla(*_inputs())
    o.sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "dormouse.model.kda_fla"]
    assert lines[0].startswith(
        "kda: first fla call for shape 2 x 16 x 2 x 8 (float32); on a "
        "fresh machine its kernels autotune for ~3 minutes"
    )
    assert f"cached in {os.environ['TRITON_CACHE_DIR']}; later runs start in seconds" in lines[0]
    assert lines[1] == "kda: first fla forward for shape 2 x 16 x 2 x 8 (float32) took 10.0 s"
    assert lines[2] == "kda: first fla backward for shape 2 x 16 x 2 x 8 (float32) took 10.0 s"
    caplog.clear()
    kda_fla.kda_fla(*_inputs())[0].sum().backward()  # the same shape: silent
    assert not [r for r in caplog.records if r.name == "dormouse.model.kda_fla"]
    kda_fla.kda_fla(*_inputs(T=32, grad=False))  # a new shape, no backward: said, forward timed
    lines = [r.getMessage() for r in caplog.records if r.name == "dormouse.model.kda_fla"]
    assert len(lines) == 2 and "shape 2 x 32 x 2 x 8" in lines[0] and "forward" in lines[1]


def test_fast_first_calls_report_no_time(fake_fla, monkeypatch, caplog):
    monkeypatch.setattr(kda_fla._FirstCall, "clock", staticmethod(lambda: 0.0))
    caplog.set_level(logging.INFO, logger="dormouse")
    kda_fla.kda_fla(*_inputs())[0].sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "dormouse.model.kda_fla"]
    assert len(lines) == 1 and lines[0].startswith("kda: first fla call")


# ---- bench warm ----------------------------------------------------------------------------


def test_warm_on_cpu_has_nothing_to_warm(capsys):
    from dormouse.cli import main

    assert main(["bench", "warm", "tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "bench warm: nothing to warm on cpu: no Triton kernel runs and nothing "
        "compiles here (tiny: "
    )
    assert "device cpu is not CUDA" in out and "|" not in out  # nothing built, nothing timed


def test_warm_runs_a_step_and_an_eval_per_shape(monkeypatch, capsys):
    # the CUDA path's bookkeeping on the CPU: the torch arm stands in for fla
    from dormouse.bench import warm

    monkeypatch.setattr(warm, "triton_arm", lambda run, device: (True, "stand-in"))
    argv = ["warm", "tiny", "--device", "cpu", "--set", "global_batch=8"]
    assert main_bench(argv) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith("|")][2:]  # fmt: skip
    assert [r[3:5] for r in rows] == [
        ["4 x 64", "train step (forward + backward + optimizer) x 2 micro-batches"],
        ["4 x 64", "eval forward"],
    ]
    assert all(float(r[5]) >= 0 for r in rows) and "kernel cache: " in out


def test_shipped_fla_configs_seed_the_cache_folder_and_the_users_entries_win(
    tmp_path, monkeypatch, caplog
):
    """point_at merges dormouse's shipped winners for the card into <cache>/fla-configs/<card>
    (an entry already there is kept), points FLA_CONFIG_DIR at it once, and leaves a user's
    FLA_CONFIG_DIR alone; a card with none shipped is said and left to fla's tuning."""
    from dormouse.model import fla_tuned

    shipped = tmp_path / "shipped" / "NVIDIA_H100_80GB_HBM3"
    shipped.mkdir(parents=True)
    entry = lambda w: {"autotune_key": [4, 64], "config": {"kwargs": {}, "num_warps": w}}
    (shipped / "k.json").write_text(
        json.dumps({"autotune_entries": {"a": entry(4), "b": entry(8)}})
    )
    monkeypatch.setattr(fla_tuned, "SHIPPED", shipped.parent)
    monkeypatch.setenv("DORMOUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    dest = fla_tuned.folder_for("NVIDIA H100 80GB HBM3")
    dest.mkdir(parents=True)
    (dest / "k.json").write_text(json.dumps({"autotune_entries": {"a": entry(2)}}))
    monkeypatch.setattr(fla_tuned, "_POINTED", [])
    with caplog.at_level(logging.INFO):
        fla_tuned.point_at("NVIDIA H100 80GB HBM3")
        fla_tuned.point_at("another card")  # once per process
    assert os.environ["FLA_CONFIG_DIR"] == str(dest)
    got = json.loads((dest / "k.json").read_text())["autotune_entries"]
    assert got["a"]["config"]["num_warps"] == 2 and got["b"]["config"]["num_warps"] == 8
    assert "1 entries added" in caplog.text
    monkeypatch.setattr(fla_tuned, "_POINTED", [])
    monkeypatch.setenv("FLA_CONFIG_DIR", "/mine")
    fla_tuned.point_at("NVIDIA H100 80GB HBM3")
    assert os.environ["FLA_CONFIG_DIR"] == "/mine"
    monkeypatch.delenv("FLA_CONFIG_DIR")
    monkeypatch.setattr(fla_tuned, "_POINTED", [])
    caplog.clear()
    with caplog.at_level(logging.INFO):
        fla_tuned.point_at("GeForce GTX 1650")
    assert "FLA_CONFIG_DIR" not in os.environ and "none for GeForce GTX 1650" in caplog.text


def test_saved_fla_configs_are_what_flas_own_reader_installs(tmp_path, monkeypatch):
    """fla_tuned.save writes a tuned winner in fla's file layout; fla's CachedAutotuner reads it
    back for that exact key (strict) and installs it without timing anything, and not for
    another key. Needs fla-core and Triton (the GPU box); no kernel runs."""
    fla_cache = pytest.importorskip("fla.ops.utils.cache")
    import triton
    import triton.language as tl

    from dormouse.model import fla_tuned

    @fla_cache.fla_cache_autotune(
        configs=[triton.Config({"BK": b}, num_warps=w) for b in (16, 32) for w in (2, 4)],
        key=["K"],
    )
    @triton.jit
    def toy_kernel(x, K: tl.constexpr, BK: tl.constexpr):
        pass

    x = torch.zeros(4)
    toy_kernel.cache[(64, str(x.dtype))] = triton.Config({"BK": 32}, num_warps=4, num_stages=2)
    assert fla_tuned.save(tmp_path) == (1, 1)
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.STRICT)
    key = fla_cache.AutotuneKey.build(toy_kernel.arg_names, toy_kernel.keys, (x, 64), {})
    other = fla_cache.AutotuneKey.build(toy_kernel.arg_names, toy_kernel.keys, (x, 128), {})
    got = fla_cache.load_cached_config("toy_kernel", key)
    assert got["kwargs"] == {"BK": 32} and (got["num_warps"], got["num_stages"]) == (4, 2)
    assert fla_cache.load_cached_config("toy_kernel", other) is None
    toy_kernel.cache.clear()
    toy_kernel.maybe_load_cached_config(key=key, nargs={"x": x, "K": 64}, runtime_kwargs={})
    assert toy_kernel.cache[(64, "torch.float32")].kwargs == {"BK": 32}
