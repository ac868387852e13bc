"""Tokenised training data with deterministic, process-sharded batches.

The embedded default corpus is the Python standard library's own source, read from the running
interpreter, so every machine has real text to learn from without a download. ``data.path`` may
point at a text file, a directory of text files, or a pre-tokenised ``.bin`` token file (uint16,
the format nanoGPT and Megatron users already have; ``.u32.bin`` for uint32). The tokenizer is
byte-level (vocab 256) by default, or a HuggingFace BPE (``data.tokenizer=bpe``) loaded from a
``tokenizer.json`` or trained locally on the corpus. Batches walk shuffled epochs of non-overlapping windows and are a pure
function of (seed, step): the loader's state is its step counter, so resuming is exact, and each
process materialises only its own rows of the global batch. (grain offers the same guarantees for
record datasets; for one contiguous token array this arithmetic is all that is needed.)
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxtp.config import ConfigError, DataConfig

_DEFAULT_BYTES = 8 * 2**20  # 8 MiB of the stdlib is plenty for the tiny preset


def _read_text_files(paths: list[Path], limit: int | None) -> np.ndarray:
    chunks, total = [], 0
    for p in paths:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if limit is not None and total >= limit:
            break
    if not chunks:
        raise ConfigError("no readable text found for the corpus; check data.path")
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def load_tokens(cfg: DataConfig, *, vocab_size: int = 256, cache_dir: str | None = None
                ) -> np.ndarray:
    """The whole corpus as a 1-D array of token ids (bytes, or BPE ids for ``tokenizer=bpe``)."""
    raw = _load_raw(cfg)
    if cfg.tokenizer == "byte" or raw.dtype != np.uint8:
        return raw
    return bpe_encode(raw.tobytes(), tokenizer=bpe_tokenizer(cfg, raw.tobytes(), vocab_size,
                                                             cache_dir))


def bpe_tokenizer(cfg: DataConfig, text: bytes, vocab_size: int, cache_dir: str | None):
    """A HuggingFace byte-level BPE: loaded from ``data.tokenizer_path`` or trained on ``text``."""
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


def _load_raw(cfg: DataConfig) -> np.ndarray:
    if not cfg.path:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
        return _read_text_files(files, _DEFAULT_BYTES)
    path = Path(os.path.expanduser(cfg.path))
    if not path.exists():
        raise ConfigError(f"data.path={cfg.path!r} does not exist")
    if path.suffix == ".bin":
        dtype = np.uint32 if path.name.endswith(".u32.bin") else np.uint16
        return np.memmap(path, dtype=dtype, mode="r")
    if path.is_dir():
        return _read_text_files(sorted(p for p in path.rglob("*") if p.is_file()), None)
    return _read_text_files([path], None)


@dataclass
class Loader:
    """Epochs over non-overlapping windows of ``seq_len + 1`` tokens, reshuffled each epoch.

    Global sample ``g = step x batch_size + row`` is window ``perm_e[g mod n]`` of epoch
    ``e = g div n``, so within an epoch every window is seen exactly once, the batch at ``step`` is a
    pure function of ``(seed, step)``, and the checkpointed state is just the step counter. Process
    ``p`` of ``P`` materialises rows ``[p B/P, (p+1) B/P)`` of each global batch.
    """

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    process_index: int = 0
    process_count: int = 1
    step: int = 0

    def __post_init__(self):
        self.n_windows = (len(self.tokens) - 1) // self.seq_len
        if self.n_windows < self.batch_size:
            raise ConfigError(f"the corpus ({len(self.tokens)} tokens) holds {self.n_windows} "
                              f"windows of train.seq_len={self.seq_len}, fewer than "
                              f"train.batch_size={self.batch_size}; use more data or smaller "
                              f"batches")
        if self.batch_size % self.process_count:
            raise ConfigError(f"train.batch_size={self.batch_size} is not divisible by the "
                              f"{self.process_count} processes")
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng((self.seed, epoch)).permutation(
                self.n_windows)}
        return self._perms[epoch]

    def window_ids(self, step: int) -> np.ndarray:
        """Window index of each of this process's rows of global batch ``step``."""
        rows = self.batch_size // self.process_count
        first = step * self.batch_size + self.process_index * rows
        g = np.arange(first, first + rows)
        return np.array([self._perm(int(i // self.n_windows))[i % self.n_windows] for i in g])

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``step``."""
        starts = self.window_ids(step) * self.seq_len
        windows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts])
        windows = windows.astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        return self

    def state(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def restore(self, state: dict) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])
        self._perms = {}


def train_eval_split(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The last ``eval_fraction`` of the corpus is held out."""
    cut = int(len(tokens) * (1.0 - eval_fraction))
    return tokens[:cut], tokens[cut:]
