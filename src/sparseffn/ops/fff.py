"""Fast feed-forward (FFF) trees: the leaf distribution ``R(i|x)`` in every formulation of
Chaunin & Mikhailovskiy, and greedy hard inference.

A tree of depth d has N = 2^d - 1 router nodes with logits ``z = W x (+ b)`` and L = 2^d
leaves. Layout: nodes in heap order, level l holds nodes ``[2^l - 1, 2^(l+1) - 1)``, node n's
children are 2n + 1 (left) and 2n + 2 (right); leaves are numbered left to right, so the bits
of leaf i, most significant first, are its turns (0 = left). Chaunin & Mikhailovskiy number nodes from 1
with children 2i and 2i + 1; the left child is reached with ``σ(z_n)`` (Eq. 3), the right
with ``σ(-z_n)`` (Eq. 4). (The ``fastfeedforward`` package sends ``σ(z)`` to the right child:
its model with weights w is ours with -w.)

Every soft formulation computes ``R = softmax(T a(S z))`` (Eq. 9), with ``a`` one of
``TREE_ACTIVATIONS``; with ``a = logsigmoid`` this is the original product of sigmoids
(Eq. 6), already normalised:

- ``orig``: the original training forward (Belcak & Wattenhofer's code): a ``[T, L]``
  mixture multiplied level by level by every node's two branch values, O(d·L) per token;
- ``logs``: the same in log space, one exponentiation (softmax) at the end (Eq. 7);
- ``matrix``: Eq. 9 with dense T [L, 2N] and S [2N, N], O(L²) per token;
- ``matrix_sparse``: Eq. 9 with S as the interleave ``(z, -z)`` it is and T in CSR, O(d·L);
- ``levelwise`` (ours): each level's values are expanded onto the next level, O(L) per
  token, in a fused C kernel on CPU with a bottom-up backward of the same cost.

``descend`` is the greedy hard inference: d dot products per token.

Activations: ``a(x) - a(-x) = x`` for log-sigmoid, softplus, ReLU and GELU, so the right
branch's value is the left one's minus z (one activation per node); for the linear
activation it is the negation.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import warnings
from typing import Callable

import torch
from torch.nn import functional as F

from ..requirements import torch_release
from ..runtime import assume_constant_result
from . import kernels, native, triton_tree
from .grad_mode import differentiable_once, grad_wanted, gradients_of
from .kernels import descend_from_logits_fn
from .precision import autocast_off
from .sizes import exporting

TREE_ACTIVATIONS = ("logsigmoid", "softplus", "linear", "relu", "gelu")
SOFT_FORMULATIONS = ("orig", "logs", "matrix", "matrix_sparse", "levelwise")
# torch.export in PyTorch 2.8 and 2.9 loses a size of the fused expansion's autograd.Function
# output ("64*s77 is not tracked with proxy"); there the exported levelwise router uses its
# PyTorch ops (the same function, differentiated by autograd). 2.10 and later export the kernel.
_EXPORT_TAKES_PYTORCH_OPS = torch_release(torch.__version__) < (2, 10)
MAX_DENSE_MATRIX_DEPTH = 14     # T alone is 2^d x 2^(d+1) floats: 2 GiB at d = 14
# The tree matrices kept between calls, at most this many bytes in all (least recently used
# go first); SPARSEFFN_TREE_CACHE_MB overrides it, 0 keeps none.
TREE_CACHE_BYTES = int(float(os.environ.get("SPARSEFFN_TREE_CACHE_MB", "256")) * (1 << 20))


class _TreeMatrixCache:
    """Tree matrices by (kind, depth, dtype, device), bounded by bytes, not entries: one
    depth-13 pair of dense matrices alone is 1 GiB. Entries are built outside any
    ``inference_mode`` and without autograd, so a first call under ``inference_mode`` cannot
    leave inference tensors behind for later calls that need autograd."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _nbytes(value) -> int:
        tensors = value if isinstance(value, tuple) else (value,)
        total = 0
        for t in tensors:
            if t.layout == torch.sparse_csr:
                total += sum(p.numel() * p.element_size()
                             for p in (t.crow_indices(), t.col_indices(), t.values()))
            else:
                total += t.numel() * t.element_size()
        return total

    def get(self, key, build):
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        with torch.inference_mode(False), torch.no_grad():
            value = build()
        size = self._nbytes(value)
        with self._lock:
            if size <= self.max_bytes:
                self._entries[key] = value
                while sum(self._nbytes(v) for v in self._entries.values()) > self.max_bytes:
                    self._entries.popitem(last=False)
        return value

    def nbytes(self) -> int:
        """Bytes held now."""
        with self._lock:
            return sum(self._nbytes(v) for v in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


tree_matrix_cache = _TreeMatrixCache(TREE_CACHE_BYTES)


def _linear(x: torch.Tensor) -> torch.Tensor:
    return x


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "logsigmoid": F.logsigmoid, "softplus": F.softplus, "linear": _linear, "relu": F.relu,
    "gelu": F.gelu,
}


