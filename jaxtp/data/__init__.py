"""Training data: token sources (text, JSONL, Parquet, ArrayRecord, token files), the corpus of a
run, packed batches with segment ids, mixtures, and ``prepare-data``."""

from jaxtp.data.batches import loaders  # noqa: F401  (jaxtp.data.loaders)
