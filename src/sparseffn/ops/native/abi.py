"""The C interface of the fused kernels, declared from one table.

Every exported function is listed once in :data:`SIGNATURES` with its argument types; calls
go through :func:`call`, which checks the return code and raises an error that names the
kernel and the cause. Return codes shared by the kernels: 0 success, -1 no BLAS, -2 an
epilogue the kernel cannot apply, -3 or 1 an allocation failed, -4 an index out of range.
"""

from __future__ import annotations

import ctypes

P = ctypes.c_void_p
I64 = ctypes.c_int64
INT = ctypes.c_int

# name -> argument types (every function returns int, except sf_init)
SIGNATURES: dict[str, list] = {
    # src, src_ld, in_idx, w, wse, w_ld, w_trans, counts, E, m, n, out, out_rows, out_idx,
    # group, scale, dot_with, dots, relu, mask_with, bf16, nthreads, chunk
    "sf_cvmm": [P, I64, P, P, I64, INT, INT, P, INT, INT, INT, P, I64, P, INT, P, P, P, INT, P,
                INT, INT, INT],
    # a_src, a_ld, a_idx, scale, b_src, b_ld, b_idx, counts, E, ma, nb, out, bf16, nthreads,
    # chunk
    "sf_weight_grad": [P, I64, P, P, P, I64, P, P, INT, INT, INT, P, INT, INT, INT],
    # a, lda, z, ldz, rows, depth, mode, out, nthreads
    "sf_fff_expand": [P, I64, P, I64, I64, INT, INT, P, INT],
    # grad_leaf, ldg, leaf, ldl, node_data, ldd, rows, depth, mode, out, nthreads
    "sf_fff_expand_backward": [P, I64, P, I64, P, I64, I64, INT, INT, P, INT],
    # x, ldx, w, ldw, bias, rows, dim, depth, out, nthreads
    "sf_fff_descend": [P, I64, P, I64, P, I64, INT, INT, P, INT],
    # x, ldx, table, ldt, bf16 table, idx, rows, m, d, out, nthreads
    "sf_gather_dot": [P, I64, P, I64, INT, P, I64, I64, I64, P, INT],
    # idx, w, rows, m, table, ldt, bf16 table and out, d, out, ldo, nthreads
    "sf_gather_sum": [P, P, I64, I64, P, I64, INT, I64, P, I64, INT],
    # idx, w, rows, m, src, lds, n_rows, d, out, bf16 out, nthreads
    "sf_scatter_rows": [P, P, I64, I64, P, I64, I64, I64, P, INT, INT],
    # idx, w, rows, m, src, lds, table, ldt, n_rows, d, out, dots, bf16 src/table/out, nthreads
    "sf_scatter_rows_dot": [P, P, I64, I64, P, I64, P, I64, I64, I64, P, P, INT, INT],
    # s, lds, rows, n, k, vals, ids, nthreads
    "sf_topk_rows": [P, I64, I64, I64, I64, P, P, INT],
    # sa, lda, sb, ldb, rows, n_a, n_b, k, vals, ids, nthreads
    "sf_pk_topk": [P, I64, P, I64, I64, I64, I64, I64, P, P, INT],
    # x, ldx, idx, gates, keep, T, k, w1, w1_se, w1_sr, wg, wg_se, wg_sr, b1, b1_se, w2, w2_se,
    # w2_sr, b2, b2_se, m, G, n, act, out, nthreads
    "sf_mlp_pairs": [P, I64, P, P, P, I64, INT, P, I64, I64, P, I64, I64, P, I64, P, I64, I64,
                     P, I64, INT, INT, INT, INT, P, INT],
}

_NO_MEMORY = (MemoryError, "it could not allocate its scratch memory")
# return code -> (the error raised, its cause)
_ERRORS = {-1: (RuntimeError, "no BLAS routine was registered for its dtype"),
           -2: (RuntimeError, "an epilogue it cannot apply was asked for"),
           -3: _NO_MEMORY, 1: _NO_MEMORY, -4: (IndexError, "an index was out of range")}


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument and return types of every kernel of ``lib``."""
    lib.sf_init.argtypes = [P, P, P]
    lib.sf_init.restype = None
    lib.sf_own_bf16_gemm.argtypes = []
    lib.sf_own_bf16_gemm.restype = INT
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = INT


def call(lib: ctypes.CDLL, name: str, *args) -> None:
    """Call kernel ``name``; a nonzero return code raises (MemoryError for allocation,
    IndexError for an index out of range)."""
    status = getattr(lib, name)(*args)
    if status:
        error, cause = _ERRORS.get(status, (RuntimeError, f"it returned {status}"))
        raise error(f"sparseffn: the C kernel {name} failed: {cause}")
