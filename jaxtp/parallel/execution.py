"""The two execution modes, as the boundary operators a Transformer block calls.

The model is written once, in the global view, and calls five operators at the points where
Megatron-LM's algebra puts communication: ``constrain`` at block boundaries, ``copy_to_model``
(``f``) before a column-parallel linear, ``reduce_from_model`` (``g``) after a row-parallel one,
the vocab-parallel ``vocab_max`` / ``vocab_sum`` / ``vocab_start`` of the loss and embedding, and
``attention`` (ring attention over ``context`` under context parallelism); ``gather_layer`` is ZeRO-3's just-in-time gather of one layer's weights inside the layer scan.

With ``sequence_parallel`` the residual stream is split along the sequence over ``model`` and
``f`` / ``g`` become an all-gather / a reduce-scatter (Korthikanti et al. 2022).

- :class:`GSPMDOps`: ``f`` and ``g`` are sharding constraints; XLA's partitioner inserts the
  collectives that the parameter and activation tables imply.
- :class:`ExplicitOps`: the model runs per-device inside ``jax.shard_map`` and ``f`` / ``g`` are the
  collectives of :mod:`jaxtp.parallel.collectives`, written out.
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

from jaxtp.configs import CONTEXT, TP_AXIS
from jaxtp.parallel import collectives
from jaxtp.parallel.ring import ring_attention
from jaxtp.parallel.sharding import Rules, constrain, restrict, without_axes, zero_axes_of

GATHERED = "zero_gathered"
# The output of a row-parallel all-reduce / reduce-scatter (explicit mode): the remat policies save
# it, so backward never re-runs the collective to rebuild it from the saved partial sums.
TP_REDUCED = "tp_reduced"


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

    def attention(self, q, k, v, implementation: str | None = None, segment_ids=None):
        """Causal attention ``q [B,S,N,H], k, v [B,S,K,H] -> [B,S,N,H]`` (fused where the
        backend has a kernel); with ``segment_ids [B,S]`` a token sees only its own segment."""
        kwargs = {} if implementation is None else {"implementation": implementation}
        if segment_ids is not None:
            kwargs["mask"] = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, **kwargs)

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

    def gather_vocab(self, x):
        """Vocab-sharded logits ``[B,V/t] -> [B,V]`` on every TP rank (decode's sampler)."""
        return x

    layer_specs = None  # one layer's parameter specs when ZeRO-3 shards them

    @property
    def gathers_layers(self) -> bool:
        return self.layer_specs is not None

    def gather_layer(self, layer_params: nnx.State) -> nnx.State:
        return layer_params


def on_tp_blocks(fn, x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """``fn(x)`` on each device's TP block of ``x`` (whose full spec is ``spec``).

    Inside a region manual over the batch axes that leaves other mesh axes to the partitioner
    (GSPMD mode: ``model``), a collective over the manual axes on a TP-split tensor would be
    partitioned badly: the partitioner replicates the operand over ``model`` first (an extra
    all-gather) and moves ``t`` times the bytes over ``data``. A nested region manual over the
    axes ``x`` is split on runs ``fn`` on the local block instead. ``fn`` must keep the TP dims
    (it may resize a dim no auto axis splits). Elsewhere (explicit mode, a replicated tensor) it
    is ``fn(x)``."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    tp = restrict(spec, auto)
    split = frozenset(a for e in tp if e for a in ((e,) if isinstance(e, str) else e))
    if not split:
        return fn(x)
    return jax.shard_map(fn, mesh=mesh, in_specs=tp, out_specs=tp, axis_names=split)(x)


def _all_gather_leaf(x, dim, axes, spec):
    """All-gather of a ZeRO shard over its (manual) ``axes``, on each device's TP block."""
    return on_tp_blocks(lambda a: collectives.gather_shard(a, axes, dim), x, spec)


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
    context: int = 1  # ring attention over `context` when > 1
    context_layout: str = "zigzag"

    def attention(self, q, k, v, implementation=None, segment_ids=None):
        if self.context == 1:
            return super().attention(q, k, v, implementation, segment_ids)
        # the engine makes `context` manual (with the batch axes) whenever it is split
        return ring_attention(q, k, v, axis=CONTEXT, causal=True, layout=self.context_layout,
                              segment_ids=segment_ids)

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
        # The column-parallel input is replicated over `model` (gathered along the sequence under
        # SP); its cotangent gets all-reduced (reduce-scattered).
        return self.constrain(x, "batch", "seq", "embed")

    def reduce_from_model(self, x):
        # Pinning the row-parallel output replicated over `model` is what makes XLA all-reduce;
        # pinning it split along the sequence (SP) makes it reduce-scatter.
        return self.constrain(x, "batch", "residual_seq", "embed")

    def gather_vocab(self, x):
        return self.constrain(x, "batch", None)


@dataclass(frozen=True)
class ExplicitOps(LocalOps):
    """Per-device view inside ``jax.shard_map``: the Megatron operators written out."""

    layer_specs: object = None
    sequence_parallel: bool = False
    context: int = 1
    context_layout: str = "zigzag"
    tp_axis: str = TP_AXIS  # the mesh axis the parameter table splits heads over

    def attention(self, q, k, v, implementation=None, segment_ids=None):
        if self.context == 1:
            return super().attention(q, k, v, implementation, segment_ids)
        return ring_attention(q, k, v, axis=CONTEXT, causal=True, layout=self.context_layout,
                              segment_ids=segment_ids)

    def gather_layer(self, layer_params):
        if self.layer_specs is None:
            return layer_params
        return gather_params(layer_params, self.layer_specs)

    def copy_to_model(self, x):
        if self.sequence_parallel:
            return collectives.gather_sequence(x, self.tp_axis)
        return collectives.copy_to_model(x, self.tp_axis)

    def reduce_from_model(self, x):
        if self.sequence_parallel:
            return checkpoint_name(collectives.reduce_scatter_sequence(x, self.tp_axis),
                                   TP_REDUCED)
        return checkpoint_name(collectives.reduce_from_model(x, self.tp_axis), TP_REDUCED)

    def vocab_max(self, x):
        return collectives.max_over_model(x, self.tp_axis)

    def vocab_sum(self, x):
        return collectives.reduce_from_model(x, self.tp_axis)

    def vocab_start(self, local_vocab: int):
        return jax.lax.axis_index(self.tp_axis) * local_vocab

    def gather_vocab(self, x):
        return collectives.gather_vocab(x, self.tp_axis)
