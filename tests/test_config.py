"""Config: presets, --set typing and suggestions, validation refusals, JSON round trip."""

import dataclasses
import json
import re
from pathlib import Path

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
    from dormouse.config import CHOICES

    assert CHOICES["kda_impl"] == ("auto", "torch", "fla")
    assert CHOICES["dtype"] == ("auto", "fp32", "bf16", "fp16")  # one dtype knob, no "none"
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


# ---- the parts of TrainConfig ----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_every_training_field_is_in_one_part():
    from dormouse.config import PARTS

    named = [f.name for cls in PARTS.values() for f in dataclasses.fields(cls)]
    assert sorted(named) == sorted(f.name for f in dataclasses.fields(TrainConfig))
    assert len(set(named)) == len(named)
    run = apply_sets(preset("tiny"), ["lr=0.25", "eval_every=7"])
    assert run.train.optim.lr == 0.25 and run.train.metrics.eval_every == 7


@pytest.mark.parametrize(
    "sets",
    [["optim.lr=0.25"], ["train.optim.lr=0.25"], ["train.lr=0.25"], ["lr=0.25"]],
)
def test_set_takes_a_part_name_or_the_flat_key(sets):
    assert apply_sets(preset("tiny"), sets).train.lr == 0.25


@pytest.mark.parametrize(
    "key, needle",
    [("lr_schedule.lr", "it is optim.lr"), ("wings.lr", "prefix must be"),
     ("optim.d_model", "it is model.d_model"), ("model.lr", "unknown key")],
)  # fmt: skip
def test_set_refuses_a_part_that_does_not_own_the_key(key, needle):
    with pytest.raises(ConfigError, match=needle):
        apply_sets(preset("tiny"), [f"{key}=1"])


@pytest.mark.parametrize("name", ["tiny-flat.json", "small-sets-flat.json"])
def test_a_config_json_written_before_the_parts_still_loads(name):
    """tests/configs/: config.json files the flat TrainConfig wrote (tiny-flat: `dormouse train
    tiny`'s own; small-sets-flat: `small` with 18 --set). They load, validate, and write the
    same JSON back."""
    text = (ROOT / "tests" / "configs" / name).read_text()
    run = validate(RunConfig.from_json(text))
    assert json.loads(run.to_json()) == json.loads(text)


def test_a_config_json_may_group_the_training_fields_by_part():
    d = preset("tiny").to_dict()
    d["train"]["optim"] = {"lr": 0.25, "opt": "adamw"}
    del d["train"]["lr"], d["train"]["opt"]
    run = RunConfig.from_dict(d)
    assert (run.train.lr, run.train.opt) == (0.25, "adamw")
    d["train"]["optim"]["wings"] = 1
    with pytest.raises(ConfigError, match="train.optim has no field"):
        RunConfig.from_dict(d)


def _documented_sets() -> list[tuple[str, str]]:
    """Every `--set key=value` in the README and docs/*.md."""
    found = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for key, value in re.findall(
            r"--set ([a-z_][a-z_0-9.]*)=([^\s`\"')\];,]*)", doc.read_text()
        ):
            found.add((key, value))
    return sorted(found)


def test_the_documented_set_keys_are_found():
    keys = {k for k, _ in _documented_sets()}
    assert {"lr", "tensorboard", "global_batch", "verdict", "compile"} <= keys, keys


@pytest.mark.parametrize("key, value", _documented_sets())
def test_every_documented_set_still_works(key, value):
    """The keys the docs show keep working, flat or by part: each is applied with the value
    shown (or, where the docs show a placeholder such as N or X, the field's own default)."""
    if key == "key":
        return  # the usage line's `--set key=value`
    run, bare = preset("tiny"), key.rpartition(".")[2]
    fields = {**run.to_dict()["model"], **run.to_dict()["train"]}
    try:
        out = apply_sets(run, [f"{key}={value}"])
    except ConfigError as e:
        assert "unknown key" not in str(e) and "prefix" not in str(e), e
        default = fields[bare]
        text = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else str(default)
        out = apply_sets(run, [f"{key}={text}"])
    assert bare in fields and out.to_dict()["source"] == run.source
