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


def _dynamo_modules_after(code: str) -> str:
    code += "; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    out = subprocess.run([sys.executable, "-c", "import sys; " + code], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_importing_sparseffn_does_not_import_dynamo():
    """Dynamo took 1.5 of the 4 s of ``import sparseffn``; a process that compiles nothing
    (``sparseffn --help``, an eager run) need not load it."""
    assert _dynamo_modules_after("import sparseffn") == "[]"


def test_the_trainer_and_the_expert_parallel_stores_import_dynamo_only_when_sharding():
    """``torch.compiler.disable`` on the expert exchange that reads its sizes on the host
    imported Dynamo with ``sparseffn.distributed``, so in every ``sparseffn train``; it is now
    applied when the first sharded store is built (or unpickled)."""
    assert _dynamo_modules_after(
        "import sparseffn.cli, sparseffn.train.trainer, sparseffn.train.parallel, "
        "sparseffn.distributed") == "[]"
    from sparseffn.distributed.expert_parallel import (ExpertParallelMLP,
                                                       _keep_sized_exchange_eager)
    _keep_sized_exchange_eager()
    exchange = ExpertParallelMLP._sized_exchange
    assert getattr(exchange, "_torchdynamo_disable", False)
    _keep_sized_exchange_eager()
    assert ExpertParallelMLP._sized_exchange is exchange   # disabled once, not wrapped again
