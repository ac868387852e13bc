"""The step loss as a mean over tokens: every token of the global batch, or -- for a packed batch
-- only those its ``loss_mask`` counts (not the position after a document's end, not padding).

A packed batch's mean is over a data-dependent count, so each device sums its own masked losses
and the count is summed over the token axes once per step (one scalar all-reduce, only for packed
batches); an unpacked batch divides by the static ``batch_size x seq_len``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_sum(losses: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``sum(losses)`` over the tokens ``mask`` counts (all of them for ``None``)."""
    return jnp.sum(losses) if mask is None else jnp.sum(losses * mask.astype(losses.dtype))


def token_count(batch: dict, n_tokens: int, axes: tuple[str, ...] = ()):
    """What the step's loss sum is divided by: ``n_tokens`` for an unpacked batch, else the
    number of counted tokens in the global batch (summed over ``axes``, the manual token axes,
    when this runs per device); at least 1."""
    mask = batch.get("loss_mask")
    if mask is None:
        return n_tokens
    count = jnp.sum(mask.astype(jnp.float32))
    if axes:
        missing = tuple(a for a in axes if a not in jax.typeof(count).manual_axis_type.varying)
        count = jax.lax.pcast(count, missing, to="varying") if missing else count
        count = jax.lax.psum(count, axes)
    return jnp.maximum(count, 1.0)
