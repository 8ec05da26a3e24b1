"""``sparseffn export CHECKPOINT --safetensors``: the model weights of a checkpoint as a
``.safetensors`` file, which any framework opens without unpickling (Hugging Face's format).

The run config and the step go into the file's metadata (``sparseffn_config`` as JSON,
``sparseffn_step``), which :func:`load_safetensors` returns with the weights. Where the
checkpoint holds one, the model config it was trained with goes there too
(``sparseffn_model_config``, the ``to_dict`` of its ``LMConfig`` or ``ClassifierConfig``):
the exact network the weights belong to, which the run config builds again only while the
library's defaults stay the same. :func:`load_safetensors` does not return it; read it from
the file's metadata. Optimiser state, RNG states and the tokenizer stay in the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import checkpoint as ckpt


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        from ..bench.plotting import MissingDependency
        raise MissingDependency("exporting safetensors needs the safetensors package: "
                                "pip install safetensors (or sparseffn[hf])") from None
    return st


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with every tensor contiguous and owning its memory: safetensors refuses
    tensors that share storage (tied weights, views)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        shared = key in seen or tensor.untyped_storage().nbytes() != tensor.nbytes
        seen.add(key)
        out[name] = tensor.detach().clone().contiguous() if shared or not tensor.is_contiguous() \
            else tensor.detach()
    return out


def export_safetensors(checkpoint: str | Path, out: str | Path | None = None) -> Path:
    """Write the model weights of ``checkpoint`` to ``out`` (default: ``model.safetensors``
    beside it), atomically: an interrupted or failed export leaves any earlier file whole."""
    st = _safetensors()
    state = ckpt.load(checkpoint)
    target = Path(out) if out else Path(checkpoint).with_name("model.safetensors")
    metadata = {"format": "pt", "sparseffn_config": json.dumps(state["config"]),
                "sparseffn_step": str(int(state["step"]))}
    if state.get("model_config") is not None:    # the network trained (train.model_config)
        metadata["sparseffn_model_config"] = json.dumps(state["model_config"])
    with ckpt.atomic_path(target) as temp:
        st.save_file(_unshared(state["model"]), str(temp), metadata=metadata)
    return target


def load_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, int]:
    """(state dict, run config dict, step) of a file :func:`export_safetensors` wrote."""
    st = _safetensors()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors file at {path}")
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata() or {}
    if "sparseffn_config" not in metadata:
        raise ckpt.CheckpointError(f"{path} was not exported by sparseffn (no sparseffn_config "
                                   f"in its metadata)")
    return (st.load_file(str(path)), json.loads(metadata["sparseffn_config"]),
            int(metadata.get("sparseffn_step", 0)))
