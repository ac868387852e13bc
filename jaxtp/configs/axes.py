"""Mesh axis names and the named groups of them that the rest of jaxtp reasons with.

The six axes run outermost (slowest links) to innermost (fastest links), so Megatron's per-layer
all-reduces over ``model`` stay on NVLink / ICI (Narayanan et al. 2021, sec. 3). Derived groups
are named once here, as torchtitan names its derived meshes (``dp_cp``, ``dp_shard``): the
*batch* axes split the batch, the *token* axes hold different tokens of the global batch (the
loss is summed and replicated gradients are synced over them), the *ZeRO* axes shard training
state. Every other module takes these names from here.
"""

from __future__ import annotations

from collections.abc import Mapping

PIPELINE, DATA, FSDP = "pipeline", "data", "fsdp"
CONTEXT, EXPERT, MODEL = "context", "expert", "model"

AXES: tuple[str, ...] = (PIPELINE, DATA, FSDP, CONTEXT, EXPERT, MODEL)
# the axes that split the batch of a dense layer (EP adds `expert`, see token_axes)
BATCH_AXES: tuple[str, ...] = (DATA, FSDP)
# the axes that shard parameters, gradients and moments (fsdp-major: shards nest)
ZERO_AXES: tuple[str, ...] = (FSDP, DATA)
# the tensor-parallel axis of the Megatron operators
TP_AXIS = MODEL


def token_axes(degrees: Mapping[str, int], *, split_only: bool) -> tuple[str, ...]:
    """The axes whose devices hold different tokens of the global batch: the batch axes,
    ``context`` (sequence chunks) and, under expert parallelism, ``expert`` (expert ranks are
    data ranks for attention and the dense layers). ``split_only``: only those of size > 1."""
    axes = BATCH_AXES + (CONTEXT,) + ((EXPERT,) if degrees[EXPERT] > 1 else ())
    return tuple(a for a in axes if degrees[a] > 1) if split_only else axes


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (``None``, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec) -> frozenset[str]:
    """Every mesh axis a PartitionSpec names."""
    return frozenset(a for e in spec for a in entry_axes(e))
