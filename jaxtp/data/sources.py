"""Where training tokens come from: documents read from text, JSONL, Parquet, ArrayRecord or token
files, tokenised, and laid end to end as one token stream per source with its document starts.

A source is a :class:`TokenStream`: ``len(stream)`` tokens, ``stream.read(a, b)`` the tokens in
``[a, b)``, and ``stream.offsets`` the start of each document (plus the end), or ``None`` for an
unbroken stream (``data.packing=false``). Each document ends with the tokenizer's end-of-document
token (``data.eos_id``; byte 0 for the byte tokenizer), so a model learns where documents end.

What a ``data.path`` (or one entry of ``data.mixture``) may name:

- ``""``: the embedded corpus, the Python standard library's sources, one document per file;
- a text file (one document) or a directory of text files (one document per file);
- ``*.jsonl``: one document per line, the string in field ``data.text_field``;
- ``*.parquet``: one document per row of column ``data.text_field`` (read with pyarrow);
- ``*.arrayrecord`` / ``*.array_record``: one document per record, UTF-8 text or a JSON object
  with ``data.text_field`` (read with grain's ``ArrayRecordDataSource``);
- a directory made by ``jaxtp prepare-data`` (``manifest.json`` beside ArrayRecord shards of
  token ids): read record by record, never loaded whole (:class:`RecordStream`);
- ``*.bin`` (uint16) / ``*.u32.bin`` (uint32) token files, split into documents at ``eos_id``.

A glob (``shards/*.jsonl``) reads every match in sorted order.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from jaxtp.configs import ConfigError, DataConfig

DEFAULT_BYTES = 8 * 2**20  # 8 MiB of the stdlib is plenty for the tiny preset
MANIFEST = "manifest.json"
RECORD_SUFFIXES = (".arrayrecord", ".array_record")
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


# ----------------------------------------------------------------------------------------------
# Token streams
# ----------------------------------------------------------------------------------------------

class ArrayStream:
    """Tokens in memory (or a memmap), with the start of each document (``None``: one stream)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray | None):
        self.tokens, self.offsets = tokens, offsets

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, a: int, b: int) -> np.ndarray:
        return np.asarray(self.tokens[a:b])

    def max_token(self) -> int:
        return int(self.tokens.max()) if len(self.tokens) else 0


