import json

import pytest

from sparseffn import DenseMLPConfig, SigmaMoEConfig, TopKMLPConfig, config_from_dict


@pytest.mark.parametrize("make, field, allowed", [
    (lambda: SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=5), "k", r"\[1, num_experts=4\]"),
    (lambda: SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=0), "k", r"\[1, num_experts=4\]"),
    (lambda: SigmaMoEConfig(d_model=0, num_experts=4, expert_size=4, k=1), "d_model", "positive integer"),
    (lambda: SigmaMoEConfig(d_model=8, num_experts=-1, expert_size=4, k=1), "num_experts", "positive integer"),
    (lambda: SigmaMoEConfig(d_model=8, num_experts=4, expert_size=2.5, k=1), "expert_size", "positive integer"),
    (lambda: SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=1, activation="tanh"),
     "activation", "'relu', 'gelu'"),
    (lambda: SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=1, router={"gate": "hardmax"}),
     "gate", "'sigmoid', 'softmax', 'softmax_renorm'"),
    (lambda: SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=1, router={"expert_dropout": 1.0}),
     "expert_dropout", r"\[0, 1\)"),
    (lambda: SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=1, router={"entropy_weight": -1}),
     "entropy_weight", "non-negative"),
    (lambda: SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=1, init="xavier"),
     "init", "'sigma_moe', 'standard'"),
    (lambda: DenseMLPConfig(d_model=8, d_ff=0), "d_ff", "positive integer"),
    (lambda: DenseMLPConfig(d_model=8, d_ff=8, activation="swish"), "activation", "'relu', 'gelu'"),
    (lambda: DenseMLPConfig(d_model=8, d_ff=8, dropout=-0.1), "dropout", r"\[0, 1\)"),
    (lambda: TopKMLPConfig(d_model=8, d_ff=8, k=9), "k", r"\[1, d_ff=8\]"),
])
def test_impossible_configs_name_the_field_and_what_is_allowed(make, field, allowed):
    with pytest.raises(ValueError, match=rf"\.{field} must .*{allowed}"):
        make()


def test_width_not_divisible_into_experts():
    with pytest.raises(ValueError, match=r"d_ff=100 must be divisible by num_experts=16"):
        SigmaMoEConfig.from_dense(d_model=8, d_ff=100, num_experts=16, k=2)
    cfg = SigmaMoEConfig.from_dense(d_model=8, d_ff=128, num_experts=16, k=2)
    assert cfg.expert_size == 8 and cfg.d_ff == 128


@pytest.mark.parametrize("cfg", [
    DenseMLPConfig(d_model=8, d_ff=32, activation="gelu", bias=True),
    TopKMLPConfig(d_model=8, d_ff=32, k=4),
    SigmaMoEConfig(d_model=8, num_experts=4, expert_size=8, k=2,
                   router={"gate": "softmax", "expert_dropout": 0.1, "entropy_weight": 0.01}),
])
def test_configs_round_trip_through_json(cfg):
    assert config_from_dict(json.loads(cfg.to_json())) == cfg


def test_unknown_type_or_field_is_an_error():
    with pytest.raises(ValueError, match="config 'type' must be one of"):
        config_from_dict({"type": "nope"})
    with pytest.raises(ValueError, match=r"no field\(s\) \['colour'\]"):
        config_from_dict({"type": "dense", "d_model": 4, "d_ff": 4, "colour": "red"})


def test_configs_are_frozen_and_replace_validates():
    cfg = DenseMLPConfig(d_model=8, d_ff=8)
    with pytest.raises(AttributeError):
        cfg.d_ff = 9
    assert cfg.replace(d_ff=16).d_ff == 16
    with pytest.raises(ValueError):
        cfg.replace(d_ff=-1)


def test_renamed_fields_still_work_with_a_deprecation_warning():
    """``n_layers`` of a layer config only scaled the init (now ``init_depth``); PKM's
    ``activation`` was its score function (now ``score``). Old names keep working."""
    import warnings
    from sparseffn import PKMConfig, SigmaMoEConfig
    with pytest.warns(DeprecationWarning, match="init_depth"):
        cfg = SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=2, n_layers=3)
    assert cfg.init_depth == 3
    with pytest.warns(DeprecationWarning, match="init_depth"):
        assert cfg.n_layers == 3
    with pytest.warns(DeprecationWarning, match="score"):
        pkm = PKMConfig(d_model=8, num_subkeys=4, k=2, activation="relu")
    assert pkm.score == "relu" and "activation" not in pkm.to_dict()
    with pytest.warns(DeprecationWarning):       # a dict or TOML file written before
        old = config_from_dict({"type": "dense", "d_model": 8, "d_ff": 16, "n_layers": 2})
    assert old == DenseMLPConfig(d_model=8, d_ff=16, init_depth=2)
    with pytest.raises(TypeError, match="not both"):
        DenseMLPConfig(d_model=8, d_ff=16, n_layers=2, init_depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the new names warn about nothing
        DenseMLPConfig(d_model=8, d_ff=16, init_depth=2).replace(d_ff=32)


def test_sigma_moe_embeds_its_router_config():
    """SigmaMoEConfig holds a SigmaRouterConfig instead of restating its fields; a TOML
    sub-table without ``type`` changes only the fields it names; the flat fields of earlier
    releases map into it with a warning."""
    from sparseffn import SigmaRouterConfig, SoftmaxRouterConfig
    cfg = SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=2,
                         router={"entropy_weight": 0.01})
    assert cfg.router == SigmaRouterConfig(entropy_weight=0.01)
    assert cfg.to_dict()["router"] == {"type": "sigma", **SigmaRouterConfig(entropy_weight=0.01).__dict__}
    assert cfg.to_moe_config().router is cfg.router
    with pytest.warns(DeprecationWarning, match=r"router\.(gate|expert_dropout)"):
        old = SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=2, gate="softmax",
                             expert_dropout=0.1)
    assert old.router == SigmaRouterConfig(gate="softmax", expert_dropout=0.1)
    with pytest.warns(DeprecationWarning):
        assert old.gate == "softmax"
    with pytest.raises(ValueError, match="must be a SigmaRouterConfig"):
        SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=2, router=SoftmaxRouterConfig())
    with pytest.raises(ValueError, match="no field"):
        SigmaMoEConfig(d_model=8, num_experts=4, expert_size=4, k=2, router={"capacity": 2})
