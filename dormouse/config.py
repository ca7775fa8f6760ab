"""Run configuration: ModelConfig and RunConfig, the presets, `--set`, validation, JSON.

Owns every knob of a run (TrainConfig and its eight parts are train_config.py's). One parser
(`apply_sets`) turns `key=value` strings into typed field values; one validator (`validate`)
refuses impossible combinations with the cause, the measured fact and the escape. Nothing here
imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from .errors import ConfigError

# TrainConfig's parts and checks are config's names too (`from dormouse.config import Optim`)
from .train_config import (  # noqa: F401
    PARTS,
    Checkpoint,
    Compile,
    Corpus,
    Dtype,
    Fleet,
    Metrics,
    Optim,
    Part,
    Schedule,
    TrainConfig,
    Training,
    check_device,
    check_file_name,
)

log = logging.getLogger(__name__)

KdaImpl = Literal["auto", "torch", "fla"]
MoeImpl = Literal["auto", "grouped", "batched", "dense", "triton"]


#: `dropout=auto`, as stored in a config: resolved to a probability before the model is built.
DROPOUT_AUTO = -1.0


@dataclass(frozen=True)
class ModelConfig(Part):
    """The network's shape. Field names are unique across ModelConfig and TrainConfig."""

    # "dormouse" (Engram + looped KDA/MoE body) or "gpt": the plain causal transformer
    # baseline (model/gpt.py), which reads d_model, n_layers, n_heads, head_dim, d_ffn,
    # max_seq_len, init_std and dropout and ignores the rest
    arch: Literal["dormouse", "gpt"] = "dormouse"
    vocab: int = 256
    d_model: int = 256
    n_layers: int = 2  # distinct blocks in the body
    max_iter: int = 2  # times the body is applied
    rank: int = 8  # per-iteration low-rank delta on the mixer's projections (0 = pure tying)
    # KDA mixer
    n_heads: int = 4
    head_dim: int = 64
    conv_size: int = 4
    gate_rank: int = 16  # low-rank f(x) that feeds the per-key-dim decay
    kda_impl: KdaImpl = "auto"
    kda_chunk: int = 16  # chunk length of the torch arm
    segment_len: int = 0  # 0 = whole window; else carry state, cut gradient at borders
    # softmax attention in place of KDA (model/attn.py): 0 = every block mixes by KDA; N >= 1 =
    # every N-th block (blocks N-1, 2N-1, ...) by causal attention with RoPE; 1 = all of them
    attn_every: int = 0
    # MoE FFN
    d_ffn: int = 512
    n_experts: int = 4
    moe_topk: int = 2
    moe_capacity: float = 0.0  # 0 = dropless; > 0 = capacity factor
    moe_lb_coef: float = 0.0  # LFB update rate; 0 = controller off
    moe_impl: MoeImpl = "auto"
    shared_rank: int = 16
    # Engram
    engram_rows: int = 1024
    engram_dim: int = 16
    engram_heads: int = 2
    engram_orders: tuple[int, ...] = (2, 3)
    # memory mechanisms (exact ones leave the math unchanged)
    engram_ram: bool = False
    moe_offload: bool = False
    act_ckpt: bool = False
    act_ckpt_quant: bool = False  # quantize checkpointed inputs to bf16 (approximate)
    # the rest
    max_seq_len: int = 512
    init_std: float = 0.02
    # regularisation: dropout on the embedding and on every residual branch's output (GPT-2's
    # places), masks keyed by (seed, step, global row) so a fleet draws what one process draws.
    # DROPOUT_AUTO (`--set dropout=auto`, the presets' default): chosen from how many times the
    # run reads its train split (train/run.py resolve_dropout; measured in docs/learning.md)
    dropout: float = 0.0

    @property
    def d_attn(self) -> int:
        return self.n_heads * self.head_dim

    def mixer_of(self, layer: int) -> Literal["kda", "attn"]:
        """The mixer of body block `layer` (0-based): "attn" for every attn_every-th block."""
        return "attn" if self.attn_every and (layer + 1) % self.attn_every == 0 else "kda"

    POSITIVE = (
        "vocab",
        "d_model",
        "n_layers",
        "max_iter",
        "n_heads",
        "head_dim",
        "conv_size",
        "kda_chunk",
        "d_ffn",
        "n_experts",
        "moe_topk",
        "engram_rows",
        "engram_dim",
        "engram_heads",
        "max_seq_len",
    )
    NON_NEGATIVE = (
        "rank",
        "gate_rank",
        "segment_len",
        "attn_every",
        "shared_rank",
        "moe_capacity",
        "moe_lb_coef",
        "init_std",
    )

    def out_of_range(self, name: str, v: int) -> str | None:
        if v < _SHAPE_MAX:
            return None
        return (
            f"{name}={v} is beyond any model dormouse builds (limit {_SHAPE_MAX - 1}); "
            f"lower --set {name}"
        )

    def check(self) -> None:
        self.check_fields()
        m = self
        if m.dropout != DROPOUT_AUTO and not 0 <= m.dropout < 1:
            raise ConfigError(
                f"dropout={m.dropout} must be in [0, 1) (0.1 drops one value in ten), "
                f"or auto (chosen from the passes over the data)"
            )
        if m.vocab != 256:
            raise ConfigError(f"vocab={m.vocab}: dormouse is byte-level, vocab must be 256")
        if m.moe_topk > m.n_experts:
            raise ConfigError(
                f"moe_topk={m.moe_topk} exceeds n_experts={m.n_experts}: a token cannot pick more "
                f"experts than exist; lower --set moe_topk or raise --set n_experts"
            )
        if m.n_heads * m.head_dim != m.d_model:
            raise ConfigError(
                f"n_heads*head_dim = {m.n_heads}*{m.head_dim} = {m.n_heads * m.head_dim} but "
                f"d_model={m.d_model}; the mixer's heads must tile the model width: set head_dim="
                f"{m.d_model // m.n_heads if m.d_model % m.n_heads == 0 else '?'} or change n_heads"
            )
        if not m.engram_orders or any(n < 2 for n in m.engram_orders):
            raise ConfigError(f"engram_orders={m.engram_orders}: each order must be >= 2 bytes")
        if len(set(m.engram_orders)) != len(m.engram_orders):
            # an order's tables hash by (order, head) alone: a repeat reads the very same rows
            raise ConfigError(
                f"engram_orders={m.engram_orders} repeats an order: its tables would hash every "
                f"n-gram to the same rows as the first's (memory for nothing); for more tables of "
                f"one order raise --set engram_heads"
            )
        if m.attn_every and m.arch == "dormouse":
            if m.attn_every > m.n_layers:
                raise ConfigError(
                    f"attn_every={m.attn_every} exceeds n_layers={m.n_layers}: no block would mix "
                    f"by attention; pick 1..{m.n_layers} or attn_every=0 (KDA everywhere)"
                )
            if m.segment_len:
                raise ConfigError(
                    f"attn_every={m.attn_every} with segment_len={m.segment_len}: attention carries "
                    f"no state across segments; set segment_len=0 or attn_every=0"
                )
            if m.head_dim % 2:
                raise ConfigError(
                    f"attn_every={m.attn_every} with head_dim={m.head_dim}: rotary positions turn "
                    f"channel pairs, so head_dim must be even"
                )
        biggest = max(
            m.n_experts * m.d_model * m.d_ffn,
            m.engram_rows * m.engram_dim,
            m.d_model * m.d_attn,
            m.d_model * m.vocab,
        )
        if biggest > _TENSOR_MAX:
            raise ConfigError(
                f"one weight of this model would hold {biggest:.3g} elements (n_experts*d_model*"
                f"d_ffn = {m.n_experts}*{m.d_model}*{m.d_ffn}, engram_rows*engram_dim = "
                f"{m.engram_rows}*{m.engram_dim}): more than {_TENSOR_MAX:.3g}, beyond any card; "
                f"lower the sizes"
            )
        # a lower bound of the parameters: the experts (the MLP) and the mixers' projections of
        # every layer, the Engram tables, the embedding (count_params: tiny 133,120 of 170,000)
        ffn = 3 * m.n_experts if m.arch == "dormouse" else 2  # SwiGLU experts, or the GPT's MLP
        least = (
            m.n_layers * (ffn * m.d_model * m.d_ffn + 4 * m.d_model * m.d_attn)
            + (m.arch == "dormouse")
            * len(m.engram_orders)
            * m.engram_heads
            * m.engram_rows
            * m.engram_dim
            + m.vocab * m.d_model
        )
        if least > _MODEL_MAX:
            raise ConfigError(
                f"this model would have at least {least:.3g} parameters (n_layers={m.n_layers} of "
                f"d_model={m.d_model}, d_ffn={m.d_ffn}), more than "
                f"{_MODEL_MAX:.3g}: beyond any machine dormouse trains on; lower the sizes"
            )


