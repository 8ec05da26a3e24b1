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


def test_the_lr_sweep_is_the_main_job_at_several_rates():
    """experiments/lr_sweep_pydoc.toml chose the main job's learning rates: it must train the
    same data, model, steps and variants (the main job may only set each variant's lr)."""
    folder = EXPERIMENTS[0].parent
    main = read_config_file(str(folder / "compare_pydoc.toml"))
    sweep = read_config_file(str(folder / "lr_sweep_pydoc.toml"))
    for section in ("seed", "data", "model", "train"):
        assert sweep[section] == main[section], section
    def strip(variant):    # a preset name is the table {name, ffn}; the lr may differ
        table = {"name": variant, "ffn": variant} if isinstance(variant, str) else variant
        return {k: x for k, x in table.items() if k != "train"}
    assert [strip(v) for v in sweep["compare"]["variants"]] == \
        [strip(v) for v in main["compare"]["variants"]]
    assert all(set(v.get("train", {})) <= {"lr"} for v in main["compare"]["variants"]
               if isinstance(v, dict))
    assert len(sweep["compare"]["lrs"]) >= 3
