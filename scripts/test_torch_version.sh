#!/usr/bin/env bash
# The test suite against another PyTorch release than the CPU build that CI pins (2.13.0), in
# a virtual environment of its own (.venv-torch<VERSION>, or $VENV; .venv is not touched).
#
#   bash scripts/test_torch_version.sh 2.11.0                 # the whole suite
#   bash scripts/test_torch_version.sh 2.11.0 tests/test_hf.py -x
#   PYTHON=python3.13 VENV=.venv-torch2.13.0-py3.13 bash scripts/test_torch_version.sh 2.13.0
#                                                  # another Python (pyenv has 3.12 and 3.13)
#
# Why: the lent GPU machines run PyTorch 2.11 and Triton 3.6, and a GPU session has 15 minutes
# of device time. Code that only 2.13 runs correctly costs that session its one call, or
# worse, passes there with wrong numbers. Run this (about 25 minutes on a 2-core machine, and
# a one-time install of about 3 GB: PyPI's Linux wheels of torch are CUDA builds, which import
# and run on a CPU machine) before a GPU session whenever the code changed since the last
# run. The thirty-ninth session found this way that the compiled fixed expert exchange gave
# wrong gradients and hung on 2.11 (docs/distributed.md).
#
# NumPy stays below 2.3 here: Triton 3.6's interpreter (which runs the kernel tests on the CPU)
# raises a TypeError on NumPy 2.4. The fused CPU kernels build into the venv's own cache.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?"usage: bash scripts/test_torch_version.sh VERSION [pytest arguments]"}
shift
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-torch$VERSION}

if [ ! -x "$VENV/bin/python" ]; then
    echo "test_torch_version: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.sparseffn-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "test_torch_version: installing torch==$VERSION and sparseffn[test] into $VENV"
    if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -q \
            "torch==$VERSION" "numpy<2.3" -e ".[test]"; then
        # torch 2.4 and 2.5 pin Triton 3.0 and 3.1, below the test extra's triton>=3.2 (and
        # Liger-Kernel's Triton kernels): their own Triton comes with them, the rest of the
        # test extra is installed as it is.
        echo "test_torch_version: the test extra conflicts with torch==$VERSION;" \
            "installing it without triton and liger-kernel"
        mapfile -t extra < <("$VENV/bin/python" - <<'PY'
import re, tomllib
with open("pyproject.toml", "rb") as f:
    test = tomllib.load(f)["project"]["optional-dependencies"]["test"]
print("\n".join(r for r in test if not re.match(r"(triton|liger-kernel)\b", r)))
PY
        )
        "$VENV/bin/python" -m pip install --disable-pip-version-check -q \
            "torch==$VERSION" "numpy<2.3" -e . "${extra[@]}"
    fi
    touch "$stamp"
fi
"$VENV/bin/python" - "$VERSION" <<'PY'
import sys, torch
if torch.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"test_torch_version: the venv has torch {torch.__version__}, not {sys.argv[1]}")
try:
    import triton
    print(f"test_torch_version: torch {torch.__version__}, triton {triton.__version__}")
except ImportError:
    print(f"test_torch_version: torch {torch.__version__}, no triton")
PY
export SPARSEFFN_CACHE_DIR="$(cd "$VENV" && pwd)/sparseffn-cache"
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
