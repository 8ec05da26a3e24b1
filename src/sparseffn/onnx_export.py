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
import logging
import warnings
from typing import Any, Iterator, Optional

import torch

from .ops import portable
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
      strict: ``torch.export``'s strict mode.
      onnx_options: passed to ``torch.onnx.export`` (``opset_version``,
        ``input_names``, ``output_names``, ``optimize``, ...).
    """
    require_onnx_packages()
    training = [name for name, module in model.named_modules()
                if isinstance(module, SparseFFN) and module.training]
    if training:
        raise ValueError(f"to_onnx exports inference: call model.eval() first (sparse layers "
                         f"in training mode: {', '.join(n or '<model>' for n in training[:3])}"
                         f"{', ...' if len(training) > 3 else ''})")
    with torch.no_grad(), _without_exporter_noise():
        with portable.tracing_forms():
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes,
                                          strict=strict)
        onnx_options.setdefault("verbose", False)   # no progress lines on stdout
        return torch.onnx.export(program, args, kwargs=kwargs, dynamo=True, **onnx_options)


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
