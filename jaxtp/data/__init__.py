"""Training data: token sources (text, JSONL, Parquet, ArrayRecord, token files), the corpus of a
run, packed batches with segment ids, mixtures, and ``prepare-data``."""

from jaxtp.data.batches import Loader, loaders, train_eval_split
from jaxtp.data.corpus import load_tokens, parse_mixture
from jaxtp.data.prepare_data import prepare
from jaxtp.data.sources import ArrayStream, bpe_encode, bpe_tokenizer

__all__ = [
    "ArrayStream", "Loader", "bpe_encode", "bpe_tokenizer", "load_tokens", "loaders",
    "parse_mixture", "prepare", "train_eval_split"
]
