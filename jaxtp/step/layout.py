"""Layout: where every byte of one model lives on one mesh.

The data half of a training setup, computed once from a validated config and a device set: the
mesh and its degrees, the parameter and activation tables of :mod:`jaxtp.parallel.sharding`, the abstract
model (``nnx.eval_shape``: shapes and logical names, nothing allocated), and from them the
PartitionSpecs and shardings of the parameters, gradients, optimizer moments (ZeRO, Rajbhandari et
al. 2019) and token batches, plus the order of the stacked layers under interleaved pipelines
(:mod:`jaxtp.pipeline.layer_order`). A Layout holds no functions of the execution mode: the
:mod:`jaxtp.step.region` of the mode reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtp.configs import CONTEXT, PIPELINE, Config, validate_model
from jaxtp.layers import Transformer
from jaxtp.parallel import (
    Rules,
    ZeroLayout,
    activation_rules,
    batch_spec,
    build_mesh,
    mesh_shape,
    named,
    param_rules,
    param_specs,
    positions_for_layout,
    to_layout,
    validate,
    zero_layout,
    zero_specs,
)
from jaxtp.pipeline import to_natural_order, to_pipeline_order

Batch = dict[str, jax.Array]  # {"inputs": [B,S] int32, "targets": [B,S] int32}


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def abstract_model(cfg: Config, padded_vocab: int) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its parameters as ShapeDtypeStructs (nothing allocated)."""
    abstract = nnx.eval_shape(
        lambda: Transformer(cfg.model, padded_vocab=padded_vocab, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


@dataclass(frozen=True, eq=False)
class Layout:
    """The mesh, the tables and every spec and sharding derived from them, for one config."""

    cfg: Config
    mesh: Mesh
    degrees: dict[str, int]
    param_rules: Rules
    activation_rules: Rules
    padded_vocab: int
    graphdef: nnx.GraphDef
    abstract_params: nnx.State  # ShapeDtypeStruct values, no sharding

    @property
    def moe(self) -> bool:
        """Whether the model has Mixture-of-Experts layers (``model.n_experts > 0``)."""
        return self.cfg.model.n_experts > 0

    @cached_property
    def zero(self) -> ZeroLayout:
        return zero_layout(self.cfg.parallel, self.degrees)

    @cached_property
    def tp_specs(self) -> nnx.State:
        """Parameter specs from the tensor-parallel table alone (a ZeRO-3 shard, gathered)."""
        return param_specs(self.abstract_params, self.param_rules)

    @cached_property
    def param_specs(self) -> nnx.State:
        return zero_specs(self.abstract_params, self.tp_specs, self.zero.params, self.zero)

    @cached_property
    def grad_specs(self) -> nnx.State:
        return zero_specs(self.abstract_params, self.tp_specs, self.zero.grads, self.zero)

    @cached_property
    def moment_specs(self) -> nnx.State:
        """Adam moments (and any other per-parameter optimizer state)."""
        return zero_specs(self.abstract_params, self.tp_specs, self.zero.moments, self.zero)

    @cached_property
    def param_shardings(self) -> nnx.State:
        return named(self.mesh, self.param_specs)

    @cached_property
    def grad_shardings(self) -> nnx.State:
        return named(self.mesh, self.grad_specs)

    @cached_property
    def moment_shardings(self) -> nnx.State:
        return named(self.mesh, self.moment_specs)

    @cached_property
    def layer_specs(self) -> nnx.State | None:
        """One layer's parameter specs (the ``layers`` dim dropped) when ZeRO-3 shards them."""
        if not self.zero.params:
            return None
        return jax.tree.map(lambda s: PartitionSpec(*tuple(s)[1:]), self.param_specs["blocks"],
                            is_leaf=is_spec)

    @cached_property
    def outer_specs(self) -> nnx.State:
        """The parameter specs with the scanned layers' entries replicated: what ZeRO-3 gathers
        before the layer scan (the embedding, final norm and head)."""
        def one(v, s):
            return PartitionSpec() if "layers" in v.get_metadata()["names"] else s
        return jax.tree.map(one, self.abstract_params, self.param_specs, is_leaf=is_variable)

    @property
    def batch_spec(self) -> PartitionSpec:
        return batch_spec(self.activation_rules)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch_spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    # ---- parameters ---------------------------------------------------------------------------
    def init_params(self, seed: int | None = None) -> nnx.State:
        """Parameters created directly in their shardings (never materialised on one device).
        The same on every layout: the model is drawn at its own vocabulary and the rows (or
        columns) a tensor-parallel degree pads the vocabulary with are zeros, as a restore onto
        another degree pads them (issue 37: drawing the padded table made ``model=4``'s run
        start from other weights than one device's)."""
        seed = self.cfg.train.seed if seed is None else seed

        def pad(x, like):
            return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, like.shape)])

        def init():
            model = Transformer(self.cfg.model, padded_vocab=self.cfg.model.vocab_size,
                                rngs=nnx.Rngs(seed))
            state = jax.tree.map(pad, nnx.state(model), self.abstract_params)
            return self.to_pipeline_order(state)

        return jax.jit(init, out_shardings=self.param_shardings)()

    def shard_params(self, params: nnx.State) -> nnx.State:
        """Place existing (e.g. reference) parameters, in natural layer order, in this layout's
        shardings (and layer order: :meth:`natural_layers`)."""
        if self.cfg.parallel.virtual_stages == 1:
            return jax.device_put(params, self.param_shardings)
        return jax.jit(self.to_pipeline_order, out_shardings=self.param_shardings)(params)

    @property
    def layer_units(self) -> int:
        """Length of the stacked ``layers`` dim: layers, or MoE groups."""
        m = self.cfg.model
        return m.n_layers // m.moe_every if m.n_experts else m.n_layers

    def to_pipeline_order(self, tree):
        """Natural layer order -> this layout's (rank-major under interleaved pipelines)."""
        return to_pipeline_order(tree, self.degrees[PIPELINE],
                                             self.cfg.parallel.virtual_stages, self.layer_units)

    def natural_layers(self, tree, *, inverse: bool = False):
        """A parameter-, gradient- or train-state-shaped ``tree`` of this layout with its stacked
        layers in natural order (layer ``i`` at index ``i``), shardings kept; ``inverse``: back to
        this layout's order. The identity except for interleaved pipelines."""
        if self.cfg.parallel.virtual_stages == 1:
            return tree
        p, v, units = self.degrees[PIPELINE], self.cfg.parallel.virtual_stages, self.layer_units
        move = to_pipeline_order if inverse else to_natural_order
        shardings = jax.tree.map(lambda a: a.sharding, tree)
        return jax.jit(lambda t: move(t, p, v, units), out_shardings=shardings)(tree)

    # ---- batches ------------------------------------------------------------------------------
    def shard_batch(self, batch: Batch) -> Batch:
        return jax.device_put(batch, self.batch_sharding)

    def abstract_params_sharded(self) -> nnx.State:
        """The parameters as ShapeDtypeStructs carrying their shardings."""
        return jax.tree.map(
            lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
            self.abstract_params, self.param_shardings, is_leaf=is_variable)

    def abstract_batch(self) -> Batch:
        t = self.cfg.train
        tok = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32,
                                   sharding=self.batch_sharding)
        return {"inputs": tok, "targets": tok}

    def prepare(self, batch: Batch) -> Batch:
        """Global-view batch -> what the model consumes: every ``[B,S]`` entry in the ``context``
        layout order, and the positions for RoPE (the batch's own -- a packed batch's positions
        within each document -- or else the global ones). The per-token loss is a (masked)
        mean, so the order is free. The permutation moves only int32 ids (XLA gathers them
        over ``context``, b x s x 4 bytes per entry once per step); the activations are born
        in the layout."""
        inputs = batch["inputs"]
        cp = self.degrees[CONTEXT]
        order = self.cfg.parallel.context_layout
        if cp > 1:
            batch = {k: to_layout(v, cp, order) for k, v in batch.items()}
        if "positions" in batch:
            return batch
        positions = (jnp.arange(inputs.shape[1], dtype=jnp.int32) if cp == 1 else
                     positions_for_layout(inputs.shape[1], cp, order))
        positions = jnp.broadcast_to(positions, inputs.shape)
        return {**batch, "positions": jax.lax.with_sharding_constraint(positions,
                                                                        self.batch_sharding)}


def build_layout(cfg: Config, devices=None, *, training: bool = True) -> Layout:
    """Validate ``cfg`` against the devices and derive the mesh, tables and abstract model
    (``training=False``: without the ``train.*`` batch rules, :func:`jaxtp.parallel.validation.validate`)."""
    validate_model(cfg.model)  # the model's own rules before the mesh's
    mesh = build_mesh(cfg.parallel, devices)
    degrees = mesh_shape(mesh)
    validate(cfg, degrees, platform=mesh.devices.flat[0].platform, training=training)
    padded_vocab = cfg.model.padded_vocab_size(degrees["model"])
    graphdef, state = abstract_model(cfg, padded_vocab)
    return Layout(cfg=cfg, mesh=mesh, degrees=degrees, param_rules=param_rules(cfg.parallel),
                  activation_rules=activation_rules(cfg.parallel, degrees),
                  padded_vocab=padded_vocab, graphdef=graphdef, abstract_params=state)
