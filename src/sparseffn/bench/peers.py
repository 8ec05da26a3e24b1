"""Other MoE implementations, built at σ-MoE's sizes, for ``sparseffn bench layers --peers``.

Every peer gets the same experts as σ-MoE: ``num_experts`` two-layer ReLU MLPs of
``expert_size`` hidden units over ``d_model``, ``k`` of them per token. Each peer module takes
``[tokens, d_model]`` and returns ``[tokens, d_model]``; peers that also return auxiliary
losses are wrapped so that the benchmark's loss includes them (``bench_extra_loss``).

- ``mixtral_loop``: the loop most MoE code uses today (e.g. Hugging Face's Mixtral block):
  softmax router, top-k, then for each expert pick its tokens, run it, and ``index_add`` back.
- ``grouped_mm``: ``torch._grouped_mm`` used plainly, as a user who calls it directly would:
  σ-MoE's sigmoid top-k router, the (token, slot) pairs sorted by expert, their rows gathered,
  two grouped products, and each token's k rows summed back in token order (no atomics).
- ``st_moe_pytorch``: ``st_moe_pytorch.MoE`` with our experts (its own router, top-n gating,
  capacity factor 1.25 and losses, as shipped).
- ``deepspeed``: ``deepspeed.moe.layer.MoE`` with our expert, ``ep_size=1`` in a one-process
  gloo group (its default capacity factor 1.0 with token dropping, as shipped).
"""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..config import SigmaMoEConfig
from ..requirements import torch_release


class Expert(nn.Sequential):
    """``d_model -> expert_size -> d_model`` with ReLU, no biases."""

    def __init__(self, d_model: int, expert_size: int) -> None:
        super().__init__(nn.Linear(d_model, expert_size, bias=False), nn.ReLU(),
                         nn.Linear(expert_size, d_model, bias=False))


class MixtralStyleMoE(nn.Module):
    """Softmax top-k router, renormalised, and a Python loop over experts."""

    def __init__(self, cfg: SigmaMoEConfig) -> None:
        super().__init__()
        self.k = cfg.k
        self.gate = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.d_model, cfg.expert_size)
                                     for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, selected = torch.topk(probs, self.k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(selected, len(self.experts)).permute(2, 1, 0)  # [E, k, T]
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(expert_mask[e])
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


def grouped_mm_missing_on(device: torch.device | str) -> str | None:
    """Why ``torch._grouped_mm`` cannot run on ``device``'s type in this PyTorch, or None where
    it has a kernel there: PyTorch has it from 2.8, on the CPU from 2.9 (2.8's CPU tensors
    raise NotImplementedError)."""
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm needs PyTorch >= 2.8"
    if torch.device(device).type == "cpu" and torch_release(torch.__version__) < (2, 9):
        return "torch._grouped_mm has no CPU kernel before PyTorch 2.9"
    return None


class GroupedMMMoE(nn.Module):
    """σ-MoE's experts through ``torch._grouped_mm`` with nothing else from the library.

    ``s = σ(W_s x)``, top-k (Csordás et al. 2023 Eq. 25 with σ-MoE's selection), then the
    ``T·k`` pairs sorted by expert, the ends of each expert's block found by a binary search
    (offsets on the device, no host read), the pairs' input rows gathered, ``relu(rows W1_e)
    W2_e`` as two grouped products, scaled by the scores, put back in (token, slot) order and
    summed over the k slots. Weights are stored as ``nn.Linear`` stores them ([E, out, in])
    and handed over transposed, as torchtitan's MoE does. Needs PyTorch ≥ 2.8
    (``torch._grouped_mm`` with autograd; on the CPU ≥ 2.9) and, on CUDA, bf16 on a Hopper
    or newer GPU.

    forward(x: [tokens, d_model]) -> [tokens, d_model]
    """

    def __init__(self, cfg: SigmaMoEConfig) -> None:
        super().__init__()
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError("the grouped_mm peer needs torch._grouped_mm (PyTorch >= 2.8)")
        self.k, self.num_experts = cfg.k, cfg.num_experts
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(cfg.num_experts, cfg.expert_size, cfg.d_model)
                               / cfg.d_model ** 0.5)
        self.w2 = nn.Parameter(torch.randn(cfg.num_experts, cfg.d_model, cfg.expert_size)
                               / cfg.expert_size ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, d_model = x.shape
        scores, experts = torch.sigmoid(self.router(x)).topk(self.k, dim=-1)     # [T, k]
        pair_experts = experts.flatten()                                          # [T·k]
        order = pair_experts.argsort(stable=True)
        ends = torch.searchsorted(pair_experts[order],
                                  torch.arange(self.num_experts, device=x.device),
                                  right=True).to(torch.int32)                     # [E]
        rows = x[order // self.k]                                                 # [T·k, d]
        hidden = F.relu(torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=ends))
        out = torch._grouped_mm(hidden, self.w2.transpose(-2, -1), offs=ends)
        out = out * scores.flatten()[order].unsqueeze(1).to(out.dtype)
        in_pair_order = torch.empty_like(out).index_copy(0, order, out)
        return in_pair_order.view(tokens, self.k, d_model).sum(1)


class _WithAuxLoss(nn.Module):
    """Adapts a peer that returns ``(output, aux_loss, ...)`` or needs ``[batch, seq, d]``."""

    def __init__(self, inner: nn.Module, batched: bool) -> None:
        super().__init__()
        self.inner, self.batched = inner, batched
        self.last_aux = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x.unsqueeze(0) if self.batched else x)
        if isinstance(out, tuple):
            out, self.last_aux = out[0], out[1]
        return out.squeeze(0) if self.batched else out

    @staticmethod
    def bench_extra_loss(module: "_WithAuxLoss") -> torch.Tensor:
        aux = module.last_aux
        return aux.sum() if isinstance(aux, torch.Tensor) else torch.zeros(())


