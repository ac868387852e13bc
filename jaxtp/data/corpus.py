"""A run's corpus from its config: each source of ``data.path`` / ``data.mixture`` opened as a
token stream with one tokenizer, checked against the model's vocabulary, split into training and
held-out parts (see :mod:`jaxtp.data.sources` for what a path may name)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxtp.configs import ConfigError, DataConfig
from jaxtp.data import sources
from jaxtp.data.sources import ArrayStream, RecordStream


def parse_mixture(text: str) -> list[tuple[str, float]]:
    """``"a:0.7,b:0.3"`` -> ``[("a", 0.7), ("b", 0.3)]`` (weights normalised to sum 1)."""
    entries = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        path, sep, weight = part.rpartition(":")
        try:
            w = float(weight) if sep else float("nan")
        except ValueError:
            w = float("nan")
        if not path or not (w > 0 and np.isfinite(w)):
            raise ConfigError(f"data.mixture entry {part!r} is not PATH:WEIGHT with a positive "
                              f"weight; write data.mixture=\"a.jsonl:0.7,b.jsonl:0.3\"")
        entries.append((path, w))
    if not entries:
        raise ConfigError(f"data.mixture={text!r} names no source; write "
                          f"data.mixture=\"a.jsonl:0.7,b.jsonl:0.3\"")
    if len({p for p, _ in entries}) < len(entries):
        raise ConfigError(f"data.mixture={text!r} names a source twice; give each path once")
    total = sum(w for _, w in entries)
    return [(p, w / total) for p, w in entries]


def entries(cfg: DataConfig) -> list[tuple[str, float]]:
    """``[(path, weight)]``: the mixture's sources, or ``data.path`` alone."""
    if cfg.mixture:
        if cfg.path:
            raise ConfigError(f"data.path={cfg.path!r} and data.mixture={cfg.mixture!r} are both "
                              f"set; put every source in data.mixture and leave data.path empty")
        return parse_mixture(cfg.mixture)
    return [(cfg.path, 1.0)]


def _read_manifest(path: str) -> dict:
    return json.loads((Path(os.path.expanduser(path)) / sources.MANIFEST).read_text())


def _text_docs(path: str, cfg: DataConfig) -> tuple[list, bool]:
    """(documents, whether they are whole files): the files of ``path`` read as documents."""
    docs, plain = [], True
    for f in sources.source_files(path):
        record = f.name.endswith((".jsonl", ".parquet", *sources.RECORD_SUFFIXES))
        plain &= not record
        try:
            docs += sources.read_documents(f, cfg.text_field)
        except ConfigError:
            raise
        except OSError:
            continue
    if not docs:
        raise ConfigError(f"data.path={path!r} holds no readable documents")
    return docs, plain


def tokenizer_for(cfg: DataConfig, texts: list[bytes], vocab_size: int, cache_dir: str | None):
    """The run's BPE tokenizer (``None`` for bytes): loaded, or trained on ``texts``."""
    if cfg.tokenizer != "bpe":
        return None
    return sources.bpe_tokenizer(cfg, b"\n".join(texts), vocab_size, cache_dir)


def _check_prepared(path: str, manifest: dict, tokenizer, vocab_size: int) -> None:
    want = sources.tokenizer_hash(tokenizer)
    if manifest["tokenizer_hash"] != want:
        hint = (f"set data.tokenizer=bpe data.tokenizer_path={manifest['tokenizer_path']}"
                if manifest.get("tokenizer_path") else "set data.tokenizer=byte")
        raise ConfigError(f"data.path={path!r} was prepared with tokenizer "
                          f"{manifest['tokenizer_hash']} but this run tokenizes with {want}; "
                          f"{hint}, or prepare the data again with this run's tokenizer")
    if manifest["max_token"] >= vocab_size:
        raise ConfigError(f"data.path={path!r} holds token id {manifest['max_token']} >= "
                          f"model.vocab_size={vocab_size}; raise model.vocab_size")


