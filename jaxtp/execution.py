"""The two execution modes, as the boundary operators a Transformer block calls.

The model is written once, in the global view, and calls five operators at the points where
Megatron-LM's algebra puts communication: ``constrain`` at block boundaries, ``copy_to_model``
(``f``) before a column-parallel linear, ``reduce_from_model`` (``g``) after a row-parallel one,
and the vocab-parallel ``vocab_max`` / ``vocab_sum`` / ``vocab_start`` of the loss and embedding.

- :class:`GSPMDOps`: ``f`` and ``g`` are sharding constraints; XLA's partitioner inserts the
  collectives that the parameter and activation tables imply.
- :class:`ExplicitOps`: the model runs per-device inside ``jax.shard_map`` and ``f`` / ``g`` are the
  collectives of :mod:`jaxtp.collectives`, written out.
- :class:`LocalOps`: no mesh at all; the single-device reference every parallel run is checked
  against.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from jaxtp import collectives
from jaxtp.sharding import Rules, constrain


class LocalOps:
    """Single device: every operator is the identity."""

    def constrain(self, x, *names):
        return x

    def copy_to_model(self, x):
        return x

    def reduce_from_model(self, x):
        return x

    def vocab_max(self, x):
        return jax.lax.stop_gradient(x)

    def vocab_sum(self, x):
        return x

    def vocab_start(self, local_vocab: int):
        return 0


@dataclass(frozen=True)
class GSPMDOps(LocalOps):
    """Global view under ``jax.jit``: constraints at the Megatron boundaries, XLA adds collectives."""

    mesh: Mesh
    rules: Rules

    def constrain(self, x, *names):
        return constrain(x, names, mesh=self.mesh, rules=self.rules)

    def copy_to_model(self, x):
        # The column-parallel input is replicated over `model`; its cotangent gets all-reduced.
        return self.constrain(x, "batch", "seq", "embed")

    def reduce_from_model(self, x):
        # Pinning the row-parallel output replicated over `model` is what makes XLA all-reduce.
        return self.constrain(x, "batch", "seq", "embed")


class ExplicitOps(LocalOps):
    """Per-device view inside ``jax.shard_map``: the Megatron operators written out."""

    def copy_to_model(self, x):
        return collectives.copy_to_model(x)

    def reduce_from_model(self, x):
        return collectives.reduce_from_model(x)

    def vocab_max(self, x):
        return collectives.max_over_model(x)

    def vocab_sum(self, x):
        return collectives.reduce_from_model(x)

    def vocab_start(self, local_vocab: int):
        return jax.lax.axis_index(collectives.MODEL) * local_vocab