@dataclass(frozen=True)
class RunConfig:
    source: str
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    # ---- JSON ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "model": dataclasses.asdict(self.model),
            "train": dataclasses.asdict(self.train),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        if not isinstance(d, dict) or not isinstance(d.get("source"), str):
            raise ConfigError(
                f"a run config must be a JSON object with a 'source' string, got "
                f"{type(d).__name__}{'' if not isinstance(d, dict) else ' without one'}"
            )
        for part in ("model", "train"):
            if not isinstance(d.get(part, {}), dict):
                raise ConfigError(
                    f"the run config's {part!r} must be a JSON object, got {type(d[part]).__name__}"
                )
        model, train = dict(d.get("model", {})), _flat_train(dict(d.get("train", {})))
        _one_dtype(model, train)
        return cls(str(d["source"]), _build(ModelConfig, model), _build(TrainConfig, train))

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            d = loads(text)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"the run config is not valid JSON ({e})") from None
        return cls.from_dict(d)


def _flat_train(train: dict[str, Any]) -> dict[str, Any]:
    """A config's train object, flat: a part written as an object (`"optim": {"lr": ..}`,
    what `--set optim.lr=` names) gives its fields; config.json as dormouse writes it is flat."""
    out = {}
    for k, v in train.items():
        if k in PARTS and isinstance(v, dict):
            known = {f.name for f in fields(PARTS[k])}
            if set(v) - known:
                raise ConfigError(
                    f"the run config's train.{k} has no field(s) "
                    f"{sorted(set(v) - known)}; this file was written by another "
                    f"version of dormouse"
                )
            out.update(v)
        else:
            out[k] = v
    return out