def _token_file(path: str, eos: int, packing: bool) -> ArrayStream:
    p = Path(os.path.expanduser(path))
    if not p.exists():
        raise ConfigError(f"data.path={path!r} does not exist")
    toks = np.memmap(p, dtype=np.uint32 if p.name.endswith(".u32.bin") else np.uint16, mode="r")
    if len(toks) == 0:
        raise ConfigError(f"data.path={path!r} is empty; remove it or prepare the data again")
    offsets = None
    if packing:
        ends = np.flatnonzero(np.asarray(toks) == eos) + 1
        offsets = np.unique(np.concatenate([[0], ends, [len(toks)]])).astype(np.int64)
    return ArrayStream(toks, offsets)


def open_streams(cfg: DataConfig, *, vocab_size: int = 256, cache_dir: str | None = None,
                 packing: bool | None = None, check_vocab: bool = True
                 ) -> list[tuple[str, float, object]]:
    """``[(name, weight, stream)]`` for every source, tokenised with one tokenizer."""
    packing = cfg.packing if packing is None else packing
    listed = entries(cfg)
    texts = {p: _text_docs(p, cfg) for p, _ in listed
             if not (sources.is_prepared(p) or sources.is_token_file(p))}
    tokenizer = tokenizer_for(cfg, [d if isinstance(d, bytes) else d.encode()
                                    for docs, _ in texts.values() for d in docs],
                              vocab_size, cache_dir)
    eos = sources.eos_id(cfg, tokenizer)
    encode = sources.Encoder(tokenizer, eos)
    out = []
    for path, weight in listed:
        if sources.is_prepared(path):
            manifest = _read_manifest(path)
            _check_prepared(path, manifest, tokenizer, vocab_size if check_vocab else 2**32)
            root = Path(os.path.expanduser(path))
            stream = RecordStream([str(root / s) for s in manifest["shards"]],
                                  np.load(root / "lengths.npy"), np.load(root / "offsets.npy"),
                                  manifest["dtype"],
                                  manifest["max_token"], packing=packing)
        elif sources.is_token_file(path):
            stream = _token_file(path, eos, packing)
        else:
            docs, plain = texts[path]
            stream = _encode_stream(docs, plain, encode, tokenizer, packing)
        if check_vocab and stream.max_token() >= vocab_size:
            raise ConfigError(f"data source {path or '(embedded corpus)'!r} has token id "
                              f"{stream.max_token()} >= model.vocab_size={vocab_size}; raise "
                              f"model.vocab_size or use the model's tokenizer")
        out.append((path, weight, stream))
    return out


def _encode_stream(docs: list, plain: bool, encode, tokenizer, packing: bool) -> ArrayStream:
    if not packing and plain:  # the continuous stream of earlier releases: files joined by "\n"
        raw = b"\n".join(docs)
        if tokenizer is None:
            return ArrayStream(np.frombuffer(raw, dtype=np.uint8), None)
        return ArrayStream(bpe_encode_all(raw, tokenizer), None)
    ids = encode(docs)
    lengths = np.array([len(d) for d in ids], np.int64)
    tokens = np.concatenate(ids)
    if tokenizer is None and tokens.max(initial=0) < 256:
        tokens = tokens.astype(np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)]) if packing else None
    return ArrayStream(tokens, offsets)


def bpe_encode_all(raw: bytes, tokenizer) -> np.ndarray:
    return sources.bpe_encode(raw, tokenizer=tokenizer)


def load_tokens(cfg: DataConfig, *, vocab_size: int = 256, cache_dir: str | None = None
                ) -> np.ndarray:
    """The first source as one 1-D array of token ids, as an unbroken stream."""
    (_, _, stream), *_ = open_streams(cfg, vocab_size=vocab_size, cache_dir=cache_dir,
                                      packing=False, check_vocab=False)
    return stream.read(0, len(stream))
