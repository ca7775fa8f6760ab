"""The references' own guarantees: the equation layer imports nothing of dormouse, the
every-expert MoE is the loop's rule, and every optimizer-facing config field reaches the
optimizer (a field dropped on the way, `--set engram_lr_mult` silently ignored, trains the
single process and its fleet alike: no fleet gate can see it).
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
REFS = ROOT / "references"
#: Layer 3 (DESIGN §5): the fleet's references run the trainer's own single-process code by
#: design (single.py runs train_run; gradref.py steps with MixOptimizer.from_config). No other
#: module of references/ may import dormouse.train.
FLEET_LAYER = {"single.py", "gradref.py"}
#: Layer 2: the equations. Not a name of dormouse may be imported, even transitively.
EQUATIONS = ["references.model", "references.step"]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_no_reference_but_the_fleet_layer_imports_dormouse_train():
    importers = {p.name for p in REFS.glob("*.py")
                 if any(m == "dormouse.train" or m.startswith("dormouse.train.")
                        for m in _imports(p))}  # fmt: skip
    assert importers <= FLEET_LAYER, f"references importing dormouse.train: {importers}"
    dormouse = {p.name for p in REFS.glob("*.py")
                if any(m.split(".")[0] == "dormouse" for m in _imports(p))}  # fmt: skip
    assert dormouse <= FLEET_LAYER, f"references importing dormouse at all: {dormouse}"


def test_the_equation_references_load_no_dormouse_module():
    """At run time, transitively: importing the equation layer loads not one dormouse module."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in EQUATIONS)
        + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dormouse'))"
    )
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    assert got.stdout.strip() == "[]", got.stdout


@pytest.mark.parametrize("with_drops", [False, True])
def test_every_expert_form_is_the_loops_rule(with_drops):
    from references.moe_dense import moe_all_experts, moe_dense, pick_experts

    gen = torch.Generator().manual_seed(3)

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    D, F, E, R, k = 8, 12, 5, 4, 2
    x, router = randn(11, D), randn(E, D)
    w1, w3, w2 = randn(E, D, F), randn(E, D, F), randn(E, F, D)
    shared = (randn(R, D), randn(R, D), randn(D, R))
    bias = randn(E) * 0.1
    drop, mask = set(), None
    if with_drops:
        _, picked, _ = pick_experts(x, router, k, bias)
        drop = {(t, int(picked[t, 1])) for t in range(0, 11, 3)}
        mask = torch.zeros(11, E, dtype=torch.bool)
        for t, e in drop:
            mask[t, e] = True
    want = moe_dense(x, router, w1, w3, w2, shared=shared, bias=bias, topk=k, drop=drop)
    got = moe_all_experts(x, router, w1, w3, w2, shared=shared, bias=bias, topk=k,
                          dropped=mask)  # fmt: skip
    assert (got - want).abs().max() < 1e-12


# ---- every optimizer-facing config field reaches the optimizer ---------------------------------


def _groups(opt, kind: str) -> list[dict]:
    return [g for g in opt.param_groups if g["kind"] == kind]


def _state(opt, kind: str) -> dict:
    p = _groups(opt, kind)[0]["params"][0]
    return opt.state[p]


def _nondefault(default, values):
    return st.sampled_from([v for v in values if v != default])


def _floats(default, lo, hi):
    return st.floats(lo, hi, allow_nan=False).filter(lambda v: v != default)


