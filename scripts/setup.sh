#!/usr/bin/env bash
# Set up sparseffn in ./.venv: the pinned CPU build of PyTorch first, so that pip never pulls
# the CUDA wheels, then the package itself (editable) with the extras named in $EXTRAS
# (comma-separated, e.g. EXTRAS=test or EXTRAS=test,peers). Safe to run again: each step is
# skipped when already done.
#
# The dependencies are installed at the versions in scripts/constraints.txt (the ones the
# suite last passed with on a fresh machine), so that a dependency's new release does not
# change what `make test` runs; CONSTRAINTS= (empty) installs the newest releases instead,
# in a .venv set up with the constraints too (torch stays at $TORCH_VERSION).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${EXTRAS:-test}
VENV=.venv
CONSTRAINTS=${CONSTRAINTS-scripts/constraints.txt}

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
constrained=()
if [ -n "$CONSTRAINTS" ]; then constrained=(-c "$CONSTRAINTS"); fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$VENV/bin/python" - "$TORCH_VERSION" <<'PY' 2>/dev/null
import sys, torch
sys.exit(torch.__version__.split("+")[0] != sys.argv[1])
PY
then
    echo "setup: installing torch==$TORCH_VERSION (CPU build)"
    pip_install ${constrained[@]+"${constrained[@]}"} "torch==$TORCH_VERSION"
fi

# The stamp holds what the install followed: the constraints file and its hash, or "newest
# releases"; another (CONSTRAINTS= after a constrained install, or the reverse) installs again.
stamp="$VENV/.sparseffn-installed-$(echo "$EXTRAS" | tr ',' '-')"
if [ -n "$CONSTRAINTS" ]; then
    followed="constraints $CONSTRAINTS $(sha256sum < "$CONSTRAINTS" | cut -c1-16)"
    newest=()
else
    followed="newest releases"
    # every dependency to its newest release, torch held at the CPU build named here
    newest=(--upgrade --upgrade-strategy eager "torch==$TORCH_VERSION")
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] ||
        [ "$(cat "$stamp" 2>/dev/null)" != "$followed" ]; then
    echo "setup: installing sparseffn[$EXTRAS] ($followed)"
    pip_install ${constrained[@]+"${constrained[@]}"} ${newest[@]+"${newest[@]}"} \
        -e ".[$EXTRAS]"
    if [[ ",$EXTRAS," == *",peers,"* ]]; then
        # DeepSpeed builds against the torch already installed; it needs no build isolation.
        pip_install --no-build-isolation deepspeed
    fi
    echo "$followed" > "$stamp"
fi
