"""The two execution modes, as the boundary operators a Transformer block calls.

The model is written once, in the global view, and calls five operators at the points where
Megatron-LM's algebra puts communication: ``constrain`` at block boundaries, ``copy_to_model``
(``f``) before a column-parallel linear, ``reduce_from_model`` (``g``) after a row-parallel one,
and the vocab-parallel ``vocab_max`` / ``vocab_sum`` / ``vocab_start`` of the loss and embedding;
``gather_layer`` is ZeRO-3's just-in-time gather of one layer's weights inside the layer scan.

- :class:`GSPMDOps`: ``f`` and ``g`` are sharding constraints; XLA's partitioner inserts the
  collectives that the parameter and activation tables imply.
- :class:`ExplicitOps`: the model runs per-device inside ``jax.shard_map`` and ``f`` / ``g`` are the
  collectives of :mod:`jaxtp.collectives`, written out.
- :class:`LocalOps`: no mesh at all; the single-device reference every parallel run is checked
  against.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtp import collectives
from jaxtp.sharding import Rules, constrain, without_axes, zero_axes_of


GATHERED = "zero_gathered"


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _gather_state(state: nnx.State, specs, gather_leaf) -> nnx.State:
    """Apply ``gather_leaf(value, dim, axes, spec)`` to every ZeRO-sharded leaf of ``state``."""
    def one(spec, var):
        dim, axes = zero_axes_of(spec)
        if dim is None:
            return var
        # Named so that the layer's remat policy never saves a gathered weight for backward: it
        # is gathered again there (ZeRO-3's second all-gather).
        return var.replace(checkpoint_name(gather_leaf(var[...], dim, axes, spec), GATHERED))
    return jax.tree.map(one, specs, state, is_leaf=_is_spec)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gspmd_gather(x, gathered: NamedSharding, sharded: NamedSharding):
    return jax.lax.with_sharding_constraint(x, gathered)


def _gspmd_gather_fwd(x, gathered, sharded):
    return _gspmd_gather(x, gathered, sharded), None


def _gspmd_gather_bwd(gathered, sharded, _, ct):
    # The weight gradient leaves the layer reduce-scattered to its shard, not all-reduced.
    return (jax.lax.with_sharding_constraint(ct, sharded),)


_gspmd_gather.defvjp(_gspmd_gather_fwd, _gspmd_gather_bwd)


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

    layer_specs = None  # one layer's parameter specs when ZeRO-3 shards them

    @property
    def gathers_layers(self) -> bool:
        return self.layer_specs is not None

    def gather_layer(self, layer_params: nnx.State) -> nnx.State:
        return layer_params


def _all_gather_leaf(x, dim, axes, spec):
    return collectives.gather_shard(x, axes, dim)


def gather_params(state: nnx.State, specs) -> nnx.State:
    """All-gather every ZeRO-3 shard of ``state`` (``specs`` says which), in a manual region."""
    return _gather_state(state, specs, _all_gather_leaf)


@dataclass(frozen=True)
class GSPMDOps(LocalOps):
    """Global view under ``jax.jit``: constraints at the Megatron boundaries, XLA adds collectives.

    ``layer_specs``: one layer's parameter specs when ZeRO-3 shards them (else ``None``).
    ``manual_zero``: the ZeRO axes are manual here (a ``shard_map`` over the batch axes), so the
    gather is an explicit all-gather rather than a constraint.
    """

    mesh: Mesh
    rules: Rules
    layer_specs: object = None
    manual_zero: bool = False

    def gather_layer(self, layer_params):
        if self.layer_specs is None:
            return layer_params
        return self.gather(layer_params, self.layer_specs)

    def gather(self, state, specs):
        """ZeRO shards of ``state`` gathered to their tensor-parallel layout; the cotangent is
        reduce-scattered back to the shard."""
        if self.manual_zero:
            return gather_params(state, specs)

        def leaf(x, dim, axes, spec):
            return _gspmd_gather(x, NamedSharding(self.mesh, without_axes(spec, axes)),
                                 NamedSharding(self.mesh, spec))
        return _gather_state(state, specs, leaf)

    def constrain(self, x, *names):
        return constrain(x, names, mesh=self.mesh, rules=self.rules)

    def copy_to_model(self, x):
        # The column-parallel input is replicated over `model`; its cotangent gets all-reduced.
        return self.constrain(x, "batch", "seq", "embed")

    def reduce_from_model(self, x):
        # Pinning the row-parallel output replicated over `model` is what makes XLA all-reduce.
        return self.constrain(x, "batch", "seq", "embed")


@dataclass(frozen=True)
class ExplicitOps(LocalOps):
    """Per-device view inside ``jax.shard_map``: the Megatron operators written out."""

    layer_specs: object = None

    def gather_layer(self, layer_params):
        if self.layer_specs is None:
            return layer_params
        return gather_params(layer_params, self.layer_specs)

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