#: field -> (strategy of non-default values, did the value reach the optimizer?). The
#: strategies are built against TrainConfig's defaults.
def _fields():
    from dormouse.config import TrainConfig

    d = TrainConfig()
    mix = ("muon",)
    return {
        "lr": (
            _floats(d.lr, 1e-5, 0.1),
            lambda o, t, v: all(
                g["base_lr"] == (v * t.engram_lr_mult if g["kind"] == "engram" else v)
                for g in o.param_groups
            ),
        ),
        "wd": (
            _floats(d.wd, 0.0, 1.0),
            lambda o, t, v: all(
                g["weight_decay"] == v for k in ("muon", "adamw") for g in _groups(o, k)
            ),
        ),
        "opt": (
            _nondefault(d.opt, ["mix", "adamw"]),
            lambda o, t, v: bool(_groups(o, "muon")) == (v == "mix"),
        ),
        "ns_steps": (
            st.integers(1, 9).filter(lambda v: v != d.ns_steps),
            lambda o, t, v: all(g["ns_steps"] == v for g in _groups(o, "muon")),
        ),
        "ns_kind": (
            _nondefault(d.ns_kind, ["quintic", "polar_express"]),
            lambda o, t, v: all(g["ns_kind"] == v for g in _groups(o, "muon")),
        ),
        "ns_dtype": (
            _nondefault(d.ns_dtype, ["fp32", "bf16"]),
            lambda o, t, v: all(g["ns_dtype"] == v for g in _groups(o, "muon")),
        ),
        "muon_state_dtype": (
            _nondefault(d.muon_state_dtype, ["fp32", "bf16", "int8"]),
            lambda o, t, v: (
                "momentum_q" in _state(o, "muon")
                if v == "int8"
                else _state(o, "muon")["momentum_buffer"].dtype
                == {"fp32": torch.float32, "bf16": torch.bfloat16}[v]
            ),
        ),
        "engram_state_dtype": (
            _nondefault(d.engram_state_dtype, ["fp32", "bf16", "int8"]),
            lambda o, t, v: (
                "exp_avg_q" in _state(o, "engram")
                if v == "int8"
                else _state(o, "engram")["exp_avg"].dtype
                == {"fp32": torch.float32, "bf16": torch.bfloat16}[v]
            ),
        ),
        "muon_variant": (
            _nondefault(d.muon_variant, ["nesterov", "plain"]),
            lambda o, t, v: all(g["nesterov"] == (v == "nesterov") for g in _groups(o, "muon")),
        ),
        "muon_sf": (
            _nondefault(d.muon_sf, ["rms", "jordan"]),
            lambda o, t, v: all(g["muon_sf"] == v for g in _groups(o, "muon")),
        ),
        "muon_momentum": (
            _floats(d.muon_momentum, 0.0, 0.999),
            lambda o, t, v: all(g["momentum"] == v for g in _groups(o, "muon")),
        ),
        "adam_betas": (
            st.tuples(_floats(d.adam_betas[0], 0.0, 0.999), _floats(d.adam_betas[1], 0.0, 0.999)),
            lambda o, t, v: all(
                tuple(g["betas"]) == tuple(v)
                for k in ("adamw", "adamw_nodecay", "engram")
                for g in _groups(o, k)
            ),
        ),
        "adam_eps": (
            _floats(d.adam_eps, 1e-12, 1e-3),
            lambda o, t, v: all(
                g["eps"] == v for k in ("adamw", "adamw_nodecay", "engram") for g in _groups(o, k)
            ),
        ),
        "engram_lr_mult": (
            _floats(d.engram_lr_mult, 0.0, 50.0),
            lambda o, t, v: _groups(o, "engram")[0]["base_lr"] == t.lr * v,
        ),
    }, mix


#: Fields from_config reads that leave no trace in a CPU optimizer, each held elsewhere:
#: optim_8bit is refused loudly here (bitsandbytes steps CUDA tensors only: its own test
#: below); compile and compile_mode capture the step in a CUDA graph (tests/test_optim.py's
#: capture tests, the reduce-overhead gates on a GPU).


class _Reads:
    """A TrainConfig that records which fields are read."""

    def __init__(self, cfg):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._cfg, name)


@pytest.fixture(scope="module")
def tiny_model():
    from dormouse.config import preset
    from dormouse.model import DormouseModel

    torch.manual_seed(0)
    return DormouseModel(preset("tiny").model)


def test_from_config_reads_exactly_the_fields_this_test_checks(tiny_model):
    """from_config hands the optimizer its part of the config (`train.optim`) and reads the
    compile knobs itself; every field of that part but optim_8bit (refused on the CPU, below)
    has a check here that it reaches the optimizer."""
    from dormouse.config import Optim, TrainConfig
    from dormouse.train.optim.mix import MixOptimizer

    fields, _ = _fields()
    cfg = _Reads(TrainConfig(compile=True))  # compile_mode is read only then
    MixOptimizer.from_config(tiny_model, cfg, "cpu")
    assert cfg.read == {"optim", "compile", "compile_mode"}, cfg.read
    part = {f.name for f in dataclasses.fields(Optim)}
    assert part - {"optim_8bit"} == set(fields), (
        f"no check here holds {sorted(part - set(fields) - {'optim_8bit'})}; "
        f"{sorted(set(fields) - part)} are not the optimizer's"
    )


# no shrinking: the failure names the field and its value already (shrinking one took 150 s)
@settings(
    max_examples=12,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_every_optimizer_field_reaches_the_optimizer(tiny_model, data):
    from dormouse.config import TrainConfig
    from dormouse.train.optim.mix import MixOptimizer

    fields, _ = _fields()
    for name, (values, reached) in fields.items():
        v = data.draw(values, label=name)
        t = dataclasses.replace(TrainConfig(), **{name: v})
        opt = MixOptimizer.from_config(tiny_model, t, "cpu")
        assert reached(opt, t, v), f"{name}={v!r} did not reach the optimizer"


def test_optim_8bit_reaches_the_optimizer_as_a_loud_refusal_on_the_cpu(tiny_model):
    from dormouse.config import ConfigError, TrainConfig
    from dormouse.train.optim.mix import MixOptimizer

    with pytest.raises(ConfigError, match="optim_8bit"):
        MixOptimizer.from_config(tiny_model, TrainConfig(optim_8bit=True), "cpu")
