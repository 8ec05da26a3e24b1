"""Product-key retrieval (Lample et al. 2019; Csordás et al. 2023 §3.2 Eq. 15; He 2024 §3.2).

N = n_a · n_b keys are never stored: key ``i + n_a · j`` is the concatenation of sub-key ``i``
of table A and sub-key ``j`` of table B, so its score against a query ``q = [q_a | q_b]`` is
``s_a[i] + s_b[j]`` (Eq. 15, ``u[i] = u_b[⌊i/√N⌋] + u_a[i mod √N]``). The top k of all N
scores are among the k² sums of the top k of each half, so retrieval costs
``O((n_a + n_b) · d + k²)`` per query instead of ``O(N · d)``.

Ties are broken deterministically: every top-k here orders by (score descending, index
ascending), so equal scores go to the lower index. The result is the top k, under that order,
of the k² candidate sums ``fl(s_a[i] + s_b[j])`` of each half's top k, the same on every
implementation. Because float addition is monotone, that is the top k of all N sums too,
except where a sum outside the candidates rounds to the k-th one and has a lower key index:
with ``s_a = [1e8]``, ``s_b = [-1, 0]`` and k = 1 both sums round to 1e8, and key 0 would
come first, but sub-key 1 of b is the better half, so key 1 is returned. (If an (i, j) of the
full top k lost its i in the half's top k, the k sub-keys beating i give k keys whose sums are
at least its own: beating it, unless a sum rounds to equal.)

    topk_lowest_index(scores, k)                   top k of each row, ties to the lower index
    product_key_topk(scores_a, scores_b, k)        the top k of all sums, from the two halves
    retrieve(query, keys_a, keys_b, k)             scores and indices per head, differentiable
"""

from __future__ import annotations

import torch

from . import kernels, portable, triton_rows
from .grad_mode import differentiable_once, grad_wanted, gradients_of
from .precision import autocast_off
from .rows import gather_dot
from .sizes import exported_for_any_size

# Sub-key scores of at most this many floats (per half) exist at once during retrieval.
_SCORE_CHUNK_ELEMENTS = 1 << 22
# Tables of at most this many sub-keys (heads · n per half) take the dense backward.
_DENSE_BACKWARD_ROWS = 2048


