"""Real data that works without internet (../shared/DATA.md): text corpora for language
modelling and arrays for classification. A missing dataset raises :class:`MissingDataset`
with the exact command that gets it."""

from .arrays import ArrayData, DATASETS, clusters, load_arrays, read_idx
from .corpora import CORPORA, corpus_bytes
from .errors import MissingDataset
from .text import TextData, bits_per_byte, split_bytes, unigram_entropy_bits
from .tokenizers import BPETokenizer, ByteTokenizer

__all__ = ["ArrayData", "BPETokenizer", "ByteTokenizer", "CORPORA", "DATASETS", "MissingDataset",
           "TextData", "bits_per_byte", "clusters", "corpus_bytes", "load_arrays", "read_idx",
           "split_bytes", "unigram_entropy_bits"]
