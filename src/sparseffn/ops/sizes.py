"""Paths chosen by a batch's size, under ``torch.export``.

A few layers pick a path by the token count: the expert MLPs of a few tokens without a
dispatch plan, product-key retrieval in chunks of tokens, the tree router's padded GEMM,
GShard's groups (and Switch's capacity, when the batch may be empty). Under
``torch.export`` with a dynamic token count each such test is a guard, and the exported
program serves only the sizes on the side traced: an unbounded ``Dim`` then fails the export
("Constraints violated"). A program exported for every size takes the path that serves every
size: the dispatch plan, one retrieval of the whole batch, the unpadded GEMM, the grouped
assignment (one group when the batch fits one).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def exporting() -> bool:
    """Whether ``torch.export`` is tracing this call: ``torch.compiler.is_exporting()``, read
    from the flag it returns. Dynamo on PyTorch 2.8 to 2.11 folds the call itself to True in
    every graph it traces, ``torch.compile``'s included (measured), so a compiled layer took
    the paths meant for exported programs; it reads the module flag as it is (True in a
    strict export, False under ``torch.compile``), as 2.13's Dynamo does for the call."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def exported_for_any_size(size) -> bool:
    """True while ``torch.export`` traces a dynamic size (a ``SymInt``); False in eager mode,
    under ``torch.compile`` (which keeps its bounded number of graphs) and for a static size
    of a non-strict export. Dynamo, which traces a strict export, shows a symbolic size as
    an ``int``: there every size counts as dynamic (the path that serves every size serves a
    static one too). Otherwise the size test was a guard, and ``to_onnx(..., strict=True)``
    with an unbounded ``Dim`` failed ("Not all values of t ... satisfy ... <= 7281")."""
    if not exporting():
        return False
    return isinstance(size, torch.SymInt) or torch.compiler.is_dynamo_compiling()


# Whether an exported program may choose between two paths by its token count with
# ``torch.cond`` (an ONNX ``If``): the expert MLPs' pairs or plan. Read where the program is
# traced (a plain module flag, which Dynamo reads as it is).
_cond_allowed = True


@contextlib.contextmanager
def without_cond() -> Iterator[None]:
    """While a program is traced inside this context, no layer puts a ``torch.cond`` in it:
    each takes the path that serves every size (the expert MLPs' dispatch plan).
    :func:`sparseffn.to_onnx` traces a strict export in it on a PyTorch whose Dynamo
    forgets attribute writes made after a ``torch.cond``
    (:func:`~sparseffn.onnx_export.dynamo_forgets_writes_after_cond`)."""
    global _cond_allowed
    outer, _cond_allowed = _cond_allowed, False
    try:
        yield
    finally:
        _cond_allowed = outer


def cond_allowed() -> bool:
    """False inside :func:`without_cond`."""
    return _cond_allowed