def topk_lowest_index(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries along the last dim, ordered by (value desc, index asc); of equal
    values the lower indices are taken. scores: [..., n]; returns (values, int64 indices),
    both [..., k]. (``torch.topk`` leaves the choice among ties unspecified.)"""
    n = scores.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"topk_lowest_index: k must lie in [1, {n}], got {k}")
    flat = scores.reshape(-1, n)
    _, indices = kernels.topk_rows(kernels.rankable(flat), k)
    values = flat.gather(1, indices)          # the scores themselves: NaN stays NaN
    return values.view(*scores.shape[:-1], k), indices.view(*scores.shape[:-1], k)


def product_key_topk(scores_a: torch.Tensor, scores_b: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of ``scores_a[r, i] + scores_b[r, j]`` over all (i, j), with full index
    ``i + n_a · j``, ordered by (sum desc, index asc); not differentiable.

    scores_a: [R, n_a]; scores_b: [R, n_b]; 1 <= k <= n_a · n_b.
    Returns (values [R, k], int64 indices [R, k]). NaN and -inf rank last, +inf first; the
    values are the original sums (a NaN row gets NaN values)."""
    rows, n_a = scores_a.shape
    n_b = scores_b.shape[1]
    if scores_b.shape[0] != rows:
        raise ValueError(f"product_key_topk: scores_a {tuple(scores_a.shape)} and scores_b "
                         f"{tuple(scores_b.shape)} must have the same rows")
    if not 1 <= k <= n_a * n_b:
        raise ValueError(f"product_key_topk: k must lie in [1, {n_a * n_b}], got {k}")
    return kernels.product_key_topk(scores_a, scores_b, k)


def retrieve(query: torch.Tensor, keys_a: torch.Tensor, keys_b: torch.Tensor,
             k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Product-key retrieval for every head: the k keys of each head's table with the highest
    scores ``<q_a, keys_a[h, i]> + <q_b, keys_b[h, j]>``, where ``q = [q_a | q_b]``.

    query: [T, H, d_a + d_b], or [T, d_a + d_b] (one query shared by every head); its first
    d_a units are scored against keys_a [H, n_a, d_a], the rest against keys_b [H, n_b, d_b].
    Returns scores [T, H, k] (differentiable in the query and keys) and int64 indices
    [T, H, k] into the head's n_a · n_b keys (``i + n_a · j``).

    The query is taken whole, not as two halves, so that it is cast once and its gradient is
    one tensor: two slices would each get a zero-filled gradient of the full query, added
    afterwards. With each half's casts, that was about 5 ms of a PEER layer's bf16 training
    step on a 2-core CPU (2,048 tokens, 4 heads, 256-wide queries).

    The sub-key scores are computed chunk by chunk of tokens and dropped. The backward reads
    only the selected sub-keys (``gather_dot``: O(k · d) per query, not the O(n · d) of
    differentiating the full score GEMM), except for tables of at most
    ``_DENSE_BACKWARD_ROWS`` sub-keys (heads · n) where :func:`_dense_backward` says so: there
    the full GEMMs beat gathering rows, so the selected scores' gradients become dense
    [T, heads · n] rows (``kernels.dense_rows``) and the gradients two GEMMs each.
    """
    heads, n_a, d_a = keys_a.shape
    n_b, d_b = keys_b.shape[1:]
    shared = query.dim() == 2
    if query.shape[-1] != d_a + d_b or query.dim() not in (2, 3) or (
            not shared and query.shape[1] != heads):
        raise ValueError(f"retrieve: the query must be [tokens, {d_a + d_b}] or [tokens, "
                         f"{heads}, {d_a + d_b}] for sub-keys {tuple(keys_a.shape)} and "
                         f"{tuple(keys_b.shape)}, got {tuple(query.shape)}")
    tokens = query.shape[0]
    # The scores that choose keys are computed and compared in float32 whatever the module's
    # dtype or autocast (as the MoE routers do): in bfloat16 about 9% of retrievals at 64
    # sub-keys picked other keys than in float32.
    score_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    step = max(1, _SCORE_CHUNK_ELEMENTS // (heads * max(n_a, n_b)))
    with torch.no_grad(), autocast_off(query.device.type):
        q = query.to(score_dtype)                 # one cast of the whole query, then views
        qa, qb = q[..., :d_a], q[..., d_a:]
        ka, kb = keys_a.to(score_dtype), keys_b.to(score_dtype)
        fa, fb = ka.reshape(heads * n_a, d_a), kb.reshape(heads * n_b, d_b)

        def select(part: slice) -> tuple[torch.Tensor, torch.Tensor]:
            """The top-k keys of the tokens ``part``: values and indices [t, heads, k]."""
            if shared:      # one GEMM for every head; rows (t, h)
                s_a = (qa[part] @ fa.t()).view(-1, n_a)
                s_b = (qb[part] @ fb.t()).view(-1, n_b)
                v, i = product_key_topk(s_a, s_b, k)
                return v.view(-1, heads, k), i.view(-1, heads, k)
            # a batched GEMM per head; rows (h, t)
            s_a = torch.bmm(qa[part].transpose(0, 1), ka.transpose(1, 2))
            s_b = torch.bmm(qb[part].transpose(0, 1), kb.transpose(1, 2))
            v, i = product_key_topk(s_a.reshape(-1, n_a), s_b.reshape(-1, n_b), k)
            return v.view(heads, -1, k).transpose(0, 1), i.view(heads, -1, k).transpose(0, 1)

        # A batch that fits one chunk is not looped over: under torch.compile(dynamic=True)
        # a loop over a symbolic token count fixes the count (a recompile for every batch
        # size), where this test only adds the guard tokens <= step; a program exported for
        # any token count retrieves the whole batch at once.
        if exported_for_any_size(tokens) or tokens <= step:
            vals, idx = select(slice(None))
            vals, idx = vals.contiguous(), idx.contiguous()
        else:
            vals = torch.empty(tokens, heads, k, dtype=score_dtype, device=query.device)
            idx = torch.empty(tokens, heads, k, dtype=torch.int64, device=query.device)
            for start in range(0, tokens, step):
                part = slice(start, min(tokens, start + step))
                vals[part], idx[part] = select(part)
    if not grad_wanted(query, keys_a, keys_b):
        return vals, idx
    if _dense_backward(heads * max(n_a, n_b), query, keys_a, keys_b):
        return _SelectedScores.apply(vals, query, keys_a, keys_b, idx), idx
    # The same scores again, as gathered dot products that autograd can follow; their values
    # are discarded (the GEMM's are kept, exactly the ones the selection compared).
    again = _scores_of_selected(gather_dot, query, keys_a, keys_b, idx)
    return vals + (again - again.detach()).to(vals.dtype), idx


def _scores_of_selected(gather_dot, query: torch.Tensor, keys_a: torch.Tensor,
                        keys_b: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The scores [T, H, k] of the selected keys ``idx`` [T, H, k] (shapes as
    :func:`retrieve`'s) as gathered dot products ``<q_a, keys_a[h, i]> + <q_b, keys_b[h, j]>``
    by ``gather_dot`` (:func:`~sparseffn.ops.rows.gather_dot`, or its portable form), which
    autograd can follow."""
    heads, n_a, d_a = keys_a.shape
    n_b, d_b = keys_b.shape[1:]
    tokens, k = idx.shape[0], idx.shape[2]
    shared = query.dim() == 2
    head_a = torch.arange(heads, device=idx.device).view(1, heads, 1) * n_a
    head_b = torch.arange(heads, device=idx.device).view(1, heads, 1) * n_b
    sub_a, sub_b = kernels.sub_key_indices(idx, n_a)
    rows_a, rows_b = sub_a + head_a, sub_b + head_b
    flat_a, flat_b = keys_a.reshape(heads * n_a, d_a), keys_b.reshape(heads * n_b, d_b)
    rows = tokens if shared else tokens * heads
    per_row = heads * k if shared else k
    query_a = query[..., :d_a].reshape(rows, d_a)
    query_b = query[..., d_a:].reshape(rows, d_b)
    return (gather_dot(query_a, flat_a, rows_a.view(rows, per_row))
            + gather_dot(query_b, flat_b, rows_b.view(rows, per_row))).view(tokens, heads, k)


def _selected_scores_with_graph(ctx, grad):
    """:class:`_SelectedScores`' gradients in differentiable ops, for second derivatives (see
    :func:`~sparseffn.ops.grad_mode.differentiable_once`): the selected scores as gathered
    dot products in their portable form, differentiated by autograd."""
    query, keys_a, keys_b, idx = ctx.saved_tensors

    def scores(vals, query, keys_a, keys_b, idx):
        return _scores_of_selected(portable.gather_dot, query, keys_a, keys_b, idx
                                   ).to(grad.dtype)
    return gradients_of(scores, (None, query, keys_a, keys_b, idx), ctx.needs_input_grad,
                        (grad,))


def _dense_backward(sub_keys: int, *tensors: torch.Tensor) -> bool:
    """Whether retrieval over ``sub_keys`` sub-keys per half differentiates the full score
    GEMMs (:class:`_SelectedScores`) instead of the selected rows: for small tables, on the CPU
    and where the Triton ``dense_rows`` kernel runs (elsewhere ``dense_rows`` would be an atomic
    ``scatter_add_``; on the CPU it adds each row's pairs in slot order). A layer step at
    the PKM shapes of Csordás et al. 2023 (4 heads of 62 sub-keys, k 32; 2,048 tokens) spent
    14 ms per layer on the CPU gathering and scattering sub-key rows, and takes about 2 ms for
    the dense rows and GEMMs."""
    if sub_keys > _DENSE_BACKWARD_ROWS:
        return False
    return all(t.is_cpu for t in tensors) or triton_rows.usable(*tensors)


class _SelectedScores(torch.autograd.Function):
    """The selected scores ``vals`` [T, H, k] (returned unchanged) as a function of the
    query and sub-keys, for autograd: the backward differentiates the full score GEMMs
    ``s = q · keysᵀ`` of each half (Eq. 15 of Csordás et al. 2023), the gradient of the
    selected scores scattered into dense [T, H, n] score rows (zero where nothing was
    selected; a (token, head)'s k keys reach only its head's n sub-keys). The query's
    gradient is written half by half into one tensor of the query's dtype."""
    generate_vmap_rule = True

    @staticmethod
    def forward(vals, query, keys_a, keys_b, idx):
        return vals.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, query, keys_a, keys_b, idx = inputs
        ctx.save_for_backward(query, keys_a, keys_b, idx)

    @staticmethod
    @differentiable_once(with_graph=lambda ctx, grad: _selected_scores_with_graph(ctx, grad))
    def backward(ctx, grad):
        query, keys_a, keys_b, idx = ctx.saved_tensors
        tokens, heads, k = grad.shape
        n_a, d_a = keys_a.shape[1:]
        shared = query.dim() == 2
        needs_query, needs_keys = ctx.needs_input_grad[1], ctx.needs_input_grad[2:4]
        grad_query = torch.empty_like(query) if needs_query else None
        grad_keys = [None, None]
        with autocast_off(grad.device.type):
            q = query.to(grad.dtype) if any(needs_keys) else None    # one cast, then views
            sub_a, sub_b = kernels.sub_key_indices(idx, n_a)
            for side, (keys, sub, cols) in enumerate(((keys_a, sub_a, slice(None, d_a)),
                                                      (keys_b, sub_b, slice(d_a, None)))):
                if not (needs_query or needs_keys[side]):
                    continue
                n = keys.shape[1]
                table = keys.to(grad.dtype)
                g = kernels.dense_rows(sub.reshape(tokens * heads, k),
                                       grad.reshape(tokens * heads, k), n)
                if shared:                     # [T, H·n] against all heads' keys
                    g = g.view(tokens, heads * n)
                    if needs_query:
                        grad_query[:, cols] = g @ table.reshape(heads * n, -1)
                    if needs_keys[side]:
                        grad_keys[side] = (g.t() @ q[:, cols]).view_as(keys)
                else:                          # per head: [T, H, n] against the head's keys
                    g = g.view(tokens, heads, n)
                    if needs_query:            # [H, T, d] written as [T, H, d]
                        grad_query[..., cols] = torch.bmm(g.transpose(0, 1), table
                                                          ).transpose(0, 1)
                    if needs_keys[side]:
                        # one GEMM per head: cuBLAS's batched kernel for this skinny, long-K
                        # product took 0.6 ms on an H100 (n 38, T 16384); the 2-D ones split K
                        grad_keys[side] = torch.stack([g[:, h].t() @ q[:, h, cols]
                                                       for h in range(heads)])
        grad_a, grad_b = (None if grad is None else grad.to(keys.dtype)
                          for grad, keys in zip(grad_keys, (keys_a, keys_b)))
        return None, grad_query, grad_a, grad_b, None
