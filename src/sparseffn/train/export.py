"""``sparseffn export CHECKPOINT --safetensors``: the model weights of a checkpoint as a
``.safetensors`` file, which any framework opens without unpickling (Hugging Face's format).
``--onnx``: the trained network as an ONNX model (:func:`export_onnx`).

The run config and the step go into the file's metadata (``sparseffn_config`` as JSON,
``sparseffn_step``), which :func:`load_safetensors` returns with the weights. Where the
checkpoint holds one, the model config it was trained with goes there too
(``sparseffn_model_config``, the ``to_dict`` of its ``LMConfig`` or ``ClassifierConfig``):
the exact network the weights belong to, which the run config builds again only while the
library's defaults stay the same. :func:`load_safetensors_model` builds that network and
loads the weights into it; :func:`load_safetensors` returns the weights, the run config and
the step. Optimiser state, RNG states and the tokenizer stay in the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

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
    weights, metadata = _read(path)
    return (weights, json.loads(metadata["sparseffn_config"]),
            int(metadata.get("sparseffn_step", 0)))


def load_safetensors_model(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The network of a file :func:`export_safetensors` wrote, holding its weights, on
    ``device`` and in eval mode (as a Hugging Face ``from_pretrained`` model; call
    ``.train()`` to train it on): a :class:`~sparseffn.models.lm.TransformerLM` or a
    :class:`~sparseffn.models.classifier.SparseClassifier`, built from the model config in the
    file's metadata (the network the weights were trained in, whatever this version's
    defaults). A file exported from a checkpoint that holds no model config (written before
    sparseffn kept one) holds an LM's run config: its network is built as this version builds
    that run config, for the vocabulary of the file's token embedding. A classifier's needs
    its data's sizes, which the file lacks: that is a CheckpointError, as is a file whose
    weights do not fit the network (``load_state_dict``'s message names the tensors)."""
    from ..models.classifier import SparseClassifier
    from ..models.lm import LMConfig, TransformerLM
    from .config import lm_config, run_config_from_dict
    from .model_config import saved_model_config
    weights, metadata = _read(path)
    try:
        if "sparseffn_model_config" in metadata:
            config = saved_model_config(json.loads(metadata["sparseffn_model_config"]))
        else:
            run = run_config_from_dict(json.loads(metadata["sparseffn_config"]))
            if run.model.kind != "lm":
                raise ValueError("the file holds no model config, and a classifier's network "
                                 "needs its data's sizes: build it from the run config "
                                 "(load_safetensors) and load the weights into it")
            if "embed.weight" not in weights:
                raise ValueError("the file holds no model config and no token embedding "
                                 "(embed.weight) to size the vocabulary by")
            config = lm_config(run, weights["embed.weight"].shape[0])
        model = TransformerLM(config) if isinstance(config, LMConfig) else \
            SparseClassifier(config)
        model.load_state_dict(weights)
    except (ValueError, TypeError, RuntimeError) as error:
        raise ckpt.CheckpointError(f"cannot build the network of {path}: {error}") from error
    return model.to(device).eval()


def _read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a file :func:`export_safetensors` wrote."""
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
    return st.load_file(str(path)), metadata


def export_onnx(checkpoint: str | Path, out: str | Path | None = None,
                kv_cache: bool = False) -> tuple[Path, float | None]:
    """Write the network of ``checkpoint`` to ``out`` (default: ``model.onnx`` beside it) as
    an ONNX model (:func:`sparseffn.to_onnx`), atomically: an interrupted or failed export
    leaves any earlier file whole. A language model takes int64 ``tokens`` [batch, time],
    time up to its context, and gives ``logits`` [batch, time, vocab]; a classifier takes
    float32 ``features`` [batch, in_features] and gives ``logits`` [batch, classes]; the
    batch size (and the time) are dynamic.

    ``kv_cache``: a language model's decoding program instead (default ``decoder.onnx``;
    :func:`sparseffn.decoder_to_onnx`, which :class:`sparseffn.OnnxDecoder` generates from);
    a CheckpointError for a classifier.

    Returns the path and, where ``onnxruntime`` is installed, the largest absolute difference
    between ONNX Runtime's logits and PyTorch's on a batch of 3 other than the traced one (for
    the decoder: a prompt of half the context, then one token at a time to its end; None
    without onnxruntime)."""
    from ..models.lm import TransformerLM
    from ..onnx_export import to_onnx
    from .trainer import load_network
    _, model = load_network(checkpoint)
    if kv_cache:
        if not isinstance(model, TransformerLM):
            raise ckpt.CheckpointError(f"{checkpoint} holds a {type(model).__name__}: only a "
                                       f"language model has a KV cache to export (drop "
                                       f"--kv-cache)")
        from ..onnx_decoding import decoder_to_onnx
        try:
            program = decoder_to_onnx(model)
        except ValueError as error:      # routing that a cache would change (a capacity)
            raise ckpt.CheckpointError(f"{checkpoint}: {error}") from error
    else:
        example, check, dynamic, input_name = _onnx_inputs(model)
        program = to_onnx(model, (example,), dynamic_shapes=(dynamic,),
                          input_names=[input_name], output_names=["logits"])
    default = "decoder.onnx" if kv_cache else "model.onnx"
    target = Path(out) if out else Path(checkpoint).with_name(default)
    with ckpt.atomic_path(target) as temp:
        program.save(str(temp))
    if kv_cache:
        return target, _decoder_difference(target, model)
    return target, _onnx_runtime_difference(target, model, check)


def _onnx_inputs(model: nn.Module):
    """(the traced input, another input to check, its dynamic dimensions, its name)."""
    from ..models.lm import TransformerLM
    gen = torch.Generator().manual_seed(0)
    batch = torch.export.Dim("batch", min=1)
    if isinstance(model, TransformerLM):
        config = model.config
        time = torch.export.Dim("time", min=2, max=config.context)
        example = torch.randint(0, config.vocab_size, (2, min(8, config.context)),
                                generator=gen)
        check = torch.randint(0, config.vocab_size, (3, config.context), generator=gen)
        return example, check, {0: batch, 1: time}, "tokens"
    features = model.config.in_features
    return (torch.randn(2, features, generator=gen), torch.randn(3, features, generator=gen),
            {0: batch}, "features")


def _onnx_runtime_difference(path: Path, model: nn.Module, inputs: torch.Tensor
                             ) -> float | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(path))
    got = session.run(None, {session.get_inputs()[0].name: inputs.numpy()})[0]
    with torch.no_grad():
        want = model(inputs)
    return float((torch.from_numpy(got) - want).abs().max())


def _decoder_difference(path: Path, model: nn.Module) -> float | None:
    """The largest difference between the logits :class:`~sparseffn.OnnxDecoder` gives a batch
    of 3 whole-context sequences (half of each as the prompt, then token by token) and
    PyTorch's forward of them; None without onnxruntime."""
    import importlib.util
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    from ..onnx_decoding import OnnxDecoder
    context = model.config.context
    tokens = torch.randint(0, model.config.vocab_size, (3, context),
                           generator=torch.Generator().manual_seed(1))
    decoder = OnnxDecoder(path)
    decoder.reset(3)
    prompt = max(1, context // 2)
    got = torch.cat([decoder.step(tokens[:, :prompt])]
                    + [decoder.step(tokens[:, i:i + 1]) for i in range(prompt, context)], 1)
    with torch.no_grad():
        want = model(tokens)
    return float((got - want).abs().max())
