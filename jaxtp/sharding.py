"""Logical axis names -> mesh axes: one table for parameters, one for activations.

The model speaks logical names only (``batch seq embed heads kv_heads head_dim mlp vocab experts
layers``); these tables are the one place that says which mesh axis splits each name, and this module
is the only one that writes ``PartitionSpec``s. Tables are plain data passed explicitly (no
thread-local rules), as MaxText's logical axis rules and Levanter's parameter / compute mappings are.
The Megatron layout (Shoeybi et al. 2019, sec. 3): attention heads and the MLP hidden dim are split
over ``model`` (column-parallel in, row-parallel out) and so is the vocabulary (vocab-parallel
embedding and loss); everything else is replicated over ``model``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtp.config import ParallelConfig
from jaxtp.mesh import BATCH_AXES

MeshAxes = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Rules:
    """A logical-name -> mesh-axes table. Names missing from the table are replicated."""

    table: tuple[tuple[str, MeshAxes], ...]

    def __getitem__(self, name: str | None) -> MeshAxes:
        return dict(self.table).get(name) if name is not None else None

    def spec(self, names: Sequence[str | None]) -> PartitionSpec:
        return PartitionSpec(*(self[n] for n in names))

    def replicating(self, *names: str) -> Rules:
        """This table with ``names`` mapped to no mesh axis (e.g. ``batch`` inside a region where
        the batch axes are manual, so a constraint must not name them)."""
        return Rules(tuple((k, None if k in names else v) for k, v in self.table))


def _rules(mapping: Mapping[str, MeshAxes]) -> Rules:
    return Rules(tuple(mapping.items()))


def param_rules(parallel: ParallelConfig) -> Rules:
    """Where each parameter dim lives: Megatron TP over ``model``, replicated elsewhere."""
    del parallel  # ZeRO-3 / FSDP and pipeline stages will extend this table.
    return _rules({
        "vocab": "model",
        "heads": "model",
        "kv_heads": "model",
        "mlp": "model",
        "embed": None,
        "head_dim": None,
        "layers": None,
    })


def activation_rules(parallel: ParallelConfig) -> Rules:
    """Where each activation dim lives: batch over the data axes, head / mlp / vocab over model."""
    del parallel  # sequence and context parallelism will map ``seq``.
    return _rules({
        "batch": BATCH_AXES,
        "seq": None,
        "embed": None,
        "heads": "model",
        "kv_heads": "model",
        "head_dim": None,
        "mlp": "model",
        "vocab": "model",
    })


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_names(state: nnx.State) -> nnx.State:
    """The ``names`` metadata of every parameter, as a State of tuples."""
    return jax.tree.map(lambda v: v.get_metadata()["names"], state, is_leaf=_is_variable)


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
