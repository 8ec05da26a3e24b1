"""The tiny corpus the training tests train their LMs on."""

import pytest

CORPUS = (b"It is a truth universally acknowledged, that a single man in possession of a good "
          b"fortune, must be in want of a wife. ") * 60


@pytest.fixture
def corpus(tmp_path):
    """The path of a file holding :data:`CORPUS`."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(CORPUS)
    return str(path)
