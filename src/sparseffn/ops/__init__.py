"""The arithmetic under the layers: autograd functions over the operators of
:mod:`~sparseffn.ops.kernels` (registered with ``torch.library``); each has a plain reference
in the tests."""

from .cvmm import DispatchPlan, cvmm
from .expert_mlp import expert_mlp
from .debug import set_checks
from .dense_products import set_dense_products_enabled
from .grouped_mm import grouped_mm_rows, grouped_weight_grad_rows, set_grouped_mm_enabled

__all__ = ["DispatchPlan", "cvmm", "expert_mlp", "grouped_mm_rows", "grouped_weight_grad_rows",
           "set_checks", "set_dense_products_enabled", "set_grouped_mm_enabled"]