def tree_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation ``a`` of Eq. 9 by name (``TREE_ACTIVATIONS``)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"tree activation must be one of {TREE_ACTIVATIONS}, got {name!r}") from None


def depth_of(num_nodes: int) -> int:
    """d for a row of ``2^d - 1`` node logits."""
    depth = int(num_nodes + 1).bit_length() - 1
    if num_nodes < 1 or (1 << depth) - 1 != num_nodes:
        raise ValueError(f"a tree has 2^depth - 1 nodes (1, 3, 7, ...), got {num_nodes} node logits")
    return depth


def level_slice(level: int) -> slice:
    """The nodes of one level in heap order."""
    return slice((1 << level) - 1, (1 << (level + 1)) - 1)


def _branches(z: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``a(z)`` and ``a(-z)`` for the left and right child."""
    az = tree_activation(activation)(z)
    return az, (-az if activation == "linear" else az - z)


def _normalise(leaf_logits: torch.Tensor, activation: str) -> torch.Tensor:
    """Leaf log-values to probabilities: ``exp`` for log-sigmoid (Eq. 7 sums log-probabilities
    that already add up to one), the softmax of Eq. 9 otherwise."""
    if activation == "logsigmoid":
        return leaf_logits.exp()
    return torch.softmax(leaf_logits, dim=-1)


# ---------------------------------------------------------------------------------------------
# The tree matrices of Eq. 9

def tree_matrices(depth: int, dtype: torch.dtype = torch.float32, device=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``T`` [2^d, 2(2^d - 1)] and ``S`` [2(2^d - 1), 2^d - 1] of Chaunin & Mikhailovskiy
    Eq. 9.

    Row 2n of S picks ``+z_n`` and row 2n + 1 picks ``-z_n``; ``T[i, 2n + b] = 1`` when node n
    is on leaf i's path and leaf i turns ``b`` (0 left, 1 right) there. For d = 2 these are the
    matrices printed in Chaunin & Mikhailovskiy §2.2.
    """
    if not 1 <= depth <= MAX_DENSE_MATRIX_DEPTH:
        raise ValueError(f"dense tree matrices need 1 <= depth <= {MAX_DENSE_MATRIX_DEPTH}, got {depth}")
    nodes, leaves = (1 << depth) - 1, 1 << depth
    S = torch.zeros(2 * nodes, nodes, dtype=dtype, device=device)
    idx = torch.arange(nodes, device=device)
    S[2 * idx, idx] = 1
    S[2 * idx + 1, idx] = -1
    T = torch.zeros(leaves, 2 * nodes, dtype=dtype, device=device)
    T[torch.arange(leaves, device=device)[:, None], path_columns(depth).to(device)] = 1
    return T, S


def path_columns(depth: int) -> torch.Tensor:
    """int64 [2^d, d]: for every leaf, the columns of ``a(S z)`` its path sums (``2n + turn``
    for each node n on the path, root first): the nonzeros of T's rows."""
    return tree_matrix_cache.get(("path_columns", depth), lambda: _path_columns(depth))


# The lookups the soft formulations make while torch.compile may be tracing them are marked
# assume_constant_result: the compiler runs them (the cache's lock cannot be traced, and
# broke the graph) and keeps their tensors as constants of the compiled graph. Their
# arguments are Python ints, dtypes and devices, and a result depends on nothing else.

@assume_constant_result
def _path_columns_on(depth: int, device: torch.device) -> torch.Tensor:
    """:func:`path_columns` on ``device``."""
    return tree_matrix_cache.get(("path_columns", depth, str(device)),
                                 lambda: path_columns(depth).to(device))


def _path_columns(depth: int) -> torch.Tensor:
    leaves = torch.arange(1 << depth)
    node = torch.zeros_like(leaves)
    columns = []
    for level in range(depth):
        turn = (leaves >> (depth - 1 - level)) & 1
        columns.append(2 * node + turn)
        node = 2 * node + 1 + turn
    return torch.stack(columns, dim=1)


def _sparse_T(depth: int) -> torch.Tensor:
    """T in CSR on the CPU (d nonzeros per row)."""
    return tree_matrix_cache.get(("sparse_T", depth), lambda: _build_sparse_T(depth))


def _build_sparse_T(depth: int) -> torch.Tensor:
    leaves = 1 << depth
    cols = path_columns(depth)
    with warnings.catch_warnings():   # "CSR support is in beta": it is what Chaunin & Mikhailovskiy names
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(torch.arange(0, leaves * depth + 1, depth),
                                       cols.reshape(-1), torch.ones(leaves * depth),
                                       size=(leaves, 2 * ((1 << depth) - 1)),
                                       check_invariants=True)


# ---------------------------------------------------------------------------------------------
# Soft formulations: node logits z [T, 2^d - 1] -> leaf probabilities R [T, 2^d]

def orig_level(mixture: torch.Tensor, z_level: torch.Tensor, activation: str) -> torch.Tensor:
    """One level of the original training forward: every leaf's running weight times the
    branch value of its ancestor at this level.

    mixture: [T, L] running leaf weights; z_level: [T, 2^l] this level's node logits. Branch
    values are ``σ(±z)`` for log-sigmoid (Eq. 3-4), otherwise ``exp(a(±z) - c)`` with ``c`` the
    level's largest value per token (a factor common to every leaf, removed by the final
    normalisation)."""
    tokens, leaves = mixture.shape
    if activation == "logsigmoid":
        left = torch.sigmoid(z_level)
        right = 1 - left
    else:
        a_left, a_right = _branches(z_level, activation)
        top = torch.maximum(a_left, a_right).amax(dim=-1, keepdim=True)
        left, right = (a_left - top).exp(), (a_right - top).exp()
    modifier = torch.stack((left, right), dim=-1).reshape(tokens, 2 * left.shape[-1], 1)    # [T, 2^(l+1), 1]
    return (mixture.view(tokens, modifier.shape[1], leaves // modifier.shape[1]) * modifier
            ).reshape(tokens, leaves)


def leaf_probs_orig(z: torch.Tensor, activation: str = "logsigmoid") -> torch.Tensor:
    """``orig``: Eq. 6 level by level on the full [T, L] mixture (O(d·L) per token)."""
    depth = depth_of(z.shape[-1])
    mixture = z.new_ones(z.shape[0], 1 << depth)
    for level in range(depth):
        mixture = orig_level(mixture, z[:, level_slice(level)], activation)
    if activation == "logsigmoid":
        return mixture
    return mixture / mixture.sum(dim=-1, keepdim=True)


def logs_level(log_mixture: torch.Tensor, z_level: torch.Tensor, activation: str) -> torch.Tensor:
    """One level of Eq. 7 on the full [T, L] log-mixture: add ``a(±z)`` of each leaf's ancestor."""
    tokens, leaves = log_mixture.shape
    modifier = torch.stack(_branches(z_level, activation), dim=-1).reshape(
        tokens, 2 * z_level.shape[-1], 1)
    return (log_mixture.view(tokens, modifier.shape[1], leaves // modifier.shape[1]) + modifier
            ).reshape(tokens, leaves)


def leaf_probs_logs(z: torch.Tensor, activation: str = "logsigmoid") -> torch.Tensor:
    """``logs``: Eq. 7 level by level in log space, one exponentiation at the end."""
    depth = depth_of(z.shape[-1])
    log_mixture = z.new_zeros(z.shape[0], 1 << depth)
    for level in range(depth):
        log_mixture = logs_level(log_mixture, z[:, level_slice(level)], activation)
    return _normalise(log_mixture, activation)


def leaf_probs_matrix(z: torch.Tensor, activation: str = "logsigmoid",
                      T: torch.Tensor | None = None, S: torch.Tensor | None = None) -> torch.Tensor:
    """``matrix``: Eq. 9, ``softmax(T a(S z))``, with dense T and S (the tree's by default, or
    any given ones: ``T = S = I`` with ``activation="linear"`` is the softmax MoE router).

    z: [tokens, n]; S: [m, n]; T: [E, m]; returns [tokens, E]."""
    if T is None and S is None:
        T, S = _dense_matrices(depth_of(z.shape[-1]), z.dtype, z.device)
    elif T is None or S is None:
        raise ValueError("give both T and S, or neither (the tree's)")
    if S.shape[-1] != z.shape[-1] or T.shape[-1] != S.shape[0]:
        raise ValueError(f"shapes do not chain: z [.., {z.shape[-1]}], S {tuple(S.shape)}, "
                         f"T {tuple(T.shape)}; need S [m, {z.shape[-1]}] and T [E, m]")
    act = tree_activation(activation)
    return torch.softmax(act(z @ S.T.to(z.dtype)) @ T.T.to(z.dtype), dim=-1)


@assume_constant_result
def _dense_matrices(depth: int, dtype: torch.dtype, device: torch.device):
    return tree_matrix_cache.get(("dense", depth, dtype, str(device)),
                                 lambda: tree_matrices(depth, dtype, device))


def leaf_probs_matrix_sparse(z: torch.Tensor, activation: str = "logsigmoid") -> torch.Tensor:
    """``matrix_sparse``: Eq. 9 with sparse matrices. ``S z`` is the interleave ``(z_n, -z_n)``
    (S has two nonzeros per column), and T (d nonzeros per row) multiplies in CSR."""
    depth = depth_of(z.shape[-1])
    tokens = z.shape[0]
    pairs = torch.stack(_branches(z, activation), dim=-1).reshape(tokens, 2 * z.shape[-1])    # a(S z) [T, 2N]
    # (torch.compile takes no CSR constant: a compiled CPU layer takes the gather too)
    if z.device.type == "cpu" and z.dtype == torch.float32 and not torch.compiler.is_compiling():
        with autocast_off("cpu"):   # CSR products have no bfloat16 kernel
            leaf_logits = torch.sparse.mm(_sparse_T(depth), pairs.float().T).T     # [T, L]
    else:   # the same sums as a gather of each leaf's d path columns
        leaf_logits = pairs[:, _path_columns_on(depth, z.device)].sum(dim=-1)
    return torch.softmax(leaf_logits, dim=-1)


def leaf_probs_levelwise(z: torch.Tensor, activation: str = "logsigmoid") -> torch.Tensor:
    """``levelwise`` (ours): level l's 2^l path values become level l + 1's 2^(l+1) by adding
    each node's two branch values (Eq. 7 computed top-down without repeating a level per leaf):
    O(L) per token. Log-sigmoid runs as products of ``σ(±z)`` and needs no normalisation."""
    depth = depth_of(z.shape[-1])
    if not _kernel_ok(z) or (_EXPORT_TAKES_PYTORCH_OPS and exporting()):
        return _levelwise_torch(z, depth, activation)
    if z.stride(-1) != 1:    # the kernels take any row stride (e.g. a slice of wider logits)
        z = z.contiguous()
    if grad_wanted(z):
        return _LevelwiseTree.apply(z, depth, activation)
    return _expanded_probs(kernels.fff_expand, z, depth, activation)   # no autograd node


def _kernel_ok(z: torch.Tensor) -> bool:
    """True when a fused kernel runs the expansion: the C kernels (CPU float32) or the Triton
    kernels (CUDA, depth up to ``triton_tree.MAX_DEPTH``)."""
    if z.dim() != 2:
        return False
    if z.device.type == "cpu" and z.dtype == torch.float32 and native.available():
        return True
    return triton_tree.usable(depth_of(z.shape[-1]), z)


def _expanded_probs(expand: Callable, z: torch.Tensor, depth: int, activation: str
                    ) -> torch.Tensor:
    """The leaf probabilities [T, L] by ``expand`` (the operator ``kernels.fff_expand`` or its
    PyTorch ops ``kernels.fff_expand_torch``)."""
    if activation == "logsigmoid":   # the product of σ(±z) (Eq. 3-6), already normalised
        return expand(z, depth, kernels.FFF_PRODUCT_OF_LOGITS, None)
    if activation == "linear":
        leaf_logits = expand(z, depth, kernels.FFF_SUM_ODD, None)
    else:                            # Eq. 7 with a(-z) = a(z) - z
        leaf_logits = expand(tree_activation(activation)(z), depth, kernels.FFF_SUM_SHIFTED, z)
    return torch.softmax(leaf_logits, dim=-1)


def _levelwise_torch(z: torch.Tensor, depth: int, activation: str) -> torch.Tensor:
    """The levelwise expansion in PyTorch ops (other devices and dtypes, no C compiler, no
    Triton), differentiated by autograd."""
    return _expanded_probs(kernels.fff_expand_torch, z, depth, activation)


def _activation_derivative(z: torch.Tensor, activation: str) -> torch.Tensor:
    """``a'(z)`` for the activations with ``a(x) - a(-x) = x``."""
    if activation == "softplus":
        return torch.sigmoid(z)
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":   # d/dz z Φ(z) = Φ(z) + z φ(z)
        return 0.5 * (1 + torch.erf(z * math.sqrt(0.5))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    raise AssertionError(activation)


def _levelwise_with_graph(ctx, grad_probs):
    """:class:`_LevelwiseTree`'s gradient in differentiable ops, for second derivatives (see
    :func:`~sparseffn.ops.grad_mode.differentiable_once`): the expansion in PyTorch ops,
    differentiated by autograd."""
    z, _ = ctx.saved_tensors
    return gradients_of(_levelwise_torch, (z, ctx.depth, ctx.activation), ctx.needs_input_grad,
                        (grad_probs,))


class _LevelwiseTree(torch.autograd.Function):
    """Leaf probabilities from node logits on the fused kernels of ``sparseffn::fff_expand``
    (the C kernels of ``fff_cpu.c`` on CPU, the Triton kernels on CUDA).

    Saves the node logits z and the output probabilities."""
    generate_vmap_rule = True

    @staticmethod
    def forward(z, depth: int, activation: str):
        return _expanded_probs(kernels.fff_expand, z, depth, activation)

    @staticmethod
    def setup_context(ctx, inputs, probs):
        z, depth, activation = inputs
        ctx.save_for_backward(z, probs)
        ctx.depth, ctx.activation = depth, activation

    @staticmethod
    @differentiable_once(with_graph=_levelwise_with_graph)
    def backward(ctx, grad_probs):
        z, probs = ctx.saved_tensors
        depth, activation = ctx.depth, ctx.activation
        grad_probs = grad_probs.contiguous()
        if activation == "logsigmoid":
            grad_z = kernels.fff_expand_backward(grad_probs, probs, z, depth,
                                                 kernels.FFF_PRODUCT_OF_LOGITS)
        else:
            # softmax backward: g_i = R_i (dR_i - Σ_j dR_j R_j)
            grad_logits = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))
            if activation == "linear":
                grad_z = kernels.fff_expand_backward(grad_logits, None, None, depth,
                                                     kernels.FFF_SUM_ODD)
            else:
                grad_z = kernels.fff_expand_backward(grad_logits, None,
                                                     _activation_derivative(z, activation),
                                                     depth, kernels.FFF_SUM_SHIFTED)
        return grad_z, None, None


_SOFT = {"orig": leaf_probs_orig, "logs": leaf_probs_logs, "matrix": leaf_probs_matrix,
         "matrix_sparse": leaf_probs_matrix_sparse, "levelwise": leaf_probs_levelwise}


def leaf_probs(z: torch.Tensor, formulation: str = "levelwise",
               activation: str = "logsigmoid") -> torch.Tensor:
    """``R(i|x)`` [T, 2^d] from node logits z [T, 2^d - 1] in the named formulation
    (``SOFT_FORMULATIONS``, or ``"auto"``: levelwise); all compute the same function."""
    if formulation == "auto":
        formulation = "levelwise"
    try:
        fn = _SOFT[formulation]
    except KeyError:
        raise ValueError(f"formulation must be one of {SOFT_FORMULATIONS + ('auto',)}, "
                         f"got {formulation!r}") from None
    tree_activation(activation)
    if z.dim() != 2:
        raise ValueError(f"node logits must be [tokens, 2^depth - 1], got {tuple(z.shape)}")
    return fn(z, activation)


# ---------------------------------------------------------------------------------------------
# Hard inference

def descend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Greedy hard inference (Chaunin & Mikhailovskiy §1.2): from the root, go left where
    ``z_n = <x, w_n> + b_n > 0`` and right otherwise (NaN goes right); one dot product per
    level and token, batched over tokens (the operator ``sparseffn::fff_descend``).

    x: [T, dim]; weight: [2^d - 1, dim]; bias: [2^d - 1] or None. Returns int64 [T] leaves.
    """
    depth = depth_of(weight.shape[0])
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [tokens, {weight.shape[1]}], got {tuple(x.shape)}")
    if not torch.is_grad_enabled():   # no new no_grad context (1.4 µs) where grad is off
        return kernels.fff_descend(x, weight, bias, depth)
    with torch.no_grad():   # the C kernel on CPU, the Triton kernel on CUDA, else PyTorch
        return kernels.fff_descend(x, weight, bias, depth)


def descend_logits(z: torch.Tensor) -> torch.Tensor:
    """Greedy descent over precomputed node logits z [T, 2^d - 1]: the reference of
    :func:`descend` (reads one logit per level)."""
    depth = depth_of(z.shape[-1])
    return descend_from_logits_fn(lambda level, node: z.gather(1, node[:, None]).squeeze(1),
                                  depth, z.shape[0], z.device)
