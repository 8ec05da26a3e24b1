"""Each LM preset's FFN layer at the LM's shapes, forward+backward, replayed from CUDA graphs,
with each change not yet timed on a GPU switched off (one, not yet used, on) in turn, all in the
same rounds.

    python scripts/gpu_lm_layers.py [--presets sigma_moe,pkm] [--tokens 16384] [--rounds 10]

``sparseffn bench lm`` (d_model 256, each FFN sized to a dense d_ff 2048 MLP, 64 × 256
tokens) times the whole step, so it shows the changes made since the last GPU timing only
together. Here each layer is timed alone, in three versions where they apply:

- ``now``: the layer as it is;
- ``unpadded`` (σ-MoE, Switch, GLaM, FFF): experts keep their 255 (FFF 254) hidden units
  instead of being padded with zero units to 256 (``ops/expert_mlp.py``, ``HIDDEN_MULTIPLE``);
- ``bf16 gates`` (the same): the backward's products take the gates in bf16, not widened to
  float32 (``ops/cvmm.py``, ``backward_gate_rows``);
- ``unsplit`` (the same): each expert's weight gradient summed by one program a tile, not
  split over several where the tiles are too few (``ops/triton_cvmm.py``,
  ``WEIGHT_GRAD_SPLITS``; at these shapes, 5 ranges of an expert's rows on an H100);
- ``parts 2nd launch`` (the same): the split weight gradient's ranges and the gate
  gradient's column tiles added by ``sum_partials`` in a launch of their own, as before the
  fifty-fourth session, not by the last program of each block to finish
  (``ADD_PARTS_IN_KERNEL``);
- ``torch.sort plan`` (the same): the dispatch plan (and Switch's capacity positions) by a
  stable ``torch.sort`` and a ``searchsorted`` (about eight launches each), as before the
  fifty-fifth session, not by the two launches of the counting sort (``ops/triton_plan.py``);
- ``two kernels`` (PKM, PEER): ``gather_sum``'s table and weight gradients from
  ``scatter_rows`` and ``gather_dot`` instead of one pass (``kernels.scatter_rows_dot``);
- ``torch sinkhorn`` (S-BASE): the training assignment's Sinkhorn iterations and top-k as
  PyTorch ops instead of the Triton kernels (``ops/triton_sinkhorn.py``, one launch per
  iteration; the assignment may differ where the plan has near-ties);
- ``no triton`` (the MoE presets): every operator of the layer on its PyTorch CUDA path,
  the experts' products as ``torch._grouped_mm`` (``triton_cvmm.set_triton_enabled(False)``).
  ``bench fig2`` found that path 0.89 of the Triton one's time at d_model 512 and slower at
  1024 and 2048; this says which one wins at the LM's d_model of 256;
- ``unfused biases`` (sparse FFF, whose leaves have biases): the experts as before the
  fifty-sixth session: two CVMM calls with the first bias added to the hidden rows, a ReLU
  pass between them, its gradient apart, and ``b2`` gathered, not the fused path with the
  biases as weights of a constant input (``expert_mlp._biased_relu_experts``);
- ``index_add b1`` (the same): that unfused path with the first bias's gradient by
  ``index_select``'s backward, an ``index_add_`` (atomics), as before
  ``expert_mlp.add_expert_bias`` summed each expert's rows by the weight-gradient kernel;
- ``dense_rows by slot`` (PKM, PEER): the product-key backward's ``dense_rows`` kernel
  loading its pairs one slot at a time (two dependent loads a slot, 32 slots at these
  shapes), as before the fifty-seventh session, not a tile of 32 slots at once
  (``triton_rows.DENSE_ROWS_SLOTS``; the same sums);
- ``grouped weight grads`` (the MoE presets): both expert weight gradients as
  ``torch._grouped_mm`` (cuBLAS's grouped GEMM on Hopper) on rows gathered and gate-scaled
  beforehand, the rest of the layer on the Triton kernels: whether the weight gradients,
  23% of σ-MoE's compiled LM step on an H200, should take it where it runs;
- ``usage by index_add`` (PKM, PEER): the usage statistics summed by an ``index_add_`` of
  every pair into a [2, N] buffer (float atomics on CUDA), as before the fifty-eighth
  session, not read from the row index the table gradients sort anyway (its offsets and one
  ``scatter_rows`` with a column of ones, ``Routing.row_index``);
- ``dense products`` (PKM, PEER): switched *on*, as it is off by default: the gathered-row
  products of their tables as dense bf16 GEMMs (``ops/dense_products.py``), which cost 2·N·d
  FLOPs a token against m·d elements read; at these tables (3,844 and 1,444 rows, 128 and 32
  pairs a token) the arithmetic favours them on an H100. If they win, turn them on for small
  tables by default;

beside the dense FFN of equal parameters (``dense``). The keyed product-key top-k, also not yet
timed in a layer, is timed kernel against kernel by ``scripts/gpu_rows_calls.py``.

A step is the layer's forward under bf16 autocast (the weight cache off, as CUDA graphs
require) and the backward of its output, from a fixed random gradient, and of its weighted
auxiliary losses. Each version's calls are captured as one CUDA graph
(``measure.graph_call_times``): the device's time, none of the host's launch cost, as
``bench lm --compile reduce-overhead`` pays it, but with eager kernels (no Inductor fusion of
the small operators between them). Printed one preset at a time, that preset's versions and
``dense`` timed in the same rounds (so a run cut off by a time limit keeps the presets it
finished): ms per call, and the per-round ratios to ``now`` and to ``dense``.

First, each version's output and gradients are compared with those of ``now`` (same weights,
same input, same seed): the largest difference relative to the largest value, over the output
and every gradient. A switch changes how a layer computes, not what, so this is rounding
(zero where the sums keep their order). With ``--device cpu`` (``TRITON_INTERPRET=1``) only
this comparison runs, at 64 tokens in float32: a check of the script and of the switches.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import statistics

import torch

from sparseffn import build_layer
from sparseffn.auxiliary import aux_loss
from sparseffn.bench.lm_step import lm_ffn
from sparseffn.bench.measure import (forward_backward_fn, graph_call_times, kernel_script_device,
                                     paired_ratio)
from sparseffn.ops import (dense_products, kernels, triton_cvmm, triton_plan, triton_rows,
                           triton_sinkhorn)
from sparseffn.routing import Routing

# the modules, not the functions of the same names that sparseffn.ops exports
cvmm = importlib.import_module("sparseffn.ops.cvmm")
expert_mlp = importlib.import_module("sparseffn.ops.expert_mlp")

MOE_PRESETS = ("sigma_moe", "softmax_moe", "sbase", "switch", "glam", "fff", "fff_sparse")
ROW_PRESETS = ("pkm", "peer")
# the presets the GPU issue's LM target names (softmax_moe differs from sigma_moe in its router)
DEFAULT_PRESETS = ("sigma_moe", "sbase", "switch", "glam", "fff", "fff_sparse") + ROW_PRESETS


@contextlib.contextmanager
def _set(module, name: str, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _gates_as_they_are(gates, order):
    """``backward_gate_rows`` before float32 gates: the sorted rows' gates in their dtype."""
    return None if gates is None else gates.index_select(0, order)