#: How deep a JSON file dormouse reads may nest: ours nest 3 deep (a config's model, a tuple
#: field); Python's parser recursed into a RecursionError at ~1,000 (100,000 was a traceback).
JSON_DEPTH = 32
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_NEST = re.compile(r"[\[\]{}]")


class DeepJSON(ValueError):
    """JSON nested deeper than JSON_DEPTH: refused before the parser recurses."""


def loads(text: str | bytes):
    """json.loads with a depth bound (DeepJSON beyond JSON_DEPTH): every JSON file dormouse
    reads (config.json, a checkpoint's config, metrics rows) comes from a folder a user or an
    attacker may have written."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    depth = deepest = 0
    for m in _JSON_NEST.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m[0] in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > JSON_DEPTH:
                raise DeepJSON(f"JSON nested deeper than {JSON_DEPTH} levels")
    return json.loads(text)


def check_path(flag: str, path) -> None:
    """Refuse a path the system cannot name (ENAMETOOLONG was a traceback): a part longer than
    the filesystem's NAME_MAX (255 bytes on Linux), or the whole longer than PATH_MAX."""
    raw = os.fsencode(path)
    longest = max(raw.split(b"/"), key=len, default=b"")
    try:
        name_max = os.pathconf(".", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(longest) > name_max:
        raise ConfigError(
            f"{flag}: a name in it is {len(longest)} bytes ({os.fsdecode(longest[:24])}...), "
            f"longer than this filesystem allows ({name_max}); use a shorter name"
        )
    if len(raw) >= 4096:
        raise ConfigError(
            f"{flag}: the path is {len(raw)} bytes, longer than the system allows "
            f"(4095); use a shorter one"
        )


def _one_dtype(model: dict[str, Any], train: dict[str, Any]) -> None:
    """An older config's ModelConfig.bf16 and dtype=none (the flag decides) -> one dtype."""
    if "bf16" not in model and train.get("dtype") != "none":
        return
    bf16, old = model.pop("bf16", False), train.get("dtype", "none")
    train["dtype"] = ("auto" if bf16 is True else "fp32") if old == "none" else old
    log.info(
        "run config of an older dormouse: bf16=%s dtype=%s -> dtype=%s", bf16, old, train["dtype"]
    )


def _build(cls, d: dict[str, Any]):
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(
            f"{cls.__name__} has no field(s) {unknown}; "
            f"this file was written by another version of dormouse"
        )
    hints = typing.get_type_hints(cls)
    kw = {k: _coerce_json(hints[k], v, k) for k, v in d.items()}
    return cls(**kw)


def _coerce_json(tp, v, key: str = "?"):
    """A JSON value as the field's declared type; ConfigError when it is another kind."""
    if typing.get_origin(tp) is Literal:  # validate() checks the value itself
        if isinstance(v, bool) and v in typing.get_args(tp):
            return v  # compile: true|false in a config.json (and "auto")
        tp = str
    if typing.get_origin(tp) is tuple:
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"field {key}: expected a list, got {type(v).__name__} {v!r}")
        (inner, *_rest) = typing.get_args(tp)
        return tuple(_coerce_json(inner, x, key) for x in v)
    ok = {
        bool: lambda x: isinstance(x, bool),
        int: lambda x: isinstance(x, int) and not isinstance(x, bool),
        float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
        str: lambda x: isinstance(x, str),
    }.get(tp)
    if ok is not None and not ok(v):
        raise ConfigError(f"field {key}: expected {_tname(tp)}, got {type(v).__name__} {v!r}")
    return float(v) if tp is float else v


