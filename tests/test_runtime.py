"""``sparseffn.runtime``: marks and settings for ``torch.compile`` that cost nothing at import."""

import subprocess
import sys

import torch

from sparseffn.runtime import assume_constant_result


def test_assume_constant_result_marks_a_function_as_pytorchs_decorator_does():
    def ours():
        return 1

    def pytorchs():
        return 1
    assert assume_constant_result(ours) is ours
    torch.compiler.assume_constant_result(pytorchs)
    assert vars(ours) == vars(pytorchs) != {}


def test_importing_sparseffn_does_not_import_dynamo():
    """Dynamo took 1.5 of the 4 s of ``import sparseffn``; a process that compiles nothing
    (``sparseffn --help``, an eager run) need not load it."""
    code = ("import sys, sparseffn; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
