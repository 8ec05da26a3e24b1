"""``sparseffn reproduce NAME``: the comparisons of the papers at a scale a user can run, each
writing ``OUT/NAME.md`` (our table, the claims checked, held or not) and ``OUT/NAME.json``.

- ``moefication``: a pretrained sentence encoder's MLPs converted into mixtures of their own
  hidden units (:mod:`sparseffn.reproduce.moefication`).
- ``fff-activations``: the activation of the matrix-form FFF router and the MoE row
  (Chaunin & Mikhailovskiy, Table 1) on Fashion-MNIST and clusters of Gaussians
  (:mod:`sparseffn.reproduce.fff_activations`).
- ``sigma-moe-ablations``, ``topk-mlp``, ``pkm``, ``switch-vs-dense``, ``expert-scaling``,
  ``peer-vs-moe``: byte-level language models compared claim by claim
  (:mod:`sparseffn.reproduce.lm_experiments`).
"""

from __future__ import annotations

import importlib

_LM = "sparseffn.reproduce.lm_experiments"
LM_NAMES = ("sigma-moe-ablations", "topk-mlp", "pkm", "switch-vs-dense", "expert-scaling",
            "peer-vs-moe")
EXPERIMENTS = {"moefication": "sparseffn.reproduce.moefication",
               "fff-activations": "sparseffn.reproduce.fff_activations",
               **{name: _LM for name in LM_NAMES}}


def run(name: str, **options) -> dict:
    """Run experiment ``name`` (see :data:`EXPERIMENTS`) and return its results."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; experiments are {', '.join(EXPERIMENTS)}")
    module = importlib.import_module(EXPERIMENTS[name])
    if name in LM_NAMES:
        from .lm import run_lm_experiment
        return run_lm_experiment(module.LM_EXPERIMENTS[name], **options)
    return module.run(**options)
