"""Training batches: packed documents from one corpus or a weighted mixture, deterministic by
(seed, step), sharded by process, resumable exactly.

Each source (:mod:`jaxtp.data.sources`) is one token stream with its document starts. Its rows are
windows of ``seq_len + 1`` tokens on a grid, visited in a shuffled order that grain's
``MapDataset.range(n).shuffle(seed).repeat()`` draws afresh each epoch, so within an epoch every
window is seen once. With ``data.packing=true`` (the default) a window that crosses documents is
*packed*: each row carries ``segment_ids`` (1, 2, ... per document in the row), ``positions``
(each token's place in its document, for RoPE) and ``loss_mask`` (0 where the target is the next
document's first token) beside ``inputs`` and ``targets``, and the model keeps attention inside
each document. A document longer than a row continues in the next window with its positions
running on. ``data.packing=false`` gives the one continuous stream of earlier releases: windows
of ``inputs`` / ``targets`` only.

A mixture (``data.mixture="a.jsonl:0.7,b.parquet:0.3"``) draws each global row's source with
``numpy.random.default_rng((seed, step))`` and the given weights; a source's k-th row is the k-th
of its own shuffled window stream. The loader's state is the step, the mixture, and the rows each
source has given, so a resume continues exactly, and a resume with a changed mixture continues
each source where it stopped (the change is logged). Process ``p`` of ``P`` materialises rows
``[p B/P, (p+1) B/P)`` of each global batch.
"""

from __future__ import annotations

import numpy as np

from jaxtp.configs import Config, ConfigError, check_eval_split
from jaxtp.data import corpus, sources
from jaxtp.data.sources import ArrayStream


