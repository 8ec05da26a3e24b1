"""The PyTorch floor: checked at import, and the same as the one pip enforces."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from sparseffn.requirements import MINIMUM_TORCH, check_torch, torch_release


@pytest.mark.parametrize("version, release", [
    ("2.7.1", (2, 7)), ("2.13.0+cpu", (2, 13)), ("2.11.0+cu130", (2, 11)),
    ("2.10.0a0+git1234abc", (2, 10)), ("3.0", (3, 0))])
def test_a_release_is_read_from_any_version_string(version, release):
    assert torch_release(version) == release


def test_an_unreadable_version_is_named():
    with pytest.raises(ValueError, match="cannot read the PyTorch version 'nightly'"):
        torch_release("nightly")


def test_releases_below_the_floor_are_refused_by_name():
    check_torch("2.7.1")
    check_torch("2.13.0+cpu")
    check_torch(torch.__version__)
    for old in ("2.6.0", "2.4.1+cu121", "1.13.1"):
        with pytest.raises(ImportError, match=re.escape(f"has torch {old}")):
            check_torch(old)


def test_the_floor_is_the_one_pip_enforces():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    floors = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    assert floors == [f"torch>={MINIMUM_TORCH[0]}.{MINIMUM_TORCH[1]}"]


def test_importing_sparseffn_under_an_old_torch_names_the_release():
    code = "import torch; torch.__version__ = '2.6.0'; import sparseffn"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "ImportError: sparseffn needs PyTorch >= 2.7, and this environment has torch " \
           "2.6.0" in out.stderr
