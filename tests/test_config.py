"""Config: presets, --set typing and suggestions, validation refusals, JSON round trip."""

import dataclasses

import pytest

from dormouse.config import (
    PRESET_PARAMS, ConfigError, ModelConfig, RunConfig, TrainConfig, apply_sets, preset,
    preset_names, validate,
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
    run = apply_sets(preset("tiny"), ["d_model=32", "lr=2e-4", "dist=true", "schedule=wsd",
                                       "model.rank=0", "train.steps=7", "engram_orders=2,3,4"])
    assert run.model.d_model == 32 and run.train.lr == 2e-4 and run.train.dist is True
    assert run.model.rank == 0 and run.train.steps == 7 and run.model.engram_orders == (2, 3, 4)
    assert run.train.schedule == "wsd"


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
    assert set(PRESET_PARAMS) == {"small", "medium", "b1"}
