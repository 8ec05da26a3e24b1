import pytest

from sparseffn import (DenseMLP, DenseMLPConfig, SigmaMoE, SigmaMoEConfig,
                       TopKMLPConfig, active_equal_dense, build_layer, compare_with_dense,
                       param_equal_dense)


def _numel(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("cfg", [
    DenseMLPConfig(d_model=12, d_ff=40), DenseMLPConfig(d_model=12, d_ff=40, bias=True),
    TopKMLPConfig(d_model=12, d_ff=40, k=3),
    SigmaMoEConfig(d_model=12, num_experts=5, expert_size=7, k=2),
])
def test_counted_parameters_equal_the_module(cfg):
    assert cfg.cost().total_params == _numel(build_layer(cfg))


@pytest.mark.parametrize("num_experts, expert_size, k", [(16, 128, 4), (64, 32, 16), (256, 128, 4),
                                                         (8, 10, 1)])
def test_param_equal_dense_is_exact(num_experts, expert_size, k):
    cfg = SigmaMoEConfig(d_model=512, num_experts=num_experts, expert_size=expert_size, k=k)
    dense = param_equal_dense(cfg)
    assert _numel(DenseMLP(dense)) == _numel(SigmaMoE(cfg))
    # Csordás et al. 2023: the selection network's parameters are compensated by widening d_ff
    assert dense.d_ff == num_experts * expert_size + num_experts // 2


def test_param_equal_dense_is_nearest_when_exact_is_impossible():
    cfg = SigmaMoEConfig(d_model=6, num_experts=3, expert_size=4, k=1)   # 3·6 + 3·48 = 162
    report = compare_with_dense(cfg)
    assert report.sparse.total_params == 162
    assert report.param_difference == cfg.d_model   # 162 / 12 = 13.5 -> d_ff 14
    assert report.dense.total_params == _numel(DenseMLP(report.dense_config))


def test_active_equal_dense_has_the_expert_flops():
    cfg = SigmaMoEConfig(d_model=512, num_experts=16, expert_size=128, k=4)
    dense = active_equal_dense(cfg)
    assert dense.d_ff == 512
    assert dense.cost().flops == cfg.cost().expert_flops


def test_table7_flops_fraction_and_active_params():
    cfg = SigmaMoEConfig(d_model=412, num_experts=16, expert_size=128, k=4)
    report = compare_with_dense(cfg)
    assert report.relative_expert_flops == pytest.approx(0.25)       # Csordás et al. 2023 Table 7
    assert report.sparse.active_params == 16 * 412 + 4 * 2 * 412 * 128
    assert report.sparse.flops == 2 * 16 * 412 + 4 * 4 * 412 * 128
    assert 0.25 < report.relative_flops < 0.26                       # + the selection network
    d = report.as_dict()
    assert d["dense_d_ff"] == 2048 + 8 and d["total_params"] == d["dense_params"]
    big = compare_with_dense(cfg.replace(num_experts=128))
    assert big.relative_expert_flops == pytest.approx(4 / 128)


def test_topk_costs():
    cfg = TopKMLPConfig(d_model=10, d_ff=40, k=4)
    report = compare_with_dense(cfg)
    assert report.param_difference == 0
    assert report.sparse.active_params == 10 * 40 + 4 * 10
    assert report.dense_config.d_ff == 40


@pytest.mark.parametrize("cfg", [
    SigmaMoEConfig(d_model=64, num_experts=8, expert_size=32, k=2),
    SigmaMoEConfig(d_model=48, num_experts=5, expert_size=7, k=3),
])
def test_compute_equal_dense_reads_as_many_parameters_per_token(cfg):
    from sparseffn.matching import compute_equal_dense
    dense = compute_equal_dense(cfg)
    # k experts of expert_size units plus the selection network's d_model·E weights
    assert dense.d_ff == cfg.k * cfg.expert_size + (cfg.num_experts + 1) // 2
    assert abs(dense.cost().total_params - cfg.cost().active_params) <= cfg.d_model
    assert dense.cost().total_params < param_equal_dense(cfg).cost().total_params
