"""From a config to sharded parameters and a jitted loss-and-gradient function, in either mode.

The one-way flow of STYLE.md: validated config -> mesh -> parameter and activation tables ->
abstract model (``nnx.eval_shape``, nothing allocated) -> sharded init under the mesh -> the loss
function, written once and run either by GSPMD (``jax.jit`` + constraints) or per-device under
``jax.shard_map`` with the Megatron operators. :func:`abstract_inputs` gives ShapeDtypeStructs so a
step for a mesh far larger than the machine can be compiled without allocating anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtp import collectives
from jaxtp.config import Config, validate_model
from jaxtp.execution import ExplicitOps, GSPMDOps, LocalOps
from jaxtp.mesh import BATCH_AXES, build_mesh, validate
from jaxtp.model import Transformer
from jaxtp.sharding import Rules, activation_rules, batch_spec, named, param_rules, param_specs

Batch = dict[str, jax.Array]  # {"inputs": [B,S] int32, "targets": [B,S] int32}


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def token_losses(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, ops, *,
                 remat: str) -> jax.Array:
    """Per-token next-token cross-entropy ``[B,S]`` of the model ``(graphdef, params)``."""
    model = nnx.merge(graphdef, params)
    inputs = batch["inputs"]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    return model.token_losses(inputs, batch["targets"], positions, ops, remat=remat)


@dataclass(frozen=True, eq=False)
class Engine:
    """Everything derived from a config and a device set, computed once."""

    cfg: Config
    mesh: Mesh
    degrees: dict[str, int]
    param_rules: Rules
    activation_rules: Rules
    padded_vocab: int
    graphdef: nnx.GraphDef
    abstract_params: nnx.State  # ShapeDtypeStruct values, no sharding

    @cached_property
    def param_specs(self) -> nnx.State:
        return param_specs(self.abstract_params, self.param_rules)

    @cached_property
    def param_shardings(self) -> nnx.State:
        return named(self.mesh, self.param_specs)

    @property
    def batch_spec(self) -> PartitionSpec:
        return batch_spec(self.activation_rules)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.batch_spec)

    def init_params(self, seed: int | None = None) -> nnx.State:
        """Parameters created directly in their shardings (never materialised on one device)."""
        seed = self.cfg.train.seed if seed is None else seed

        def init():
            model = Transformer(self.cfg.model, padded_vocab=self.padded_vocab,
                                rngs=nnx.Rngs(seed))
            return nnx.state(model)

        return jax.jit(init, out_shardings=self.param_shardings)()

    def shard_params(self, params: nnx.State) -> nnx.State:
        """Place existing (e.g. reference) parameters in this engine's shardings."""
        return jax.device_put(params, self.param_shardings)

    def shard_batch(self, batch: Batch) -> Batch:
        return jax.device_put(batch, self.batch_sharding)

    def abstract_inputs(self) -> tuple[nnx.State, Batch]:
        """ShapeDtypeStructs with shardings for (params, batch): compile without allocating."""
        params = jax.tree.map(
            lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
            self.abstract_params, self.param_shardings, is_leaf=_is_variable)
        t = self.cfg.train
        tok = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32,
                                   sharding=self.batch_sharding)
        return params, {"inputs": tok, "targets": tok}

    # --------------------------------------------------------------------------------------
    def loss_fn(self) -> Callable[[nnx.State, Batch], jax.Array]:
        """Mean next-token loss over the global batch, in the configured execution mode."""
        cfg, graphdef = self.cfg, self.graphdef
        remat = cfg.parallel.remat

        if cfg.parallel.mode == "gspmd":
            ops = GSPMDOps(self.mesh, self.activation_rules)
            return lambda params, batch: jnp.mean(
                token_losses(graphdef, params, batch, ops, remat=remat))

        n_tokens = cfg.train.batch_size * cfg.train.seq_len

        def local_loss(params, batch):
            params = collectives.data_parallel_params(params, BATCH_AXES)
            per_token = token_losses(graphdef, params, batch, ExplicitOps(), remat=remat)
            return jax.lax.psum(jnp.sum(per_token), BATCH_AXES) / n_tokens

        return jax.shard_map(local_loss, mesh=self.mesh,
                             in_specs=(self.param_specs, self.batch_spec),
                             out_specs=PartitionSpec())

    def value_and_grad_fn(self):
        """``(params, batch) -> (loss, grads)``, accumulated over ``train.microbatches``.

        With one micro-batch this is ``jax.value_and_grad(loss_fn())``. With m > 1 each device
        splits its rows into m micro-batches, accumulates *local* gradients over them in a scan,
        and the data-parallel all-reduce runs once per step after the scan (never once per
        micro-batch): the batch axes are manual (``shard_map``), the ``model`` axis is manual too in
        explicit mode and left to GSPMD otherwise.
        """
        m = self.cfg.train.microbatches
        if m == 1:
            return jax.value_and_grad(self.loss_fn())
        cfg, graphdef = self.cfg, self.graphdef
        n_tokens = cfg.train.batch_size * cfg.train.seq_len
        explicit = cfg.parallel.mode == "explicit"
        if explicit:
            ops, manual = ExplicitOps(), None
        else:  # the batch axes are manual inside the region; `model` stays with GSPMD
            ops = GSPMDOps(self.mesh, self.activation_rules.replicating("batch"))
            manual = frozenset(BATCH_AXES)

        def micro_loss(params, micro):
            losses = token_losses(graphdef, params, micro, ops, remat=cfg.parallel.remat)
            return jnp.sum(losses) / n_tokens

        def local(params, batch):
            params = collectives.data_parallel_params(params, BATCH_AXES)
            # local row r*m + k goes to micro-batch k: a reshape, no data movement
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1), batch)

            def body(acc, mb):
                loss, grads = jax.value_and_grad(micro_loss)(params, mb)
                return jax.tree.map(jnp.add, acc, (loss, grads)), None

            zero_loss = jax.lax.pcast(jnp.zeros((), jnp.float32), BATCH_AXES, to="varying")
            zero = (zero_loss, jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(body, zero, micro)
            return jax.lax.psum((loss, grads), BATCH_AXES)  # the one gradient sync per step

        if explicit:
            specs = (self.param_specs, self.batch_spec)
            return jax.shard_map(local, mesh=self.mesh, in_specs=specs,
                                 out_specs=(PartitionSpec(), self.param_specs))
        return jax.shard_map(local, mesh=self.mesh, in_specs=(PartitionSpec(), self.batch_spec),
                             out_specs=(PartitionSpec(), PartitionSpec()), axis_names=manual)

    def loss_and_grad(self, *, donate: bool = False):
        """``jit``-ed ``(params, batch) -> (loss, grads)`` with grads sharded like params."""
        return jax.jit(
            self.value_and_grad_fn(),
            in_shardings=(self.param_shardings, self.batch_sharding),
            out_shardings=(NamedSharding(self.mesh, PartitionSpec()), self.param_shardings),
            donate_argnums=(0,) if donate else ())

    def loss(self):
        return jax.jit(self.loss_fn(), in_shardings=(self.param_shardings, self.batch_sharding),
                       out_shardings=NamedSharding(self.mesh, PartitionSpec()))


def build(cfg: Config, devices=None) -> Engine:
    """Validate ``cfg`` against the devices and derive the mesh, tables and abstract model."""
    validate_model(cfg.model)
    mesh = build_mesh(cfg.parallel, devices)
    degrees = {a: int(s) for a, s in mesh.shape.items()}
    validate(cfg.model, cfg.parallel, cfg.train, degrees)
    padded_vocab = cfg.model.padded_vocab_size(degrees["model"])
    abstract = nnx.eval_shape(
        lambda: Transformer(cfg.model, padded_vocab=padded_vocab, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return Engine(cfg=cfg, mesh=mesh, degrees=degrees, param_rules=param_rules(cfg.parallel),
                  activation_rules=activation_rules(cfg.parallel), padded_vocab=padded_vocab,
                  graphdef=graphdef, abstract_params=state)


def reference_loss_fn(cfg: Config, padded_vocab: int | None = None):
    """The single-device reference: the same model with no mesh and no collectives."""
    padded_vocab = padded_vocab or cfg.model.padded_vocab_size(1)
    abstract = nnx.eval_shape(
        lambda: Transformer(cfg.model, padded_vocab=padded_vocab, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)

    def loss(params, batch):
        return jnp.mean(token_losses(graphdef, params, batch, LocalOps(),
                                     remat=cfg.parallel.remat))
    return loss


def reference_params(cfg: Config, seed: int | None = None,
                     padded_vocab: int | None = None) -> nnx.State:
    seed = cfg.train.seed if seed is None else seed
    padded_vocab = padded_vocab or cfg.model.padded_vocab_size(1)
    return nnx.state(Transformer(cfg.model, padded_vocab=padded_vocab, rngs=nnx.Rngs(seed)))
