"""Parameters in the global view: each carries its logical axis names (Flax NNX metadata)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str | None], *,
          std: float | None, dtype, stack: int | tuple[int, ...] | None = None) -> nnx.Param:
    """A parameter of ``shape`` named ``names``; ``stack`` prepends a ``layers`` dim for the scan
    (a tuple prepends one per entry: e.g. the dense layers stacked inside each scanned MoE group).

    ``std=None`` initialises to ones (norm scales); otherwise a normal with that std. A ``None``
    name marks a dim that is never sharded (e.g. the q/k/v slot of the fused QKV weight).
    """
    shape, names = tuple(shape), tuple(names)
    if stack is not None:
        stack = (stack,) if isinstance(stack, int) else tuple(stack)
        shape, names = (*stack, *shape), (*("layers",) * len(stack), *names)
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, names=names)


def residual_std(init_std: float, n_layers: int) -> float:
    """GPT-2's scaled init for projections that write into the residual stream."""
    return init_std / math.sqrt(2 * n_layers)
