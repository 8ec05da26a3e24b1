import json
import os
import re

import pytest

from sparseffn import cli
from sparseffn.bench.measure import saved_bytes
from sparseffn.bench.peers import grouped_mm_missing_on
from sparseffn import DenseMLP, SigmaMoE
import torch

REQUIRED = {"config", "pass", "moe_ms", "dense_param_ms", "dense_active_ms", "ratio_param",
            "ratio_active", "moe_saved_bytes", "dense_param_saved_bytes", "expert_gemms_ms",
            "ratio_expert_gemms", "expert_gemms_over_active"}


def test_bench_layers_writes_one_record_per_config_and_pass(tmp_path, capsys):
    path = tmp_path / "out" / "layers.json"
    assert cli.main(["bench", "layers", "--tokens", "64", "--repeats", "1",
                     "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    layer_records = [r for r in records if "router" not in r]
    router_records = [r for r in records if "router" in r]
    assert [(r["config"], r["pass"]) for r in layer_records] == [
        (c, p) for c in "abc" for p in ("forward", "forward_backward")]
    from sparseffn.bench.moe_routers import ROUTER_ROWS
    assert [r["router"] for r in router_records] == \
        ["sigma"] * 3 + [name for name, _, _ in ROUTER_ROWS]
    from sparseffn import MoEConfig, param_equal_dense
    for r in router_records:
        cfg = MoEConfig(d_model=r["d_model"], num_experts=r["num_experts"],
                        expert_size=r["expert_size"], k=r["k"], router=r["router_config"])
        assert r["dense_param_d_ff"] == param_equal_dense(cfg).d_ff   # its own param-equal dense
        assert r["moe_ms"] > 0 and r["ratio_param"] > 0
        if r["router"] == "sigma":
            assert r["ratio_sigma_same_k"] == 1.0
        assert (r["dropped_fraction"] is not None) == (
            r["router"].startswith("switch") or r["router"] in ("gshard", "expert_choice"))
    out = capsys.readouterr().out
    assert "/σ-MoE same k" in out and "noisy_topk" in out
    for r in layer_records:
        assert REQUIRED <= set(r)
        assert r["moe_ms"] > 0 and r["dense_active_ms"] > 0
        assert r["ratio_active"] == pytest.approx(r["moe_ms"] / r["dense_active_ms"])
        assert r["ratio_expert_gemms"] == pytest.approx(r["moe_ms"] / r["expert_gemms_ms"])
        assert r["expert_gemms_over_active"] == pytest.approx(
            r["expert_gemms_ms"] / r["dense_active_ms"])
        if r["config"] == "c":
            assert r["dense_param_ms"] is None and r["ratio_param"] is None
        else:
            assert r["ratio_param"] == pytest.approx(r["moe_ms"] / r["dense_param_ms"])
    assert "moe/active" in out and "moe/gemms" in out and f"wrote {path}" in out


@pytest.mark.parametrize("backward", [False, True])
def test_expert_gemms_computes_each_experts_products(backward):
    """The GEMM-only reference multiplies each expert's block (empty experts skipped) and,
    with backward, also computes the four backward products."""
    from sparseffn.bench.gemm_bound import ExpertGemms

    counts = [3, 0, 5, 1]
    g = ExpertGemms(counts, d_model=6, expert_size=4, backward=backward)
    g.dh.fill_(float("nan"))
    g.dw1.fill_(float("nan"))
    g()
    start = 0
    for e, n in enumerate(counts):
        r = slice(start, start + n)
        start += n
        if n == 0:
            continue
        h = g.x[r] @ g.w1[e].t()
        torch.testing.assert_close(g.h[r], h)
        torch.testing.assert_close(g.y[r], h @ g.w2[e])
        if backward:
            dh = g.dy[r] @ g.w2[e].t()
            torch.testing.assert_close(g.dh[r], dh)
            torch.testing.assert_close(g.dw2[e], h.t() @ g.dy[r])
            torch.testing.assert_close(g.dx[r], dh @ g.w1[e])
            torch.testing.assert_close(g.dw1[e], dh.t() @ g.x[r])
    if not backward:   # the forward-only reference leaves the backward outputs untouched
        assert torch.isnan(g.dh).all() and torch.isnan(g.dw1).all()


def test_saved_bytes_counts_distinct_storages():
    x = torch.randn(32, 16)
    dense = DenseMLP(d_model=16, d_ff=64)
    # x, W1, relu output (shared by relu and the second matmul), W2
    want = (32 * 16 + 64 * 16 + 32 * 64 + 16 * 64) * 4
    assert saved_bytes(dense, x) == want
    moe = SigmaMoE(d_model=16, num_experts=4, expert_size=16, k=1)
    assert saved_bytes(moe, x) < want


def test_no_routers_leaves_the_router_rows_out(tmp_path):
    path = tmp_path / "layers.json"
    assert cli.main(["bench", "layers", "--tokens", "32", "--repeats", "1", "--configs", "a",
                     "--no-routers", "--json", str(path)]) == 0
    assert all("router" not in r for r in json.loads(path.read_text()))


def test_bench_layers_under_bf16_autocast_says_so_in_every_record(tmp_path):
    path = tmp_path / "layers.json"
    assert cli.main(["bench", "layers", "--tokens", "32", "--repeats", "1", "--configs", "a",
                     "--no-routers", "--dtype", "bfloat16", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["device"], r["dtype"]) for r in records] == [("cpu", "bfloat16")] * 2
    assert all("peak_mib" not in r for r in records)    # the allocator's peak: CUDA only


def test_expert_gemms_run_in_the_dtype_asked_for():
    from sparseffn.bench.gemm_bound import ExpertGemms
    gemms = ExpertGemms([3, 0, 5], d_model=8, expert_size=4, backward=True,
                        dtype=torch.bfloat16)
    gemms()
    assert gemms.y.dtype == gemms.dw1.dtype == torch.bfloat16
    want = gemms.x[:3].float() @ gemms.w1[0].float().t()
    torch.testing.assert_close(gemms.h[:3].float(), want, atol=0.1, rtol=0.02)


def test_bad_arguments_exit_with_a_message(capsys):
    assert cli.main(["bench", "layers", "--tokens", "0"]) == 2
    assert "--tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "layers", "--configs", "z"])


def test_mixtral_style_peer_computes_the_same_mixture():
    """The peer we time is a faithful MoE: its output equals the per-token reference."""
    from tests.ops.reference import expert_mlp_reference
    from sparseffn import SigmaMoEConfig
    from sparseffn.bench.peers import MixtralStyleMoE

    peer = MixtralStyleMoE(SigmaMoEConfig(d_model=8, num_experts=5, expert_size=6, k=2))
    x = torch.randn(9, 8)
    probs = torch.softmax(peer.gate(x), -1)
    weights, indices = probs.topk(2, dim=-1)
    w1 = torch.stack([e[0].weight.t() for e in peer.experts])
    w2 = torch.stack([e[2].weight.t() for e in peer.experts])
    ref = expert_mlp_reference(x, indices, weights / weights.sum(-1, keepdim=True), w1, w2,
                               torch.relu)
    torch.testing.assert_close(peer(x), ref, atol=1e-5, rtol=1e-5)


def test_runtime_allocator_tuning_is_idempotent():
    import sys
    from sparseffn import tune_cpu_allocator
    first = tune_cpu_allocator()
    assert tune_cpu_allocator() is first
    if sys.platform.startswith("linux"):
        assert first is True


def test_bench_routers_writes_json_plot_and_table_2(tmp_path, capsys):
    from sparseffn.bench.tree_routers import METHODS
    path, png = tmp_path / "routers.json", tmp_path / "plots" / "routers.png"
    assert cli.main(["bench", "routers", "--depths", "1-3", "--batch", "16", "--dim", "32",
                     "--repeats", "1", "--max-matrix-depth", "2", "--json", str(path),
                     "--plot", str(png)]) == 0
    records = json.loads(path.read_text())
    keys = {(r["method"], r["depth"], r["pass"]) for r in records}
    for method in METHODS:
        for depth in (1, 2, 3):
            for pass_name in ("forward", "forward_backward"):
                expected = not (method == "hard" and pass_name == "forward_backward") \
                    and not (method == "matrix" and depth == 3)
                assert ((method, depth, pass_name) in keys) == expected, (method, depth, pass_name)
    assert all(r["ms"] > 0 for r in records)
    assert {(r["device"], r["dtype"], r["timing"]) for r in records} == {("cpu", "float32",
                                                                           "eager")}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "Table 2" in out and "7.27 / 4.55" in out and "target: auto within 1.5x" in out


def test_table_2_sets_the_papers_gpu_column_beside_gpu_records():
    from sparseffn.bench.tree_routers import METHODS, format_table
    records = [{"method": m, "depth": d, "pass": "forward", "ms": 1.0 + i, "batch": 4, "dim": 8,
                "device": "cuda:0"} for i, m in enumerate(METHODS) for d in (1, 2)]
    table = format_table(records)
    assert "paper GPU" in table and "45.63 / 57.84" in table and "7.27 / 4.55" not in table


def test_table_2_is_the_harmonic_mean_of_speedups_over_orig():
    from sparseffn.bench.tree_routers import check_targets, harmonic_speedups
    rows = [("orig", 1, 4.0), ("moe", 1, 1.0), ("orig", 2, 4.0), ("moe", 2, 4.0),
            ("matrix", 1, 2.0), ("matrix", 2, 8.0), ("hard", 2, 0.5)]
    records = [{"method": m, "depth": d, "pass": "forward", "ms": ms} for m, d, ms in rows]
    speedups = harmonic_speedups(records, "forward", 8)
    assert speedups["moe"] == pytest.approx(2 / (1 / 4 + 1 / 1))
    assert speedups["matrix"] == pytest.approx(2 / (1 / 2 + 2))
    assert speedups["orig"] == 1.0 and speedups["hard"] is None     # hard lacks depth 1
    assert any("n/a" in line for line in check_targets(records))


def test_bench_fff_compares_with_fastfeedforward(tmp_path, capsys):
    path = tmp_path / "fff.json"
    assert cli.main(["bench", "fff", "--depths", "2", "--batch", "8", "--d-model", "6",
                     "--leaf-width", "3", "--repeats", "1", "--peers", "--json", str(path)]) == 0
    methods = {(r["method"], r["pass"]) for r in json.loads(path.read_text())}
    assert {("ours_soft", "forward"), ("ours_hard", "forward"),
            ("fastfeedforward_train", "forward_backward"),
            ("fastfeedforward_eval", "forward")} <= methods
    out = capsys.readouterr().out
    assert "once their missing leaf bias b2 is added" in out


def test_bench_tokenizers_times_both_engines_and_finds_them_agreeing(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tok.json"
    assert cli.main(["bench", "tokenizers", "--megabytes", "0.05", "--vocab-sizes", "300",
                     "--corpus", "pydoc", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["engine"] for r in records] == ["numpy", "tokenizers"]
    assert all(r["agrees_with_numpy"] and r["bytes"] == int(0.05 * (1 << 20)) and
               0 < r["tokens_per_byte"] < 1 for r in records)
    assert "speed-up train" in capsys.readouterr().out


def test_bench_distributed_measures_the_exchange_share(tmp_path, capsys):
    """Two exchanges on two processes (sizes read on the host, and fixed blocks at a tight
    factor, which drop pairs), none on one."""
    path = tmp_path / "dist.json"
    assert cli.main(["bench", "distributed", "--processes", "1", "2", "3", "--tokens", "64",
                     "--d-model", "16", "--num-experts", "4", "--expert-size", "8", "--k", "2",
                     "--repeats", "1", "--capacity-factor", "0.5", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    # 4 experts do not split over 3
    assert [(r["processes"], r["exchange"]) for r in records] == \
        [(1, "none"), (2, "sized"), (2, "fixed")]
    assert records[0]["all_to_all_ms"] == 0 and records[1]["all_to_all_ms"] > 0
    assert all(0 <= r["all_to_all_share"] < 1 and r["tokens_per_s"] > 0 for r in records)
    assert records[1]["dropped_fraction"] == 0 < records[2]["dropped_fraction"] < 1
    assert [r["capacity_factor"] for r in records] == [None, None, 0.5]
    assert "skipped: 4 experts do not split over 3" in capsys.readouterr().out
    assert {r["compile"] for r in records} == {"none"}
    # compiled: the fixed exchange runs inside the graph, so no exchange is timed alone
    assert cli.main(["bench", "distributed", "--processes", "2", "--tokens", "64", "--d-model",
                     "16", "--num-experts", "4", "--expert-size", "8", "--k", "2", "--repeats",
                     "1", "--capacity-factor", "0.5", "--compile", "default", "--json",
                     str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["exchange"], r["compile"], r["all_to_all_ms"]) for r in records] == \
        [("sized", "default", None), ("fixed", "default", None)]
    assert records[0]["dropped_fraction"] == 0 < records[1]["dropped_fraction"] < 1
    assert "compile: default" in capsys.readouterr().out
    for bad in ("0", "nan"):
        assert cli.main(["bench", "distributed", "--capacity-factor", bad]) == 2
        assert "--capacity-factor must be a finite number > 0" in capsys.readouterr().err


def test_bad_depths_are_rejected(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "routers", "--depths", "0-3"])
    assert "depths must lie in 1..20" in capsys.readouterr().err


PRODUCT_KEY_FIELDS = {"case", "n_experts", "method", "pass", "ms", "peak_bytes", "device",
                      "dtype"}


def test_bench_productkeys_writes_the_issue_fields_and_plot(tmp_path, capsys):
    path, png = tmp_path / "pk.json", tmp_path / "pk.png"
    assert cli.main(["bench", "productkeys", "--exponents", "6,7", "--scaling-tokens", "16",
                     "--tokens", "16", "--repeats", "1", "--cases", "scaling", "pkm",
                     "--json", str(path), "--plot", str(png)]) == 0
    records = json.loads(path.read_text())
    assert all(PRODUCT_KEY_FIELDS <= set(r) for r in records)
    assert {(r["device"], r["dtype"]) for r in records} == {("cpu", "float32")}
    cases = {(r["case"], r["method"], r["n_experts"]) for r in records}
    assert {("scaling", "product_keys", 64), ("scaling", "naive", 128),
            ("pkm", "sparseffn", 512 ** 2)} <= cases
    assert {("pkm_product_key_memory", "product_key_memory", 512 ** 2)} <= cases
    assert png.stat().st_size > 0
    out = capsys.readouterr().out
    assert "retrieve the same 16 keys for 100.0%" in out
    assert "PKM forward_backward: product-key-memory / ours" in out


def test_peers_given_our_weights_compute_the_same_layer():
    """The weight mapping the benchmark relies on: peer-pytorch and product-key-memory with
    our weights give our outputs."""
    from sparseffn import PEER, PEERConfig, PKMConfig, ProductKeyMemory
    from sparseffn.bench import product_keys as bench
    torch.manual_seed(0)
    ours = PEER(PEERConfig(d_model=16, num_experts=64, heads=2, k=4))
    theirs = bench._peer_pytorch(ours)
    x = torch.randn(20, 16)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)
    ours = ProductKeyMemory(PKMConfig(d_model=16, num_subkeys=8, heads=2, k=4, query="linear",
                                      key_dim=12, query_norm="layernorm"))
    theirs = bench._product_key_memory(ours)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)


def test_peak_bytes_sees_a_temporary():
    from sparseffn.bench.measure import peak_bytes

    def make():
        big = torch.ones(1 << 20)        # 4 MB, freed before returning
        return big.sum()
    assert peak_bytes(make) >= 4 << 20


def test_bad_exponents_are_rejected(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "productkeys", "--exponents", "1-30"])
    assert "exponents must lie in 2..24" in capsys.readouterr().err


def test_bench_sparse_grad_twin_shares_parameters_and_gives_sparse_gradients():
    from sparseffn import PEER, PEERConfig
    from sparseffn.bench.product_keys import with_sparse_grad
    layer = PEER(PEERConfig(d_model=8, num_experts=16, heads=2, k=3, key_dim=4))
    twin = with_sparse_grad(layer)
    assert twin.store.w_in is layer.store.w_in and not layer.store.sparse_grad
    twin(torch.randn(5, 8)).sum().backward()
    assert layer.store.w_in.grad.is_sparse                  # the shared table, sparse gradient
    layer.zero_grad(set_to_none=True)
    layer(torch.randn(5, 8)).sum().backward()
    assert not layer.store.w_in.grad.is_sparse              # the original is unchanged


def test_bench_lm_times_every_preset_beside_the_parameter_equal_dense(tmp_path, capsys):
    from sparseffn.models import PRESETS
    path = tmp_path / "lm.json"
    assert cli.main(["bench", "lm", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
                     "--context", "8", "--batch", "2", "--d-ff", "256", "--repeats", "1",
                     "--device", "cpu", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["preset"] for r in records] == list(PRESETS)   # dense first, then the rest
    dense = records[0]
    assert dense["over_dense"] == 1.0 and dense["dtype"] == "float32"
    for r in records:
        assert r["total_params"] <= dense["total_params"] * 1.01, r["preset"]
        assert r["active_params"] <= r["total_params"] and r["ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(2 * 8 / r["ms"] * 1e3)
        assert r["peak_mib"] is None        # the allocator's peak is CUDA only
    sigma = next(r for r in records if r["preset"] == "sigma_moe")
    assert sigma["active_params"] < dense["active_params"]
    out = capsys.readouterr().out
    assert "ms/step" in out and "sigma_moe" in out


def test_bench_generate_times_the_three_modes_of_every_preset(tmp_path, capsys):
    from sparseffn.models import PRESETS
    path = tmp_path / "generate.json"
    assert cli.main(["bench", "generate", "--d-model", "32", "--n-layers", "2", "--n-heads",
                     "2", "--context", "12", "--d-ff", "256", "--prompt", "3", "--batch", "2",
                     "--repeats", "1", "--device", "cpu", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["preset"] for r in records] == list(PRESETS)   # dense first, then the rest
    assert records[0]["cache_over_dense"] == 1.0
    for r in records:
        assert r["tokens"] == 9 and r["batch"] == 2 and r["same_tokens"], r["preset"]
        assert r["cache_ms_per_token"] > 0 and r["window_ms_per_token"] > 0
        assert r["static_ms_per_token"] > 0 and r["compile"] == "none"
        assert r["window_over_cache"] > 0 and r["static_over_cache"] > 0
    out = capsys.readouterr().out
    assert "window/cache" in out and "static/dense" in out and "peer" in out
    assert cli.main(["bench", "generate", "--context", "8", "--prompt", "9"]) == 2
    assert "the prompt must hold 1..context (8) tokens" in capsys.readouterr().err


def test_bench_generate_onnx_times_onnx_runtime_beside_pytorch(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    path = tmp_path / "generate.json"
    assert cli.main(["bench", "generate", "--presets", "pkm", "--d-model", "32",
                     "--n-layers", "2", "--n-heads", "2", "--context", "12", "--d-ff", "256",
                     "--prompt", "3", "--repeats", "1", "--device", "cpu", "--onnx",
                     "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["preset"] for r in records] == ["dense", "pkm"]
    for r in records:       # same tokens: ONNX Runtime's draws are PyTorch's too
        assert r["onnx_ms_per_token"] > 0 and r["onnx_over_cache"] > 0 and r["same_tokens"]
    assert records[0]["onnx_over_dense"] == 1.0
    assert "onnx/cache" in capsys.readouterr().out
    assert cli.main(["bench", "generate", "--onnx", "--dtype", "bfloat16", "--device",
                     "cpu"]) == 2
    assert "--onnx runs ONNX Runtime's CPU provider in float32, not on cpu in bfloat16" in \
        capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, None])
def test_bench_lms_float16_step_scales_the_loss_as_training_does(monkeypatch, dtype):
    """From a loss scale of 2^60 the scaled float16 gradients overflow: the step is skipped
    and no weight moves, as in ``train.fp16``. bf16 and float32 steps have no scale, and
    move the weights."""
    from sparseffn.bench import lm_step
    from sparseffn.train import loss_scaling
    monkeypatch.setattr(loss_scaling, "INITIAL_LOSS_SCALE", 2.0 ** 60)
    model = lm_step.lm_model("sigma_moe", d_model=32, n_layers=1, n_heads=2, context=8,
                             d_ff=256)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lm_step.training_step_fn(model, lm_step.byte_tokens(2, 8), dtype)()
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert (moved == []) == (dtype == torch.float16)


def test_bench_lm_compiles_each_model_when_asked(tmp_path, capsys):
    path = tmp_path / "lm.json"
    assert cli.main(["bench", "lm", "--presets", "sigma_moe", "--d-model", "32", "--n-layers",
                     "1", "--n-heads", "2", "--context", "8", "--batch", "2", "--d-ff", "256",
                     "--repeats", "1", "--device", "cpu", "--compile", "default",
                     "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["preset"], r["compile"], r["compiled"]) for r in records] == [
        ("dense", "default", True), ("sigma_moe", "default", True)]
    out = capsys.readouterr().out
    assert "does not compile" not in out
    # each model's line as it compiles, before the table (a log cut off mid-run shows them)
    assert re.search(r"dense: compiled in \d+ s\n(.*\n)*  sigma_moe: compiled in \d+ s\n"
                     r"(.*\n)*preset ", out)
    with pytest.raises(SystemExit):
        cli.main(["bench", "lm", "--compile", "max"])
    assert "invalid choice: 'max'" in capsys.readouterr().err


def test_a_step_that_does_not_compile_is_timed_eagerly(capsys):
    from sparseffn.bench.measure import first_call_or_eager
    built = []

    def make_eager():
        built.append(1)
        return lambda: None

    def broken():
        raise RuntimeError("no graph for you")
    step, ok = first_call_or_eager(lambda: None, make_eager, "fine")
    assert ok and built == []                 # the eager step is built only when needed
    step, ok = first_call_or_eager(broken, make_eager, "layer")
    assert not ok and built == [1] and step is not broken
    assert "layer: does not compile (RuntimeError: no graph for you); timed eagerly" in \
        capsys.readouterr().out
    calls = []

    def fails_when_captured():   # CUDA graphs: the first call warms up, the second records
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during capture")
    step, ok = first_call_or_eager(fails_when_captured, make_eager, "peer")
    assert not ok and built == [1, 1] and step is not fails_when_captured
    assert "peer: does not compile (RuntimeError: Cannot copy" in capsys.readouterr().out


def test_a_compiled_step_that_cuda_graphs_skipped_says_so(capsys):
    """Under "reduce-overhead" Inductor runs a graph holding a CPU tensor without CUDA graphs
    and says nothing; the line after the first calls counts the graphs it skipped (faked
    here: the step bumps Inductor's counter as a skip does)."""
    from torch._dynamo.utils import counters

    from sparseffn.bench.measure import first_call_or_eager

    def skipped_once():
        counters["inductor"]["cudagraph_skips"] += 1 if not calls else 0
        calls.append(1)
    calls = []
    first_call_or_eager(lambda: None, lambda: None, "whole")
    first_call_or_eager(skipped_once, lambda: None, "switch")
    out = capsys.readouterr().out
    assert "whole: compiled in 0 s\n" in out
    assert "switch: compiled in 0 s; CUDA graphs skipped for 1 graph (TORCH_LOGS=cudagraphs " \
        "says why)" in out


def test_bench_generate_counts_the_graphs_inductor_ran_without_cuda_graphs(monkeypatch,
                                                                           tmp_path, capsys):
    """The static steps' warm-up of each preset is where Inductor compiles them; a skip is
    faked there for pkm (no CUDA here)."""
    from torch._dynamo.utils import counters

    from sparseffn.bench import generation
    original = generation.Decoder.generate

    def generate(self, *args, **kwargs):
        if self.model.blocks[0].ffn.__class__.__name__ == "ProductKeyMemory" and not warmed:
            counters["inductor"]["cudagraph_skips"] += 2
            warmed.append(self)
        return original(self, *args, **kwargs)
    warmed = []
    monkeypatch.setattr(generation.Decoder, "generate", generate)
    path = tmp_path / "generate.json"
    assert cli.main(["bench", "generate", "--presets", "pkm", "--d-model", "32", "--n-layers",
                     "1", "--n-heads", "2", "--context", "8", "--d-ff", "256", "--prompt", "3",
                     "--repeats", "1", "--device", "cpu", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["preset"], r["static_cudagraph_skips"]) for r in records] == [("dense", 0),
                                                                             ("pkm", 2)]
    out = capsys.readouterr().out
    assert ("  pkm: static steps compiled; CUDA graphs skipped for 2 graphs "
            "(TORCH_LOGS=cudagraphs says why)\n") in out
    assert "dense: static steps" not in out


def test_host_sync_in_names_the_sparseffn_line_that_synchronised(monkeypatch):
    """The check of scripts/gpu_check.py, gpu_lm_sync.py and ``bench compile``: the step runs
    under sync debug mode "error" (faked here: no CUDA), which is set back afterwards, and a
    RuntimeError raised below sparseffn code is reported at that code's line."""
    import importlib
    from sparseffn.bench.measure import host_sync_in
    grouped_mm = importlib.import_module("sparseffn.ops.grouped_mm")
    modes = ["default"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert host_sync_in(lambda: None, torch.device("cuda")) is None
    assert modes == ["default", "error", "default"]
    if hasattr(torch, "_grouped_mm"):   # PyTorch >= 2.8; before, nothing to probe
        monkeypatch.setattr(grouped_mm, "_GROUPED_MM_OK", {})   # the probe, inside a capture
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        found = host_sync_in(lambda: grouped_mm._grouped_mm_usable(torch.device("cuda"),
                                                                    torch.float16),
                             torch.device("cuda"))
        assert found.startswith("ops/grouped_mm.py:") and "CUDA graph capture" in found
    found = host_sync_in(lambda: grouped_mm._loop_mm(torch.ones(3, 2), torch.ones(2, 2, 2),
                                                     [1, 1]), torch.device("cuda"))
    assert found.startswith("ops/grouped_mm.py:"), found     # not torch's frame below it
    assert modes[-1] == "default"
    with pytest.raises(ValueError):        # only RuntimeErrors are host synchronisations
        host_sync_in(lambda: int("x"), torch.device("cuda"))
    assert modes[-1] == "default"


def test_bench_lm_rejects_an_unknown_preset_and_a_bad_size(capsys):
    assert cli.main(["bench", "lm", "--presets", "dense", "nope", "--device", "cpu",
                     "--d-model", "32", "--n-heads", "2", "--d-ff", "64"]) == 2
    assert "unknown FFN preset(s) nope" in capsys.readouterr().err
    assert cli.main(["bench", "lm", "--context", "0"]) == 2
    assert "--context must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["lm", "fig2"])
def test_bench_deterministic_times_under_deterministic_algorithms_and_restores(
        bench, tmp_path, capsys, monkeypatch):
    """--deterministic times the steps as `sparseffn train` runs them by default, says so in
    the header and the records, and leaves the process's setting as it found it."""
    from sparseffn.bench import measure
    seen, original = [], measure.interleaved_times

    def timed(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(*args, **kwargs)
    monkeypatch.setattr(measure, "interleaved_times", timed)   # both benchmarks' timing
    sizes = (["--presets", "sigma_moe", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
              "--context", "8", "--batch", "2", "--d-ff", "256"] if bench == "lm" else
             ["--d-models", "128", "--tokens", "32", "--dtype", "float32"])
    path = tmp_path / "out.json"
    for flag in ([], ["--deterministic"]):
        assert cli.main(["bench", bench, *sizes, "--repeats", "1", "--device", "cpu",
                         "--json", str(path), *flag]) == 0
        records = json.loads(path.read_text())
        assert {r["deterministic"] for r in records} == {bool(flag)}
        assert ("deterministic algorithms" in capsys.readouterr().out) == bool(flag)
        assert not torch.are_deterministic_algorithms_enabled()
    assert seen == [False, True]


def test_deterministic_algorithms_restores_the_previous_setting():
    from sparseffn.runtime import deterministic_algorithms
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic_algorithms(False, torch.device("cpu")):
            assert not torch.are_deterministic_algorithms_enabled()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        with pytest.raises(KeyError), deterministic_algorithms(True, torch.device("cpu")):
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
            raise KeyError("an error inside the block")
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_bench_fig2_rejects_widths_it_cannot_split_into_k_experts_of_128(capsys):
    assert cli.main(["bench", "fig2", "--d-models", "512,200", "--device", "cpu"]) == 2
    assert "--d-models must be multiples of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # 4·64 / 128 = 2 experts, fewer than k = 4
        cli.main(["bench", "fig2", "--d-models", "64"])
    assert "d-models must lie in 128..65536" in capsys.readouterr().err


def test_bench_fig2_compiles_the_peers_but_the_mixtral_loop(tmp_path):
    """Under --compile the plain grouped_mm peer compiles (bf16: what its meta kernel takes);
    the loop, whose shapes follow the routing, is timed eagerly."""
    path = tmp_path / "fig2.json"
    assert cli.main(["bench", "fig2", "--d-models", "128", "--tokens", "32", "--repeats", "1",
                     "--device", "cpu", "--peers", "--compile", "default", "--json",
                     str(path)]) == 0
    (record,) = json.loads(path.read_text())
    want = {"sparseffn": True, "dense_param": True, "dense_active": True,
            "grouped_mm": True, "mixtral_loop": False}
    if grouped_mm_missing_on("cpu"):    # PyTorch < 2.9: the peer is skipped, and said so
        del want["grouped_mm"]
    assert record["compiled"] == want


def test_bench_fig2_runs_on_cpu_and_writes_ratios_to_the_dense_mlp(tmp_path, capsys):
    path = tmp_path / "fig2.json"
    assert cli.main(["bench", "fig2", "--d-models", "128", "--tokens", "48", "--repeats", "1",
                     "--device", "cpu", "--dtype", "float32", "--peers", "--json",
                     str(path)]) == 0
    (record,) = json.loads(path.read_text())
    assert record["num_experts"] == 4 and record["k"] == 4 and record["expert_size"] == 128
    assert set(record["ms"]) == {"sparseffn", "dense_param", "dense_active", "mixtral_loop"} | (
        set() if grouped_mm_missing_on("cpu") else {"grouped_mm"})
    assert record["over_dense_param"]["dense_param"] == 1.0
    assert record["best_peer"] in {"grouped_mm", "mixtral_loop"}
    assert record["best_peer_over_sparseffn"] > 0
    assert record["compile"] == "none" and not any(record["compiled"].values())
    assert record["router_precision"] == "autocast"
    out = capsys.readouterr().out
    assert "the CUDA kernels (Csordás CVMM, ScatterMoE, Liger) skipped on cpu" in out
    assert "router precision autocast, compile none" in out


def test_forward_backward_fn_backpropagates_a_fixed_output_gradient_and_the_extra_loss():
    """The benchmarks' step: the gradients are those of (out · dout).sum() + extra, with dout
    handed over in the output's dtype (made once), and the same in every call."""
    from sparseffn.bench.measure import forward_backward_fn
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 6)
    x = torch.randn(5, 6)
    torch.manual_seed(1)
    run = forward_backward_fn(layer, x, extra_loss=lambda m: m.weight.square().sum())
    torch.manual_seed(1)
    dout = torch.randn_like(x)
    run()
    first = layer.weight.grad.clone()
    run()                                       # gradients are reset, not accumulated
    w = layer.weight.detach().requires_grad_()
    b = layer.bias.detach().requires_grad_()
    ((x @ w.t() + b) * dout).sum().add(w.square().sum()).backward()
    torch.testing.assert_close(layer.weight.grad, w.grad)
    torch.testing.assert_close(first, w.grad)
    torch.testing.assert_close(layer.bias.grad, b.grad)
    seen = []
    hook = layer.register_full_backward_hook(lambda m, gin, gout: seen.append(gout[0].dtype))
    forward_backward_fn(layer, x, autocast_dtype=torch.bfloat16)()
    hook.remove()
    assert seen == [torch.bfloat16]             # the output's dtype under autocast


def _gpu_session_commands() -> dict[str, str]:
    """Each stage of scripts/gpu_session.sh: its command line, continuation lines joined."""
    from pathlib import Path
    text = (Path(__file__).parents[1] / "scripts" / "gpu_session.sh").read_text()
    text = re.sub(r"\\\n\s*", " ", text)
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s+([\w-]+)\) (.*?);;", text, re.M)}


def test_every_gpu_session_stage_names_flags_and_presets_this_version_has():
    """A lent GPU comes rarely and for 15 minutes: a stage that dies on a renamed flag or preset
    wastes a call. Every ``sparseffn`` command of the script parses, and every preset it names
    exists."""
    import shlex
    from sparseffn.models import PRESETS
    stages = _gpu_session_commands()
    assert {"tests", "lm-graphs", "fig2-graphs", "profile-lm", "routers-graphs", "lm-first",
            "train-quick", "tests-new", "fig2-eager", "lm-layers-first",
            "profile-first", "profile-fig2-eager", "tests-parts", "lm-layers-fff",
            "lm-deterministic"} <= set(stages)
    parsed = 0
    for name, line in stages.items():
        words = shlex.split(line.replace("$", "_"))
        if "sparseffn" in words and words[words.index("sparseffn") - 1] == "-m":
            args = cli.build_parser().parse_args(words[words.index("sparseffn") + 1:])
            parsed += 1
            assert set(getattr(args, "presets", None) or []) <= set(PRESETS), name
        if "--lm" in words:
            assert set(words[words.index("--lm") + 1].split(",")) <= {"dense", *PRESETS}, name
    assert parsed >= 10


def test_gpu_session_first_and_second_run_their_stages_each_under_sigint_at_its_limit(
        tmp_path):
    """``first`` (a session's one call) expands to its three stages in order, ``second`` to
    its three, each run under ``timeout -s INT`` so that a benchmark stopped at its limit still
    reports; an unknown stage is refused. The stages' Python is stood in for by a script
    that logs its arguments."""
    import subprocess
    from pathlib import Path
    script = Path(__file__).parents[1] / "scripts" / "gpu_session.sh"
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "ran: $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "OUT": str(tmp_path / "out"), "WHEELS": "/nowhere"}
    done = subprocess.run(["bash", str(script), "first"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^== ([\w-]+): exit 0$", done.stdout, re.M) == [
        "plan-check", "lm-first", "profile-first"]
    assert "SPARSEFFN_COUNTING_SORT=0" not in done.stdout
    lm_log = (tmp_path / "out" / "lm-first.log").read_text()
    assert "ran: -m sparseffn bench lm --device cuda --compile reduce-overhead" in lm_log
    assert "--time-limit 310" in lm_log
    assert "ran: scripts/gpu_profile.py --top 12 --lm dense,sigma_moe,pkm,fff_sparse" in \
        (tmp_path / "out" / "profile-first.log").read_text()
    assert "timeout -s INT -k 20" in script.read_text()
    done = subprocess.run(["bash", str(script), "second"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert re.findall(r"^== ([\w-]+): exit 0$", done.stdout, re.M) == [
        "tests-parts", "cvmm-graphs", "fig2-eager"]
    assert "--lm-shapes --rounds 5 --graphs" in \
        (tmp_path / "out" / "cvmm-graphs.log").read_text()
    refused = subprocess.run(["bash", str(script), "nope"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "unknown stage nope (first " in refused.stdout


def test_a_failed_plan_check_turns_the_counting_sort_off_for_the_later_stages(tmp_path):
    """``first`` begins with the counting sort's tests; where they fail, the stages after it
    run with ``SPARSEFFN_COUNTING_SORT=0`` (the PyTorch sort) instead of on a broken kernel."""
    import subprocess
    from pathlib import Path
    script = Path(__file__).parents[1] / "scripts" / "gpu_session.sh"
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in *test_triton_plan*) exit 1 ;; esac\n'
                    'echo "ran: $* sort=${SPARSEFFN_COUNTING_SORT:-on}"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "OUT": str(tmp_path / "out"), "WHEELS": "/nowhere"}
    env.pop("SPARSEFFN_COUNTING_SORT", None)
    done = subprocess.run(["bash", str(script), "first"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "== plan-check: exit 1" in done.stdout
    assert "SPARSEFFN_COUNTING_SORT=0 from here on" in done.stdout
    for stage in ("lm-first", "profile-first"):
        assert "sort=0" in (tmp_path / "out" / f"{stage}.log").read_text()


def test_gpu_profile_runs_the_eager_fig2_stage_on_the_cpu():
    """``profile-fig2-eager``'s flags (``--compile none --fig2``) parse and profile bench
    fig2's σ-MoE and dense steps (``--device cpu`` checks the script itself); the host's
    issue time of a step is at most its wall time."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).parents[1] / "scripts" / "gpu_profile.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--top", "3",
                           "--compile", "none", "--fig2", "512", "--tokens", "64"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^sigma_moe d_model 512: [\d.]+ ms CPU time", done.stdout, re.M)
    assert re.search(r"^dense_param d_model 512: [\d.]+ ms CPU time", done.stdout, re.M)
    spec = importlib.util.spec_from_file_location("gpu_profile", script)
    gpu_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_profile)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    issue, wall = gpu_profile.issue_and_wall_ms(lambda: a @ b, torch.device("cpu"), rounds=3)
    assert 0 < issue <= wall


def test_gpu_train_check_quick_runs_its_checks_on_the_cpu(tmp_path):
    """``train-quick``'s script (``--device cpu`` checks the script itself): the fp32, bf16
    and resume checks pass and are the only ones run."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).parents[1]
    path = tmp_path / "checks.json"
    done = subprocess.run([sys.executable, str(root / "scripts" / "gpu_train_check.py"),
                           "--device", "cpu", "--quick", "--presets", "sigma_moe", "--steps",
                           "4", "--json", str(path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(path.read_text())
    assert [(r["check"], r["ok"]) for r in results] == [
        ("fp32 vs cpu", True), ("ms per step", True), ("bf16 autocast", True),
        ("resume to the bit", True)]


def test_test_torch_version_installs_that_torch_apart_and_runs_pytest_there(tmp_path):
    """``scripts/test_torch_version.sh VERSION ARGS``: its own venv gets ``torch==VERSION``
    (with NumPy below 2.3, for Triton 3.6's interpreter) and the test extras, then pytest runs
    there with ARGS and a kernel cache of its own; without a version it refuses. A stand-in
    Python logs what it is asked."""
    import subprocess
    from pathlib import Path
    script = Path(__file__).parents[1] / "scripts" / "test_torch_version.sh"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "log"
    fake = venv / "bin" / "python"
    fake.write_text(f'#!/bin/sh\necho "ran: $* cache=$SPARSEFFN_CACHE_DIR" >> {log}\n'
                    '[ "$1" = "-" ] && cat > /dev/null\nexit 0\n')
    fake.chmod(0o755)
    env = {**os.environ, "VENV": str(venv)}
    done = subprocess.run(["bash", str(script), "2.11.0", "tests/test_hf.py", "-x"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = log.read_text().splitlines()
    assert ran[0].startswith("ran: -m pip install") and "torch==2.11.0 numpy<2.3 -e .[test]" \
        in ran[0]
    assert ran[-1] == (f"ran: -m pytest -p no:cacheprovider tests/test_hf.py -x "
                       f"cache={venv}/sparseffn-cache")
    refused = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode != 0 and "usage: bash scripts/test_torch_version.sh VERSION" \
        in refused.stderr
