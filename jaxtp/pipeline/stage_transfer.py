"""How a stage's output travels to the next pipeline rank: one ``ppermute`` over the pipeline
axis, optionally of each tensor-parallel rank's ``1/n`` slice only (Narayanan et al. 2021, sec. 4.1,
"scatter/gather": the activations are replicated over the ``model`` axis, so each rank sends its
slice over the slow pipeline link and the receiver all-gathers them over the fast one)."""

from __future__ import annotations

from collections.abc import Callable

import jax


def all_gather_invariant(x, axis: str, dim: int):
    """All-gather whose result is typed replicated (invariant) over ``axis``, as its input was
    before it was sliced. Public in newer JAX; jax 0.10 has it only internally."""
    gather = getattr(jax.lax, "all_gather_invariant", None)
    if gather is None:
        from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axis, axis=dim, tiled=True)


def sender(axis: str, split: tuple[str, int] | None) -> Callable:
    """``send(x, perm)``: ``ppermute`` over ``axis``, of ``1/n`` slices when ``split`` is set."""
    if split is None:
        return lambda x, perm: jax.lax.ppermute(x, axis, perm)
    name, dim = split
    mesh = jax.sharding.get_abstract_mesh()
    if name in mesh.manual_axes:
        n = jax.lax.axis_size(name)

        def send(x, perm):
            size = x.shape[dim] // n
            part = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(name) * size, size, dim)
            return all_gather_invariant(jax.lax.ppermute(part, axis, perm), name, dim)
        return send

    def spec(*entries):
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))

    def send(x, perm):  # GSPMD: a nested manual region over `name` sends each device's shard
        sliced = jax.sharding.PartitionSpec(*[None] * dim, name)
        moved = jax.shard_map(lambda part: jax.lax.ppermute(part, axis, perm), mesh=mesh,
                              in_specs=sliced, out_specs=sliced, axis_names=frozenset({name}))
        # replicated on both sides, or the propagation pulls the sliced layout into the stages
        x = jax.lax.with_sharding_constraint(x, spec())
        return jax.lax.with_sharding_constraint(moved(x), spec())
    return send
