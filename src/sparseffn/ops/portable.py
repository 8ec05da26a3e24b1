"""Portable forms of the inference operators, for exporters (ONNX).

Each ``sparseffn::`` operator of :mod:`~sparseffn.ops.kernels` runs a C, Triton or PyTorch
implementation that writes into buffers it allocated, cuts its work into chunks by size, or
reads per-expert counts on the host. An exporter that turns a ``torch.export`` program into
another runtime's graph (ONNX) can take none of that. The forms here compute what the
operators compute in *functional* PyTorch ops whose output shapes follow from the input
shapes alone, each of which ONNX has:

- the expert products still run sparsely, over sizes the graph counts at run time (not the
  ones traced): up to 32 experts one product per expert over the rows ``nonzero`` finds for
  it; above, each expert's rows cut into blocks of B rows and one batched product with each
  block's expert weights gathered (at most E·B rows more than the pairs'), in a graph of the
  same few nodes for any number of experts;
- gathered rows are ``index_select`` and a batched product (the [T, m, d] rows in memory
  at once);
- top-k is ``torch.topk``, whose ONNX ``TopK`` orders equal values by index as the
  operators do.

Each operator traces as its form while ``torch.export`` traces for ``torch.onnx.export`` or
inside :func:`tracing_forms` (:func:`sparseffn.to_onnx`), and ``forms()`` is the table for
``ExportedProgram.run_decompositions``; they are not registered globally (see
:mod:`sparseffn.onnx_export`). Inference only: the backward operators have no portable form.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from ..activations import activation_fn
from .sizes import exporting


def expert_of_sorted_rows(counts: Tensor, rows: int) -> Tensor:
    """e(r) for the expert-sorted rows r < ``rows`` [rows]: the number of experts whose block
    ends at or before r; rows after the last block (dropped pairs) get E."""
    ends = counts.cumsum(0)                                                      # [E]
    r = torch.arange(rows, device=counts.device, dtype=ends.dtype)
    return (r.unsqueeze(1) >= ends.unsqueeze(0)).sum(1)


def cvmm_rows(src: Tensor, weight: Tensor, counts: Tensor, in_idx: Optional[Tensor],
              out_idx: Optional[Tensor], scale: Optional[Tensor], out_rows: int, group: int,
              relu: bool, mask_with: Optional[Tensor], dot_with: Optional[Tensor]
              ) -> tuple[Tensor, Tensor]:
    """:func:`~sparseffn.ops.kernels.cvmm_rows`: its PyTorch implementation, with the
    per-expert products of :func:`_per_expert_products` and the functional slot sum of
    :func:`_sum_slots` (shapes: as that operator's)."""
    from .kernels import _cvmm_rows_torch
    return _cvmm_rows_torch(src, weight, counts, in_idx, out_idx, scale, out_rows, group, relu,
                            mask_with, dot_with, grouped=_per_expert_products,
                            put_back=_sum_slots)


def _sum_slots(rows: Tensor, out_idx: Tensor, out_rows: int, group: int) -> Tensor:
    """:func:`~sparseffn.ops.kernels.sum_slots` into a fresh zero tensor (the operator's
    copies into an uninitialised one in place, which an exported graph cannot hold)."""
    slots = torch.zeros_like(rows).index_copy(0, out_idx, rows)
    return slots.view(out_rows, group, rows.shape[1]).sum(1)


# Up to this many experts the exported expert products are one product per expert; above,
# blocks. Per-expert products ran in ONNX Runtime in 0.65-1.05x the blocks' time (16 to 64
# experts, d_model 512, 1,024 tokens; noisy), but their graph and export time grow with E:
# at 16 experts 13-20 s against the blocks' 8-11 s, at 64 experts 44-51 s against 8-9 s.
PER_EXPERT_PRODUCTS_UP_TO = 32
# Blocks per expert, on average, in _products_in_blocks: more blocks pad less and gather
# each expert's weights more often.
BLOCKS_PER_EXPERT = 2


def _per_expert_products(rows: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """:func:`~sparseffn.ops.grouped_mm.grouped_mm_rows` [P, n] without reading the counts
    on the host: :func:`_products_per_expert` up to :data:`PER_EXPERT_PRODUCTS_UP_TO`
    experts, :func:`_products_in_blocks` above (whose graph does not grow with E). The rows
    after the last block (dropped pairs) are exactly zero."""
    if weight.shape[0] <= PER_EXPERT_PRODUCTS_UP_TO:
        return _products_per_expert(rows, weight, counts)
    return _products_in_blocks(rows, weight, counts)


def _products_per_expert(rows: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """One product per expert over the rows that ``nonzero`` finds in its block [P, n]; the
    rows after the last block stay zero. E products in the graph."""
    expert = expert_of_sorted_rows(counts, rows.shape[0])
    places, blocks = [], []
    for e in range(weight.shape[0]):
        mine = (expert == e).nonzero().squeeze(1)
        places.append(mine)
        blocks.append(rows.index_select(0, mine) @ weight[e])
    # one scatter of all the blocks (one per expert would copy the [P, n] rows E times)
    return rows.new_zeros(rows.shape[0], weight.shape[2]).index_copy(0, torch.cat(places),
                                                                     torch.cat(blocks))


def _products_in_blocks(rows: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """The per-expert products [P, n] as one batched product over blocks of B rows, each
    block within one expert's rows: [N, B, m] @ [N, m, n], with each block's expert weights
    gathered. The rows after the last block (dropped pairs) are exactly zero.

    B = Σ counts // (2E) + 2 and N = Σ_e ceil(count_e / B), so however the rows are spread
    over the experts the products cost at most E·B ≈ Σ counts / 2 + 2E rows more than the
    pairs' (a quarter more on average), and N < 3E expert matrices are gathered. B is at
    least 2: Inductor's batched product asks whether B is 1, which AOTInductor cannot decide
    for a size the graph counts.

    The sizes are counted in the graph (not the ones traced), so the graph has the same few
    nodes for any number of experts: one product per expert makes the graph and its export
    time grow with E (one σ-MoE layer of 64 experts: 44-51 s to export, against 8-9 s);
    padding every expert to the largest count exported as fast, but made a model with a busy
    expert cost up to E/k times its pairs (3.2-3.4x the per-expert products' time with one
    expert at 13.7x the mean count)."""
    experts, num_rows = weight.shape[0], rows.shape[0]
    counts = counts.long()
    block = (counts.sum() // (BLOCKS_PER_EXPERT * experts) + 2).item()
    torch._check(block >= 2)
    starts = counts.cumsum(0) - counts                                        # [E]
    blocks = (counts + block - 1) // block                                    # [E]
    first_block = blocks.cumsum(0) - blocks                                   # [E]
    num_blocks = blocks.sum().item()
    torch._check(num_blocks >= 0)
    # block j of expert e(j) reads rows starts[e] + (j - first_block[e])·B + lane; past the
    # expert's count, whatever row that reaches (at most the last): those products are never
    # read, and each product row depends on its own input row alone. No block, no index.
    block_expert = expert_of_sorted_rows(blocks, num_blocks)                  # [N]
    place = ((torch.arange(num_blocks, device=rows.device) - first_block[block_expert])
             .unsqueeze(1) * block + torch.arange(block, device=rows.device))  # [N, B]
    source = (starts[block_expert].unsqueeze(1) + place).clamp(max=num_rows - 1)
    padded = rows.index_select(0, source.reshape(-1)).view(num_blocks, block, rows.shape[1])
    products = torch.bmm(padded, weight.index_select(0, block_expert)).reshape(
        num_blocks * block, weight.shape[2])
    # row r of expert e is block row first_block[e]·B + (r - starts[e]); a dropped row
    # (e(r) = E) reads an appended zero row
    expert = expert_of_sorted_rows(counts, num_rows)                         # [P]
    mine = expert.clamp(max=experts - 1)
    slot = torch.where(expert < experts, first_block[mine] * block
                       + torch.arange(num_rows, device=rows.device) - starts[mine],
                       num_blocks * block)
    return torch.cat([products, products.new_zeros(1, weight.shape[2])]).index_select(0, slot)


def expert_mlp_pairs(x: Tensor, indices: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
                     activation: str, b1: Optional[Tensor], b2: Optional[Tensor],
                     w_gate: Optional[Tensor], keep: Optional[Tensor]) -> Tensor:
    """:func:`~sparseffn.ops.kernels.expert_mlp_pairs` with each pair's expert weights
    gathered, [T, k, G, d] (shapes: as that operator's): a few ops whatever the number of
    experts, for the few tokens the operator is called on (a decoding step). Eq. 25 of
    Csordás et al. 2023 (arXiv:2310.10837), ``y_t = Σ_j g_tj f_{i_tj}(x_t)``, each pair's
    product a batched matrix-vector product."""
    act = activation_fn(activation)
    chosen = indices.long()
    if keep is not None:     # a dropped pair reads expert 0, and adds exactly zero below
        chosen = chosen.masked_fill(~keep, 0)
    rows = x.unsqueeze(1).unsqueeze(3)                                     # [T, 1, d_in, 1]
    pre = torch.matmul(w1[chosen], rows).squeeze(3)                        # [T, k, G]
    if b1 is not None:
        pre = pre + b1[chosen]
    hidden = act(pre) if w_gate is None else \
        act(torch.matmul(w_gate[chosen], rows).squeeze(3)) * pre
    out = torch.matmul(hidden.unsqueeze(2), w2[chosen]).squeeze(2)         # [T, k, d_out]
    if b2 is not None:
        out = out + b2[chosen]
    out = out * gates.unsqueeze(2).to(out.dtype)
    if keep is not None:
        out = torch.where(keep.unsqueeze(2), out, torch.zeros((), dtype=out.dtype))
    return out.sum(1)


def gather_dot(x: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """``out[t, j] = <x[t], table[idx[t, j]]>`` [T, m] (as the operator)."""
    dtype = torch.promote_types(x.dtype, table.dtype)
    rows = table.index_select(0, idx.reshape(-1)).view(*idx.shape, table.shape[1])
    return torch.bmm(rows.to(dtype), x.to(dtype).unsqueeze(-1)).squeeze(-1)


def gather_sum(idx: Tensor, weights: Tensor, table: Tensor) -> Tensor:
    """``out[t] = Σ_j weights[t, j] · table[idx[t, j]]`` [T, d] (as the operator)."""
    rows = table.index_select(0, idx.reshape(-1)).view(*idx.shape, table.shape[1])
    # a batched product, not a product and a sum: two passes fewer over the [T, m, d] rows
    # (a PKM layer at 1,024 tokens in ONNX Runtime, 2 CPU threads: 105 -> 82 ms)
    return torch.bmm(weights.to(table.dtype).unsqueeze(1), rows).squeeze(1)


def topk_rows(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row, equal values by index (ONNX ``TopK`` orders them so;
    the eager operator raises on NaN, which the exported graph does not check)."""
    return torch.topk(scores, k, dim=-1)


def product_key_topk(scores_a: Tensor, scores_b: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`~sparseffn.ops.kernels.product_key_topk`: the top k of the sums of each row's
    top-k candidates of both halves, ties to the lower product index."""
    from .kernels import rankable, sub_key_indices
    rows, n_a = scores_a.shape
    val_a, idx_a = _top_by_index(rankable(scores_a), min(k, n_a))
    val_b, idx_b = _top_by_index(rankable(scores_b), min(k, scores_b.shape[1]))
    # candidates laid out j-major: i + n_a·j increases along a row, so TopK's tie rule (the
    # lower position) is the operator's (the lower index), with no sort of the k² candidates
    candidates = idx_a.shape[1] * idx_b.shape[1]
    sums = (val_b.unsqueeze(-1) + val_a.unsqueeze(-2)).reshape(rows, candidates)
    full = (n_a * idx_b.unsqueeze(-1) + idx_a.unsqueeze(-2)).reshape(rows, candidates)
    _, pos = torch.topk(sums, k, dim=-1)
    indices = full.gather(1, pos)
    sub_a, sub_b = sub_key_indices(indices, n_a)
    return scores_a.gather(1, sub_a) + scores_b.gather(1, sub_b), indices


def _top_by_index(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest scores of each row (ties to the lower index) [R, k], in index order."""
    values, idx = torch.topk(scores, k, dim=-1)
    idx, order = torch.sort(idx, dim=-1)          # distinct indices: any sort is this one
    return values.gather(1, order), idx


def exporting_to_onnx() -> bool:
    """Whether ``torch.onnx.export`` (its ``torch.export`` capture) is tracing this call.

    Dynamo folds ``torch.onnx.is_in_onnx_export()`` to False, so where Dynamo traces (the
    exporter's strict capture, which it tries after a failed non-strict one, and
    ``torch.cond``'s branches) the flag is read from the module of the exporter that holds
    it, as Dynamo reads any module attribute. (Without that, a layer in training mode, refused
    by the non-strict capture, was captured strictly as a training program and failed at
    ONNX conversion with "No ONNX function found for sparseffn.cvmm_rows".)"""
    if not exporting():
        return False
    if torch.onnx.is_in_onnx_export():
        return True
    try:
        from torch.onnx._internal.exporter import _flags
    except ImportError:      # a PyTorch without the module: the public flag alone
        return False
    return bool(getattr(_flags, "_is_onnx_exporting", False))


_tracing_forms = False


@contextlib.contextmanager
def tracing_forms() -> Iterator[None]:
    """While ``torch.export`` traces inside this context, each operator traces as its
    portable form (:meth:`~sparseffn.ops.kernels.Operator.__call__`), so that the program has
    no ``sparseffn::`` operator (:func:`sparseffn.to_onnx`; ``torch.onnx.export`` needs no
    context). Outside an export it changes nothing; ``torch.export`` alone keeps the
    operators."""
    global _tracing_forms
    outer, _tracing_forms = _tracing_forms, True
    try:
        yield
    finally:
        _tracing_forms = outer


def traces_forms() -> bool:
    """Whether an operator called now traces as its portable form: ``torch.export`` traces
    inside :func:`tracing_forms` or for ``torch.onnx.export``."""
    return exporting() and (_tracing_forms or exporting_to_onnx())


def form_of(operator) -> Callable:
    """The portable form of a :class:`~sparseffn.ops.kernels.Operator`; a clear error for an
    operator that has none (the backward operators: an exported program is inference)."""
    form = _FORMS.get(operator.op._opoverload)
    if form is None:
        raise NotImplementedError(
            f"{operator.op._opoverload.name()} has no portable form: an ONNX export computes "
            f"inference only (call model.eval() and export under torch.no_grad())")
    return form


# What form_of looks up: a plain dict, which Dynamo reads where it traces (torch.cond's
# branches); an lru_cache made it warn on every export of a mixture.
_FORMS: dict = {}


def fill_forms() -> None:
    """Fill the table :func:`form_of` reads, from :func:`forms` (kernels.py calls it once
    its operators exist)."""
    _FORMS.update(forms())


def forms() -> dict:
    """The portable form of each inference operator: ``{operator overload: function}``."""
    from . import kernels
    return {
        kernels.cvmm_rows.op._opoverload: cvmm_rows,
        kernels.expert_mlp_pairs.op._opoverload: expert_mlp_pairs,
        kernels.gather_dot.op._opoverload: gather_dot,
        kernels.gather_sum.op._opoverload: gather_sum,
        kernels.topk_rows.op._opoverload: topk_rows,
        kernels.product_key_topk.op._opoverload: product_key_topk,
        kernels.fff_expand.op._opoverload: kernels.fff_expand_torch,
        kernels.fff_descend.op._opoverload: kernels.fff_descend_torch,
    }
