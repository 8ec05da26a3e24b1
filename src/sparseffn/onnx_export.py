"""ONNX export of models that hold sparse layers.

The layers' arithmetic runs in ``sparseffn::`` operators (:mod:`~sparseffn.ops.kernels`),
for which ONNX has no function. While ``torch.export`` traces a model for ONNX, each operator
traces as its *portable form* instead (:mod:`~sparseffn.ops.portable`: functional PyTorch
ops that ONNX has, the experts still computed sparsely, one block per expert), so the
program holds ATen ops alone. Both ways of exporting do this:

- ``torch.onnx.export(model, args, dynamo=True)``, as for any model: the layers see the
  exporter's flag, refuse training mode and trace inference (as under ``no_grad``);
- :func:`to_onnx`, which also refuses training mode by the layers' names before tracing,
  traces under ``no_grad`` and quiets the exporter's logging::

    model.eval()
    tokens = torch.export.Dim("tokens", min=2)
    onnx_program = sparseffn.to_onnx(model, (x,), dynamic_shapes=({0: tokens},))
    onnx_program.save("model.onnx")         # onnxruntime.InferenceSession("model.onnx")

``torch.export`` alone keeps the operators (its programs run them, AOTInductor's packages
too); :func:`portable_forms` turns such a program into ATen ops. The forms are not
registered in PyTorch's global decomposition table: its fake tensors prefer a registered
decomposition to an operator's own shape function whenever sizes are symbolic, so
``torch.export`` and ``torch.compile(dynamic=True)`` would trace them too.
``torch.onnx.export`` needs the ``onnx`` and ``onnxscript`` packages (``pip install
sparseffn[onnx]``). TorchScript tracing (``dynamo=False``) is refused by the layers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any, Iterator, Optional

import torch

from .ops import portable, sizes
from .requirements import torch_release
from .routing import SparseFFN


def portable_forms() -> dict:
    """``{operator overload: portable form}`` for ``ExportedProgram.run_decompositions``:
    ``torch.export.export(model, args).run_decompositions(portable_forms())`` is a program
    without ``sparseffn::`` operators, which other exporters can take."""
    return portable.forms()


def require_onnxruntime(user: str):
    """The ``onnxruntime`` module, or MissingDependency saying that ``user`` needs it and what
    to install."""
    try:
        import onnxruntime
    except ImportError:
        from .bench.plotting import MissingDependency
        raise MissingDependency(f"{user} needs onnxruntime: pip install 'sparseffn[onnx]' "
                                f"(or onnxruntime)") from None
    return onnxruntime


def cpu_session(path: str, threads: int):
    """An ONNX Runtime session of the program at ``path`` on the CPU execution provider, with
    ``threads`` intra-op threads and one inter-op thread (the benchmarks give it as many as
    PyTorch uses)."""
    ort = require_onnxruntime("this benchmark")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def require_onnx_packages() -> None:
    import importlib.util
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        from .bench.plotting import MissingDependency
        raise MissingDependency(f"to_onnx needs {' and '.join(missing)}: pip install "
                                f"'sparseffn[onnx]' (or {' '.join(missing)})")


def to_onnx(model: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, *,
            dynamic_shapes: Any = None, strict: bool = False,
            **onnx_options: Any) -> "torch.onnx.ONNXProgram":
    """``torch.onnx.export`` of ``model`` (in eval mode) with its sparse layers' operators
    replaced by their portable forms; returns the ``ONNXProgram`` (``.save(path)``).

    Args:
      model: any module; its sparse layers must be in eval mode (routing noise, dropout,
        capacity drops and usage statistics are training behaviour, which the program would
        not reproduce): a ValueError otherwise.
      args, kwargs: example inputs, as ``torch.export.export`` takes them.
      dynamic_shapes: as ``torch.export.export`` takes it (a ``Dim`` for the token count
        lets the program serve every batch size).
      strict: ``torch.export``'s strict mode. Where this PyTorch's Dynamo forgets
        attribute writes made after a ``torch.cond`` (:func:`dynamo_forgets_writes_after_cond`),
        the program then has no ``torch.cond``: the expert MLPs take their dispatch plan at
        every token count (decoding a token in ONNX Runtime runs every expert's block of
        small ops, where the pairs path reads its k experts alone).
      onnx_options: passed to ``torch.onnx.export`` (``opset_version``,
        ``input_names``, ``output_names``, ``optimize``, ...).
    """
    require_onnx_packages()
    sparse = [(name, module) for name, module in model.named_modules()
              if isinstance(module, SparseFFN)]
    training = [name for name, module in sparse if module.training]
    if training:
        raise ValueError(f"to_onnx exports inference: call model.eval() first (sparse layers "
                         f"in training mode: {', '.join(n or '<model>' for n in training[:3])}"
                         f"{', ...' if len(training) > 3 else ''})")
    no_cond = (sizes.without_cond() if strict and dynamo_forgets_writes_after_cond()
               else contextlib.nullcontext())
    with torch.no_grad(), _without_exporter_noise():
        with portable.tracing_forms(), no_cond, _explaining_old_releases(bool(sparse)):
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes,
                                          strict=strict)
        onnx_options.setdefault("verbose", False)   # no progress lines on stdout
        return torch.onnx.export(program, args, kwargs=kwargs, dynamo=True, **onnx_options)


# The oldest release whose torch.export traces every layer for a dynamic token count.
_EXPORTS_EVERY_LAYER = (2, 8)


@contextlib.contextmanager
def _explaining_old_releases(sparse: bool) -> Iterator[None]:
    """On a PyTorch older than :data:`_EXPORTS_EVERY_LAYER`, a failed export of a model that
    holds sparse layers (``sparse``) gets a note saying which layers that release cannot
    export and which release does. 2.7's ``torch.export`` cannot
    trace the data-dependent sizes of the expert MLPs' dispatch plan and of the trees for a
    dynamic token count (``nonzero`` inside ``torch.cond``: "Cond doesn't work unless it is
    captured completely with torch.compile"); the dense MLP, PKM, PEER, the top-k MLP and the
    classic mixtures export there."""
    try:
        yield
    except Exception as error:
        if sparse and torch_release(torch.__version__) < _EXPORTS_EVERY_LAYER:
            need = ".".join(map(str, _EXPORTS_EVERY_LAYER))
            error.add_note(
                f"sparseffn: PyTorch {torch.__version__} cannot export the expert MLPs "
                f"(σ-MoE, every MoE router, S-BASE) or the FFF trees for a dynamic token "
                f"count; PyTorch >= {need} exports them (the dense MLP, PKM, PEER, the top-k "
                f"MLP and the classic mixtures export on this one)")
        raise


class _Written:
    """What :func:`dynamo_forgets_writes_after_cond`'s program writes and reads."""
    value = 0


_WRITTEN = _Written()


class _WriteAroundCond(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _WRITTEN.value = 1
        x = torch.cond(x.shape[0] <= 4, lambda t: t + 1, lambda t: t - 1, (x,))
        _WRITTEN.value = 2
        return x * _WRITTEN.value


@functools.cache
def dynamo_forgets_writes_after_cond() -> bool:
    """Whether this PyTorch's Dynamo, tracing a strict ``torch.export``, reads an attribute
    written after a ``torch.cond`` as it was before the cond, when it was written before the
    cond too (checked once a process, by exporting such a program; PyTorch 2.13 does: its
    program multiplied by 1 where the code multiplies by the 2 written after the cond; 2.11
    does not).

    Code that writes and reads a global object's attribute around each call then goes wrong
    after the first ``torch.cond`` of a program: transformers 5.25's kernelized attention
    (the ``kernels`` package's ``CompileableContextVar``) fails a strict export of a Llama
    at the second block ("Dynamo does not know how to trace method `reset` of class
    `ContextVar`") once σ-MoE's first layer has put its ``torch.cond`` in the program, and
    a read that raises nothing gives a program that computes with the stale value.
    :func:`to_onnx` therefore puts no ``torch.cond`` in a strict export on such a PyTorch.
    False when the check itself cannot be exported."""
    x = torch.full((6, 1), 2.0)
    try:
        with warnings.catch_warnings():   # Dynamo's note on the writes: this check's own
            warnings.simplefilter("ignore")
            program = torch.export.export(_WriteAroundCond(), (x,), strict=True,
                                          dynamic_shapes=({0: torch.export.Dim("n", min=2)},))
        return bool(program.module()(x)[0, 0] != 2.0)    # (2 - 1) · 2 when the write is read
    except Exception:        # noqa: BLE001 (no strict export of a cond here: nothing to avoid)
        return False


# Loggers that print at every export something that concerns no model: PyTorch 2.13's ONNX
# registry ("torchvision is not installed. Skipping torchvision::nms", four lines), and
# onnx_ir's "Attribute type is ambiguous because it is an empty sequence" (its default is
# right).
_NOISY_LOGGERS = ("torch.onnx._internal.exporter._registration", "onnx_ir._convenience")


@contextlib.contextmanager
def _without_exporter_noise() -> Iterator[None]:
    """Quiet :data:`_NOISY_LOGGERS` below errors, and pytree's FutureWarning on ``LeafSpec``
    from inside ``torch.export``, for the duration."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
