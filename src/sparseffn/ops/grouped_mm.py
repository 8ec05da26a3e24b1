"""Grouped matrix multiplication over rows sorted by expert.

Rows ``[offset_{e-1}, offset_e)`` of the input belong to expert ``e`` and are multiplied by
that expert's matrix; rows after the last expert's block (pairs dropped at an expert's
capacity) are left out and come back as zeros. Two implementations compute the same thing:

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
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"sparseffn: torch._grouped_mm has not yet been checked on {device.type} in "
                f"{dtype}, and the check reads its result on the host, which CUDA graph "
                f"capture forbids; run one step of the PyTorch path (without Triton) eagerly "
                f"before capturing it")
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


def zero_rows_after(out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out`` with its rows >= Σ counts set to exactly zero (no host read)."""
    done = torch.arange(out.shape[0], device=out.device) < counts.sum()
    return torch.where(done.unsqueeze(1), out, torch.zeros((), dtype=out.dtype, device=out.device))


def pad_rows(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``rows`` [D, ...] followed by zero rows up to ``num_rows`` (the rows of pairs dropped at
    capacity, written as zeros)."""
    if rows.shape[0] == num_rows:
        return rows
    return torch.cat((rows, rows.new_zeros(num_rows - rows.shape[0], *rows.shape[1:])))


def grouped_mm_rows(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out[r] = rows[r] @ weight[e(r)]`` for the expert-sorted rows r < Σ counts; the rows
    after them (pairs dropped at capacity) are zero.

    rows: [P, m]; weight: [E, m, n] (may be a transposed view); counts: int64 [E] tensor.
    Returns [P, n]. With ``torch._grouped_mm`` nothing is read on the host; the loop reads the
    counts once.
    """
    if rows.shape[0] and _grouped_mm_usable(rows.device, rows.dtype) and \
            _aligned(weight.shape[-1], rows, weight):
        offsets = counts.cumsum(0).to(torch.int32)
        return zero_rows_after(torch._grouped_mm(rows, weight, offs=offsets), counts)
    sizes = counts.tolist()
    return pad_rows(_loop_mm(rows[:sum(sizes)], weight, sizes), rows.shape[0])


def grouped_weight_grad_rows(rows: torch.Tensor, grads: torch.Tensor,
                             counts: torch.Tensor) -> torch.Tensor:
    """``out[e] = rows_eᵀ @ grads_e`` over the expert-sorted rows r < Σ counts (the rows after
    them are ignored). rows: [P, m]; grads: [P, n]; counts: int64 [E] tensor.
    Returns [E, m, n]; an expert with no rows gets an exact zero matrix."""
    if rows.shape[1] > grads.shape[1]:
        return grouped_weight_grad_rows(grads, rows, counts).transpose(1, 2)
    if rows.shape[0] and _grouped_mm_usable(rows.device, rows.dtype) and \
            _aligned(grads.shape[-1], rows, grads):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(zero_rows_after(rows, counts).t(), grads, offs=offsets)
    sizes = counts.tolist()
    done = sum(sizes)
    return _loop_weight_grad(rows[:done], grads[:done], sizes)


def _loop_weight_grad(rows: torch.Tensor, grads: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = rows.new_empty(len(counts), rows.shape[1], grads.shape[1])
    for block, grad_block, out_e, count in zip(rows.split(counts), grads.split(counts),
                                               out.unbind(0), counts):
        if count:
            torch.mm(block.t(), grad_block, out=out_e)
        else:
            out_e.zero_()
    return out
