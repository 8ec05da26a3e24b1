"""Stores whose experts are single rows of a table, read with the gathered-row operators
(:mod:`sparseffn.ops.rows`), which never copy the selected rows out per token."""

from __future__ import annotations

import torch
from torch import nn

from ..activations import activation_fn
from ..ops import native
from ..ops.precision import autocast_dtype
from ..ops.rows import gather_dot, gather_sum
from ..routing import Routing
from .base import ExpertStore


def _compute_dtype(x: torch.Tensor, sparse_grad: bool) -> torch.dtype | None:
    """The autocast dtype the gathered products run in, as ``nn.Linear``'s do (fp32
    accumulation inside the kernels), or None (the tables' own dtype): under autocast, except
    a CPU autocast dtype the C row kernels do not read (they take fp32 and bf16 tables), and
    for tables with sparse gradients (the backward of a cast cannot carry a sparse gradient
    to the parameter: such tables are read as they are)."""
    dtype = autocast_dtype(x)
    if dtype is None or sparse_grad or (x.is_cpu and dtype not in native.ROW_DTYPES):
        return None
    return dtype


# A table is cast to the autocast dtype for a batch that reads at least this many rows per
# table row (pairs / rows); a smaller batch reads its rows in place, in the table's dtype.
CAST_READS_PER_ROW = 16


def _cast_pays(indices: torch.Tensor, num_rows: int) -> bool:
    """Whether a batch reading ``indices`` (its pairs) should read a table of ``num_rows`` rows
    cast to the autocast dtype rather than in place: a cast reads and writes every row, the
    gathered products only the rows the pairs name. Decoding one token with PEER's million
    experts under CPU bf16 autocast took 328 ms a layer with the cast and 2.3 ms without."""
    return indices.numel() >= CAST_READS_PER_ROW * num_rows


class ValueRows(ExpertStore):
    """``y_t = Σ_j w_tj · v_{i_tj}``: each expert is one value row ``v_i`` (the values of a
    product-key memory, Lample et al. 2019, Eq. 14 of Csordás et al. 2023, arXiv:2310.10837;
    the second layer of a top-K MLP, their Eq. 13-14).

    Parameters: ``values`` [num_rows, d_model], initialised ``N(0, std)``. With
    ``sparse_grad`` their gradient is a sparse tensor holding only the rows a batch read.
    Under autocast (bf16 only on the CPU; not with ``sparse_grad``) the rows are read in the
    autocast dtype (fp32 accumulation), as ``nn.Linear`` reads its weight, for a batch that
    reads each row ``CAST_READS_PER_ROW`` times or more on average; a smaller one (decoding)
    reads them in place, in their own dtype.

    forward(x: [T, d_model], routing) -> [T, d_model]
    """

    def __init__(self, num_rows: int, d_model: int, *, std: float,
                 sparse_grad: bool = False) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.d_out = num_rows, d_model, d_model
        self.std, self.sparse_grad = std, sparse_grad
        self.values = nn.Parameter(torch.empty(num_rows, d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.values.normal_(0.0, self.std)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        dtype = _compute_dtype(x, self.sparse_grad)
        cast = dtype is not None and _cast_pays(routing.indices, self.num_experts)
        values = self.values.to(dtype) if cast else self.values
        # the pairs grouped by row for the table gradient, made here and kept on the routing:
        # the layer's usage statistics read them too
        row_index = routing.row_index(self.num_experts, values, sparse_grad=self.sparse_grad)
        y = gather_sum(routing.indices, routing.weights, values, sparse_grad=self.sparse_grad,
                       row_index=row_index)
        return y.to(x.dtype)

    def sparse_grad_parameters(self) -> list[nn.Parameter]:
        return [self.values] if self.sparse_grad else []

    def extra_repr(self) -> str:
        return f"num_rows={self.num_experts}, d_model={self.d_model}, sparse_grad={self.sparse_grad}"


class NeuronExperts(ExpertStore):
    """PEER's single-neuron experts ``e_i(x) = act(u_iᵀ x) v_i`` (He 2024, "Mixture of A
    Million Experts", arXiv:2407.04153, §3.2): ``y_t = Σ_j w_tj · act(u_{i_tj}ᵀ x_t) ·
    v_{i_tj}``, with hidden-unit dropout.

    Parameters: ``w_in`` [N, d_model] (rows u_i, ``N(0, in_std)``) and ``w_out`` [N, d_model]
    (rows v_i, ``N(0, out_std)``). Per token only the selected rows are read: ``u_iᵀ x`` as
    gathered dot products and the sum as a gathered sum, neither materialising
    [T, k, d_model] weights. Under autocast (bf16 only on the CPU; not with ``sparse_grad``)
    both read x in the autocast dtype (fp32 accumulation), and the tables too for a batch
    that reads each row ``CAST_READS_PER_ROW`` times or more on average, as ``nn.Linear``
    does; a smaller one (decoding) reads them in place, in their own dtype.

    forward(x: [T, d_model], routing) -> [T, d_model]
    """

    def __init__(self, num_experts: int, d_model: int, *, activation: str = "relu",
                 dropout: float = 0.0, in_std: float, out_std: float,
                 sparse_grad: bool = False) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.d_out = num_experts, d_model, d_model
        self.activation_name, self.in_std, self.out_std = activation, in_std, out_std
        self.sparse_grad = sparse_grad
        self.activation = activation_fn(activation)
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_model))
        self.hidden_dropout = nn.Dropout(dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.w_in.normal_(0.0, self.in_std)
        self.w_out.normal_(0.0, self.out_std)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        dtype = _compute_dtype(x, self.sparse_grad)
        w_in, w_out, inputs = self.w_in, self.w_out, x
        if dtype is not None:        # x as input_dtype says; the tables where it pays
            inputs = x.to(dtype)
            if _cast_pays(routing.indices, self.num_experts):
                w_in, w_out = w_in.to(dtype), w_out.to(dtype)
        # both tables' gradients group the same pairs by row: sort them once, not twice (and
        # the layer's usage statistics read the same grouping)
        row_index = routing.row_index(self.num_experts, w_in, w_out, inputs,
                                      sparse_grad=self.sparse_grad)
        hidden = self.activation(gather_dot(inputs, w_in, routing.indices,          # act(u_iᵀ x)
                                            sparse_grad=self.sparse_grad, row_index=row_index))
        hidden = self.hidden_dropout(hidden)
        y = gather_sum(routing.indices, routing.weights.to(hidden.dtype) * hidden, w_out,
                       sparse_grad=self.sparse_grad, row_index=row_index)
        return y.to(x.dtype)

    def sparse_grad_parameters(self) -> list[nn.Parameter]:
        return [self.w_in, self.w_out] if self.sparse_grad else []

    def input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """Under autocast, the dtype the gathered dot products read x in (see
        :func:`_compute_dtype`)."""
        return _compute_dtype(x, self.sparse_grad)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, d_model={self.d_model}, "
                f"activation={self.activation_name}, sparse_grad={self.sparse_grad}")
