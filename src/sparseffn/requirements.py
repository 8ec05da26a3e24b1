"""The oldest PyTorch sparseffn runs on, checked at import.

pip enforces ``torch>=2.7`` (pyproject.toml) when it installs the package, but not in an
environment built otherwise (conda, ``--no-deps``, a source checkout on ``PYTHONPATH``).
There, PyTorch 2.4 failed deep inside the first operator's registration (its schema
inference reads postponed annotations as strings); the check names the release instead.

Why 2.7: the whole suite was run on 2.4.1, 2.6.0 and 2.7.1 (``scripts/test_torch_version.sh``,
docs/performance.md). On 2.4.1, with that registration mended, 471 tests failed: Triton 3.0
(2.4's; 2.5 pins 3.1) rejects the kernels, current Hugging Face Transformers refuses PyTorch
below 2.6, and the trainer's checkpoints (``torch.serialization.safe_globals``) and gradient
clipping (``torch.nn.utils.get_total_norm``) need newer releases. On 2.6.0, layers compiled with
``dynamic=True`` still recompiled for each token count, FSDP2 does not run on CPU ranks, and the
compiled fixed expert exchange does not trace. On 2.7.1 the suite passes, except that
``torch.export`` with a dynamic token count works only for the dense MLP (the test expects that
failure there) and FSDP2 sums gloo gradients it should average, as on 2.8.
"""

from __future__ import annotations

import re

MINIMUM_TORCH = (2, 7)


def torch_release(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; a local or pre-release suffix is ignored."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"sparseffn: cannot read the PyTorch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str) -> None:
    """Raise ImportError naming ``version`` when it is older than :data:`MINIMUM_TORCH`."""
    if torch_release(version) < MINIMUM_TORCH:
        need = ".".join(map(str, MINIMUM_TORCH))
        raise ImportError(f"sparseffn needs PyTorch >= {need}, and this environment has "
                          f"torch {version}: install a newer release (pip install "
                          f"'torch>={need}')")