# ---- presets ---------------------------------------------------------------

_TINY = ModelConfig(
    d_model=64, n_heads=4, head_dim=16, d_ffn=128, n_layers=1, max_iter=2, rank=8,
    n_experts=4, moe_topk=2, engram_rows=64, engram_dim=8, engram_heads=2,
    shared_rank=16, gate_rank=8, max_seq_len=64,
)  # fmt: skip

_SMALL = ModelConfig(
    d_model=256, n_heads=4, head_dim=64, d_ffn=128, n_layers=4, max_iter=2, rank=16,
    n_experts=8, moe_topk=2, engram_rows=16384, engram_dim=32, engram_heads=4,
    shared_rank=64, gate_rank=32, max_seq_len=512,
    dropout=DROPOUT_AUTO,
)  # fmt: skip

#: The main job's shape (README): what a 2-core CPU learns most from in a few minutes. The CPU
#: is compute-bound at ~500 tokens/s for `small` whatever the batch, so this model is narrower
#: and shallower (1.1M parameters outside its Engram tables, whose row-sparse lookups are cheap)
#: and reads ~10x the bytes a second. max_iter 1: at equal CPU time 800 steps of two blocks once
#: reached val bpb 2.057, one block twice 2.085, two blocks twice (600 steps) 2.183. attn_every
#: 1: softmax attention in both blocks steps in 220 ms where the torch KDA arm took 453 (one
#: attention block of two: 330), so in the same time it reads twice the bytes: 2,000 steps
#: reached 1.834, the hybrid's 1,300 1.886, KDA's 800 2.057 (docs/learning.md). kda_chunk 8
#: (with attn_every=0): the torch arm ran 1.7x faster than at 16 here (853 vs 1,532 ms a step).
_CPU = ModelConfig(
    d_model=128, n_heads=4, head_dim=32, d_ffn=256, n_layers=2, max_iter=1, rank=8,
    n_experts=4, moe_topk=2, engram_rows=16384, engram_dim=32, engram_heads=4,
    shared_rank=32, gate_rank=16, kda_chunk=8, max_seq_len=128, attn_every=1,
    dropout=DROPOUT_AUTO,
)  # fmt: skip

_MEDIUM = ModelConfig(
    d_model=768, n_heads=12, head_dim=64, d_ffn=768, n_layers=6, max_iter=2, rank=32,
    n_experts=8, moe_topk=2, engram_rows=65536, engram_dim=64, engram_heads=4,
    shared_rank=128, gate_rank=64, max_seq_len=1024,
    dropout=DROPOUT_AUTO,
)  # fmt: skip

_B1 = ModelConfig(
    d_model=1536, n_heads=12, head_dim=128, d_ffn=1920, n_layers=8, max_iter=2, rank=64,
    n_experts=8, moe_topk=2, engram_rows=393216, engram_dim=128, engram_heads=4,
    shared_rank=256, gate_rank=128, max_seq_len=2048,
    dropout=DROPOUT_AUTO,
)  # fmt: skip

#: The plain-GPT baselines (model/gpt.py) for `small`: the same total parameters (9.15M vs
#: 9.34M), and the same parameters outside the Engram tables (4.92M vs 5.14M). Dropout 0.2:
#: the setting the well-known character-level GPT recipes use at this size and data scale.
_GPT_SMALL = ModelConfig(arch="gpt", d_model=384, n_heads=6, head_dim=64, d_ffn=1536,
                         n_layers=5, max_seq_len=512, dropout=0.2)  # fmt: skip
