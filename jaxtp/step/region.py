"""Region: where the per-device program starts, one class per execution mode.

The model is written once; a Region says how it runs on the mesh. :func:`region_for` is the only
code in jaxtp that reads ``parallel.mode``.

- :class:`GSPMDRegion`: the model runs in the global view under ``jax.jit`` and XLA's partitioner
  inserts the tensor-parallel collectives from the sharding constraints. Only the *token axes*
  of size > 1 (the batch axes, ``context``, ``expert`` under EP) become manual, in a
  ``jax.shard_map``, when a step needs each device's local loss: gradient accumulation with one
  sync per step, ring attention, a pipeline schedule.
- :class:`ExplicitRegion`: every mesh axis is manual and the Megatron operators of
  :mod:`jaxtp.parallel.collectives` are written out (:class:`~jaxtp.parallel.execution.ExplicitOps`); the TP axis is
  the one the parameter table splits heads over.

Both give the same loss, gradients and collective census (tested).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
from flax import nnx

from jaxtp.configs import CONTEXT, MODEL, token_axes
from jaxtp.parallel import ExplicitOps, GSPMDOps, gather_params, restrict
from jaxtp.step.layout import Layout, is_spec


@dataclass(frozen=True, eq=False)
class Region:
    """What both modes share; subclasses decide the manual axes and the operators."""

    layout: Layout

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The manual axes whose devices hold different tokens: the per-device loss is summed over
        them and the gradients of parameters replicated over them are synced once per step."""
        raise NotImplementedError

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The manual axes over which a parameter is replicated but sees different data."""
        return self.token_axes

    @property
    def global_view(self) -> bool:
        """Whether a forward pass can run without any manual axis (no per-device region)."""
        return False

    def manual_axes(self, *extra: str) -> tuple[str, ...]:
        """The axes a per-device region over the token axes (and ``extra``) makes manual."""
        raise NotImplementedError

    def ops(self, *, manual: bool):
        """The boundary operators of :mod:`jaxtp.parallel.execution` for code inside (``manual``) or
        outside a per-device region."""
        raise NotImplementedError

    @property
    def n_token_ranks(self) -> int:
        """Devices holding different tokens: each adds ``1/n`` of a replicated (global) term,
        e.g. an MoE router loss, to its local loss."""
        return math.prod(self.layout.degrees[a] for a in self.token_axes)

    def specs_in(self, specs, manual: tuple[str, ...]):
        """``shard_map`` specs of ``specs`` (a pytree of PartitionSpecs) naming only ``manual``."""
        return jax.tree.map(lambda s: restrict(s, manual), specs, is_leaf=is_spec)

    def per_device(self, fn: Callable, *, out_specs, extra: tuple[str, ...] = (),
                   with_batch: bool = True) -> Callable:
        """``fn(params, batch)`` per device, manual over :meth:`manual_axes` (``extra`` too);
        ``batch`` is first :meth:`~jaxtp.step.layout.Layout.prepare` d. ``out_specs`` are full specs,
        restricted here. With no manual axis ``fn`` runs in the global view."""
        lo = self.layout
        manual = self.manual_axes(*extra)
        if not manual:
            return lambda params, batch: fn(params, lo.prepare(batch))
        batch_spec = restrict(lo.batch_spec, manual)
        mapped = jax.shard_map(
            fn, mesh=lo.mesh, in_specs=(self.specs_in(lo.param_specs, manual), batch_spec),
            out_specs=self.specs_in(out_specs, manual), axis_names=frozenset(manual))
        return lambda params, batch: mapped(params, lo.prepare(batch))

    def gather_outer(self, params: nnx.State) -> nnx.State:
        """ZeRO-3 inside a per-device region: gather the embedding, final norm and head (the
        parameters outside the layer scan) before use; their gradients reduce-scatter back."""
        if not self.layout.zero.params:
            return params
        return gather_params(params, self.layout.outer_specs)


@dataclass(frozen=True, eq=False)
class GSPMDRegion(Region):
    @property
    def token_axes(self) -> tuple[str, ...]:
        return token_axes(self.layout.degrees, split_only=True)

    @property
    def global_view(self) -> bool:
        # ring attention is written per device, so `context` is manual whenever it is split
        return self.layout.degrees[CONTEXT] == 1

    def manual_axes(self, *extra: str) -> tuple[str, ...]:
        return self.token_axes + tuple(a for a in extra if a not in self.token_axes)

    def ops(self, *, manual: bool):
        lo = self.layout
        cp = dict(context=lo.degrees[CONTEXT], context_layout=lo.cfg.parallel.context_layout)
        if manual:  # token axes manual inside the region; `model` left to the partitioner
            return GSPMDOps(lo.mesh, lo.activation_rules.without(*self.token_axes),
                            lo.layer_specs, manual_zero=True, **cp)
        return GSPMDOps(lo.mesh, lo.activation_rules, lo.layer_specs, **cp)


@dataclass(frozen=True, eq=False)
class ExplicitRegion(Region):
    @property
    def token_axes(self) -> tuple[str, ...]:
        return token_axes(self.layout.degrees, split_only=False)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        # with SP, norm scales see only their sequence shard (Korthikanti et al. sec. 4.2.2)
        if self.layout.cfg.parallel.sequence_parallel:
            return self.token_axes + (self.tp_axis,)
        return self.token_axes

    @property
    def tp_axis(self) -> str:
        axis = self.layout.param_rules["heads"]
        return axis if isinstance(axis, str) else MODEL

    def manual_axes(self, *extra: str) -> tuple[str, ...]:
        return tuple(self.layout.mesh.axis_names)

    def ops(self, *, manual: bool = True):
        lo = self.layout
        return ExplicitOps(lo.layer_specs, sequence_parallel=lo.cfg.parallel.sequence_parallel,
                           context=lo.degrees[CONTEXT],
                           context_layout=lo.cfg.parallel.context_layout, tp_axis=self.tp_axis)


def region_for(layout: Layout) -> Region:
    """The Region of ``layout``'s execution mode: the one place ``parallel.mode`` is read."""
    mode = layout.cfg.parallel.mode
    if mode == "explicit":
        return ExplicitRegion(layout)
    if mode == "gspmd":
        return GSPMDRegion(layout)
    raise ValueError(f"parallel.mode={mode!r}: choose gspmd or explicit")
