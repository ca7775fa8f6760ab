"""compile=true on one process: torch.compile of the model trains the eager trajectory.

The GPU half (fla's kernels inside the compiled graph and its CUDA graphs) is in test_kda.py
(`test_kda_op_equals_fla_autograd`, `test_kda_compiled_matches_eager`); the speed is a
benchmark (`dormouse bench step small --set compile=true ...`, docs/performance.md)."""

from __future__ import annotations

import pytest
import torch

from dormouse.config import ConfigError, RunConfig, apply_sets, preset, validate
from dormouse.train.run import train_run
from dormouse.train.step import Callbacks


def _losses(tmp_path, name, sets, graphs=None):
    """The 6 logged losses and the checkpoint; `graphs` (a list) gets dynamo's count of
    compiled graphs after each step."""
    from torch._dynamo.utils import counters

    run = apply_sets(preset("tiny"), ["steps=6", "grad_clip=0", "eval_every=0", "ckpt_every=0",
                                      f"out_dir={tmp_path / name}", *sets])  # fmt: skip
    got = []

    def on_log(d):
        got.append(float(d["loss"]))
        if graphs is not None:
            graphs.append(counters["stats"]["unique_graphs"])

    train_run(run, callbacks=Callbacks(on_log=on_log))
    state = torch.load(tmp_path / name / "ckpt.pt", weights_only=True)
    return got, state


def test_compiled_chooses_the_kernel_arms_before_the_first_trace():
    """A trace that chose the KDA arm itself (set `_impl` on the first forward) guarded on
    `_impl is None`, and step 2 recompiled."""
    from dormouse.model.kda import KDAMixer
    from dormouse.train.run import build_model, compiled
    from dormouse.train.step import Wrapped

    run = apply_sets(preset("tiny"), ["compile=true", "compile_backend=aot_eager"])
    model = build_model(run)
    mixers = [m for m in model.modules() if isinstance(m, KDAMixer)]
    assert mixers and all(m.impl is None for m in mixers)
    w = compiled(Wrapped(model), run, torch.device("cpu"), None)
    assert all(m.impl == "torch" for m in mixers)
    assert w.net is not model and not w.graphs  # compiled; no CUDA graphs on the CPU


# slow: inductor compiles tiny's regions on the 2-core CPU in ~25 s
@pytest.mark.slow
def test_compiled_training_follows_the_eager_trajectory(tmp_path, caplog):
    caplog.set_level("INFO")
    eager, s0 = _losses(tmp_path, "eager", [])
    graphs = []
    compiled, s1 = _losses(tmp_path, "compiled", ["compile=true"], graphs)
    # every graph is compiled by the first step: a later step that compiles again is a guard
    # the first trace broke (the lazily chosen KDA arm was one: a graph more at step 2)
    assert graphs[0] > 0 and graphs == graphs[:1] * 6, graphs
    assert any("compile=true: torch.compile(model, mode=default" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # fp32 round-off of inductor's fused kernels against eager's (measured: 4.8e-7 over 8
    # steps); a wrong graph (a dropped op, a stale constant) moves the loss by > 1e-3
    assert len(compiled) == len(eager) == 6
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= 5e-6
    # the checkpoint holds the model's own names, not the compiled wrapper's (_orig_mod.)
    assert s0["model"].keys() == s1["model"].keys()


def test_compile_auto_resolves_by_device_and_shape(monkeypatch, caplog):
    """compile=auto (the default): compiled on CUDA sm_70+, in reduce-overhead only where the
    step's shapes are static on one process; never on the CPU or an older card. Logged."""
    from dormouse.train.run import resolve_compile

    def resolved(sm, sets=(), world=1, device="cuda"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: sm)
        t = resolve_compile(apply_sets(preset("small"), list(sets)), torch.device(device),
                            world).train  # fmt: skip
        return t.compile, t.compile_mode

    assert preset("small").train.compile == "auto"
    with caplog.at_level("INFO"):
        assert resolved((9, 0)) == (True, "reduce-overhead")
    said = [r.getMessage() for r in caplog.records]
    assert any("compile=auto: cuda sm_90 -> compile=true" in m for m in said)
    assert any("compile_mode=auto: one process on CUDA" in m and "0.0229 TFLOP a step" in m
               for m in said)  # fmt: skip
    assert resolved((6, 1)) == (False, "default")  # a GTX 10x0: no inductor Triton
    assert resolved(None, device="cpu") == (False, "default")
    assert resolved((8, 6), ["global_batch=64"]) == (True, "default")  # accumulation
    assert resolved((8, 6), ["engram_ram=true"]) == (True, "default")
    assert resolved((8, 6), world=2) == (True, "default")  # a fleet: gate g31's mode
    assert resolved((9, 0), ["batch=32", "seq_len=512"]) == (True, "reduce-overhead")
    assert resolved((9, 0), ["batch=1024", "seq_len=512"]) == (True, "default")  # 15.7 TFLOP
    # what the user pinned stays pinned
    assert resolved((9, 0), ["compile=false"]) == (False, "default")
    assert resolved(None, ["compile=true"], device="cpu") == (True, "default")
    assert resolved((9, 0), ["compile_mode=max-autotune-no-cudagraphs"]) == (
        True,
        "max-autotune-no-cudagraphs",
    )


def test_compile_reads_words_and_bools():
    run = apply_sets(preset("tiny"), ["compile=false"])
    assert run.train.compile is False
    assert apply_sets(run, ["compile=auto"]).train.compile == "auto"
    assert RunConfig.from_json(run.to_json()).train.compile is False
    with pytest.raises(ConfigError, match="compile='maybe' is not one of"):
        validate(apply_sets(run, ["compile=maybe"]))
