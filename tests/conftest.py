import importlib

import pytest
import torch

grouped_mm_module = importlib.import_module("sparseffn.ops.grouped_mm")


@pytest.fixture(params=["grouped_mm", "loop"])
def matmul_path(request):
    """Run a test through ``torch._grouped_mm`` (where usable) and through the expert loop."""
    grouped_mm_module.set_grouped_mm_enabled(request.param == "grouped_mm")
    yield request.param
    grouped_mm_module.set_grouped_mm_enabled(True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
