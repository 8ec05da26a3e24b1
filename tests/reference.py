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


def expert_mlp_reference(x, indices, weights, w1, w2, activation):
    """y_t = Σ_j weights[t, j] · act(x_t W1[e]) W2[e], e = indices[t, j] (seed 001 Eq. 25)."""
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(w2.shape[-1])
        for j in range(indices.shape[1]):
            e = indices[t, j]
            y = y + weights[t, j] * (activation(x[t] @ w1[e]) @ w2[e])
        rows.append(y)
    return torch.stack(rows) if rows else x.new_zeros(0, w2.shape[-1])
