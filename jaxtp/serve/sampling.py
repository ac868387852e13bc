"""Next-token sampling from logits: greedy, temperature, top-k (Fan et al. 2018) and nucleus /
top-p (Holtzman et al. 2019).

Every knob is a traced value, so one compiled decode loop serves every setting: ``temperature
<= 0`` is greedy (argmax), ``top_k <= 0`` and ``top_p >= 1`` switch their filters off. The padded
vocab rows (``id >= vocab_size``, padding to a multiple of the TP degree) are masked before
anything else, so they are never sampled. Each row draws from its own key,
``fold_in(fold_in(seed_key, row), step)``, so a row's tokens do not depend on the batch it is in
or on how the batch is split over devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


@dataclass(frozen=True)
class SamplerArgs:
    """The sampling knobs as arrays (traced in the decode loop: no recompile per setting)."""

    temperature: jax.Array  # () fp32; <= 0: greedy
    top_k: jax.Array        # () int32; <= 0: off
    top_p: jax.Array        # () fp32; >= 1: off

    @classmethod
    def make(cls, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> SamplerArgs:
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
        if top_k < 0:
            raise ValueError(f"top_k={top_k} must be >= 0 (0: off)")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p} must be in (0, 1] (1: off)")
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


jax.tree_util.register_dataclass(SamplerArgs, data_fields=["temperature", "top_k", "top_p"],
                                 meta_fields=[])


def filter_logits(logits: jax.Array, args: SamplerArgs, *, vocab_size: int) -> jax.Array:
    """``[B,V] -> [B,V]`` fp32 logits / temperature with every excluded id at ``-inf``: the
    padded vocab rows, ids outside the ``top_k`` largest, ids outside the smallest set whose
    probability reaches ``top_p`` (the most likely id is always kept)."""
    logits = logits.astype(jnp.float32)
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where(ids < vocab_size, logits, NEG_INF)
    logits = logits / jnp.where(args.temperature > 0, args.temperature, 1.0)
    ranked = jnp.sort(logits, axis=-1)[:, ::-1]                                # (B, V) descending
    k = jnp.where(args.top_k > 0, jnp.minimum(args.top_k, vocab_size), vocab_size)
    kth = jnp.take(ranked, k - 1, axis=-1)[:, None]                             # (B, 1)
    logits = jnp.where(logits >= kth, logits, NEG_INF)
    probs = jax.nn.softmax(jnp.where(ranked >= kth, ranked, NEG_INF), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs      # probability mass ranked above each id
    kept = jnp.sum(before < args.top_p, axis=-1)     # >= 1: the top id has 0 mass before it
    cutoff = jnp.take_along_axis(ranked, kept[:, None] - 1, axis=-1)            # (B, 1)
    return jnp.where(logits >= cutoff, logits, NEG_INF)


def sample(logits: jax.Array, args: SamplerArgs, keys: jax.Array, *, vocab_size: int
           ) -> jax.Array:
    """``[B,V]`` logits -> ``[B]`` int32 token ids; ``keys [B]``: one PRNG key per row."""
    filtered = filter_logits(logits, args, vocab_size=vocab_size)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    greedy = jnp.argmax(filtered, axis=-1)
    return jnp.where(args.temperature > 0, drawn, greedy).astype(jnp.int32)


def row_keys(seed_key: jax.Array, rows: jax.Array, step) -> jax.Array:
    """One key per row for decode step ``step``: ``rows [B]`` are the rows' global indices."""
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(seed_key, r), step))(rows)
