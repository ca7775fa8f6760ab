"""Config: presets, --set typing and suggestions, validation refusals, JSON round trip."""

import dataclasses
import json

import pytest

from dormouse.config import (
    PRESET_PARAMS,
    ConfigError,
    ModelConfig,
    RunConfig,
    TrainConfig,
    apply_sets,
    preset,
    preset_names,
    validate,
)  # fmt: skip


@pytest.mark.parametrize("name", preset_names())
def test_presets_validate_and_round_trip(name):
    run = validate(preset(name))
    assert RunConfig.from_json(run.to_json()) == run
    changed = apply_sets(run, ["adam_betas=0.8,0.9", "data=a.bin,b.bin", "compile=yes"])
    back = RunConfig.from_json(changed.to_json())
    assert back == changed and back.train.data == ("a.bin", "b.bin")
    assert isinstance(back.train.adam_betas, tuple)


def test_set_types_each_field_kind():
    run = apply_sets(
        preset("tiny"),
        [
            "d_model=32",
            "lr=2e-4",
            "dist=true",
            "schedule=wsd",
            "model.rank=0",
            "train.steps=7",
            "engram_orders=2,3,4",
        ],
    )
    assert run.model.d_model == 32 and run.train.lr == 2e-4 and run.train.dist is True
    assert run.model.rank == 0 and run.train.steps == 7 and run.model.engram_orders == (2, 3, 4)
    assert run.train.schedule == "wsd"


