"""A run described by one TOML (or JSON) file: what data, what model, how to train.

```toml
name = "pydoc-sigma-moe"
seed = 0

[data]                      # text: corpus = pydoc | stdlib | shakespeare | wikipedia | file
corpus = "pydoc"            # classification: dataset = clusters | fashion_mnist | mnist5k | digits | cifar10
tokenizer = "byte"          # or "bpe" (vocab_size tokens, trained on the training split)

[model]
kind = "lm"                 # or "classifier"
d_model = 128
n_layers = 4
n_heads = 4
context = 128
# a preset (dense, sigma_moe, softmax_moe, sbase, switch, glam, fff, fff_sparse, pkm, peer)
# sized to d_ff, or a full layer table: [model.ffn] type = "moe" ...
ffn = "sigma_moe"
d_ff = 512
[model.ffn_options]         # preset fields to change (num_experts, k, depth, heads, ...)
k = 4

[train]
steps = 1000
batch_size = 32
lr = 1e-3
schedule = "cosine"         # cosine | one_cycle | constant
```

Every section and field is checked; an unknown one is an error naming the allowed ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from ..config import LayerConfig, config_from_dict
from ..models.classifier import ClassifierConfig
from ..models.lm import LMConfig
from ..models.presets import PRESETS, ffn_preset
from .schedule import SCHEDULES


class ConfigError(ValueError):
    """A run config that cannot be run; the message names the field."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _typed(spec: Any, section: str) -> None:
    """Check every field of ``spec`` against its annotation (``bool``, ``int``, ``float``,
    ``str``, or one of them ``| None``): a bool must be true/false (not the string "False"),
    an int an integer (not 2.5 or a bool), a float a finite number (ints are converted).
    Tables and ``Any`` fields are checked by their own rules."""
    hints = typing.get_type_hints(type(spec))
    for f in dataclasses.fields(spec):
        value, kind = getattr(spec, f.name), hints[f.name]
        where = f"{section}.{f.name}" if section else f.name
        if typing.get_origin(kind) in (Union, types.UnionType):
            if value is None and type(None) in typing.get_args(kind):
                continue
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if kind is bool:
            _check(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
        elif kind is int:
            _check(isinstance(value, int) and not isinstance(value, bool),
                   f"{where} must be an integer, got {value!r}")
        elif kind is float:
            _check(isinstance(value, (int, float)) and not isinstance(value, bool)
                   and math.isfinite(value), f"{where} must be a finite number, got {value!r}")
            object.__setattr__(spec, f.name, float(value))
        elif kind is str:
            _check(isinstance(value, str), f"{where} must be a string, got {value!r}")


@dataclass(frozen=True)
class DataSpec:
    corpus: str | None = None
    dataset: str | None = None
    path: str | None = None
    tokenizer: str = "byte"
    vocab_size: int = 512
    fetch: bool = True
    options: dict = field(default_factory=dict)   # clusters: num_classes, dim, per_class, spread, seed

    def __post_init__(self) -> None:
        _typed(self, "data")
        _check(self.vocab_size > 0, f"data.vocab_size must be positive, got {self.vocab_size}")
        _check(isinstance(self.options, dict), "data.options must be a table")
        _check((self.corpus is None) != (self.dataset is None),
               "data: set exactly one of corpus (language modelling) or dataset (classification)")
        _check(self.tokenizer in ("byte", "bpe"), f"data.tokenizer must be 'byte' or 'bpe', got "
                                                  f"{self.tokenizer!r}")

    @property
    def is_text(self) -> bool:
        return self.corpus is not None


@dataclass(frozen=True)
class ModelSpec:
    kind: str = "lm"
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    context: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = True
    ffn: Any = "dense"          # a preset name or a layer table (LM: ffn; classifier: the layer)
    d_ff: int | None = None     # the dense width presets are sized to (None: 4 · d_model)
    ffn_options: dict = field(default_factory=dict)
    sparse_every: int = 1       # with a layer table: ffn in every m-th block, dense_ffn elsewhere
    dense_ffn: dict | None = None

    def __post_init__(self) -> None:
        _typed(self, "model")
        _check(self.kind in ("lm", "classifier"), f"model.kind must be 'lm' or 'classifier', "
                                                  f"got {self.kind!r}")
        for name in ("d_model", "n_layers", "n_heads", "context", "sparse_every"):
            _check(getattr(self, name) > 0,
                   f"model.{name} must be positive, got {getattr(self, name)}")
        _check(self.d_ff is None or self.d_ff > 0, f"model.d_ff must be positive, got {self.d_ff}")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout must lie in [0, 1), got {self.dropout}")
        _check(isinstance(self.ffn_options, dict), "model.ffn_options must be a table")
        _check(self.dense_ffn is None or isinstance(self.dense_ffn, dict),
               "model.dense_ffn must be a layer table")
        _check(isinstance(self.ffn, (str, dict)), "model.ffn must be a preset name or a table")
        if isinstance(self.ffn, str):
            _check(self.ffn in PRESETS, f"model.ffn: unknown preset {self.ffn!r}; presets are "
                                        f"{', '.join(PRESETS)}, or give a layer table")


@dataclass(frozen=True)
class TrainSpec:
    steps: int | None = None        # None (and no epochs): 1000
    epochs: float | None = None     # classification: steps = epochs · (train size // batch)
    batch_size: int = 32
    micro_batches: int = 1          # each step's batch in this many parts, gradients summed
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup_steps: int = 0
    final_lr_ratio: float = 0.0
    clip: float | None = 0.25       # max gradient norm (Csordás et al. 2023); 0 or None: off
    weight_decay: float = 0.0       # Adam's L2 term, on weights only (sparseffn.param_groups)
    betas: tuple = (0.9, 0.999)
    bf16: bool = False              # bfloat16 autocast for the forward
    fp16: bool = False              # float16 autocast, with dynamic loss scaling (GradScaler)
    deterministic: bool = True      # torch.use_deterministic_algorithms: bit-exact reruns
    eval_every: int = 100
    eval_windows: int | None = 64   # LM: validation windows per evaluation (None: the whole split)
    log_every: int = 10
    checkpoint_every: int = 0       # 0: only at the end and on Ctrl-C
    expert_parallel: bool = False   # under torchrun: shard the experts across the ranks
    # with expert_parallel: exchange the experts' tokens in blocks of a fixed size, this
    # factor times an even share of a micro-batch's pairs (nothing read on the host; pairs
    # past a block dropped); none: every pair, in exchanges whose sizes are read on the host
    exchange_capacity_factor: float | None = None
    # torch.compile the training forward and loss (not eval): true, or "reduce-overhead" for
    # the same replayed from CUDA graphs on a GPU (on a CPU it is true)
    compile: Any = False
    activation_checkpointing: bool = False   # recompute each block's activations in backward

    def __post_init__(self) -> None:
        _typed(self, "train")
        _check(self.schedule in SCHEDULES, f"train.schedule must be one of "
                                           f"{', '.join(SCHEDULES)}, got {self.schedule!r}")
        _check(self.steps is None or self.epochs is None,
               "train: set steps or epochs, not both")
        if self.steps is None and self.epochs is None:
            object.__setattr__(self, "steps", 1000)
        _check(self.steps is None or self.steps > 0,
               f"train.steps must be a positive integer, got {self.steps!r}")
        _check(self.epochs is None or self.epochs > 0, "train.epochs must be positive")
        _check(self.batch_size > 0, f"train.batch_size must be positive, got {self.batch_size}")
        _check(self.micro_batches > 0,
               f"train.micro_batches must be positive, got {self.micro_batches}")
        _check(self.micro_batches <= self.batch_size,
               f"train.micro_batches ({self.micro_batches}) must be at most train.batch_size "
               f"({self.batch_size}): each micro-batch takes at least one row")
        _check(self.lr > 0, f"train.lr must be positive, got {self.lr}")
        # a negative max-norm would flip the gradient's sign in clip_grad_norm_
        _check(self.clip is None or self.clip >= 0,
               f"train.clip must be a non-negative max gradient norm (0 or none: off), got "
               f"{self.clip}")
        _check(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(0.0 <= self.final_lr_ratio <= 1.0,
               f"train.final_lr_ratio must lie in [0, 1], got {self.final_lr_ratio}")
        _check(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        _check(self.eval_every > 0 and self.log_every > 0, "train.eval_every and train.log_every "
                                                           "must be positive")
        _check(self.eval_windows is None or self.eval_windows > 0,
               f"train.eval_windows must be positive (or none: the whole split), got "
               f"{self.eval_windows}")
        _check(not (self.bf16 and self.fp16),
               "train.bf16 and train.fp16 both set: pick one autocast dtype")
        _check(isinstance(self.compile, bool) or self.compile == "reduce-overhead",
               f"train.compile must be true, false or \"reduce-overhead\" (CUDA graphs), got "
               f"{self.compile!r}")
        _check(not (self.compile == "reduce-overhead" and self.expert_parallel),
               "train.compile = \"reduce-overhead\" is not supported with "
               "train.expert_parallel (by default the experts' all-to-all reads its sizes on "
               "the host every step, between the compiled parts; with "
               "train.exchange_capacity_factor it compiles into the step's graph, but CUDA "
               "graphs around its collectives are untested); use train.compile = true")
        factor = self.exchange_capacity_factor   # (a finite number or None: _typed checked)
        _check(factor is None or factor > 0,
               f"train.exchange_capacity_factor must be a finite number > 0 (or none: every "
               f"pair, sizes read on the host), got {factor!r}")
        _check(factor is None or self.expert_parallel,
               "train.exchange_capacity_factor sizes the exchange of sharded experts: it needs "
               "train.expert_parallel = true")
        _check(self.checkpoint_every >= 0,
               f"train.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        _check(isinstance(self.betas, (list, tuple)) and len(self.betas) == 2
               and all(isinstance(b, (int, float)) and not isinstance(b, bool)
                       and 0.0 <= b < 1.0 for b in self.betas),
               f"train.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    @property
    def compile_mode(self) -> str | None:
        """``torch.compile``'s mode for the training step: None (eager), ``"default"`` or
        ``"reduce-overhead"``."""
        if self.compile is True:
            return "default"
        return self.compile or None


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    seed: int = 0
    data: DataSpec = field(default_factory=lambda: DataSpec(corpus="pydoc"))
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainSpec = field(default_factory=TrainSpec)

    def __post_init__(self) -> None:
        _typed(self, "")
        _check(not (self.train.activation_checkpointing and self.model.kind != "lm"),
               "train.activation_checkpointing is for language models (it recomputes each "
               "Transformer block); the classifier has one layer")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)


_SECTIONS = {"data": DataSpec, "model": ModelSpec, "train": TrainSpec}


def _section(cls, values: Any, name: str):
    _check(isinstance(values, dict), f"[{name}] must be a table")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    _check(not unknown, f"[{name}] has no field(s) {unknown}; fields are {sorted(names)}")
    try:
        return cls(**values)
    except TypeError as err:
        raise ConfigError(f"[{name}]: {err}") from None


def run_config_from_dict(data: dict[str, Any], allow: tuple[str, ...] = ()) -> RunConfig:
    """A RunConfig from the parsed file; top-level keys in ``allow`` (e.g. ``compare``) are
    left to the caller."""
    top = {"name", "seed", *_SECTIONS, *allow}
    unknown = sorted(set(data) - top)
    _check(not unknown, f"unknown top-level key(s) {unknown}; allowed are {sorted(top)}")
    fields = {k: _section(cls, data[k], k) for k, cls in _SECTIONS.items() if k in data}
    for key in ("name", "seed"):
        if key in data:
            fields[key] = data[key]
    return RunConfig(**fields)


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path}: {err}") from None


_WORDS = {"true": True, "false": False, "none": None, "null": None}


def parse_override_value(raw: str) -> Any:
    """The value of ``--set KEY=VALUE``: TOML (``100``, ``1e-3``, ``true``, ``"pkm"``,
    ``[0.9, 0.98]``), the words true/false/none/null in any case (``none``: unset an optional
    field), and otherwise the bare word as a string (``model.ffn=pkm``)."""
    text = raw.strip()
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["train.steps=100", "model.ffn=pkm", "train.clip=none"]``: each value as
    :func:`parse_override_value` reads it."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        _check(bool(sep) and bool(key.strip()), f"--set expects KEY=VALUE, got {item!r}")
        value = parse_override_value(raw)
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            _check(isinstance(node, dict), f"--set {key}: {part} is not a table")
        node[leaf] = value
    return data


# -- from a run config to a model config ---------------------------------------------------

def lm_config(run: RunConfig, vocab_size: int) -> LMConfig:
    m = run.model
    d_ff = m.d_ff or 4 * m.d_model
    if isinstance(m.ffn, str):
        try:
            layout = ffn_preset(m.ffn, m.d_model, d_ff, m.n_layers, **m.ffn_options)
        except ValueError as err:
            raise ConfigError(f"model.ffn: {err}") from None
        ffn, every, dense = layout.ffn, layout.sparse_every, layout.dense_ffn
    else:
        _check(not m.ffn_options, "model.ffn_options apply to presets; put the fields in "
                                  "[model.ffn] instead")
        ffn, every = _layer(m.ffn, m.d_model), m.sparse_every
        dense = None if m.dense_ffn is None else _layer(m.dense_ffn, m.d_model)
    try:
        return LMConfig(vocab_size=vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                        n_heads=m.n_heads, context=m.context, ffn=ffn, sparse_every=every,
                        dense_ffn=dense, dropout=m.dropout, tie_embeddings=m.tie_embeddings)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None


def _layer(table: dict, d_model: int) -> LayerConfig:
    table = dict(table)
    table.setdefault("d_model", d_model)
    try:
        return config_from_dict(table)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model.ffn: {err}") from None


def classifier_config(run: RunConfig, in_features: int, num_classes: int) -> ClassifierConfig:
    m = run.model
    if isinstance(m.ffn, str):
        d_ff = m.d_ff or 4 * in_features
        layer = ffn_preset(m.ffn, in_features, d_ff, 1, **m.ffn_options).ffn
    else:
        layer = _layer(m.ffn, in_features)
    try:
        return ClassifierConfig(in_features=in_features, num_classes=num_classes, layer=layer,
                                dropout=m.dropout)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None


def total_steps(run: RunConfig, steps_per_epoch: int | None) -> int:
    if run.train.steps is not None:
        return run.train.steps
    _check(steps_per_epoch is not None, "train.epochs needs a classification dataset; set steps")
    return max(1, math.ceil(run.train.epochs * steps_per_epoch))  # type: ignore[operator]


def dense_baseline(run: RunConfig, by: str = "params") -> RunConfig:
    """The run with every FFN replaced by a dense MLP: by ``"params"`` the parameter-equal one
    (Csordás et al.'s rule: the sparse model's total parameters, to within d_model per block),
    by ``"compute"`` the one with the sparse FFN's active parameters per token (Fedus et al.
    2022's FLOP-matched baseline)."""
    _check(run.model.kind == "lm", "the dense baseline is defined for language models")
    _check(by in ("params", "compute"), f"a dense baseline is matched by 'params' or "
                                        f"'compute', got {by!r}")
    lm = lm_config(run, 256).dense_baseline(by)   # FFN sizes do not depend on the vocabulary
    model = dataclasses.replace(
        run.model, ffn=lm.ffn.to_dict(), ffn_options={}, sparse_every=lm.sparse_every,
        dense_ffn=None if lm.dense_ffn is None else lm.dense_ffn.to_dict())
    suffix = "dense-baseline" if by == "params" else "dense-compute"
    return run.replace(name=f"{run.name}-{suffix}", model=model)
