"""RMSNorm (Zhang & Sennrich 2019), computed in fp32. Replicated over ``model`` (the paper's
"block inputs and norms stay replicated" region)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.layers import param


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs, stack: int | None = None):
        self.scale = param(rngs, (dim,), ("embed",), std=None, dtype=dtype, stack=stack)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [B,S,D] -> [B,S,D]
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv * self.scale[...].astype(jnp.float32)).astype(x.dtype)
