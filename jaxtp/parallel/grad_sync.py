"""The one data-parallel gradient sync per step, and the marking that makes it possible.

Inside a per-device region every parameter replicated over a token axis is marked with Megatron's
``f`` over those axes (:func:`mark_data_parallel`), so its gradient comes out as each device's
local partial sum instead of being all-reduced by the transpose inside every micro-batch.
:func:`sync_grads` then reduces it once per step (PyTorch DDP's bucketed all-reduce, Li et al.
2020; ZeRO's reduce-scatter, Rajbhandari et al. 2019): all-reduce for ZeRO 0/1, reduce-scatter into
the gradient shard for ZeRO 2, nothing for ZeRO-3 shards (their gather's transpose already
reduce-scattered them).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxtp.configs import BATCH_AXES, spec_axes
from jaxtp.parallel import collectives
from jaxtp.parallel.execution import on_tp_blocks
from jaxtp.parallel.sharding import zero_axes_of


def _map_specs(fn, specs, *trees):
    """``fn(spec, *leaves)`` over a State of PartitionSpecs and States of Variables like it."""
    return jax.tree.map(fn, specs, *trees, is_leaf=lambda x: isinstance(x, PartitionSpec))


def mark_data_parallel(params: nnx.State, specs: nnx.State,
                       axes: tuple[str, ...] = BATCH_AXES) -> nnx.State:
    """Megatron-style ``f`` over the replica ``axes`` (the batch axes, ``context``, and ``model``
    for the parameters sequence parallelism uses on sequence shards) for every parameter not
    sharded over them: its gradient becomes a local (varying) partial sum that
    :func:`sync_grads` reduces once per step."""
    def one(spec, var):
        rest = tuple(a for a in axes if a not in spec_axes(spec))
        return var.replace(jax.lax.pcast(var[...], rest, to="varying")) if rest else var
    return _map_specs(one, specs, params)


def sync_grads(grads: nnx.State, param_specs: nnx.State, grad_specs: nnx.State,
               axes: tuple[str, ...] = BATCH_AXES) -> nnx.State:
    """The one data-parallel gradient sync per step: all-reduce (ZeRO 0/1), reduce-scatter into
    the gradient shard (ZeRO 2), nothing for ZeRO-3 shards (reduce-scattered by their gather).
    Parameters sharded over a replica axis (e.g. ``model`` for TP weights) skip that axis. A
    reduce-scatter runs on each device's TP block (see :func:`jaxtp.parallel.execution.on_tp_blocks`)."""
    def one(pspec, gspec, g):
        held = spec_axes(pspec)
        dim, gaxes = zero_axes_of(gspec)
        scatter = tuple(a for a in gaxes if a not in held)
        replicated = tuple(a for a in axes if a not in held)
        sync = lambda x: collectives.sync_grads(x, replicated, scatter, dim)  # noqa: E731
        return g.replace(on_tp_blocks(sync, g[...], pspec) if scatter else sync(g[...]))
    return _map_specs(one, param_specs, grad_specs, grads)
