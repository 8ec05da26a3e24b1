"""The papers' LM comparisons (`sparseffn reproduce NAME`): claim checks on hand-made numbers,
full-size configs that keep the papers' constraints, and every quick form end to end."""

import json

import pytest
import torch

from sparseffn.cli import main
from sparseffn.reproduce import EXPERIMENTS, LM_NAMES
from sparseffn.reproduce.lm import all_hold, best_of, better, matches
from sparseffn.reproduce.lm_experiments import LM_EXPERIMENTS, RATES, SIGMA_MOE_ABLATIONS
from sparseffn.train.compare import variant_runs
from sparseffn.train.config import lm_config


def test_claim_checks_by_hand():
    bpc = {"a": 2.00, "b": 2.01, "c": 2.03, "d": 1.99}
    assert better("a", "b")(bpc)[0] and not better("b", "a")(bpc)[0]
    assert matches("b", "a")(bpc)[0]                 # 2.01 <= 2.00 * 1.01
    assert not matches("c", "a")(bpc)[0]             # 2.03 > 2.02
    assert matches("b", "a", 0.0)(bpc)[0] is False
    held, words = best_of("d", ["a", "b"])(bpc)
    assert held and "d 1.990" in words and not best_of("a", ["b", "d"])(bpc)[0]
    assert all_hold(better("a", "b"), better("d", "a"))(bpc)[0]
    assert not all_hold(better("a", "b"), better("c", "a"))(bpc)[0]


def test_every_lm_experiment_is_registered():
    assert set(LM_NAMES) == set(LM_EXPERIMENTS) and set(LM_NAMES) <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", LM_NAMES)
def test_full_configs_build_and_every_claim_names_real_variants(name):
    experiment = LM_EXPERIMENTS[name]
    runs = variant_runs(experiment.config())
    names = {r.name for r in runs}
    costs = {r.name: lm_config(r, 256).cost() for r in runs}
    bpc = {n: 2.0 for n in names}
    for claim in experiment.claims:
        claim.check(bpc)                           # a KeyError would name a missing variant
    assert set(experiment.paper) <= names
    if name in ("sigma-moe-ablations", "topk-mlp", "pkm", "peer-vs-moe"):
        # parameter-equal comparisons: every FFN within 0.5% of the dense MLP's parameters
        # (PEER within 1.5%: its experts come in n² steps of 2·d_model parameters)
        dense = costs["dense"]["ffn_params"]
        for run_name, cost in costs.items():
            if run_name != "dense-compute":
                tolerance = 0.015 if run_name == "peer" else 0.005
                assert abs(cost["ffn_params"] - dense) <= tolerance * dense, run_name


def test_sigma_moe_keeps_the_papers_constraints():
    """Csordás et al. 2023 §6: expert size >= 128 and K · G >= 256 (here 512, 25% FLOPs)."""
    run = {r.name: r for r in variant_runs(SIGMA_MOE_ABLATIONS.config())}["sigma_moe"]
    ffn = lm_config(run, 256).ffn
    assert ffn.expert_size == 128 and ffn.k * ffn.expert_size == 512 and ffn.num_experts == 16
    assert ffn.router.expert_dropout == 0.05 and ffn.router.entropy_weight == 1e-4


def test_each_family_trains_at_its_swept_rate():
    """A variant at a worse rate than its rivals would lose for the wrong reason."""
    lrs = {r.name: r.train.lr for name in LM_NAMES
           for r in variant_runs(LM_EXPERIMENTS[name].config())}
    assert lrs["dense"] == lrs["dense-params"] == lrs["topk-K128"] == RATES["dense"] == 1e-2
    assert lrs["sigma_moe"] == lrs["sbase-K4-G128"] == lrs["sigma_moe-E32"] == 5e-3
    assert lrs["switch"] == lrs["switch-no-dropout"] == lrs["peer"] == 2e-3
    assert lrs["dense-compute"] == RATES["dense-compute"] and lrs["pkm-relu"] == RATES["pkm"]


@pytest.mark.slow
@pytest.mark.parametrize("name", LM_NAMES)
def test_quick_form_runs_end_to_end(name, tmp_path, capsys):
    assert main(["reproduce", name, "--quick", "--out", str(tmp_path)]) == 0
    report = (tmp_path / f"{name}.md").read_text()
    result = json.loads((tmp_path / f"{name}.json").read_text())
    experiment = LM_EXPERIMENTS[name]
    assert result["quick"] and len(result["claims"]) == len(experiment.claims)
    assert len(result["variants"]) == len(variant_runs(experiment.config(quick=True)))
    assert report.count("** at this scale: ") == len(experiment.claims)
    assert "Quick form" in report and "## Claims" in report and "| variant | lr |" in report
    assert (tmp_path / "runs" / f"{name}-quick" / "report.md").is_file()
    assert "written:" in capsys.readouterr().out
    with pytest.raises(ValueError, match="CUDA device"):     # none here, or not that one
        from sparseffn.reproduce import run
        run(name, quick=True, out=str(tmp_path), device="cuda" if not torch.cuda.is_available() else "cuda:99")
