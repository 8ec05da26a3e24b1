"""Small autograd operations under the layers; each has a plain reference in the tests."""

from .cvmm import DispatchPlan, cvmm
from .expert_mlp import expert_mlp
from .grouped_mm import grouped_mm, grouped_weight_grad, set_grouped_mm_enabled

__all__ = ["DispatchPlan", "cvmm", "expert_mlp", "grouped_mm", "grouped_weight_grad",
           "set_grouped_mm_enabled"]
