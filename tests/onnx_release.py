"""The ONNX exports that PyTorch 2.7 cannot do (``sparseffn.onnx_export``'s note says why):
tests of them are expected failures there."""

import pytest
import torch

from sparseffn.onnx_export import _EXPORTS_EVERY_LAYER
from sparseffn.requirements import torch_release

# an expert MLP or an FFF tree exported for a dynamic token count
NEEDS_2_8 = pytest.mark.xfail(
    torch_release(torch.__version__) < _EXPORTS_EVERY_LAYER, strict=True,
    reason="PyTorch 2.7's torch.export cannot trace the expert MLPs' and the trees' "
           "data-dependent sizes for a dynamic token count (nonzero in torch.cond)")

# the layers of tests.layers.test_conformance.EXAMPLES that 2.7 exports
EXPORTED_ON_2_7 = {"layer:dense", "layer:pkm", "layer:peer", "layer:topk",
                   "variant:peer_sparse_grad", "variant:pkm_identity_query"}


def example(name: str):
    """``name`` as a test parameter, an expected failure on 2.7 unless it exports there."""
    return pytest.param(name, marks=() if name in EXPORTED_ON_2_7 else NEEDS_2_8)
