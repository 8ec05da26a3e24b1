"""What the README and docs point at is there: each relative link's file and ``#anchor``
(a heading, by GitHub's rule: lower case, punctuation dropped, spaces as hyphens, ``-1``,
``-2`` ... for repeats), each project path named in backticks, and each ``sparseffn``
command line shown (the CLI parses it)."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from sparseffn.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (a ``# comment`` there is no heading)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for match in re.finditer(r"^#{1,6} (.+)$", _prose(path), re.M):
        base = anchor(match.group(1))
        repeat = seen.get(base, 0)
        seen[base] = repeat + 1
        found.add(base if repeat == 0 else f"{base}-{repeat}")
    return found


def test_anchor_follows_githubs_rule():
    assert anchor("Set-up: two commands") == "set-up-two-commands"
    assert anchor("On a GPU: the `Triton` kernels") == "on-a-gpu-the-triton-kernels"
    assert anchor("σ-MoE × dense, [PEER](x.md)") == "σ-moe--dense-peer"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_lead_to_a_file_and_heading(doc):
    broken = []
    for match in re.finditer(r"\]\(([^)\s]+)\)", _prose(doc)):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):      # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = doc.parent / path if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{doc.name}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_project_files_the_docs_name_exist(doc):
    """A path in backticks under one of the project's folders (``tests/...``,
    ``scripts/...``) names a file or folder that is there."""
    named = re.findall(r"`((?:src|tests|scripts|experiments|docs)/[\w./\-]*\w)`",
                       doc.read_text())
    assert named or doc.name != "README.md"     # the README names some: the pattern reads them
    missing = sorted({path for path in named if not (ROOT / path).exists()})
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


# what the synopses' placeholders stand for, to parse them
_PLACEHOLDERS = {"PATH": "out.json", "N": "2", "D": "64", "MODE": "default",
                 "NAME": "dense", "P": "float32", "DIR": "peers", "FILE": "model.safetensors",
                 "CHECKPOINT": "runs/x/checkpoint.pt", "CONFIG": "experiments/lm_pydoc.toml"}


def _commands(doc: Path) -> list[str]:
    """The ``sparseffn ...`` command lines of ``doc``: in its code blocks (comments cut) and
    in backticks with arguments; a bare ``sparseffn train`` names the command only."""
    text = doc.read_text()
    lines = [line.strip() for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
             for line in block.splitlines()]
    lines += [" ".join(found.split()) for found in re.findall(r"`(sparseffn [^`]+)`", text)]
    commands = [re.sub(r"\s+#.*$", "", line) for line in lines if line.startswith("sparseffn ")]
    return [command for command in commands if len(command.split()) > 2]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_commands_the_docs_show_parse(doc):
    """Each command line the README and docs show is one the CLI takes: its subcommand,
    options and choices (``[...]`` optional parts included, placeholders filled in)."""
    refused = []
    for command in _commands(doc):
        args = [_PLACEHOLDERS.get(word, word)
                for word in shlex.split(command.replace("[", " ").replace("]", " "))[1:]
                if word != "..."]
        if args[0] == "reproduce" and args[1] == "dense":   # NAME of a reproduction
            args[1] = "pkm"
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                build_parser().parse_args(args)
        except SystemExit:
            refused.append(f"{command}: {errors.getvalue().strip().splitlines()[-1]}")
    assert not refused, f"{doc.name}: {refused}"
