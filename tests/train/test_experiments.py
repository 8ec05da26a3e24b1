"""Every run config shipped in experiments/ still loads and validates (field renames and moved
configs must not break the files users copy)."""

from pathlib import Path

import pytest

from sparseffn.train.compare import variant_runs
from sparseffn.train.config import read_config_file, run_config_from_dict

EXPERIMENTS = sorted((Path(__file__).resolve().parents[2] / "experiments").glob("*.toml"))


def test_there_are_experiments():
    assert len(EXPERIMENTS) >= 4


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_config_loads(path):
    data = read_config_file(str(path))
    runs = variant_runs(data) if "compare" in data else [run_config_from_dict(data)]
    assert runs and all(run.model is not None for run in runs)
