"""A stage's VJP split into the arrays a pipeline must keep and the parameters it already has.

``jax.vjp(stage, params, x)`` returns the backward as a ``jax.tree_util.Partial`` whose leaves are
the residuals: what the stage's remat policy saved of its forward (every intermediate under no
remat, the linear layers' outputs under selective recompute, each layer's input under full) and
the parameters the backward multiplies by. The pipeline stores the former in a residual slot from
a micro-batch's ``F`` to its ``B`` (so ``B`` runs only the backward, as in an unpipelined step)
and takes the latter from the stage's parameters again at ``B``: a slot never holds weights.
Which leaf is which is decided once per trace, by identity with the parameter leaves passed in.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class Recipe(NamedTuple):
    """How to rebuild a stage's VJP: its tree structure, and per leaf its source: ``i >= 0`` is
    parameter leaf ``i``, ``-1 - j`` is stored leaf ``j``."""

    treedef: Any
    sources: tuple[int, ...]


def split_vjp(vjp_fn, params) -> tuple[Recipe, list[jax.Array]]:
    """``vjp_fn`` (of ``params`` and the stage input) -> (its :class:`Recipe`, the leaves to
    store: those that are not one of ``params``'s leaves)."""
    leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
    index = {id(a): i for i, a in enumerate(jax.tree.leaves(params))}
    sources, stored = [], []
    for a in leaves:
        if id(a) in index:
            sources.append(index[id(a)])
        else:
            sources.append(-1 - len(stored))
            stored.append(a)
    return Recipe(treedef, tuple(sources)), stored


def vjp_leaves(recipe: Recipe, params, stored: list[jax.Array]) -> list[jax.Array]:
    """The VJP function's leaves, in order, from the stored leaves and the stage's parameters."""
    p = jax.tree.leaves(params)
    return [p[s] if s >= 0 else stored[-1 - s] for s in recipe.sources]


def join_vjp(recipe: Recipe, params, stored: list[jax.Array]):
    """The VJP function again, from the stored leaves and the stage's parameters."""
    return jax.tree_util.tree_unflatten(recipe.treedef, vjp_leaves(recipe, params, stored))
