"""Logical axis names -> mesh axes: one table for parameters, one for activations.

The model speaks logical names only (``batch batch_no_expert seq residual_seq embed heads kv_heads
head_dim mlp vocab experts layers``); these tables are the one place that says which mesh axis
splits each name, and this module is the only one that writes ``PartitionSpec``s. Tables are plain
data passed explicitly (no thread-local rules), as MaxText's logical axis rules and Levanter's
parameter / compute mappings are.
The Megatron layout (Shoeybi et al. 2019, sec. 3): attention heads and the MLP hidden dim are split
over ``model`` (column-parallel in, row-parallel out) and so is the vocabulary (vocab-parallel
embedding and loss); everything else is replicated over ``model``. Expert parallelism (GShard,
Lepikhin et al. 2020, sec. 3): the ``experts`` dim of the MoE weights is split over ``expert``,
and the expert ranks are data ranks for everything else (``batch`` is split over them too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtp.configs import BATCH_AXES, ZERO_AXES, ParallelConfig, entry_axes

MeshAxes = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Rules:
    """A logical-name -> mesh-axes table. Names missing from the table are replicated."""

    table: tuple[tuple[str, MeshAxes], ...]

    def __getitem__(self, name: str | None) -> MeshAxes:
        return dict(self.table).get(name) if name is not None else None

    def spec(self, names: Sequence[str | None]) -> PartitionSpec:
        return PartitionSpec(*(self[n] for n in names))

    def without(self, *axes: str) -> Rules:
        """This table with the mesh ``axes`` removed from every entry (e.g. inside a region where
        the batch axes and ``context`` are manual, so a constraint must not name them)."""
        def drop(v: MeshAxes) -> MeshAxes:
            kept = tuple(a for a in entry_axes(v) if a not in axes)
            return None if not kept else kept[0] if len(kept) == 1 else kept
        return Rules(tuple((k, drop(v)) for k, v in self.table))


def _rules(mapping: Mapping[str, MeshAxes]) -> Rules:
    return Rules(tuple(mapping.items()))


def param_rules(parallel: ParallelConfig) -> Rules:
    """Where each parameter dim lives: Megatron TP over ``model``; under pipeline parallelism the
    stacked ``layers`` dim over ``pipeline`` (each rank holds its stages' layers); replicated
    elsewhere. ZeRO and FSDP add their axes in :func:`zero_specs`."""
    return _rules({
        "vocab": "model",
        "heads": "model",
        "kv_heads": "model",
        "mlp": "model",
        "embed": None,
        "head_dim": None,
        "layers": "pipeline" if parallel.pipeline != 1 else None,
        "experts": "expert",
    })


def activation_rules(parallel: ParallelConfig,
                     degrees: Mapping[str, int] | None = None) -> Rules:
    """Where each activation dim lives: batch over the data axes, head / mlp / vocab over model.

    Two names for the sequence dim: ``seq`` inside attention and the MLP, split over ``context``
    under context parallelism; ``residual_seq`` in the residual stream (block boundaries, norms,
    the embedding output), additionally split over ``model`` under Megatron sequence parallelism
    (Korthikanti et al. 2022, sec. 4.2.2) -- the region plain TP leaves replicated.

    Under expert parallelism ``batch`` is split over ``expert`` as well; the MoE layer's
    dispatched tokens ``[experts, groups, capacity, embed]`` put ``experts`` on ``expert``, so
    their groups dim, ``batch_no_expert``, keeps only the data axes. ``degrees`` (the resolved
    mesh shape) decides when ``parallel.expert`` is -1 (inferred); without it an inferred degree
    counts as split (a size-1 axis in a spec is harmless).
    """
    seq = "context" if parallel.context != 1 else None
    residual = seq
    if parallel.sequence_parallel:
        residual = ("context", "model") if seq else "model"
    expert = degrees["expert"] if degrees is not None else parallel.expert
    return _rules({
        "batch": BATCH_AXES + ("expert",) if expert != 1 else BATCH_AXES,
        "batch_no_expert": BATCH_AXES,
        "experts": "expert",
        "seq": seq,
        "residual_seq": residual,
        "embed": None,
        "heads": "model",
        "kv_heads": "model",
        "head_dim": None,
        "mlp": "model",
        "vocab": "model",
    })


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_specs(state: nnx.State, rules: Rules) -> nnx.State:
    """A State of PartitionSpecs (one per parameter) from the parameters' logical names."""
    def spec(v):
        names = v.get_metadata().get("names")
        if names is None or len(names) != len(v.shape):
            raise ValueError(f"parameter of shape {v.shape} has logical names {names!r}; every "
                             f"parameter needs one name per dim")
        return rules.spec(names)
    return jax.tree.map(spec, state, is_leaf=_is_variable)


def named(mesh: Mesh, specs):
    """PartitionSpecs -> NamedShardings on ``mesh`` (any pytree)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_spec(rules: Rules) -> PartitionSpec:
    """Token batches ``[batch, seq]``."""
    return rules.spec(("batch", "seq"))


def constrain(x: jax.Array, names: Sequence[str | None], *, mesh: Mesh, rules: Rules) -> jax.Array:
    """``with_sharding_constraint`` by logical names: the GSPMD block-boundary annotation.

    Inside a partially manual ``shard_map`` (e.g. manual batch axes for gradient accumulation) the
    constraint must be stated on the context's abstract mesh, whose manual axes it cannot name.
    """
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        mesh = context
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(names)))


# ---------------------------------------------------------------------------------------------
# ZeRO (Rajbhandari et al. 2019) as shardings. The `fsdp` axis always shards parameters, gradients
# and moments (ZeRO-3 inside a group); `parallel.zero_stage` says how much of the state the `data`
# axis shards as well: 1 the Adam moments, 2 also the gradients, 3 also the parameters. With
# fsdp > 1 and data > 1 at stage < 3 this is hybrid sharding: shard inside a group, replicate across.
# Sharded axes run fsdp-major, so every state's spec extends the parameter's (a parameter shard over
# `fsdp` reduce-scatters over `data` into exactly the moment shard).


@dataclass(frozen=True)
class ZeroLayout:
    """The mesh axes (size > 1 only) that shard each kind of training state."""

    params: tuple[str, ...]
    grads: tuple[str, ...]
    moments: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]

    def size(self, axes: Sequence[str]) -> int:
        return math.prod(dict(self.sizes)[a] for a in axes)


def zero_layout(parallel: ParallelConfig, degrees: Mapping[str, int]) -> ZeroLayout:
    stage = parallel.zero_stage
    fsdp = ("fsdp",) if degrees["fsdp"] > 1 else ()
    data = ("data",) if degrees["data"] > 1 else ()
    return ZeroLayout(params=fsdp + (data if stage >= 3 else ()),
                      grads=fsdp + (data if stage >= 2 else ()),
                      moments=fsdp + (data if stage >= 1 else ()),
                      sizes=tuple((a, int(degrees[a])) for a in ZERO_AXES))


def zero_dim(names: Sequence[str | None], shape: Sequence[int], spec: PartitionSpec,
             n: int) -> int | None:
    """The dim ZeRO splits ``n`` ways: ``embed`` if it divides, else the largest dim that is not
    already sharded, not ``layers`` (each layer is gathered inside the scan) and divisible by ``n``.
    ``None``: nothing divides, the tensor stays replicated (the placement report shows it)."""
    if n == 1:
        return None
    free = [i for i, (name, size) in enumerate(zip(names, shape))
            if name != "layers" and not entry_axes(spec[i] if i < len(spec) else None)
            and size % n == 0]
    for i in free:
        if names[i] == "embed":
            return i
    return max(free, key=lambda i: shape[i], default=None)


def zero_specs(state: nnx.State, tp_specs: nnx.State, axes: Sequence[str],
               layout: ZeroLayout) -> nnx.State:
    """Per-parameter specs with the ZeRO ``axes`` added to the tensor-parallel ``tp_specs``.

    The dim is chosen once per tensor for the widest split (the moments'), so the parameter,
    gradient and moment shards of a tensor always nest.
    """
    widest = layout.size(layout.moments)

    def one(v, spec):
        names = v.get_metadata()["names"]
        dims = list(spec) + [None] * (len(v.shape) - len(spec))
        i = zero_dim(names, v.shape, PartitionSpec(*dims), widest)
        if i is not None and axes:
            dims[i] = tuple(axes) if len(axes) > 1 else axes[0]
        return PartitionSpec(*dims)
    return jax.tree.map(one, state, tp_specs, is_leaf=_is_variable)


def zero_axes_of(spec: PartitionSpec) -> tuple[int | None, tuple[str, ...]]:
    """(dim, axes) of the ZeRO axes in ``spec``; ``(None, ())`` when it has none."""
    for i, entry in enumerate(spec):
        axes = tuple(a for a in entry_axes(entry) if a in ZERO_AXES)
        if axes:
            return i, axes
    return None, ()


def restrict(spec: PartitionSpec, keep: Sequence[str]) -> PartitionSpec:
    """``spec`` naming only the mesh axes in ``keep`` (a ``shard_map`` spec over those axes)."""
    return without_axes(spec, [a for e in spec for a in entry_axes(e) if a not in keep])


def without_axes(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
    """``spec`` with ``axes`` removed: the gathered layout of a ZeRO-3 shard."""
    def drop(entry):
        kept = tuple(a for a in entry_axes(entry) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return PartitionSpec(*(drop(e) for e in spec))
