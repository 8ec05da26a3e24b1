"""Grouped matrix multiplication over rows sorted by expert.

Rows ``[offset_e, offset_e + count_e)`` of the input belong to expert ``e`` and are multiplied
by that expert's matrix. Two implementations compute the same thing:

- ``torch._grouped_mm`` where PyTorch provides it and it is correct for the device and dtype
  (checked once per (device, dtype) against the loop below);
- a loop over experts that splits the rows and *unbinds* the weight (never slices the weight
  tensor expert by expert, whose backward would copy the whole weight each time).
"""

from __future__ import annotations

import torch

_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}
_USE_GROUPED_MM = True


def set_grouped_mm_enabled(enabled: bool) -> None:
    """Force the per-expert loop (``False``) or allow ``torch._grouped_mm`` (``True``)."""
    global _USE_GROUPED_MM
    _USE_GROUPED_MM = enabled


def _grouped_mm_usable(device: torch.device, dtype: torch.dtype) -> bool:
    if not _USE_GROUPED_MM or not hasattr(torch, "_grouped_mm"):
        return False
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        _GROUPED_MM_OK[key] = _probe_grouped_mm(device, dtype)
    return _GROUPED_MM_OK[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Run both kernels once on a small uneven problem (with an empty group) and compare.
    Its inputs come from a private generator: the probe runs at the first MoE forward, and
    drawing from the global RNG there would make a process's first run differ from its next."""
    try:
        gen = torch.Generator().manual_seed(0)
        counts = [3, 0, 5, 8]
        rows = torch.randn(sum(counts), 16, generator=gen).to(device, dtype)
        weight = torch.randn(len(counts), 16, 8, generator=gen).to(device, dtype)
        offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        got = torch._grouped_mm(rows, weight, offs=offsets)
        grad = torch.randn(sum(counts), 8, generator=gen).to(device, dtype)
        got_t = torch._grouped_mm(rows.t(), grad, offs=offsets)
        want = _loop_mm(rows, weight, counts)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return (
            got.shape == want.shape
            and bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))
            and got_t.shape == (len(counts), 16, 8)
            and bool(got_t[1].eq(0).all())
        )
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _aligned(out_width: int, *tensors: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs each matrix row- or column-major with 16-byte aligned
    pointer and leading strides, its output's included (rows of ``out_width`` elements)."""
    if (out_width * tensors[0].element_size()) % 16:
        return False
    for t in tensors:
        size = t.element_size()
        *batch, s_row, s_col = t.stride()
        leading = s_row if s_col == 1 else s_col if s_row == 1 else None
        if t.data_ptr() % 16 or leading is None or any((s * size) % 16 for s in [leading, *batch]):
            return False
    return True


def _loop_mm(rows: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], weight.shape[-1])
    for block, w, out_block in zip(rows.split(counts), weight.unbind(0), out.split(counts)):
        if block.shape[0]:
            torch.mm(block, w, out=out_block)
    return out


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, counts: list[int],
               offsets: torch.Tensor) -> torch.Tensor:
    """``out[r] = rows[r] @ weight[e(r)]`` for rows sorted by expert.

    rows: [P, m]; weight: [E, m, n] (may be a transposed view); counts: E python ints summing
    to P; offsets: int32 [E], the cumulative sum of counts. Returns [P, n].
    """
    if rows.shape[0] and _grouped_mm_usable(rows.device, rows.dtype) and _aligned(weight.shape[-1], rows, weight):
        return torch._grouped_mm(rows, weight, offs=offsets)
    return _loop_mm(rows, weight, counts)


def grouped_weight_grad(rows: torch.Tensor, grads: torch.Tensor, counts: list[int],
                        offsets: torch.Tensor) -> torch.Tensor:
    """``out[e] = rows_e^T @ grads_e``: the gradient of each expert's matrix.

    rows: [P, m]; grads: [P, n], both sorted by expert. Returns [E, m, n]; an expert with no
    rows gets an exact zero matrix. When ``m > n`` the products are computed as
    ``grads_e^T @ rows_e`` (wide outputs run faster on CPU) and a transposed view of that
    [E, n, m] buffer is returned; the gradient of a weight stored as [E, n, m] and used
    through ``.transpose(1, 2)`` is then contiguous without a copy.
    """
    if rows.shape[1] > grads.shape[1]:
        return grouped_weight_grad(grads, rows, counts, offsets).transpose(1, 2)
    num_experts = len(counts)
    if rows.shape[0] and _grouped_mm_usable(rows.device, rows.dtype) and \
            _aligned(grads.shape[-1], rows, grads):
        return torch._grouped_mm(rows.t(), grads, offs=offsets)
    out = rows.new_empty(num_experts, rows.shape[1], grads.shape[1])
    for block, grad_block, out_e, count in zip(rows.split(counts), grads.split(counts),
                                               out.unbind(0), counts):
        if count:
            torch.mm(block.t(), grad_block, out=out_e)
        else:
            out_e.zero_()
    return out