class RecordStream:
    """A prepared set: ArrayRecord records of token ids (``dtype``; ``lengths`` tokens each, a
    document spanning one or more), read through grain's ``ArrayRecordDataSource`` only where a
    window needs them; ``offsets``: where each document starts."""

    def __init__(self, shards: list[str], lengths: np.ndarray, offsets: np.ndarray, dtype,
                 max_token: int, *, packing: bool = True):
        from grain.sources import ArrayRecordDataSource

        self.source = ArrayRecordDataSource(shards)
        self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.offsets = offsets if packing else None
        self.dtype, self._max = np.dtype(dtype), max_token

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, a: int, b: int) -> np.ndarray:
        return self.read_many([(a, b)])[0]

    def read_many(self, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        """The tokens of each ``[a, b)``, with one read of all the records they touch."""
        cover = [(int(np.searchsorted(self.starts, a, side="right") - 1),
                  int(np.searchsorted(self.starts, b, side="left"))) for a, b in spans]
        ids = sorted({i for lo, hi in cover for i in range(lo, hi)})
        got = {i: self.source[i] for i in ids}  # __getitems__ starts a thread pool per call
        out = []
        for (a, b), (lo, hi) in zip(spans, cover):
            toks = np.concatenate([np.frombuffer(got[i], dtype=self.dtype)
                                   for i in range(lo, hi)])
            base = int(self.starts[lo])
            out.append(toks[a - base:b - base])
        return out

    def max_token(self) -> int:
        return self._max


class SliceStream:
    """Tokens ``[lo, hi)`` of another stream (the train / held-out split)."""

    def __init__(self, stream, lo: int, hi: int):
        self.stream, self.lo, self.hi = stream, lo, hi
        off = stream.offsets
        if off is None:
            self.offsets = None
        else:
            inside = off[(off > lo) & (off < hi)] - lo
            self.offsets = np.concatenate([[0], inside, [hi - lo]]).astype(np.int64)

    def __len__(self) -> int:
        return self.hi - self.lo

    def read(self, a: int, b: int) -> np.ndarray:
        return self.stream.read(self.lo + a, self.lo + min(b, len(self)))

    def read_many(self, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        return read_many(self.stream, [(self.lo + a, self.lo + min(b, len(self)))
                                       for a, b in spans])

    def max_token(self) -> int:
        return self.stream.max_token()


def read_many(stream, spans: list[tuple[int, int]]) -> list[np.ndarray]:
    """``[stream.read(a, b) for a, b in spans]``, batched where the stream can batch."""
    if hasattr(stream, "read_many"):
        return stream.read_many(spans)
    return [stream.read(a, b) for a, b in spans]


def split(stream, eval_fraction: float) -> tuple[SliceStream, SliceStream]:
    """``(train, held out)``: the last ``eval_fraction`` of the stream is held out."""
    cut = int(len(stream) * (1.0 - eval_fraction))
    return SliceStream(stream, 0, cut), SliceStream(stream, cut, len(stream))


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------

def bpe_tokenizer(cfg: DataConfig, text: bytes, vocab_size: int, cache_dir: str | None):
    """A HuggingFace byte-level BPE: loaded from ``data.tokenizer_path`` or trained on ``text``
    (with ``<|endoftext|>`` as its end-of-document token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if cfg.tokenizer_path:
        path = Path(os.path.expanduser(cfg.tokenizer_path))
        if not path.exists():
            raise ConfigError(f"data.tokenizer_path={cfg.tokenizer_path!r} does not exist")
        tok = Tokenizer.from_file(str(path))
    else:
        cached = Path(cache_dir) / f"bpe-{vocab_size}.json" if cache_dir else None
        if cached is not None and cached.exists():
            return Tokenizer.from_file(str(cached))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        lines = text.decode("utf-8", errors="replace").splitlines()
        tok.train_from_iterator(lines, trainer=trainer)
        if cached is not None:  # write-then-rename: other processes may be reading it
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f"{cached.name}.{os.getpid()}")
            tok.save(str(tmp))
            os.replace(tmp, cached)
    if tok.get_vocab_size() > vocab_size:
        raise ConfigError(f"the tokenizer has {tok.get_vocab_size()} tokens but model.vocab_size="
                          f"{vocab_size}; set model.vocab_size >= {tok.get_vocab_size()}")
    return tok


def bpe_encode(text: bytes, *, tokenizer) -> np.ndarray:
    lines = text.decode("utf-8", errors="replace").splitlines(keepends=True)
    ids = [i for enc in tokenizer.encode_batch(lines) for i in enc.ids]
    return np.asarray(ids, dtype=np.uint32)


def eos_id(cfg: DataConfig, tokenizer=None) -> int:
    """The end-of-document token: ``data.eos_id`` if set, else the byte tokenizer's 0 (NUL) or
    the BPE tokenizer's own (``<|endoftext|>``, ``</s>``, ...)."""
    if cfg.eos_id >= 0:
        return cfg.eos_id
    if tokenizer is None:
        return 0
    for name in _EOS_NAMES:
        i = tokenizer.token_to_id(name)
        if i is not None:
            return int(i)
    raise ConfigError(f"the tokenizer {cfg.tokenizer_path or '(trained)'} has no end-of-document "
                      f"token ({', '.join(_EOS_NAMES)}); set data.eos_id=<its id>")


def tokenizer_hash(tokenizer) -> str:
    """What a prepared set records of its tokenizer: ``byte``, or a hash of the BPE's JSON."""
    if tokenizer is None:
        return "byte"
    return "bpe-" + hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


class Encoder:
    """Documents (``str`` / ``bytes``) to token ids, each followed by the end-of-document id."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos = tokenizer, eos
        if tokenizer is None:
            self.dtype = np.uint8 if eos < 256 else np.uint16
        else:
            self.dtype = np.uint16 if max(tokenizer.get_vocab_size(), eos + 1) <= 2**16 \
                else np.uint32

    def __call__(self, docs: list) -> list[np.ndarray]:
        if self.tokenizer is None:
            out = [np.frombuffer(d if isinstance(d, bytes) else d.encode(), dtype=np.uint8)
                   for d in docs]
        else:
            texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d
                     for d in docs]
            out = [np.asarray(e.ids) for e in self.tokenizer.encode_batch(texts)]
        return [np.concatenate([o.astype(self.dtype), [self.eos]]).astype(self.dtype)
                for o in out]


# ----------------------------------------------------------------------------------------------
# Reading documents
# ----------------------------------------------------------------------------------------------

def expand(path: str) -> list[Path]:
    """The files one ``data.path`` names (a glob reads every match, sorted)."""
    text = os.path.expanduser(path)
    if any(c in text for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not found:
            raise ConfigError(f"data.path={path!r} matches no files; check the pattern")
        return found
    p = Path(text)
    if not p.exists():
        raise ConfigError(f"data.path={path!r} does not exist")
    return [p]


def _field(record, where: str, field: str) -> str:
    if not isinstance(record, dict) or field not in record:
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where} has no field data.text_field={field!r} (it has {have}); "
                          f"set data.text_field (prepare-data: --text-field) to the field that "
                          f"holds the text")
    value = record[field]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field {field!r} is a {type(value).__name__}, not text; set "
                          f"data.text_field to a string field")
    return value


def read_documents(path: Path, field: str) -> list:
    """The documents of one file (text: ``bytes``; records: ``str``)."""
    name = path.name
    if name.endswith(".jsonl"):
        docs = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{n} is not JSON ({e.msg}); each line of a .jsonl "
                                      f"file is one JSON object") from None
                docs.append(_field(record, f"{path}:{n}", field))
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if field not in table.column_names:
            raise ConfigError(f"{path} has no column data.text_field={field!r} (it has "
                              f"{table.column_names}); set data.text_field to the text column")
        docs = [d for d in table.column(field).to_pylist() if d is not None]
    elif name.endswith(RECORD_SUFFIXES):
        from grain.sources import ArrayRecordDataSource

        src = ArrayRecordDataSource([str(path)])
        docs = []
        for i in range(len(src)):
            raw = src[i]
            try:
                record = json.loads(raw)
            except ValueError:
                docs.append(raw)
                continue
            docs.append(_field(record, f"{path} record {i}", field) if isinstance(record, dict)
                        else raw)
    else:
        try:
            return [path.read_bytes()]
        except OSError as e:
            raise ConfigError(f"cannot read {path} ({e.strerror})") from None
    if not docs:
        raise ConfigError(f"{path} holds no documents; remove it from data.path / data.mixture")
    return docs


def _default_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for p in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        try:
            total += p.stat().st_size
        except OSError:
            continue
        files.append(p)
        if total >= DEFAULT_BYTES:
            break
    return files


def source_files(path: str) -> list[Path]:
    """Every file that ``path`` names (a directory: its files, recursively)."""
    if not path:
        return _default_files()
    files = []
    for p in expand(path):
        files += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    return files


def is_prepared(path: str) -> bool:
    return bool(path) and (Path(os.path.expanduser(path)) / MANIFEST).is_file()


def is_token_file(path: str) -> bool:
    return path.endswith(".bin")
