"""The Transformer LM and the classifier: shapes, causality, the FFN in every block, parameter
counts that equal the modules', presets within the dense budget, the dense baseline."""

import pytest
import torch

import sparseffn
from sparseffn import DenseMLP, DenseMLPConfig, FFFConfig, SigmaMoEConfig
from sparseffn.models import (PRESETS, ClassifierConfig, LMConfig, SparseClassifier,
                              TransformerLM, ffn_preset)


def lm(name="sigma_moe", d=32, layers=2, **kw):
    layout = ffn_preset(name, d, 4 * d, layers)
    return LMConfig(vocab_size=50, d_model=d, n_layers=layers, n_heads=4, context=16,
                    ffn=layout.ffn, sparse_every=layout.sparse_every, dense_ffn=layout.dense_ffn, **kw)


def count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_fits_the_dense_budget_and_counts_exactly(name):
    cfg = lm(name)
    model = TransformerLM(cfg)
    assert cfg.cost()["total_params"] == count(model)
    budget = DenseMLPConfig(d_model=32, d_ff=128).cost().total_params
    for block in range(cfg.n_layers):
        params = cfg.block_ffn(block).cost().total_params
        assert 0.85 * budget <= params <= budget, (block, params, budget)
    assert cfg.cost()["active_params"] <= cfg.cost()["total_params"]


def test_table4_variants_are_sigma_moes_experts_behind_another_router():
    """Csordás et al. 2023 Table 4 compares the MoE variants at σ-MoE's K and G, so the
    softmax and S-BASE presets differ from sigma_moe in the router alone."""
    sigma = ffn_preset("sigma_moe", 256, 2048, 6).ffn
    for name, router in (("softmax_moe", sparseffn.SoftmaxRouterConfig),
                         ("sbase", sparseffn.SBaseRouterConfig)):
        ffn = ffn_preset(name, 256, 2048, 6).ffn
        assert isinstance(ffn.router, router), name
        assert (ffn.num_experts, ffn.expert_size, ffn.k) == (sigma.num_experts,
                                                               sigma.expert_size, sigma.k)
        assert ffn.cost() == sigma.cost()
    assert ffn_preset("sbase", 256, 2048, 6, k=4).ffn.k == 4


def test_a_router_table_changes_only_the_fields_it_names_of_a_presets_router():
    """``[model.ffn_options.router]`` without ``type`` keeps the preset's router and its other
    settings (it used to replace the router and fail for want of a type); with ``type`` it
    replaces the router."""
    switch = ffn_preset("switch", 256, 2048, 6, router={"balance_weight": 0.1}).ffn.router
    assert isinstance(switch, sparseffn.SwitchRouterConfig)
    assert (switch.capacity_factor, switch.z_loss_weight, switch.balance_weight) == (
        1.25, 1e-3, 0.1)
    sbase = ffn_preset("sbase", 256, 2048, 6, router={"sinkhorn_iterations": 4}).ffn.router
    assert isinstance(sbase, sparseffn.SBaseRouterConfig) and sbase.sinkhorn_iterations == 4
    glam = ffn_preset("glam", 256, 2048, 6, router={"capacity_factor": 1.5})
    assert glam.ffn.router == sparseffn.GShardRouterConfig(capacity_factor=1.5)
    assert glam.sparse_every == 2
    typed = ffn_preset("switch", 256, 2048, 6, router={"type": "sigma"}).ffn.router
    assert typed == sparseffn.SigmaRouterConfig()
    with pytest.raises(ValueError, match=r"ffn_options\.router has no field\(s\) \['gamma'\]"
                       r".*SwitchRouterConfig"):
        ffn_preset("switch", 256, 2048, 6, router={"gamma": 1.0})


def test_fff_sparse_is_the_fff_tree_trained_on_its_top_two_leaves():
    soft, sparse = (ffn_preset(name, 256, 2048, 6).ffn for name in ("fff", "fff_sparse"))
    assert (sparse.depth, sparse.leaf_width) == (soft.depth, soft.leaf_width)
    assert (sparse.train_mode, sparse.k, sparse.resolved_eval_mode) == ("sparse", 2, "topk")
    assert sparse.cost().total_params == soft.cost().total_params
    sigma = ffn_preset("sigma_moe", 256, 2048, 6).ffn
    # σ-MoE's active width: 2 of 8 leaves (the tree's nodes instead of its selection)
    assert sparse.cost().active_params < 0.3 * soft.cost().active_params
    assert abs(sparse.cost().active_params - sigma.cost().active_params) < 0.02 * sigma.cost(
        ).active_params
    assert ffn_preset("fff_sparse", 256, 2048, 6, k=3).ffn.k == 3
    # its top-2 weights sum to one; a router table changes only the fields it names
    assert sparse.router.renormalize and not soft.router.renormalize
    assert sparse.router.entropy_weight == sparseffn.TreeRouterConfig().entropy_weight > 0
    tuned = ffn_preset("fff_sparse", 256, 2048, 6, router={"entropy_weight": 0.1}).ffn.router
    assert tuned.renormalize and tuned.entropy_weight == 0.1
    plain = ffn_preset("fff_sparse", 256, 2048, 6, router={"renormalize": False}).ffn.router
    assert not plain.renormalize
    model = TransformerLM(lm("fff_sparse", layers=1)).train()
    tokens = torch.randint(0, 50, (2, 9))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    ffn = model.blocks[0].ffn
    routing = ffn.route(torch.randn(5, ffn.config.d_model))
    assert routing.indices.shape == (5, 2) and not routing.dense
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(5))


