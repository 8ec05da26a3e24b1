"""``sparseffn reproduce NAME``: the comparisons of the papers at a scale a user can run, each
writing ``OUT/NAME.md`` (our table, the claims checked, held or not) and ``OUT/NAME.json``.

- ``moefication``: a pretrained sentence encoder's MLPs converted into mixtures of their own
  hidden units (:mod:`sparseffn.reproduce.moefication`).
"""

from __future__ import annotations

import importlib

EXPERIMENTS = {"moefication": "sparseffn.reproduce.moefication"}


def run(name: str, **options) -> dict:
    """Run experiment ``name`` (see :data:`EXPERIMENTS`) and return its results."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; experiments are {', '.join(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[name]).run(**options)
