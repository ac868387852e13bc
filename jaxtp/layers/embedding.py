"""Vocab-parallel embedding, output head and cross-entropy (Shoeybi et al. 2019, sec. 3).

The vocabulary is split over ``model``: each rank holds ``V/t`` rows of the table, looks up the
tokens that fall in its range (zeros elsewhere) and one all-reduce of ``b x s x h`` sums the
partial embeddings. The loss never gathers the ``b x s x v`` logits: each rank reduces its own
vocab shard to ``b x s`` maxima, sums of exponentials and target logits, and only those ``O(b x s)``
values are all-reduced. Rows past ``vocab_size`` (padding to a multiple of the TP degree) are
masked out of the softmax, so padding never changes the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.layers.params import param

_MASKED = -1e9  # finite: a shard holding only padding rows must not produce inf - inf


class VocabParallelEmbedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, std: float, dtype, rngs: nnx.Rngs):
        self.table = param(rngs, (vocab, dim), ("vocab", "embed"), std=std, dtype=dtype)

    def __call__(self, tokens: jax.Array, ops) -> jax.Array:  # [B,S] -> [B,S,D]
        table = self.table[...]
        local_vocab = table.shape[0]
        start = ops.vocab_start(local_vocab)
        local = tokens - start
        in_shard = (local >= 0) & (local < local_vocab)
        rows = jnp.take(table, jnp.where(in_shard, local, 0), axis=0)    # (B, S, D){U_model}
        rows = jnp.where(in_shard[..., None], rows, 0)
        return ops.reduce_from_model(rows)                               # g

    def attend(self, x: jax.Array, ops) -> jax.Array:  # tied output head: [B,S,D] -> [B,S,V]
        h = ops.copy_to_model(x)                                         # f
        return jnp.einsum("bsd,vd->bsv", h, self.table[...].astype(x.dtype))


class OutputHead(nnx.Module):
    """Untied column-parallel output projection ``w[embed, vocab]``."""

    def __init__(self, dim: int, vocab: int, *, std: float, dtype, rngs: nnx.Rngs):
        self.w = param(rngs, (dim, vocab), ("embed", "vocab"), std=std, dtype=dtype)

    def __call__(self, x: jax.Array, ops) -> jax.Array:  # [B,S,D] -> [B,S,V]
        h = ops.copy_to_model(x)                                         # f
        return jnp.einsum("bsd,dv->bsv", h, self.w[...].astype(x.dtype))


def vocab_parallel_cross_entropy(logits: jax.Array, targets: jax.Array, *, vocab_size: int,
                                 ops) -> jax.Array:
    """Per-token cross-entropy ``[B,S]`` from vocab-sharded ``logits [B,S,V_local]``, in fp32.

    Communication: three all-reduces of ``[B,S]`` (max, sum of exponentials, target logit).
    """
    logits = logits.astype(jnp.float32)
    local_vocab = logits.shape[-1]
    ids = ops.vocab_start(local_vocab) + jnp.arange(local_vocab)             # (V_local,)
    logits = jnp.where(ids < vocab_size, logits, _MASKED)                    # drop padding rows
    shift = ops.vocab_max(jnp.max(logits, axis=-1))                          # (B, S)
    z = logits - shift[..., None]
    sum_exp = ops.vocab_sum(jnp.sum(jnp.exp(z), axis=-1))                    # (B, S)
    target_z = ops.vocab_sum(jnp.sum(jnp.where(ids == targets[..., None], z, 0.0), axis=-1))
    return jnp.log(sum_exp) - target_z