def test_sbase_lm_balances_its_experts_in_training_and_routes_by_score_in_evaluation():
    torch.manual_seed(0)
    model = TransformerLM(lm("sbase", layers=1))
    ffn = model.blocks[0].ffn
    with torch.no_grad():       # a router that sends every token to expert 0 unless balanced
        ffn.router.weight.normal_(0.0, 0.1)
        ffn.router.weight[0].fill_(1.0)
    tokens = torch.randint(0, 50, (8, 16))
    model.train()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    grad = ffn.router.weight.grad        # the sigmoid weights of the balanced choice (Eq. 32)
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    x = torch.randn(120, 32).abs()                  # expert 0 is every token's first choice
    load = torch.bincount(ffn.router(x).indices.reshape(-1), minlength=8)
    assert load.max() <= 2 * (120 * 2 / 8)          # within twice the equal share
    model.eval()
    assert (ffn.router(x).indices == 0).any(dim=1).all()


def test_blocks_use_the_configured_ffn_and_glam_alternates():
    model = TransformerLM(lm("glam", layers=4))
    kinds = [type(b.ffn).__name__ for b in model.blocks]
    assert kinds == ["DenseMLP", "MoE", "DenseMLP", "MoE"]
    model = TransformerLM(lm("pkm", layers=3))
    assert all(type(b.ffn).__name__ == "ProductKeyMemory" for b in model.blocks)


@pytest.mark.parametrize("name", ["dense", "sigma_moe", "fff", "peer"])
def test_lm_is_causal(name):
    model = TransformerLM(lm(name)).eval()
    tokens = torch.randint(0, 50, (2, 12))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 50
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 12, 50)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_lm_loss_and_aux_loss_reach_every_parameter():
    model = TransformerLM(lm("switch"))
    tokens = torch.randint(0, 50, (3, 16))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:]) + sparseffn.aux_loss(model)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert set(sparseffn.aux_loss_terms(model)) >= {"blocks.0.ffn/balance", "blocks.1.ffn/z_loss"}


def test_dense_baseline_has_the_sparse_models_parameters():
    for name in ("sigma_moe", "sbase", "pkm", "peer", "glam", "fff"):
        cfg = lm(name, layers=4)
        dense = cfg.dense_baseline()
        assert all(isinstance(dense.block_ffn(i), DenseMLPConfig) for i in range(4))
        diff = abs(dense.cost()["total_params"] - cfg.cost()["total_params"])
        assert diff <= 4 * cfg.d_model, (name, diff)
        assert count(TransformerLM(dense)) == dense.cost()["total_params"]


def test_lm_config_errors():
    ffn = SigmaMoEConfig(d_model=32, num_experts=4, expert_size=8, k=2)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        LMConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=5, context=8, ffn=ffn)
    with pytest.raises(ValueError, match="must equal the model's d_model=64"):
        LMConfig(vocab_size=10, d_model=64, n_layers=2, n_heads=4, context=8, ffn=ffn)
    with pytest.raises(ValueError, match="set dense_ffn"):
        LMConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=4, context=8, ffn=ffn, sparse_every=2)
    with pytest.raises(ValueError, match="unset its d_out"):
        LMConfig(vocab_size=10, d_model=32, n_layers=2, n_heads=4, context=8,
                 ffn=FFFConfig(d_model=32, depth=2, leaf_width=4, d_out=10))
    model = TransformerLM(LMConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=4, context=8, ffn=ffn))
    with pytest.raises(ValueError, match="exceeds context=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown FFN preset"):
        ffn_preset("mixtral", 32, 128)
    with pytest.raises(ValueError, match="preset 'sigma_moe'"):
        ffn_preset("sigma_moe", 32, 128, num_expert=4)


def test_lm_config_round_trips_through_a_dict():
    cfg = lm("glam", layers=2)
    data = cfg.to_dict()
    data.pop("kind")
    assert LMConfig(**data) == cfg


def test_classifier_fff_gives_logits_directly_and_moe_gets_a_read_out():
    fff = ClassifierConfig(in_features=12, num_classes=3,
                           layer=FFFConfig(d_model=12, depth=2, leaf_width=8, d_out=3, dropout=0.2))
    model = SparseClassifier(fff)
    assert model.head is None
    assert model(torch.randn(5, 3, 2, 2)).shape == (5, 3)
    assert fff.cost()["total_params"] == count(model)
    moe = ClassifierConfig(in_features=12, num_classes=3,
                           layer={"type": "moe", "d_model": 12, "num_experts": 4, "expert_size": 8, "k": 1})
    model = SparseClassifier(moe)
    assert model.head is not None and model(torch.randn(5, 12)).shape == (5, 3)
    assert moe.cost()["total_params"] == count(model)
    with pytest.raises(ValueError, match="must equal in_features=12"):
        ClassifierConfig(in_features=12, num_classes=3, layer=DenseMLPConfig(d_model=10, d_ff=4))
    with pytest.raises(ValueError, match="expects 12 features"):
        model(torch.randn(5, 13))


def test_dense_preset_is_the_dense_mlp():
    layout = ffn_preset("dense", 32, 100, 3)
    assert layout.ffn == DenseMLPConfig(d_model=32, d_ff=100, init_depth=3)
    assert isinstance(sparseffn.build_layer(layout.ffn), DenseMLP)
