"""The gathered-row products of a small table as dense matrix products (opt-in, for GPUs).

With S the [T, N] matrix that holds each pair's weight at its row (``S[t, i] = Σ_{j: idx[t, j]
= i} w[t, j]``, zero elsewhere), the products of :mod:`~sparseffn.ops.rows` are GEMMs:

    gather_sum(idx, w, table)  = S · table            [T, d]
    scatter_rows(idx, w, src)  = Sᵀ · src            [N, d]
    gather_dot(x, table, idx)  = (x · tableᵀ)[t, idx[t, j]]   [T, m]

A dense product costs 2·N·d FLOPs a token, the gathered rows m·d elements read a token. On a
GPU, whose tensor cores do hundreds of FLOPs in the time it reads one element, the dense form
should be the cheaper one for a table of fewer than some tens of rows per pair, as the LM
presets' PKM (3,844 rows, 128 pairs a token) and PEER (1,444 rows, 32 pairs) are; the
gathered rows win for large tables (PEER's million experts). S is written by
``triton_rows.spread_rows`` (no atomics) where Triton runs, by a ``scatter_add_`` elsewhere.
``scripts/gpu_rows_calls.py`` (``rows or dense``) and ``scripts/gpu_lm_layers.py`` (``dense
products``) time both on a GPU. Until they
have, this form is off: :func:`set_dense_products_enabled` turns it on for tables of at most
``ROWS_PER_PAIR`` rows per pair and batches of at most ``MAX_ELEMENTS`` elements of S. On a
CPU it is slower (at T 4,096, d 256, m 32: 140 ms against 14 for the C kernels with 1,444
rows), but it runs there too, which is how the tests check it.

The results are those of the gathered rows up to rounding, with two differences:
- S holds the weights in the table's (or the source's) dtype, so under bf16 autocast they are
  rounded to bf16 before the product, where the row kernels read them as they come;
- the products read every row: a NaN or inf in any table row (or in one token's gradient)
  reaches every output (or every row of the table's gradient) through its zero weights,
  where the gathered rows spread it only to the pairs that read it.
Out-of-range pairs read as zero rows and land nowhere, as in the row kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import triton_rows

# A table of at most this many rows per pair (N <= ROWS_PER_PAIR · m) takes the dense form. On
# an H100 (about 600 bf16 TFLOP/s of dense products, about 9 TB/s read from L2) the two cost
# the same near N = 67·m if the row kernels read at L2's bandwidth; not yet measured.
ROWS_PER_PAIR = 64
# ... and a batch whose S has at most this many elements (2^28: 512 MiB in bf16).
MAX_ELEMENTS = 1 << 28

_enabled = False


def set_dense_products_enabled(enabled: bool) -> None:
    """Let small tables' gathered-row products run as dense products (``True``) or never
    (``False``, the default)."""
    global _enabled
    _enabled = bool(enabled)


def pays(idx: Tensor, num_rows: int) -> bool:
    """Whether the products of the pairs ``idx`` [T, m] with a table of ``num_rows`` rows run
    densely: enabled, a non-empty batch and table, at most ``ROWS_PER_PAIR`` rows per pair and
    at most ``MAX_ELEMENTS`` elements of S. Shapes only: nothing is read on the host."""
    tokens, pairs = idx.shape
    return (_enabled and tokens > 0 and 0 < num_rows <= ROWS_PER_PAIR * pairs
            and tokens * num_rows <= MAX_ELEMENTS)


def spread(idx: Tensor, weights: Tensor, num_rows: int, dtype: torch.dtype) -> Tensor:
    """S [T, num_rows] in ``dtype``: each pair's weight at its row, a token's repeats of a row
    added; out-of-range pairs add nothing. The Triton ``spread_rows`` where it runs (writes
    only, no atomics); else a ``scatter_add_`` (on the CPU in slot order). Either sums a
    token's repeats in float32 (or wider) and rounds once to ``dtype``."""
    if triton_rows.usable(weights) and idx.shape[1] <= triton_rows.MAX_SPREAD_PAIRS:
        return triton_rows.spread_rows(idx, weights, num_rows, dtype)
    wide = torch.promote_types(dtype, torch.float32)
    inside, rows = _in_range(idx, num_rows)
    weights = torch.where(inside, weights.to(wide), torch.zeros((), dtype=wide,
                                                                device=weights.device))
    return torch.zeros(idx.shape[0], num_rows, dtype=wide, device=weights.device).scatter_add_(
        1, rows, weights).to(dtype)


def at_pairs(full: Tensor, idx: Tensor) -> Tensor:
    """``full[t, idx[t, j]]`` [T, m] from full [T, N]; 0 for an out-of-range pair."""
    inside, rows = _in_range(idx, full.shape[1])
    return torch.where(inside, full.gather(1, rows),
                       torch.zeros((), dtype=full.dtype, device=full.device))


def _in_range(idx: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """Which pairs name a row of the table (bool [T, m]), and idx clamped into it (to index
    with; the pairs outside are masked by the first)."""
    return (idx >= 0) & (idx < num_rows), idx.clamp(0, num_rows - 1)


def gather_dot(x: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """``sparseffn::gather_dot`` densely: [T, m] in the promoted dtype."""
    dtype = torch.promote_types(x.dtype, table.dtype)
    return at_pairs(x.to(dtype) @ table.to(dtype).t(), idx)


def gather_sum(idx: Tensor, weights: Tensor, table: Tensor) -> Tensor:
    """``sparseffn::gather_sum`` densely: [T, d] in the table's dtype."""
    return spread(idx, weights, table.shape[0], table.dtype) @ table


def scatter_rows(idx: Tensor, weights: Tensor, src: Tensor, num_rows: int) -> Tensor:
    """``sparseffn::scatter_rows`` densely: [num_rows, d] in src's dtype."""
    return spread(idx, weights, num_rows, src.dtype).t() @ src


def gather_dot_grads(idx: Tensor, weights: Tensor, table: Tensor, src: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """``sparseffn::gather_sum_scatter_rows`` densely, src in the table's dtype: (S · table
    [T, d], Sᵀ · src [N, d]) with one S, where the two operators would build it twice."""
    s = spread(idx, weights, table.shape[0], table.dtype)
    return s @ table, s.t() @ src


def scatter_rows_dot(idx: Tensor, weights: Tensor, src: Tensor, table: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """``sparseffn::scatter_rows_dot`` densely: (table gradient [N, d], dots [T, m])."""
    return scatter_rows(idx, weights, src, table.shape[0]), gather_dot(src, table, idx)
