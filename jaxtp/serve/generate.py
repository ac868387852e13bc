"""Text generation from a sharded model: prompts in, tokens and text out.

The host side of :mod:`jaxtp.serve.decode`: encode prompts (the byte-level tokenizer of the byte presets,
or a ``data.tokenizer_path`` BPE), check them, right-pad them into a fixed bucket, run the compiled
prefill + decode loop and cut each row's new tokens out. Lengths are bucketed to powers of two
(capped at ``model.max_seq_len``), so a session compiles once per ``(rows, prompt bucket, length
bucket)``, never once per prompt length or per token; temperature, top-k, top-p, the seed, the
stop tokens and ``max_new_tokens`` are traced arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxtp.configs import ConfigError
from jaxtp.parallel import batch_shards, named
from jaxtp.serve import decode
from jaxtp.serve.sampling import SamplerArgs
from jaxtp.step import Layout, Region

MAX_STOP_TOKENS = 8  # stop ids are padded to this many (one compile for any stop set)


@dataclass(frozen=True)
class Generation:
    """What :meth:`jaxtp.Model.generate` returns, one entry per prompt."""

    tokens: list[np.ndarray]       # each row's new tokens (a stop token, if hit, is the last)
    text: list[str] | None         # the new tokens decoded (stop token dropped), if decodable
    prompt_tokens: list[np.ndarray]


@dataclass(frozen=True)
class Request:
    """One batch of prompts, checked, bucketed and placed on the mesh."""

    rows: list[list[int]]
    length: int  # the cache length bucket
    max_new_tokens: int
    stop_tokens: tuple[int, ...]
    prompts: jax.Array   # [B, T] right-padded
    lengths: jax.Array   # [B]
    row_ids: jax.Array   # [B] global row indices (per-row sampling keys)
    seed_key: jax.Array
    stop_ids: jax.Array  # [MAX_STOP_TOKENS], -1 padded


class Tokenizer:
    """Byte-level (vocab 256, the byte presets), or the run's HuggingFace BPE: the
    ``data.tokenizer_path`` file, or the one training cached in the run directory
    (``bpe-<vocab>.json``). Without one, prompts must be token ids and there is no text."""

    def __init__(self, cfg):
        self.hf, self.byte = None, cfg.data.tokenizer == "byte"
        if not self.byte:
            from pathlib import Path

            from tokenizers import Tokenizer as HFTokenizer
            cached = Path(cfg.train.out_dir) / f"bpe-{cfg.model.vocab_size}.json"
            path = Path(cfg.data.tokenizer_path).expanduser() if cfg.data.tokenizer_path else cached
            if path.is_file():
                self.hf = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            return self.hf.encode(text).ids
        if not self.byte:
            raise ConfigError("the model's BPE tokenizer was not found (data.tokenizer_path, or "
                              "bpe-<vocab>.json in the run directory): pass token ids")
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str | None:
        ids = [int(i) for i in ids]
        if self.hf is not None:
            return self.hf.decode(ids)
        if not self.byte:
            return None
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def bucket(n: int, cap: int) -> int:
    """The power of two ``>= n``, at most ``cap``."""
    return min(1 << max(n - 1, 0).bit_length(), cap)


class Generator:
    """The compiled decode of one layout (compiled on first use per bucket), and its host side."""

    def __init__(self, layout: Layout, region: Region):
        decode.check_decodable(layout)
        self.layout, self.region = layout, region
        self.fn = decode.generate_fn(layout, region)
        self.streaming = None  # (start, extend), compiled on the first stream()
        self.tokenizer = Tokenizer(layout.cfg)

    def prompt_rows(self, prompts) -> list[list[int]]:
        """A string, a list of strings, a 1-D token array / list, a list of them or a 2-D array
        -> a list of token-id lists (each checked)."""
        if isinstance(prompts, str) or isinstance(prompts, np.ndarray | jax.Array) and np.ndim(prompts) == 1:
            prompts = [prompts]
        elif (isinstance(prompts, Sequence) and prompts and not isinstance(prompts[0], str)
              and np.ndim(prompts[0]) == 0):
            prompts = [prompts]  # one prompt of token ids
        rows = [self.tokenizer.encode(p) if isinstance(p, str) else
                [int(t) for t in np.asarray(p).reshape(-1)] for p in prompts]
        vocab = self.layout.cfg.model.vocab_size
        if not rows:
            raise ValueError("no prompts given")
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"prompt {i} is empty: give at least one token")
            if min(r) < 0 or max(r) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, model.vocab_size={vocab})")
        return rows

    def request(self, prompts, *, max_new_tokens: int, seed: int = 0,
                stop_tokens: Sequence[int] = ()) -> Request:
        """Check and place one batch of prompts (right-padded into its length buckets)."""
        rows = self.prompt_rows(prompts)
        cap = self.layout.cfg.model.max_seq_len
        longest = max(len(r) for r in rows)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if longest + max_new_tokens > cap:
            raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} "
                             f"is longer than model.max_seq_len={cap}: shorten the prompt or "
                             f"ask for fewer tokens")
        if len(stop_tokens) > MAX_STOP_TOKENS:
            raise ValueError(f"at most {MAX_STOP_TOKENS} stop tokens")
        t, length = bucket(longest, cap), bucket(longest + max_new_tokens, cap)
        shards = batch_shards(self.layout.degrees)
        n = -(-len(rows) // shards) * shards
        padded = np.zeros((n, t), np.int32)
        lengths = np.ones((n,), np.int32)  # padding rows: one token, discarded
        for i, r in enumerate(rows):
            padded[i, : len(r)], lengths[i] = r, len(r)
        stops = np.full((MAX_STOP_TOKENS,), -1, np.int32)
        stops[: len(stop_tokens)] = list(stop_tokens)
        lo = self.layout
        row_sharding = named(lo.mesh, lo.activation_rules.spec(decode.ROW_NAMES))
        return Request(rows=rows, length=length, max_new_tokens=max_new_tokens,
                       stop_tokens=tuple(stop_tokens),
                       prompts=jax.device_put(padded, lo.batch_sharding),
                       lengths=jax.device_put(lengths, row_sharding),
                       row_ids=jax.device_put(np.arange(n, dtype=np.int32), row_sharding),
                       seed_key=jax.random.PRNGKey(seed), stop_ids=jnp.asarray(stops))

    def __call__(self, params, prompts, *, max_new_tokens: int, sampler: SamplerArgs,
                 seed: int = 0, stop_tokens: Sequence[int] = ()) -> Generation:
        req = self.request(prompts, max_new_tokens=max_new_tokens, seed=seed,
                           stop_tokens=stop_tokens)
        out, made = self.fn(params, decode.init_cache(self.layout, len(req.row_ids), req.length),
                            req.prompts, req.lengths, req.row_ids, jnp.int32(max_new_tokens),
                            req.seed_key, sampler, req.stop_ids)
        return self.result(req, np.asarray(out), np.asarray(made))

    def stream(self, params, prompts, *, max_new_tokens: int, sampler: SamplerArgs,
               seed: int = 0, stop_tokens: Sequence[int] = (), chunk: int = 16):
        """Yield a :class:`Generation` of the tokens so far after the first token and after every
        ``chunk`` more (each chunk one compiled loop call; the same tokens as one call)."""
        if self.streaming is None:
            self.streaming = (decode.start_fn(self.layout, self.region),
                              decode.extend_fn(self.layout, self.region))
        start, extend = self.streaming
        req = self.request(prompts, max_new_tokens=max_new_tokens, seed=seed,
                           stop_tokens=stop_tokens)
        state = start(params, decode.init_cache(self.layout, len(req.row_ids), req.length),
                      req.prompts, req.lengths, req.row_ids, req.seed_key, sampler, req.stop_ids)
        made = 1
        while True:
            yield self.result(req, np.asarray(state[1]), np.asarray(state[4]))
            if made >= max_new_tokens or bool(np.asarray(state[3])[: len(req.rows)].all()):
                return
            last = min(made + chunk, max_new_tokens)
            state = extend(params, *state, req.lengths, req.row_ids, jnp.int32(made),
                           jnp.int32(last), req.seed_key, sampler, req.stop_ids)
            made = last

    def result(self, req: Request, out: np.ndarray, made: np.ndarray) -> Generation:
        new = [out[i, len(r): len(r) + made[i]] for i, r in enumerate(req.rows)]
        stop = set(req.stop_tokens)
        text = [self.tokenizer.decode(x[:-1] if len(x) and int(x[-1]) in stop else x)
                for x in new]
        return Generation(tokens=new, text=None if None in text else text,
                          prompt_tokens=[np.asarray(r) for r in req.rows])