def build_st_moe(cfg: SigmaMoEConfig) -> nn.Module:
    from st_moe_pytorch import MoE
    experts = nn.ModuleList(Expert(cfg.d_model, cfg.expert_size) for _ in range(cfg.num_experts))
    return _WithAuxLoss(MoE(dim=cfg.d_model, num_experts=cfg.num_experts,
                            gating_top_n=cfg.k, experts=experts), batched=True)


def _ensure_single_process_group() -> None:
    """A one-process gloo group on loopback, as DeepSpeed's MoE requires one."""
    import deepspeed
    import deepspeed.comm as ds_comm
    if ds_comm.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def build_deepspeed(cfg: SigmaMoEConfig) -> nn.Module:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.moe.layer import MoE
    _ensure_single_process_group()
    moe = MoE(hidden_size=cfg.d_model, expert=Expert(cfg.d_model, cfg.expert_size),
              num_experts=cfg.num_experts, ep_size=1, k=cfg.k)
    return _WithAuxLoss(moe, batched=False)


PEERS: dict[str, tuple[str | None, Callable[[SigmaMoEConfig], nn.Module]]] = {
    "mixtral_loop": (None, MixtralStyleMoE),
    "grouped_mm": (None, GroupedMMMoE),
    "st_moe_pytorch": ("st_moe_pytorch", build_st_moe),
    "deepspeed": ("deepspeed", build_deepspeed),
}


def available_peers() -> list[tuple[str, Callable[[SigmaMoEConfig], nn.Module]]]:
    """The peers whose packages are installed; the others are named with the install command."""
    import importlib.util
    found = []
    for name, (package, build) in PEERS.items():
        if package is None or importlib.util.find_spec(package) is not None:
            found.append((name, build))
        else:
            print(f"  peer {name}: not installed (pip install 'sparseffn[peers]', or `make peers`)")
    return found
