"""The Megatron-LM communication operators, on JAX's own transpose rules.

Megatron (Shoeybi et al. 2019, sec. 3, Fig. 3) needs two conjugate operators around each
tensor-parallel block: ``f`` before the column-parallel linear and ``g`` after the row-parallel one.
Under ``jax.shard_map`` with varying-axes checking, ``f`` is ``pcast(..., to='varying')`` (its
transpose is an all-reduce) and ``g`` is ``psum`` (its transpose is a cast back), so no custom VJP
is written here. With sequence parallelism (Korthikanti et al. 2022) the pair becomes an all-gather
along the sequence before the column-parallel linear and a reduce-scatter after the row-parallel
one, again each the other's transpose. Expert parallelism (GShard, Lepikhin et al. 2020) adds
one more conjugate pair over ``expert``: the all-to-all that dispatches routed tokens to the ranks
holding their experts, and its inverse that combines the outputs back. Notation: ``{U_model}`` =
unreduced (a partial sum) over the ``model`` axis; ``{V_model}`` = varying (different on each
rank) over ``model``.
"""

from __future__ import annotations

import jax

from jaxtp.configs import EXPERT, MODEL


def copy_to_model(x: jax.Array, axis: str = MODEL) -> jax.Array:
    """Megatron ``f``. Forward: identity. Backward: all-reduce over ``axis``.

    ``[B,S,D] -> [B,S,D]{V_model}``: marks a replicated activation as the input of every rank's
    column-parallel shard, so the cotangents the ranks produce get summed.
    """
    return jax.lax.pcast(x, axis, to="varying")


def reduce_from_model(x: jax.Array, axis: str = MODEL) -> jax.Array:
    """Megatron ``g``. Forward: all-reduce over ``axis``. Backward: identity.

    ``[B,S,D]{U_model} -> [B,S,D]``: sums the row-parallel linear's partial products.
    """
    return jax.lax.psum(x, axis)


def gather_sequence(x: jax.Array, axis: str = MODEL, dim: int = 1) -> jax.Array:
    """Korthikanti et al.'s ``g`` (Fig. 5), replacing TP's ``f``. Forward: all-gather over ``axis``
    along the sequence.
    Backward: reduce-scatter (JAX's transpose of ``all_gather``).

    ``[B,S/t,D]{V_model} -> [B,S,D]{V_model}``: the sequence-parallel block input, gathered for the
    column-parallel linear (Korthikanti et al. 2022, sec. 4.2.2).
    """
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def reduce_scatter_sequence(x: jax.Array, axis: str = MODEL, dim: int = 1) -> jax.Array:
    """Korthikanti et al.'s ``g-bar`` (Fig. 5), replacing TP's all-reduce ``g``. Forward:
    reduce-scatter over ``axis`` along the sequence. Backward: all-gather.

    ``[B,S,D]{U_model} -> [B,S/t,D]{V_model}``: the row-parallel linear's partial sums, summed and
    left split along the sequence for the norm / residual region.
    """
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def max_over_model(x: jax.Array, axis: str = MODEL) -> jax.Array:
    """All-reduce(max) over ``axis``, with no gradient: the softmax shift of the vocab-parallel loss.

    ``[B,S]{V_model} -> [B,S]``. The shift cancels in the loss, so it carries no cotangent.
    """
    return jax.lax.pmax(jax.lax.stop_gradient(x), axis)


def gather_vocab(x: jax.Array, axis: str = MODEL) -> jax.Array:
    """All-gather of the vocab shards of ``x [B,V/t]`` over ``axis``, as an all-reduce of each
    shard placed in zeros, so the result is invariant over ``axis`` (every rank samples the same
    token). ``[B,V/t]{V_model} -> [B,V]``; decode only (no gradient is taken)."""
    local = x.shape[-1]
    start = jax.lax.axis_index(axis) * local
    full = jax.numpy.zeros((*x.shape[:-1], local * jax.lax.axis_size(axis)), x.dtype)
    full = jax.lax.dynamic_update_slice_in_dim(full, x, start, axis=x.ndim - 1)
    return jax.lax.psum(full, axis)


def data_parallel_params(params, axes: tuple[str, ...]):
    """Mark replicated parameters as feeding every data-parallel rank.

    Forward: identity. Backward: one all-reduce of each gradient over ``axes`` (the DDP gradient
    sync), placed once per step outside the layer loop rather than once per use.
    """
    return jax.tree.map(lambda p: jax.lax.pcast(p, axes, to="varying"), params)


def gather_shard(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
    """ZeRO-3's just-in-time gather. Forward: all-gather over ``axes`` along ``dim``. Backward:
    reduce-scatter of the cotangent (JAX's transpose of ``all_gather``).

    ``[.., d/n, ..]{V_axes} -> [.., d, ..]{V_axes}``.
    """
    return jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True)


def sync_grads(g: jax.Array, replicated: tuple[str, ...], scatter: tuple[str, ...],
               dim: int | None) -> jax.Array:
    """The data-parallel sync of one local gradient: reduce-scatter over ``scatter`` along ``dim``
    (ZeRO 2), then all-reduce over the rest of ``replicated`` (DDP, ZeRO 0/1, hybrid replicas).

    ``[.., d, ..]{V_replicated} -> [.., d/n_scatter, ..]``.
    """
    if scatter:
        g = jax.lax.psum_scatter(g, scatter if len(scatter) > 1 else scatter[0],
                                 scatter_dimension=dim, tiled=True)
    rest = tuple(a for a in replicated if a not in scatter)
    return jax.lax.psum(g, rest) if rest else g


def dispatch_to_experts(x: jax.Array, axis: str = EXPERT) -> jax.Array:
    """EP dispatch. Forward: all-to-all over ``axis``. Backward: the inverse all-to-all.

    ``[E, G, C, D]{V_axis} -> [E/ep, ep*G, C, D]{V_axis}``: rank ``r`` sends the slots of experts
    ``r' E/ep .. (r'+1) E/ep - 1`` of its ``G`` groups to rank ``r'`` and receives, for its own
    experts, the slots of every rank's groups (source-rank major).
    """
    return jax.lax.all_to_all(x, axis, split_axis=0, concat_axis=1, tiled=True)


def combine_from_experts(y: jax.Array, axis: str = EXPERT) -> jax.Array:
    """EP combine, the inverse of :func:`dispatch_to_experts`. Forward: all-to-all over ``axis``.
    Backward: the dispatch all-to-all.

    ``[E/ep, ep*G, C, D]{V_axis} -> [E, G, C, D]{V_axis}``: each rank's expert outputs go back to
    the ranks that own the groups.
    """
    return jax.lax.all_to_all(y, axis, split_axis=1, concat_axis=0, tiled=True)
