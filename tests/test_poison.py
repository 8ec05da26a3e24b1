"""The fresh-memory fill every test runs under (tests/poison.py) does what the kernel tests
rely on: fresh memory holds the poison, and a compiled test gets the real allocators back."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .poison import poison_value, poisoned_allocations


def test_fresh_memory_holds_the_poison_of_its_dtype():
    x = torch.ones(2)
    for fresh in (torch.empty(5), torch.empty_like(x), torch.empty_strided((2, 3), (3, 1)),
                  x.new_empty(4), x.new_empty_strided((3,), (1,))):
        assert torch.all(fresh == torch.finfo(torch.float32).min)
    assert torch.all(torch.empty(3, dtype=torch.int64) == torch.iinfo(torch.int64).min)
    assert torch.all(torch.empty(3, dtype=torch.bfloat16) == poison_value(torch.bfloat16))
    assert torch.all(torch.empty(3, dtype=torch.bool))
    assert torch.empty(0).numel() == 0 and torch.empty(4, device="meta").is_meta
    leaf = torch.empty(3, requires_grad=True)
    assert leaf.is_leaf and leaf.requires_grad and torch.all(leaf == poison_value(leaf.dtype))
    assert torch.empty(2, 3, layout=torch.sparse_coo).layout == torch.sparse_coo


def test_an_output_left_partly_unwritten_no_longer_matches_by_luck():
    def half_written_relu(x):       # a "kernel" that forgets the rows after the first half
        out = torch.empty_like(x)
        out[: x.shape[0] // 2] = x[: x.shape[0] // 2].relu()
        return out
    # all negative, so the right answer is all zeros: what fresh memory from the OS holds, and
    # what this large a block gets unpoisoned
    x = -torch.rand(1 << 16, 4)
    assert not torch.equal(half_written_relu(x), x.relu())


@pytest.mark.unpoisoned
def test_the_allocators_are_restored_on_exit_and_at_the_first_compile():
    originals = (torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.compile)
    with poisoned_allocations():
        assert torch.empty is not originals[0]
        torch.compile(lambda t: t + 1, backend="eager")
        assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == originals[:3]
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.compile) == originals


@pytest.mark.unpoisoned
def test_a_device_context_still_places_what_the_poisoned_allocators_make():
    """Hugging Face builds a model inside ``torch.device("meta")``; the first such context in a
    process, entered under the poison, must still put ``torch.empty`` (nn.Linear's weights)
    on its device. A fresh process, so that no earlier test has entered one."""
    script = ("import torch\n"
              "from tests.poison import poisoned_allocations\n"
              "with poisoned_allocations(), torch.device('meta'):\n"
              "    made = (torch.empty(3), torch.nn.Linear(2, 2).weight, torch.zeros(2))\n"
              "print(' '.join(t.device.type for t in made))\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["meta", "meta", "meta"]
