"""The order of the stacked ``layers`` dim under pipeline parallelism.

Stage ``k`` of ``p * v`` runs on pipeline rank ``k % p`` as its chunk ``k // p`` (Megatron-LM's
interleaved assignment, Narayanan et al. 2021, sec. 2.2). For ``v = 1`` rank ``r`` holds stage
``r``, which is the natural layer order, so sharding the ``layers`` dim over ``pipeline`` hands each
rank its stage. For ``v > 1`` a rank's chunks are not contiguous in depth, so the trainer stores the
``layers`` dim *rank-major* (:func:`to_pipeline_order`); :func:`to_natural_order` undoes it, and
checkpoints are written in natural order, so a run saved with one pipeline layout resumes on any
other (or on none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stages_to_ranks(stacked, p: int, v: int = 1):
    """Leaves ``[p * v, ...]`` in model-stage order -> rank-major order (rank ``d``'s chunks
    ``0 .. v-1`` contiguous), so that sharding dim 0 over ``pipeline`` gives each rank its
    ``[v, ...]`` chunk parameters. Stage ``k`` = chunk ``k // p`` of rank ``k % p``."""
    def f(a):
        a = jnp.asarray(a)
        return a.reshape(v, p, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return jax.tree.map(f, stacked)


def ranks_to_stages(per_rank, p: int, v: int = 1):
    """Inverse of :func:`stages_to_ranks` (e.g. for gradients)."""
    def f(a):
        a = jnp.asarray(a)
        return a.reshape(p, v, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return jax.tree.map(f, per_rank)


def _reorder(tree, p: int, v: int, units: int, inverse: bool):
    """Reorder the leading ``layers`` dim of every leaf under a ``blocks`` key whose leading dim
    is ``units`` (parameters, gradients, optimizer moments alike)."""
    if v == 1:
        return tree
    move = ranks_to_stages if inverse else stages_to_ranks

    def one(path, a):
        keys = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        if "blocks" not in keys or not a.shape or a.shape[0] != units:
            return a
        chunks = a.reshape(p * v, units // (p * v), *a.shape[1:])
        return move(chunks, p, v).reshape(a.shape)
    return jax.tree_util.tree_map_with_path(one, tree)


def to_pipeline_order(tree, p: int, v: int, units: int):
    """Natural layer order -> rank-major order (rank ``r``'s ``v`` chunks contiguous, so sharding
    the ``layers`` dim over ``pipeline`` hands each rank its stages)."""
    return _reorder(tree, p, v, units, inverse=False)


def to_natural_order(tree, p: int, v: int, units: int):
    """Inverse of :func:`to_pipeline_order`: layer ``i`` at index ``i`` again."""
    return _reorder(tree, p, v, units, inverse=True)
