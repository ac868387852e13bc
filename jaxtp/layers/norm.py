"""RMSNorm (Zhang & Sennrich 2019), computed in fp32. Replicated over ``model`` (the paper's
"block inputs and norms stay replicated" region), or split along the sequence under Megatron SP.

The norm is elementwise work: its backward recomputes it from the input (``jax.checkpoint``), so a
layer keeps only the norm's input and, as the next linear's input, its output -- Korthikanti et
al.'s 2 sbh per norm -- rather than also the fp32 normalised value autodiff would save for the
scale's gradient.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.layers.params import param


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs, stack: int | None = None):
        self.scale = param(rngs, (dim,), ("embed",), std=None, dtype=dtype, stack=stack)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [B,S,D] -> [B,S,D]
        return rms_norm(x, self.scale[...], self.eps)


@partial(jax.checkpoint, static_argnums=(2,), prevent_cse=False)
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * scale`` over the last dim, in fp32; recomputed in backward."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * scale.astype(jnp.float32)).astype(x.dtype)
