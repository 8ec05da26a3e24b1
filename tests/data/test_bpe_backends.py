"""The two engines of BPETokenizer — NumPy and Hugging Face ``tokenizers`` — give the same
tokenizer: the same merges from the same text (ties included), the same ids for any bytes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseffn.data import BPETokenizer, fast_bpe

pytest.importorskip("tokenizers")


def _pydoc(size):
    import pydoc_data.topics
    return "".join(pydoc_data.topics.topics.values()).encode()[:size]


AWKWARD = [b"", b"\n", b"\n\n\n", b"\nstarts with a newline", b"no newline at all",
           b"crlf\r\nline\r\n", b"\x00\xff\x80 bytes that are not utf-8 \xc3\n\xc3\xa9",
           b"aaaaaaaaaaa\naaaa", bytes(range(256)) * 3]


def test_both_engines_learn_the_same_merges_on_real_text_and_encode_alike():
    text = _pydoc(300_000)
    fast = BPETokenizer.train(text, 1000, backend="tokenizers")
    slow = BPETokenizer.train(text, 1000, backend="numpy")
    assert fast_bpe.train_merges(text, 1000) == fast.merges       # not a NumPy fallback
    assert (fast.backend, slow.backend) == ("tokenizers", "numpy")
    assert fast.merges == slow.merges and len(fast.merges) == 1000 - 256
    unseen = _pydoc(400_000)[300_000:]
    for data in [text, unseen] + AWKWARD:
        ids = fast.encode(data)
        assert ids.dtype == np.int64
        assert np.array_equal(ids, slow.encode(data))
        assert fast.decode(ids) == data
    # the state is the same whoever built it, and rebuilds either engine
    assert fast.state() == slow.state()
    again = BPETokenizer(slow.state()["merges"], backend="tokenizers")
    assert np.array_equal(again.encode(unseen), slow.encode(unseen))


def test_no_token_holds_a_newline_except_at_its_start():
    tok = BPETokenizer.train(b"end of line.\n    indented\n    indented again.\n" * 40, 320,
                             backend="numpy")
    pieces = [tok.decode([i]) for i in range(tok.vocab_size)]
    assert any(p.startswith(b"\n ") for p in pieces)          # newline + indentation is one
    assert all(b"\n" not in p[1:] for p in pieces)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=300).map(lambda b: bytes(x % 5 + 95 if x % 7 else 10
                                                               for x in b)))
def test_ties_are_broken_alike(text):
    """Short texts over four letters and newlines: many pairs are equally frequent."""
    slow = BPETokenizer.train(text * 3, 300, backend="numpy")
    assert fast_bpe.train_merges(text * 3, 300) == slow.merges    # learned by tokenizers
    fast = BPETokenizer(slow.merges, backend="tokenizers")
    assert np.array_equal(fast.encode(text), slow.encode(text))


def test_merges_tokenizers_cannot_hold_fall_back_to_numpy():
    crossing = [(ord("a"), ord("\n"))]                     # an older sparseffn's merge
    duplicate = [(97, 98), (256, 99), (98, 99), (97, 258)]   # "abc" made twice
    for merges in (crossing, duplicate):
        tok = BPETokenizer(merges)
        assert tok.backend == "numpy"
        assert tok.decode(tok.encode(b"abc\nab\nc")) == b"abc\nab\nc"
        with pytest.raises(ValueError, match="numpy"):
            BPETokenizer(merges, backend="tokenizers")
    assert BPETokenizer(crossing).encode(b"a\n").tolist() == [256]


def test_without_tokenizers_numpy_is_used_and_asking_for_it_is_an_error(monkeypatch):
    monkeypatch.setattr(fast_bpe, "_tokenizers", lambda: None)
    tok = BPETokenizer.train(b"the cat sat on the mat\n" * 20, 270)
    assert tok.backend == "numpy" and len(tok.merges) == 14
    with pytest.raises(ImportError, match="pip install tokenizers"):
        BPETokenizer.train(b"abc", 300, backend="tokenizers")
    with pytest.raises(ValueError, match="backend"):
        BPETokenizer([], backend="rust")
