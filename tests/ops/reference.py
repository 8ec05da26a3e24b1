"""Slow, obviously correct references: Python loops over tokens and slots."""

import torch


def cvmm_reference(x, indices, weight, gates=None):
    """x: [T, m] or [T, k, m]; indices: [T, k]; weight: [E, m, n]; gates: [T, k] or None."""
    T, k = indices.shape
    outs = []
    for t in range(T):
        slots = []
        for j in range(k):
            row = x[t] if x.dim() == 2 else x[t, j]
            slots.append(row @ weight[indices[t, j]])
        if gates is None:
            outs.append(torch.stack(slots) if slots else x.new_zeros(0, weight.shape[-1]))
        else:
            outs.append(sum(gates[t, j] * slots[j] for j in range(k)))
    if not outs:
        shape = (0, weight.shape[-1]) if gates is not None else (0, k, weight.shape[-1])
        return x.new_zeros(shape)
    return torch.stack(outs)


def expert_mlp_reference(x, indices, weights, w1, w2, activation, w_gate=None, b1=None,
                         b2=None):
    """y_t = Σ_j weights[t, j] · act(x_t W1[e]) W2[e], e = indices[t, j] (Csordás et al. 2023 Eq.
    25); with ``w_gate`` [E, d, G] the gated expert (act(x_t Wg[e]) ⊙ x_t W1[e]) W2[e]; with
    biases b1 [E, G] (added to x_t W1[e]) and b2 [E, d_out] (to the expert's output)."""
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(w2.shape[-1])
        for j in range(indices.shape[1]):
            e = indices[t, j]
            pre = x[t] @ w1[e] + (0 if b1 is None else b1[e])
            hidden = activation(pre) if w_gate is None else activation(x[t] @ w_gate[e]) * pre
            y = y + weights[t, j] * (hidden @ w2[e] + (0 if b2 is None else b2[e]))
        rows.append(y)
    return torch.stack(rows) if rows else x.new_zeros(0, w2.shape[-1])


def product_key_reference(query_a, query_b, keys_a, keys_b, k):
    """Score every one of the n_a · n_b keys of each head (key i + n_a·j is
    [keys_a[h, i] | keys_b[h, j]], its score s_a[i] + s_b[j]) and keep the k best by
    (score desc, index asc), with a Python sort.

    query_a: [T, H, d_a]; keys_a: [H, n_a, d_a]. Returns scores [T, H, k] (differentiable)
    and indices [T, H, k]."""
    T, H = query_a.shape[:2]
    scores, indices = [], []
    for t in range(T):
        head_scores, head_indices = [], []
        for h in range(H):
            s_a = keys_a[h] @ query_a[t, h]
            s_b = keys_b[h] @ query_b[t, h]
            full = (s_b[:, None] + s_a[None, :]).reshape(-1)       # index j·n_a + i
            values = full.tolist()
            order = sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]
            head_scores.append(full[order])
            head_indices.append(torch.tensor(order))
        scores.append(torch.stack(head_scores))
        indices.append(torch.stack(head_indices))
    return torch.stack(scores), torch.stack(indices)


def product_key_layer_reference(layer, x):
    """PKM or PEER output by a loop over tokens, heads and retrieved rows, with the retrieval
    of :func:`product_key_reference` (full scoring)."""
    router = layer.router
    spec = router.spec
    q = x if router.query is None else router.query(x)
    if router.query_norm is not None:
        q = router.query_norm(q)
    q = q.view(x.shape[0], -1, spec.key_dim).expand(x.shape[0], spec.heads, spec.key_dim)
    half = spec.key_dim // 2
    scores, indices = product_key_reference(q[..., :half], q[..., half:], router.keys_a,
                                            router.keys_b, spec.k)
    if spec.score == "softmax":
        weights = torch.softmax(scores, dim=-1)
    elif spec.score == "relu":
        weights = torch.relu(scores)
    else:
        weights = torch.sigmoid(scores)
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(x.shape[1])
        for h in range(spec.heads):
            for j in range(spec.k):
                i = indices[t, h, j]
                store = layer.store
                if hasattr(store, "values"):                       # PKM: value rows
                    y = y + weights[t, h, j] * store.values[i]
                else:                                              # PEER: σ(u_iᵀx) v_i
                    y = y + weights[t, h, j] * store.activation(store.w_in[i] @ x[t]) * store.w_out[i]
        rows.append(y)
    return torch.stack(rows), indices