@contextlib.contextmanager
def _bf16_gates():
    # expert_mlp imported the function by name: both references are switched
    with _set(cvmm, "backward_gate_rows", _gates_as_they_are), \
            _set(expert_mlp, "backward_gate_rows", _gates_as_they_are):
        yield


def _bias_rows_by_index_select(hidden, bias, expert_of_row, counts):
    """The experts' first bias added as before the fifty-second session: its gradient from
    ``index_select``'s backward, an ``index_add_`` (atomics into each expert's row)."""
    return hidden + bias.index_select(0, expert_of_row).to(hidden.dtype)


def _unfused_biases(x, plan, w1, w2, gates, b1, b2, indices):
    """Biased ReLU experts on the unfused path, as before the fifty-sixth session (an
    identity hidden dropout keeps them off the fused one)."""
    return expert_mlp.expert_mlp(x, plan, w1, w2, gates, b1=b1, b2=b2, indices=indices,
                                 hidden_dropout=lambda hidden: hidden)


@contextlib.contextmanager
def _index_add_b1():
    with _set(expert_mlp, "_biased_relu_experts", _unfused_biases), \
            _set(expert_mlp, "add_expert_bias", _bias_rows_by_index_select):
        yield


SWITCHES = {
    "unpadded": (MOE_PRESETS, lambda: _set(expert_mlp, "HIDDEN_MULTIPLE", 1)),
    "bf16 gates": (MOE_PRESETS, _bf16_gates),
    "unsplit": (MOE_PRESETS, lambda: _set(triton_cvmm, "WEIGHT_GRAD_SPLITS", 1)),
    "parts 2nd launch": (MOE_PRESETS, lambda: _set(triton_cvmm, "ADD_PARTS_IN_KERNEL", False)),
    "torch.sort plan": (MOE_PRESETS, lambda: _set(triton_plan, "usable", lambda keys, n: False)),
    "two kernels": (ROW_PRESETS,
                    lambda: _set(kernels, "scatter_rows_dot", kernels.scatter_rows_and_gather_dot)),
    "torch sinkhorn": (("sbase",), lambda: _set(triton_sinkhorn, "usable", lambda logits: False)),
    "no triton": (MOE_PRESETS, lambda: _set(triton_cvmm, "_enabled", False)),
    "dense_rows by slot": (ROW_PRESETS, lambda: _set(triton_rows, "DENSE_ROWS_SLOTS", 1)),
    "grouped weight grads": (MOE_PRESETS,
                             lambda: _set(kernels, "expert_weight_grad",
                                          kernels.expert_weight_grad_torch)),
    "usage by index_add": (ROW_PRESETS,
                           lambda: _set(Routing, "built_row_index", lambda self, rows: None)),
    "dense products": (ROW_PRESETS, lambda: _set(dense_products, "_enabled", True)),
    "unfused biases": (("fff_sparse",),
                       lambda: _set(expert_mlp, "_biased_relu_experts", _unfused_biases)),
    "index_add b1": (("fff_sparse",), _index_add_b1),
}


