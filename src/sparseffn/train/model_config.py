"""The model a run trains, and the one its checkpoint was trained with.

A run config names a preset (``ffn = "fff_sparse"``) or a layer table whose unset fields take
the library's defaults. Those defaults can change between versions of sparseffn, so the same
run config can build a different network after an upgrade (a new regulariser, renormalised
weights). A checkpoint therefore keeps the model config it was trained with
(``model_config``, the ``to_dict`` of :class:`~sparseffn.models.lm.LMConfig` or
:class:`~sparseffn.models.classifier.ClassifierConfig`), and resuming, evaluating or analysing
it builds that network again, saying which fields the current version would set otherwise.
Checkpoints written before this was kept build what their run config builds now.
``sparseffn compare`` reusing a finished variant compares the model in its ``summary.json``
with what its run config builds now, and names the fields that differ.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Union

from ..data import ArrayData, TextData
from ..models.classifier import ClassifierConfig
from ..models.lm import LMConfig
from .config import RunConfig, _check, classifier_config, lm_config

ModelConfig = Union[LMConfig, ClassifierConfig]


def run_model_config(run: RunConfig, data: TextData | ArrayData) -> ModelConfig:
    """The model config that ``run`` builds for ``data`` with this version's defaults."""
    if run.model.kind == "lm":
        _check(isinstance(data, TextData), "model.kind 'lm' needs a text corpus (data.corpus)")
        data.check_context(run.model.context)  # type: ignore[union-attr]
        return lm_config(run, data.vocab_size)  # type: ignore[union-attr]
    _check(isinstance(data, ArrayData), "model.kind 'classifier' needs data.dataset")
    return classifier_config(run, data.in_features, data.num_classes)  # type: ignore[union-attr]


def model_changes(run: RunConfig, trained: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """:func:`changed_fields` between the model config a run was trained with (``trained``: a
    checkpoint's ``model_config`` or ``summary.json``'s ``model``) and the one ``run`` builds
    now for the same data sizes (vocabulary; features and classes): what this version would
    train differently. Empty where this version cannot build the run's model at all (its run
    config is then an error that training reports)."""
    try:
        if trained.get("kind") == "lm":
            current: ModelConfig = lm_config(run, trained["vocab_size"])
        else:
            current = classifier_config(run, trained["in_features"], trained["num_classes"])
    except (KeyError, ValueError):
        return []
    return changed_fields(trained, current.to_dict())


def describe_changes(changes: list[tuple[str, Any, Any]], where: str) -> str:
    """``field: old in WHERE, new now; ...``."""
    return "; ".join(f"{name}: {old!r} in {where}, {new!r} now" for name, old, new in changes)


def checkpoint_model_config(saved: dict[str, Any] | None, current: ModelConfig,
                            where: str = "the checkpoint") -> ModelConfig:
    """The model config to rebuild a checkpoint with: ``saved`` (its ``model_config``) when
    this version can build it, else ``current`` (what the run config builds now; also for
    checkpoints that hold none). A difference between the two, or a saved config this version
    cannot build, is reported on stderr, naming the fields (by rank 0 alone under torchrun)."""
    if saved is None:
        return current
    try:
        _check(isinstance(saved, dict) and saved.get("kind") == current.kind,
               f"a {current.kind!r} model config, got {saved!r:.80}")
        config = saved_model_config(saved)
    except (TypeError, ValueError) as error:     # a field this version renamed or dropped
        _note(f"{where} holds a model config this version of sparseffn cannot build "
              f"({error}); building the model its run config gives instead")
        return current
    if config != current:
        changes = describe_changes(changed_fields(config.to_dict(), current.to_dict()), where)
        _note(f"this version of sparseffn builds another model from this run config "
              f"({changes}); using the model {where} was trained with")
    return config


def saved_model_config(saved: dict[str, Any]) -> ModelConfig:
    """The :class:`LMConfig` or :class:`ClassifierConfig` whose ``to_dict`` is ``saved`` (a
    checkpoint's ``model_config``, ``summary.json``'s ``model``, an exported file's
    ``sparseffn_model_config``). A ValueError or TypeError names what this version cannot
    build (an unknown kind, a field it renamed or dropped)."""
    kinds = {config.kind: config for config in (LMConfig, ClassifierConfig)}
    kind = saved.get("kind") if isinstance(saved, dict) else None
    if kind not in kinds:
        raise ValueError(f"a model config of kind {' or '.join(map(repr, kinds))} is needed, "
                         f"got {saved!r:.80}")
    return kinds[kind](**{k: v for k, v in saved.items() if k != "kind"})


def _note(message: str) -> None:
    """A note on stderr, from one process: every rank of a torchrun job builds the model."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}", file=sys.stderr)


def changed_fields(old: dict[str, Any], new: dict[str, Any],
                   prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, old value, new value) of every field that differs between two nested
    config dicts; a field one of them lacks reads as None there."""
    out = []
    for name in list(old) + [n for n in new if n not in old]:
        a, b = old.get(name), new.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_fields(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append((f"{prefix}{name}", a, b))
    return out
