"""Tokenised training data with deterministic, process-sharded batches.

The embedded default corpus is the Python standard library's own source, read from the running
interpreter, so every machine has real text to learn from without a download. ``data.path`` may
point at a text file, a directory of text files, or a pre-tokenised ``.bin`` token file (uint16,
the format nanoGPT and Megatron users already have; ``.u32.bin`` for uint32). The tokenizer is
byte-level (vocab 256). A batch is a pure function of (seed, step): the loader's state is its step
counter, so resuming is exact, and each process materialises only its own rows of the global batch.
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


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """The whole corpus as a 1-D array of token ids."""
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
    """Random windows of ``seq_len + 1`` tokens; batch ``step`` is a pure function of the seed."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    process_index: int = 0
    process_count: int = 1
    step: int = 0

    def __post_init__(self):
        if len(self.tokens) <= self.seq_len + 1:
            raise ConfigError(f"corpus of {len(self.tokens)} tokens is shorter than "
                              f"train.seq_len={self.seq_len}")
        if self.batch_size % self.process_count:
            raise ConfigError(f"train.batch_size={self.batch_size} is not divisible by the "
                              f"{self.process_count} processes")

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``step``."""
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch_size)
        rows = self.batch_size // self.process_count
        mine = starts[self.process_index * rows:(self.process_index + 1) * rows]
        windows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in mine])
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


def train_eval_split(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The last ``eval_fraction`` of the corpus is held out."""
    cut = int(len(tokens) * (1.0 - eval_fraction))
    return tokens[:cut], tokens[cut:]
