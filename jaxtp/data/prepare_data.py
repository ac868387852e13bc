"""``jaxtp prepare-data SRC... --out DIR --tokenizer (byte|bpe|PATH)``: tokenise documents once.

Every document of the sources (text files, JSONL, Parquet, ArrayRecord; see
:mod:`jaxtp.data.sources`) is tokenised, followed by the end-of-document token, and written as one
run of records of an ArrayRecord shard (``shard-00000.arrayrecord``, ...) of its token ids, at
most ``record_tokens`` per record so that a window reads a few KiB, not a whole long document.
Beside the shards go ``lengths.npy`` (tokens per record) and ``offsets.npy`` (where each
document starts in the token stream, and its end), so a loader finds any window and its
documents without scanning the shards, and ``manifest.json``: documents, tokens, the largest id, the token dtype and the
tokenizer's hash. A BPE tokenizer (trained here for ``bpe``, copied for a ``tokenizer.json``
path) is saved as ``DIR/tokenizer.json``. Training reads the directory as a ``data.path`` or a
``data.mixture`` entry and refuses it unless the run tokenizes with the same tokenizer.
BPE encoding runs on the HuggingFace tokenizers library's threads (``encode_batch``), a batch of
documents at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxtp.configs import ConfigError, DataConfig
from jaxtp.data import sources

FORMAT = "jaxtp-prepared-1"
_BATCH = 1024  # documents per encode_batch call


def _tokenizer(spec: str, out: Path, files: list[Path], text_field: str, vocab_size: int):
    if spec == "byte":
        return None
    if spec == "bpe":
        text = b"\n".join(d if isinstance(d, bytes) else d.encode()
                          for f in files for d in sources.read_documents(f, text_field))
        tok = sources.bpe_tokenizer(DataConfig(tokenizer="bpe"), text, vocab_size, None)
    else:
        path = Path(os.path.expanduser(spec))
        if not path.is_file():
            raise ConfigError(f"--tokenizer {spec!r} is not byte, bpe or an existing "
                              f"tokenizer.json; pass one of those")
        tok = sources.bpe_tokenizer(DataConfig(tokenizer="bpe", tokenizer_path=str(path)), b"",
                                    2**31, None)
    tok.save(str(out / "tokenizer.json"))
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json"))  # hashed as training will load it


def prepare(srcs: list[str], out: str, *, tokenizer: str = "byte", vocab_size: int = 4096,
            text_field: str = "text", eos_id: int = -1, shard_tokens: int = 64 * 2**20,
            record_tokens: int = 4096, progress: bool = True) -> dict:
    """Tokenise ``srcs`` into ArrayRecord shards under ``out``; returns the manifest."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from tqdm import tqdm

    if not srcs:
        raise ConfigError("prepare-data needs at least one source: jaxtp prepare-data "
                          "docs.jsonl --out data/prepared")
    files = [f for s in srcs for f in sources.source_files(s)]
    root = Path(out)
    if (root / sources.MANIFEST).exists():
        raise ConfigError(f"--out {out} already holds a prepared set; choose a new directory or "
                          f"remove it")
    root.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(tokenizer, root, files, text_field, vocab_size)
    encode = sources.Encoder(tok, sources.eos_id(DataConfig(eos_id=eos_id,
                                                            tokenizer="bpe" if tok else "byte"),
                                                 tok))
    shards, lengths, docs_len, max_token = [], [], [], 0
    writer, shard_size = None, 0
    bar = tqdm(files, desc="prepare-data", unit="file", disable=not progress)
    for f in bar:
        docs = sources.read_documents(f, text_field)
        for i in range(0, len(docs), _BATCH):
            for ids in encode(docs[i:i + _BATCH]):
                if writer is None or shard_size >= shard_tokens:
                    if writer is not None:
                        writer.close()
                    shards.append(f"shard-{len(shards):05d}.arrayrecord")
                    writer, shard_size = ArrayRecordWriter(str(root / shards[-1]),
                                                           "group_size:1"), 0
                for a in range(0, len(ids), record_tokens):
                    writer.write(ids[a:a + record_tokens].tobytes())
                    lengths.append(len(ids[a:a + record_tokens]))
                shard_size += len(ids)
                docs_len.append(len(ids))
                max_token = max(max_token, int(ids.max()))
        bar.set_postfix(docs=len(docs_len), tokens=int(sum(docs_len)))
    if writer is not None:
        writer.close()
    if not lengths:
        raise ConfigError(f"the sources {srcs} hold no documents")
    np.save(root / "lengths.npy", np.asarray(lengths, np.int64))
    np.save(root / "offsets.npy", np.concatenate([[0], np.cumsum(docs_len)]).astype(np.int64))
    manifest = {
        "format": FORMAT, "sources": [str(s) for s in srcs], "text_field": text_field,
        "documents": len(docs_len), "records": len(lengths), "tokens": int(sum(lengths)),
        "max_token": max_token,
        "dtype": np.dtype(encode.dtype).name, "eos_id": encode.eos,
        "tokenizer": "byte" if tok is None else "bpe",
        "tokenizer_hash": sources.tokenizer_hash(tok),
        "tokenizer_path": str((root / "tokenizer.json").resolve()) if tok else "",
        "vocab_size": 256 if tok is None else tok.get_vocab_size(), "shards": shards}
    (root / sources.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
