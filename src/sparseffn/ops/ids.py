"""Integer ids (experts, table rows) in the narrowest dtype that holds them."""

from __future__ import annotations

import torch


def id_dtype(low: int, high: int) -> torch.dtype:
    """The narrowest integer dtype holding every id in ``[low, high]``, for sorting them: a
    radix sort (CUDA's) makes one pass per key byte, so uint8 ids take a quarter of int32's
    passes; PyTorch's CPU sort is faster on narrower ids too (32,768 ids below 9 sorted in
    0.08 ms as uint8 and 0.17 ms as int32, on a 2-core AVX2 machine)."""
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return torch.int64