class Source:
    """One stream as rows: window ``k`` of the stream's infinite, per-epoch shuffled order."""

    def __init__(self, name: str, stream, *, seq_len: int, seed: int, packing: bool):
        import grain

        self.name, self.stream, self.seq_len = name, stream, seq_len
        self.packed = packing and stream.offsets is not None
        self.n_windows = (len(stream) - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(f"data source {name or '(embedded)'!r} holds {len(stream)} tokens, "
                              f"less than one window of train.seq_len={seq_len} + 1; use more "
                              f"data or a shorter train.seq_len")
        self.order = grain.MapDataset.range(self.n_windows).shuffle(seed=seed % 2**32).repeat()

    def window_ids(self, ks: np.ndarray) -> np.ndarray:
        return np.array([self.order[int(k)] for k in ks], dtype=np.int64)

    def rows(self, ks: np.ndarray) -> dict[str, np.ndarray]:
        return self.windows(self.window_ids(ks))

    def windows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        s = self.seq_len
        spans = [(int(w) * s, int(w) * s + s + 1) for w in ids]
        toks = np.stack(sources.read_many(self.stream, spans)).astype(np.int32)
        batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
        if self.packed:
            pos = ids[:, None] * s + np.arange(s + 1)[None, :]
            doc = np.searchsorted(self.stream.offsets, pos, side="right") - 1
            seg = (doc - doc[:, :1] + 1).astype(np.int32)
            batch["segment_ids"] = seg[:, :-1]
            batch["positions"] = (pos - self.stream.offsets[doc])[:, :-1].astype(np.int32)
            batch["loss_mask"] = (seg[:, :-1] == seg[:, 1:]).astype(np.int32)
        return batch


class Loader:
    """This process's rows of each global batch, from ``sources`` drawn with ``weights``.

    ``Loader(tokens, batch_size=, seq_len=, seed=)`` is one unbroken stream (a token array);
    :func:`loaders` builds the configured one."""

    def __init__(self, tokens=None, *, batch_size: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1, step: int = 0,
                 sources_: list[Source] | None = None, weights: list[float] | None = None,
                 mixture: str = ""):
        if sources_ is None:
            sources_ = [Source("", ArrayStream(np.asarray(tokens), None), seq_len=seq_len,
                               seed=seed, packing=False)]
        self.sources, self.mixture = sources_, mixture
        self.weights = np.asarray(weights if weights is not None else [1.0] * len(sources_))
        self.weights = self.weights / self.weights.sum()
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.process_index, self.process_count, self.step = process_index, process_count, step
        if batch_size % process_count:
            raise ConfigError(f"train.batch_size={batch_size} is not divisible by the "
                              f"{process_count} processes")
        if len(sources_) == 1 and sources_[0].n_windows < batch_size:
            raise ConfigError(f"the corpus ({len(sources_[0].stream)} tokens) holds "
                              f"{sources_[0].n_windows} windows of train.seq_len={seq_len}, "
                              f"fewer than train.batch_size={batch_size}; use more data or "
                              f"smaller batches")
        self._base = (0, np.zeros(len(sources_), np.int64))  # (step, rows given before it)
        self._cache = self._base
        self._memo: dict[int, np.ndarray] = {}

    # -- which source and which of its rows each global row takes -------------------------------
    def _choices(self, step: int) -> np.ndarray:
        if len(self.sources) == 1:
            return np.zeros(self.batch_size, np.int64)
        if step not in self._memo:  # each step's draw is needed twice (its batch, the counts)
            rng = np.random.default_rng((self.seed, 0x6D6978, step))
            self._memo = {step: rng.choice(len(self.sources), size=self.batch_size,
                                           p=self.weights), **dict(list(self._memo.items())[:3])}
        return self._memo[step]

    def given(self, step: int) -> np.ndarray:
        """Rows each source has given to global batches before ``step``."""
        if len(self.sources) == 1:
            base_step, base = self._base
            return base + (step - base_step) * self.batch_size
        at, counts = self._cache if self._cache[0] <= step else self._base
        if step < at:
            raise ValueError(f"step {step} is before the loader's resume point {at}")
        counts = counts.copy()
        for s in range(at, step):
            counts += np.bincount(self._choices(s), minlength=len(self.sources))
        self._cache = (step, counts)
        return counts

    def _plan(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, row within the source) of this process's rows of global batch ``step``."""
        choice, before = self._choices(step), self.given(step)
        k = np.empty(self.batch_size, np.int64)
        for j in range(len(self.sources)):
            mine = choice == j
            k[mine] = before[j] + np.arange(int(mine.sum()))
        rows = self.batch_size // self.process_count
        lo = self.process_index * rows
        return choice[lo:lo + rows], k[lo:lo + rows]

    def window_ids(self, step: int) -> np.ndarray:
        """Window index (in its source) of each of this process's rows of batch ``step``."""
        choice, k = self._plan(step)
        out = np.empty(len(k), np.int64)
        for j, src in enumerate(self.sources):
            out[choice == j] = src.window_ids(k[choice == j])
        return out

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``step``."""
        choice, k = self._plan(step)
        parts = {j: src.rows(k[choice == j]) for j, src in enumerate(self.sources)
                 if (choice == j).any()}
        first = next(iter(parts.values()))
        out = {key: np.empty((len(k), self.seq_len), np.int32) for key in first}
        for j, part in parts.items():
            if set(part) != set(out):
                raise ConfigError("the sources of data.mixture disagree on packing (a token file "
                                  "without document ends beside documents); give every source "
                                  "documents or set data.packing=false")
            for key, v in part.items():
                out[key][choice == j] = v
        return out

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        return self

    # -- state -----------------------------------------------------------------------------------
    def state(self) -> dict:
        given = self.given(self.step)
        return {"step": self.step, "seed": self.seed, "mixture": self.mixture,
                "given": {s.name: int(n) for s, n in zip(self.sources, given)}}

    def restore(self, state: dict) -> str | None:
        """Continue from ``state``; returns a line describing a changed mixture, else ``None``."""
        self.step, self.seed = int(state["step"]), int(state["seed"])
        self._memo = {}
        saved = state.get("given")
        if saved is None:  # one source, saved before mixtures: every row came from it
            saved = {self.sources[0].name: self.step * self.batch_size}
        counts = np.array([int(saved.get(s.name, 0)) for s in self.sources], np.int64)
        self._base = self._cache = (self.step, counts)
        old = state.get("mixture", self.mixture)
        if old != self.mixture:
            return (f"data: the mixture changed on resume at step {self.step}: was {old!r}, now "
                    f"{self.mixture!r}; each source continues after the rows it gave "
                    f"({', '.join(f'{k}: {v}' for k, v in saved.items())})")
        return None

    def log_fields(self) -> dict:
        """For the metrics record: a mixture's realised proportions so far."""
        if len(self.sources) == 1:
            return {}
        given = self.given(self.step)
        total = max(int(given.sum()), 1)
        return {"data_mixture": {s.name: round(int(n) / total, 4)
                                 for s, n in zip(self.sources, given)}}

    def describe(self) -> str:
        """One line: each source's weight, documents and tokens, and whether rows are packed."""
        parts = []
        for s, w in zip(self.sources, self.weights):
            docs = "unbroken" if s.stream.offsets is None else f"{len(s.stream.offsets) - 1} docs"
            parts.append(f"{s.name or '(embedded corpus)'} x{w:.3g} ({docs}, {len(s.stream)} "
                         f"tokens)")
        packed = "packed documents" if self.sources[0].packed else "one continuous stream"
        return f"data: {', '.join(parts)}; {packed}"


def train_eval_split(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The last ``eval_fraction`` of the corpus is held out."""
    cut = int(len(tokens) * (1.0 - eval_fraction))
    return tokens[:cut], tokens[cut:]


def loaders(cfg: Config, *, cache_dir: str | None = None, process_index: int = 0,
            process_count: int = 1) -> tuple[Loader, Loader]:
    """``(train, held out)`` loaders of the configured corpus: every source's last
    ``data.eval_fraction`` is held out, drawn with the same weights."""
    t, d = cfg.train, cfg.data
    streams = corpus.open_streams(d, vocab_size=cfg.model.vocab_size, cache_dir=cache_dir)
    train, held, weights = [], [], []
    for j, (name, weight, stream) in enumerate(streams):
        tr, ev = sources.split(stream, d.eval_fraction)
        if len(streams) == 1:
            check_eval_split(cfg, len(ev))
        train.append(Source(name, tr, seq_len=t.seq_len, seed=t.seed + 7919 * j,
                            packing=d.packing))
        held.append(Source(name, ev, seq_len=t.seq_len, seed=t.seed + 1 + 7919 * j,
                           packing=d.packing))
        weights.append(weight)
    args = dict(batch_size=t.batch_size, seq_len=t.seq_len, process_index=process_index,
                process_count=process_count, weights=weights, mixture=d.mixture)
    return (Loader(seed=t.seed, sources_=train, **args),
            Loader(seed=t.seed + 1, sources_=held, **args))