_GPT_SMALL_NE = ModelConfig(arch="gpt", d_model=256, n_heads=4, head_dim=64, d_ffn=1024,
                            n_layers=6, max_seq_len=512, dropout=0.2)  # fmt: skip

_PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {
    # tiny computes fp32 everywhere; the others take the device policy's dtype (auto).
    "tiny": (_TINY, TrainConfig(batch=4, seq_len=64, steps=20, lr=1e-3, warmup=0,
                                log_every=1, eval_every=0, ckpt_every=0, dtype="fp32")),
    # `small` was the main job once (300 steps inside 10 minutes on a 2-core CPU),
    # where Muon's polar is compute-bound: narrow experts (d_ffn 128) cut it ~4x, and the
    # parameters they gave up sit in Engram rows (row-sparse Adam, no polar). 8 x 128 with
    # d_ffn 256 measured 2.0-2.4 s a step there (11.9 min); 6 x 128 with d_ffn 128 ~1.5 s.
    # On a GPU raise the batch, e.g. --set batch=32 --set seq_len=512.
    "small": (_SMALL, TrainConfig(batch=6, seq_len=128, steps=300, lr=3e-3, warmup=30,
                                  eval_every=50)),
    # The README's main job: train + sample within 10 minutes on a 2-core CPU (docs/learning.md
    # has its measured wall time, val bpb and sample).
    "cpu": (_CPU, TrainConfig(batch=16, seq_len=128, steps=1600, lr=8e-3, warmup=30,
                              eval_every=200)),
    "medium": (_MEDIUM, TrainConfig(batch=8, seq_len=512, steps=5000, lr=2e-3, warmup=200,
                                    eval_every=250)),
    "b1": (_B1, TrainConfig(batch=8, seq_len=512, steps=20000, lr=1e-3, warmup=500,
                            eval_every=500)),
    # the baselines train exactly as `small` does (same data path, schedule and optimizer)
    "gpt-small": (_GPT_SMALL, TrainConfig(batch=6, seq_len=128, steps=300, lr=3e-3, warmup=30,
                                          eval_every=50)),
    "gpt-small-ne": (_GPT_SMALL_NE, TrainConfig(batch=6, seq_len=128, steps=300, lr=3e-3,
                                                warmup=30, eval_every=50)),
}  # fmt: skip

#: What DESIGN.md §2 promises (parameters including Engram tables); tested at +-10%.
PRESET_PARAMS = {
    "cpu": 5.3e6,
    "small": 9.5e6,
    "medium": 140e6,
    "b1": 1.07e9,
    "gpt-small": 9.5e6,
    "gpt-small-ne": 5.1e6,
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def preset(name: str) -> RunConfig:
    if name not in _PRESETS:
        raise ConfigError(
            f"unknown preset {name!r}; choose one of {', '.join(_PRESETS)}"
            + _suggest(name, list(_PRESETS))
        )
    m, t = _PRESETS[name]
    return RunConfig(source=f"preset:{name}", model=m, train=t)


# ---- --set key=value ---------------------------------------------------------


def _field_owner() -> dict[str, str]:
    owner = {f.name: "model" for f in fields(ModelConfig)}
    for f in fields(TrainConfig):
        assert f.name not in owner, f"field name {f.name} used twice"
        owner[f.name] = "train"
    return owner


def _suggest(key: str, options: list[str]) -> str:
    near = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}?)" if near else ""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_value(tp, text: str, key: str):
    """Turn the text of `--set key=text` into the field's declared type."""
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")
        if tp is int:
            return int(text, 0)
        if tp is float:
            if key.rsplit(".", 1)[-1] == "dropout" and text.strip().lower() == "auto":
                return DROPOUT_AUTO
            return float(text)
        if origin is Literal and bool in {type(a) for a in typing.get_args(tp)}:
            low = text.strip().lower()  # compile=auto|true|false: a word or a bool
            return True if low in _TRUE else False if low in _FALSE else text.strip()
        if tp is str or origin is Literal:  # validate() checks a Literal's value
            return text
        if origin is tuple:
            (inner, *_rest) = typing.get_args(tp)
            # spaces around an item go, those inside stay: `data=my file.txt` is one path
            parts = [p.strip() for p in text.strip().strip("()[]").split(",") if p.strip()]
            return tuple(parse_value(inner, p, key) for p in parts)
    except ValueError as e:
        raise ConfigError(f"--set {key}={text!r}: not a valid {_tname(tp)} ({e})") from None
    raise ConfigError(f"--set {key}: fields of type {tp} cannot be set from the command line")