def _step(layer: torch.nn.Module, x: torch.Tensor, switch=None):
    """One forward+backward of ``layer`` into the leaf ``x`` (under ``switch()``, a context
    manager, if given), returning the output: bf16 autocast on CUDA with its weight cache
    off, as CUDA graphs require. Every version gets the same output gradient (one seed)."""
    torch.manual_seed(1)
    run = forward_backward_fn(layer, x, aux_loss, torch.bfloat16 if x.is_cuda else None,
                              autocast_cache=False)
    if switch is None:
        return run

    def step():
        with switch():
            return run()
    return step


def _results(step, x: torch.Tensor, layer: torch.nn.Module) -> list[torch.Tensor]:
    """The output and every gradient of one call of ``step``, in float32."""
    torch.manual_seed(0)
    y = step()
    return [y.detach().float(), x.grad.float()] + [
        p.grad.float() for p in layer.parameters() if p.grad is not None]


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over the tensors of max |a - b| / max |a| (NaN where the two disagree in number)."""
    if len(a) != len(b):
        return float("nan")
    worst = 0.0
    for u, v in zip(a, b):
        scale = u.abs().max().clamp_min(1e-30)
        worst = max(worst, ((u - v).abs().max() / scale).item())
    return worst


def versions(preset: str, tokens: int, device: torch.device):
    """{name: (step, x, layer)} of the preset's layer as it is and under each switch that
    applies to it, every version a copy of the same layer."""
    torch.manual_seed(0)
    layer = build_layer(lm_ffn(preset)).to(device).train()
    x = torch.randn(tokens, layer.d_model, device=device)
    leaf = x.requires_grad_(True)
    out = {"now": (_step(layer, leaf), leaf, layer)}
    for name, (presets, switch) in SWITCHES.items():
        if preset in presets:
            copied, leaf = copy.deepcopy(layer), x.detach().requires_grad_(True)
            out[name] = (_step(copied, leaf, switch), leaf, copied)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS))
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per call (default 16384 on CUDA, 64 on the CPU)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10, help="calls per captured graph")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device, where = kernel_script_device(parser, args.device)
    tokens = args.tokens or (16384 if device.type == "cuda" else 64)
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in MOE_PRESETS + ROW_PRESETS]
    if unknown:
        parser.error(f"unknown presets {unknown}: choose from {MOE_PRESETS + ROW_PRESETS}")
    print(f"LM FFN layers, forward+backward: {where}, {tokens} tokens", flush=True)
    dense = versions("dense", tokens, device)["now"][0] if device.type == "cuda" else None
    for preset in presets:    # timed and printed one preset at a time: a stage cut off by its
        fns = {}              # time limit keeps the presets it finished
        found = versions(preset, tokens, device)
        reference = _results(*found["now"])
        for name, (step, x, layer) in found.items():
            if name != "now":
                diff = _largest_difference(reference, _results(step, x, layer))
                print(f"  {preset} {name}: largest difference from now {diff:.2e} "
                      f"(relative to the largest value)", flush=True)
            fns[f"{preset} {name}"] = step
        if dense is not None:
            _time_and_print(preset, {"dense": dense, **fns}, args.rounds, args.calls, device)


def _time_and_print(preset: str, fns: dict, rounds: int, calls: int,
                    device: torch.device) -> None:
    """One preset's versions and the dense FFN, timed in the same rounds: ms per call, and
    the median per-round ratios to the preset as it is (``now``) and to dense."""
    times, failures = graph_call_times(fns, rounds, {n: calls for n in fns}, device)
    for name, why in failures.items():
        print(f"  {name}: not captured ({why})", flush=True)
    width = max([20] + [len(name) for name in times])
    print(f"  {'':{width}s} {'ms':>8s} {'/ now':>7s} {'/ dense':>8s}", flush=True)
    now = times.get(f"{preset} now")
    for name, ts in times.items():
        over_now = f"{paired_ratio(ts, now):7.2f}" if now is not None and name != "dense" \
            else " " * 7
        over_dense = f"{paired_ratio(ts, times['dense']):8.2f}" if "dense" in times else ""
        print(f"  {name:{width}s} {statistics.median(ts):8.3f} {over_now} {over_dense}",
              flush=True)

if __name__ == "__main__":
    main()
