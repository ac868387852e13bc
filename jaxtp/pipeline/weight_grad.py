"""A stage's backward split in two: the input gradient ``B`` now, the weight gradient ``W`` later.

ZB-H1 (Qi et al. 2023) runs each stage's backward as two passes: ``B`` computes the cotangent of
the stage input (needed by the previous stage at once) and ``W`` the weight gradients (needed
only by the optimizer), so ``W`` can fill the pipeline's bubble. For a linear layer ``y = x w``,
``B`` is ``dx = dy w^T`` and ``W`` is ``dw = x^T dy``: ``W`` needs the layer's input ``x`` and
its output cotangent ``dy``, which ``B`` computes on its way down the stage.

jaxtp gets the split from JAX's partial evaluation rather than from hand-written backward code.
While :func:`splitting` is on, every weight matmul of the model (:func:`weight_einsum`) carries a
one-byte marker residual, and its weight gradient reads the marker (``x + 0``): in the stage's
backward jaxpr the weight-gradient matmuls are exactly the work that depends on a marker.
:func:`split` partially evaluates that jaxpr with the markers unknown: the known part is ``B``
(every input-gradient matmul, the norms' and other non-matmul gradients), the unknown part is
``W``, and the values ``B`` hands to ``W`` (each linear's ``x`` and ``dy``, per layer: JAX's scan
rule stacks them) are the residuals a pipeline keeps from a micro-batch's ``B`` to its ``W``.
The marker folds away in XLA; with splitting off the model runs plain ``jnp.einsum``.
"""

from __future__ import annotations

import contextlib
import contextvars
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import jaxpr_as_fun

MARK = "weight_grad_marker"  # remat name of the marker (policies must keep it: :func:`policy`)
_MARK_DTYPE = jnp.uint8      # no other residual of the model has this dtype

_splitting = contextvars.ContextVar("jaxtp_weight_grad_splitting", default=False)


@contextlib.contextmanager
def splitting(on: bool = True):
    """Trace the model with markers on its weight matmuls (for :func:`split`)."""
    token = _splitting.set(on)
    try:
        yield
    finally:
        _splitting.reset(token)


def is_splitting() -> bool:
    return _splitting.get()


def with_split_markers(base):
    """Remat policy ``base`` that also saves the markers (so they stay residuals)."""
    names = jax.checkpoint_policies.save_only_these_names(MARK)
    return names if base is None else jax.checkpoint_policies.save_from_both_policies(base, names)


def weight_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for an activation ``x`` and a weight ``w``; marked while
    :func:`splitting`."""
    return _marked_einsum(spec, x, w) if is_splitting() else jnp.einsum(spec, x, w)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _marked_einsum(spec, x, w):
    return jnp.einsum(spec, x, w)


def _marked_fwd(spec, x, w):
    mark = checkpoint_name(jnp.zeros((1,), _MARK_DTYPE), MARK)
    return jnp.einsum(spec, x, w), (x, w, mark)


def _marked_bwd(spec, res, dy):
    x, w, mark = res
    dx = jax.vjp(lambda x: jnp.einsum(spec, x, w), x)[1](dy)[0]
    x_marked = x + mark[0].astype(x.dtype)  # depends on the marker: W's side of the split
    dw = jax.vjp(lambda w: jnp.einsum(spec, x_marked, w), w)[1](dy)[0]
    return dx, dw


_marked_einsum.defvjp(_marked_fwd, _marked_bwd)


def is_marker(a) -> bool:
    return jnp.dtype(a.dtype) == _MARK_DTYPE


class Split(NamedTuple):
    """A backward ``(leaves, g) -> outputs`` in two jaxprs. ``known``: the non-marker leaves and
    ``g`` -> the known outputs, then the residuals for ``unknown``; ``unknown``: the residuals,
    then the marker leaves -> the outputs that depend on a marker. ``out_unknown[i]``: output
    ``i`` comes from ``unknown``."""

    known: Any
    unknown: Any
    out_unknown: tuple[bool, ...]
    markers: tuple[int, ...]          # positions of the marker leaves
    residuals: tuple[Any, ...]        # avals of what B hands to W
    cast: Any                         # (array, varying axes) -> array varying over them too


def split(backward, leaves: list, g, cast=lambda a, axes: a) -> Split:
    """Partially evaluate ``backward(leaves, g)`` (a list of output arrays) with the marker
    leaves unknown. Inside ``shard_map``, ``cast(a, axes)`` makes an input vary over the
    manual axes the jaxprs were traced with (``jax.lax.pcast``), which it may lack."""
    from jax._src.interpreters import partial_eval as pe  # noqa: PLC0415 (JAX's unzipping)

    markers = tuple(i for i, a in enumerate(leaves) if is_marker(a))
    if not markers:
        raise ValueError("weight_grad.split: the backward has no marked weight matmuls; trace "
                         "the forward under weight_grad.splitting()")
    closed = jax.make_jaxpr(lambda leaves, g: backward(leaves, g))(leaves, g)
    unknowns = [i in markers for i in range(len(leaves))] + [False] * len(jax.tree.leaves(g))
    known, unknown, out_unknown, res = pe.partial_eval_jaxpr_nounits(closed, unknowns, False)
    return Split(known, unknown, tuple(out_unknown), markers, tuple(res), cast)


def varying(aval) -> frozenset[str]:
    """The manual axes an abstract value varies over."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _args(sp: Split, closed, args: list) -> list:
    return [sp.cast(a, varying(v)) for a, v in zip(args, closed.in_avals)]


def run_known(sp: Split, leaves: list, g) -> tuple[list, list]:
    """``B``: (the known outputs, in order, ``None`` for the unknown ones; the residuals)."""
    ins = [a for i, a in enumerate(leaves) if i not in sp.markers] + jax.tree.leaves(g)
    outs = jaxpr_as_fun(sp.known)(*_args(sp, sp.known, ins))
    n = len(outs) - len(sp.residuals)
    known = iter(outs[:n])
    return [None if u else next(known) for u in sp.out_unknown], list(outs[n:])


def run_unknown(sp: Split, residuals: list, markers: list) -> list:
    """``W``: the unknown outputs, in order, ``None`` for the known ones."""
    outs = iter(jaxpr_as_fun(sp.unknown)(*_args(sp, sp.unknown, [*residuals, *markers])))
    return [next(outs) if u else None for u in sp.out_unknown]
