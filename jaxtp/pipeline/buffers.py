"""Small array helpers of the pipeline runtime (:mod:`jaxtp.pipeline.runtime`): zero buffers with a
given varying-axes type, gradient accumulation into a chunk, and slot reads and writes."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes over which ``x`` varies (its type's ``vma``)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def vary_over(x, axes):
    """``pcast`` to varying over those of ``axes`` that ``x`` does not already vary over."""
    missing = tuple(a for a in sorted(axes) if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def zeros(shape, dtype, vma):
    return vary_over(jnp.zeros(shape, dtype), vma)


def zeros_like(tree):
    return jax.tree.map(lambda a: zeros(a.shape, a.dtype, varying_axes(a)), tree)


def add(acc, d):
    return jax.tree.map(jnp.add, acc, d)


def add_chunk(grads, c, d):
    """``grads[c] += d`` on every leaf (``c`` traced)."""
    return jax.tree.map(lambda g, x: jax.lax.dynamic_update_index_in_dim(
        g, jax.lax.dynamic_index_in_dim(g, c, 0, keepdims=False) + x, c, 0), grads, d)


def add_chunk_leaves(grads, c, d: list):
    """``grads[c] += d`` for the leaves of ``grads`` whose entry in the flat list ``d`` is not
    ``None`` (a split backward's ``B`` or ``W`` part)."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    return jax.tree_util.tree_unflatten(treedef, [
        g if x is None else jax.lax.dynamic_update_index_in_dim(
            g, jax.lax.dynamic_index_in_dim(g, c, 0, keepdims=False) + x.astype(g.dtype), c, 0)
        for g, x in zip(leaves, d)])


def index(tree, i):
    """Micro-batch ``i`` (traced) of every leaf of ``tree``."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def read(buf, slot):
    return jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)


def write(buf, slot, value):  # an unused write goes to a dead or the scratch slot
    return jax.lax.dynamic_update_index_in_dim(buf, value, slot, 0)