def _tname(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def apply_sets(run: RunConfig, sets: list[str] | tuple[str, ...]) -> RunConfig:
    """Apply `key=value` overrides. The key is a field's name (`lr`), or that name under its
    owner: `model.k`, `train.k`, a training part's `PART.k` or `train.PART.k` (`optim.lr`)."""
    owner = _field_owner()
    hints = {
        "model": typing.get_type_hints(ModelConfig),
        "train": typing.get_type_hints(TrainConfig),
    }
    new = {"model": {}, "train": {}}
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, _, text = item.partition("=")
        key = key.strip()
        bare = _owned_key(key, owner)
        where = owner[bare]
        new[where][bare] = parse_value(hints[where][bare], text, key)
    return RunConfig(
        source=run.source,
        model=replace(run.model, **new["model"]),
        train=replace(run.train, **new["train"]),
    )


def _owned_key(key: str, owner: dict[str, str]) -> str:
    """The field a `--set` key names, refusing a prefix that does not own it."""
    prefix, _, bare = key.rpartition(".")
    if prefix.startswith("train."):
        prefix = prefix[len("train.") :]
    if prefix and prefix not in ("model", "train") and prefix not in PARTS:
        raise ConfigError(
            f"--set {key}: prefix must be 'model.', 'train.' or a part of the "
            f"training config ({', '.join(p + '.' for p in PARTS)})"
        )
    if bare not in owner:
        raise ConfigError(f"--set: unknown key {key!r}" + _suggest(bare, sorted(owner)))
    part = _PART_OF.get(bare)
    if prefix in PARTS and part != prefix:
        where = f"{part}.{bare}" if part else f"model.{bare}"
        raise ConfigError(f"--set {key}: {bare} is not in {prefix}; it is {where}")
    if prefix in ("model", "train") and owner[bare] != prefix:
        raise ConfigError(f"--set: unknown key {key!r}" + _suggest(bare, sorted(owner)))
    return bare


def asked_differences(saved: RunConfig, asked: RunConfig) -> list[str]:
    """`field old -> new` for each field where `asked` (a run as the user gave it, `auto`s
    unresolved) differs from `saved` (a run as it trained, its `auto`s resolved on the machine
    that trained it). A field the user left on auto matches any resolution of it."""
    out = []
    for part in ("model", "train"):
        a, b = dataclasses.asdict(getattr(saved, part)), dataclasses.asdict(getattr(asked, part))
        for k in a:
            auto = b[k] == "auto" or (k == "dropout" and b[k] == DROPOUT_AUTO)
            if a[k] != b[k] and not auto:
                out.append(f"{k} {a[k]!r} -> {b[k]!r}")
    return out


# ---- validation ----------------------------------------------------------------

#: Every field with a fixed set of values: its Literal annotation, stated once.
CHOICES = {
    name: typing.get_args(tp)
    for cls in (ModelConfig, TrainConfig)
    for name, tp in typing.get_type_hints(cls).items()
    if typing.get_origin(tp) is Literal
}
#: A training field's part: `lr` -> "optim".
_PART_OF = {f.name: name for name, cls in PARTS.items() for f in fields(cls)}

#: Every model integer stays below this (16.7M): far beyond any preset (b1's largest is
#: engram_rows=393216), and small enough that no tensor's element count overflows int64.
_SHAPE_MAX = 2**24
#: The largest weight a run may ask for, in elements (4 TiB in fp32): no card holds it.
_TENSOR_MAX = 2**40
#: The most parameters a model may have, in elements (68.7B, 256 GiB in fp32: 69x b1, beyond
#: the memory of any one machine dormouse trains on); a depth of 10^6 tiny layers passed every
#: per-tensor bound and ran the build out of memory.
_MODEL_MAX = 2**36


def validate(run: RunConfig) -> RunConfig:
    """Refuse impossible combinations; return the run unchanged when it is sound: the model's
    rules, each training part's, then those that read the model and the training both."""
    m, t = run.model, run.train
    m.check()
    t.check()
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"seq_len={t.seq_len} exceeds the model's max_seq_len={m.max_seq_len}; "
            f"lower --set seq_len or raise --set max_seq_len"
        )
    if m.segment_len and t.seq_len % m.segment_len:
        raise ConfigError(
            f"segment_len={m.segment_len} does not divide seq_len={t.seq_len}; segments must "
            f"tile the window: pick a divisor of {t.seq_len} or segment_len=0 (whole window)"
        )
    return run