def test_tuple_items_keep_their_inner_spaces():
    """Every space of a tuple value was dropped: `data=my file.txt` read `myfile.txt`."""
    run = apply_sets(preset("tiny"), ["data=my file.txt, b.bin", "adam_betas=( 0.8, 0.9 )"])
    assert run.train.data == ("my file.txt", "b.bin") and run.train.adam_betas == (0.8, 0.9)
    with pytest.raises(ConfigError, match="not a valid float"):
        apply_sets(preset("tiny"), ["adam_betas=0.8 5,0.9"])  # was 0.85


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match="did you mean 'd_model'"):
        apply_sets(preset("tiny"), ["d_modle=3"])
    with pytest.raises(ConfigError, match="unknown key"):
        apply_sets(preset("tiny"), ["model.steps=3"])  # steps lives in train


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="not a valid int"):
        apply_sets(preset("tiny"), ["d_model=abc"])
    with pytest.raises(ConfigError, match="expected one of"):
        apply_sets(preset("tiny"), ["dist=maybe"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_sets(preset("tiny"), ["d_model"])


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["segment_len=24"], "does not divide seq_len=64"),
        (["moe_topk=5"], "exceeds n_experts=4"),
        (["head_dim=8"], "n_heads\\*head_dim"),
        (["d_ffn=-1"], "must be positive"),
        (["rank=-2"], "must not be negative"),
        (["seq_len=128"], "exceeds the model's max_seq_len"),
        (["kda_impl=cuda"], "kda_impl='cuda' is not one of"),
        (["data=a,b", "data_weights=1"], "1 data_weights for 2 corpora"),
        (["vocab=300"], "byte-level"),
    ],
)
def test_validation_refuses_impossible(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(apply_sets(preset("tiny"), sets))


def test_unique_field_names():
    m = {f.name for f in dataclasses.fields(ModelConfig)}
    t = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not m & t


def test_unknown_json_field_refused():
    d = preset("tiny").to_dict()
    d["model"]["n_wings"] = 2
    with pytest.raises(ConfigError, match="n_wings"):
        RunConfig.from_dict(d)


def test_preset_param_targets_listed():
    assert set(PRESET_PARAMS) == {"cpu", "small", "medium", "b1", "gpt-small", "gpt-small-ne"}


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["lr=inf"], "lr=inf is not a finite number"),
        (["fit_gb=nan"], "fit_gb=nan is not a finite number"),
        (["adam_betas=0.9,nan"], "is not a finite number"),
        (["adam_eps=0"], "adam_eps=0.0 must be a finite number > 0"),
        (["muon_momentum=1"], "muon_momentum=1.0 must be in"),
        (["wsd_decay_frac=2"], "wsd_decay_frac=2.0 must be in"),
        (["seed=-1"], "must not be negative"),
        (["device=cuda:x"], "is not a device"),
        (["ckpt_name=a/b"], "not a plain file name"),
        (["ckpt_name=.."], "not a plain file name"),
        (["ckpt_name="], "not a plain file name"),
        (
            ["compile=true", "compile_mode=reduce-overhead", "global_batch=8"],
            "reduce-overhead with accumulation",
        ),
        (
            ["compile=true", "compile_backend=aot_eager", "compile_mode=reduce-overhead"],
            "has no modes",
        ),
        (["dist_capacity=4,2"], "no --dist"),
        (["d_model=16777216"], "beyond any model"),
        (["n_experts=4096", "d_ffn=16777215"], "beyond any card"),
        (["engram_orders=2,3,2"], "repeats an order"),
        (["n_layers=1000000"], "at least 1.15e\\+11 parameters"),  # was the build's OOM
    ],
)
def test_new_refusals(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(apply_sets(preset("tiny"), sets))


def test_fleet_only_fields_pass_on_a_fleet():
    validate(apply_sets(preset("tiny"), ["dist=true", "dist_capacity=4,2"]))
    for dev in ("auto", "cpu", "cuda", "cuda:3"):
        validate(apply_sets(preset("tiny"), [f"device={dev}"]))


def test_json_fields_of_the_wrong_type_are_refused():
    d = preset("tiny").to_dict()
    d["train"]["lr"] = "0.1"
    with pytest.raises(ConfigError, match="field lr: expected float"):
        RunConfig.from_dict(d)
    with pytest.raises(ConfigError, match="not valid JSON"):
        RunConfig.from_json("{")


def test_choices_come_from_the_literal_annotations():
    from dormouse.config import _CHOICES

    assert _CHOICES["kda_impl"] == ("auto", "torch", "fla")
    assert _CHOICES["dtype"] == ("auto", "fp32", "bf16", "fp16")  # one dtype knob, no "none"
    assert "bf16" not in {f.name for f in dataclasses.fields(ModelConfig)}
    with pytest.raises(ConfigError, match="dtype='none' is not one of"):
        validate(apply_sets(preset("tiny"), ["dtype=none"]))
    d = preset("tiny").to_dict()
    d["train"]["schedule"] = 3
    with pytest.raises(ConfigError, match="field schedule: expected str"):
        RunConfig.from_dict(d)


def test_presets_dtype():
    # tiny computes fp32 everywhere; the rest follow the device policy (fp32 on the CPU)
    assert preset("tiny").train.dtype == "fp32"
    assert {preset(n).train.dtype for n in ("small", "medium", "b1")} == {"auto"}


@pytest.mark.parametrize("bf16, dtype, want", [
    (True, "none", "auto"),
    (False, "none", "fp32"),
    (True, "bf16", "bf16"),  # an explicit dtype always won over the flag
    (False, "auto", "auto"),
    (True, None, "auto"),  # older still: no dtype field at all (it meant none)
])  # fmt: skip
def test_old_configs_with_the_bf16_flag_load(bf16, dtype, want, caplog):
    import logging

    d = preset("small").to_dict()
    d["model"]["bf16"] = bf16
    if dtype is None:
        del d["train"]["dtype"]
    else:
        d["train"]["dtype"] = dtype
    with caplog.at_level(logging.INFO, logger="dormouse.config"):
        run = validate(RunConfig.from_json(json.dumps(d)))
    assert run.train.dtype == want and run.model == preset("small").model
    assert any(f"-> dtype={want}" in r.getMessage() for r in caplog.records)  # said, not silent
