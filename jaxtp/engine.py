"""From a config to sharded parameters and a jitted loss-and-gradient function, in either mode.

The one-way flow of STYLE.md: validated config -> mesh -> parameter and activation tables ->
abstract model (``nnx.eval_shape``, nothing allocated) -> sharded init under the mesh -> the loss
function, written once and run either by GSPMD (``jax.jit`` + constraints) or per-device under
``jax.shard_map`` with the Megatron operators. :func:`abstract_inputs` gives ShapeDtypeStructs so a
step for a mesh far larger than the machine can be compiled without allocating anything.

Mixture-of-Experts models add their router losses to the training loss: ``loss = LM + sum over MoE
layers of aux_loss``. Each layer's aux is already the global-batch value on every device, so where
each device differentiates its *local* loss (whose sum over the token ranks is the step loss) it
adds ``aux_loss / n_token_ranks``; in the global view it is added once. With micro-batches the aux
is that of each micro-batch, averaged (as Megatron-LM does), not of the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtp import collectives, staging
from jaxtp.config import Config, ConfigError, validate_model
from jaxtp.execution import ExplicitOps, GSPMDOps, LocalOps, gather_params, on_tp_blocks
from jaxtp.layers.ring_attention import positions_for_layout, to_layout
from jaxtp.mesh import BATCH_AXES, build_mesh, validate
from jaxtp.model import Transformer
from jaxtp.sharding import (Rules, ZeroLayout, activation_rules, batch_spec, named, param_rules,
                            param_specs, restrict, zero_axes_of, zero_layout, zero_specs)

Batch = dict[str, jax.Array]  # {"inputs": [B,S] int32, "targets": [B,S] int32}


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _map_specs(fn, specs, *trees):
    """``fn(spec, *leaves)`` over a State of PartitionSpecs and States of Variables like it."""
    return jax.tree.map(fn, specs, *trees, is_leaf=_is_spec)


def _axes_of(spec: PartitionSpec) -> set[str]:
    return {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}


def mark_data_parallel(params: nnx.State, specs: nnx.State,
                       axes: tuple[str, ...] = BATCH_AXES) -> nnx.State:
    """Megatron-style ``f`` over the replica ``axes`` (the batch axes, ``context``, and ``model``
    for the parameters sequence parallelism uses on sequence shards) for every parameter not
    sharded over them: its gradient becomes a local (varying) partial sum that
    :func:`sync_grads` reduces once per step."""
    def one(spec, var):
        rest = tuple(a for a in axes if a not in _axes_of(spec))
        return var.replace(jax.lax.pcast(var[...], rest, to="varying")) if rest else var
    return _map_specs(one, specs, params)


def sync_grads(grads: nnx.State, param_specs: nnx.State, grad_specs: nnx.State,
               axes: tuple[str, ...] = BATCH_AXES) -> nnx.State:
    """The one data-parallel gradient sync per step: all-reduce (ZeRO 0/1), reduce-scatter into
    the gradient shard (ZeRO 2), nothing for ZeRO-3 shards (reduce-scattered by their gather).
    Parameters sharded over a replica axis (e.g. ``model`` for TP weights) skip that axis. A
    reduce-scatter runs on each device's TP block (see :func:`on_tp_blocks`)."""
    def one(pspec, gspec, g):
        held = _axes_of(pspec)
        dim, gaxes = zero_axes_of(gspec)
        scatter = tuple(a for a in gaxes if a not in held)
        replicated = tuple(a for a in axes if a not in held)
        sync = lambda x: collectives.sync_grads(x, replicated, scatter, dim)  # noqa: E731
        return g.replace(on_tp_blocks(sync, g[...], pspec) if scatter else sync(g[...]))
    return _map_specs(one, param_specs, grad_specs, grads)


def token_losses(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, ops, *,
                 remat: str) -> jax.Array:
    """Per-token next-token cross-entropy ``[B,S]`` of the model ``(graphdef, params)``."""
    return token_losses_and_aux(graphdef, params, batch, ops, remat=remat)[0]


def token_losses_and_aux(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, ops, *,
                         remat: str) -> tuple[jax.Array, dict]:
    """``(per-token cross-entropy [B,S], MoE aux)``; the aux is ``{}`` for a dense model."""
    model = nnx.merge(graphdef, params)
    inputs = batch["inputs"]
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    return model.token_losses_and_aux(inputs, batch["targets"], positions, ops, remat=remat)


def moe_metrics(aux: dict, loss: jax.Array) -> dict:
    """What the trainer logs of an MoE step: the total loss split into LM and router parts, the
    router losses, the fraction of token-to-expert assignments dropped at capacity and each
    expert's share of the assignments (``expert_load``, sums to 1; uniform is 1/n_experts)."""
    if not aux:
        return {}
    return {"lm_loss": loss - aux["aux_loss"], **aux}


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
                            is_leaf=_is_spec)

    def _outer_specs(self, specs: nnx.State) -> nnx.State:
        """``specs`` with the scanned layers' entries replicated: what to gather before the scan."""
        def one(v, s):
            return PartitionSpec() if "layers" in v.get_metadata()["names"] else s
        return jax.tree.map(one, self.abstract_params, specs, is_leaf=_is_variable)

    def _gather_outer(self, params: nnx.State) -> nnx.State:
        """ZeRO-3 in a manual region: gather the embedding, final norm and head before use."""
        if not self.zero.params:
            return params
        return gather_params(params, self._outer_specs(self.param_specs))

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
            return self._to_pipeline_order(nnx.state(model))

        return jax.jit(init, out_shardings=self.param_shardings)()

    def shard_params(self, params: nnx.State) -> nnx.State:
        """Place existing (e.g. reference) parameters, in natural layer order, in this engine's
        shardings (and layer order: :meth:`natural_layers`)."""
        if self.cfg.parallel.virtual_stages == 1:
            return jax.device_put(params, self.param_shardings)
        return jax.jit(self._to_pipeline_order, out_shardings=self.param_shardings)(params)

    @property
    def _layer_units(self) -> int:
        """Length of the stacked ``layers`` dim: layers, or MoE groups."""
        m = self.cfg.model
        return m.n_layers // m.moe_every if m.n_experts else m.n_layers

    def _to_pipeline_order(self, tree):
        return staging.to_pipeline_order(tree, self.degrees["pipeline"],
                                         self.cfg.parallel.virtual_stages, self._layer_units)

    def natural_layers(self, tree, *, inverse: bool = False):
        """A parameter-, gradient- or train-state-shaped ``tree`` of this engine with its stacked
        layers in natural order (layer ``i`` at index ``i``), shardings kept; ``inverse``: back to
        this engine's order. The identity except for interleaved pipelines (``virtual_stages >
        1``), whose ranks hold non-contiguous chunks (:mod:`jaxtp.staging`)."""
        if self.cfg.parallel.virtual_stages == 1:
            return tree
        p, v, units = self.degrees["pipeline"], self.cfg.parallel.virtual_stages, self._layer_units
        move = staging.to_pipeline_order if inverse else staging.to_natural_order
        shardings = jax.tree.map(lambda a: a.sharding, tree)
        return jax.jit(lambda t: move(t, p, v, units), out_shardings=shardings)(tree)

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

    def _prepare(self, batch: Batch) -> Batch:
        """Global-view batch -> what the model consumes: tokens in the ``context`` layout order and
        their global positions (for RoPE). The per-token loss is a mean, so the order is free.
        The permutation moves only the int32 token ids (XLA gathers them over ``context``, b x s
        x 4 bytes once per step); the activations are born in the layout."""
        p = self.cfg.parallel
        inputs = batch["inputs"]
        if self.degrees["context"] == 1:
            positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)
        else:
            cp = self.degrees["context"]
            batch = {k: to_layout(v, cp, p.context_layout) for k, v in batch.items()}
            positions = positions_for_layout(inputs.shape[1], cp, p.context_layout)
        positions = jnp.broadcast_to(positions, inputs.shape)
        return {**batch, "positions": jax.lax.with_sharding_constraint(positions,
                                                                        self.batch_sharding)}

    # --------------------------------------------------------------------------------------
    def _ops(self, *, manual_batch: bool):
        p = self.cfg.parallel
        cp = dict(context=self.degrees["context"], context_layout=p.context_layout)
        if p.mode == "explicit":
            return ExplicitOps(self.layer_specs, sequence_parallel=p.sequence_parallel, **cp)
        if manual_batch:  # batch axes and `context` manual inside the region; `model` with GSPMD
            return GSPMDOps(self.mesh, self.activation_rules.without(*self._dp_axes),
                            self.layer_specs, manual_zero=True, **cp)
        return GSPMDOps(self.mesh, self.activation_rules, self.layer_specs, **cp)

    @property
    def _replica_axes(self) -> tuple[str, ...]:
        """The manual axes over which a parameter is replicated but sees different data, so its
        gradient is synced once per step: the token axes, and in explicit mode with SP also
        ``model`` (norm scales see only their sequence shard, Korthikanti et al. sec. 4.2.2)."""
        p = self.cfg.parallel
        if p.mode == "explicit" and p.sequence_parallel:
            return self._dp_axes + ("model",)
        return self._dp_axes

    @property
    def _dp_axes(self) -> tuple[str, ...]:
        """The token axes, manual in the per-device region: the per-device loss is summed over
        them and the gradients of parameters replicated over them are synced. All of the batch
        axes and ``context`` in explicit mode; in GSPMD mode those of size > 1 (none: the region
        is the whole program, no ``shard_map``). Ring attention is written per device, so
        ``context`` is manual whenever it is split."""
        if self.cfg.parallel.mode == "explicit":
            return BATCH_AXES + ("context",) + self._token_expert
        return tuple(a for a in BATCH_AXES + ("context",) + self._token_expert
                     if self.degrees[a] > 1)

    @property
    def _token_expert(self) -> tuple[str, ...]:
        """``("expert",)`` under expert parallelism: expert ranks are data ranks for the dense
        layers and attention (the batch is split over them too), so ``expert`` is a token axis."""
        return ("expert",) if self.degrees["expert"] > 1 else ()

    @property
    def _n_token_ranks(self) -> int:
        """Devices holding different tokens in the per-device region: each adds ``1/n`` of the
        (global, replicated) router loss to its local loss."""
        return math.prod(self.degrees[a] for a in self._dp_axes)

    def _region_specs(self, specs: nnx.State) -> nnx.State:
        """``shard_map`` specs for a state: all axes in explicit mode, the batch axes otherwise."""
        if self.cfg.parallel.mode == "explicit":
            return specs
        return jax.tree.map(lambda s: restrict(s, self._dp_axes), specs, is_leaf=_is_spec)

    def _shard_map(self, fn, *, out_specs, param_out: nnx.State | None = None):
        """``fn(params, batch)`` per device: every axis manual in explicit mode, only the batch
        axes in GSPMD mode (``model`` left to the partitioner)."""
        explicit = self.cfg.parallel.mode == "explicit"
        if not self._dp_axes:
            return lambda params, batch: fn(params, self._prepare(batch))
        out = out_specs if param_out is None else (out_specs, self._region_specs(param_out))
        batch = self.batch_spec if explicit else restrict(self.batch_spec, self._dp_axes)
        mapped = jax.shard_map(
            fn, mesh=self.mesh, in_specs=(self._region_specs(self.param_specs), batch),
            out_specs=out,
            axis_names=frozenset(self.mesh.axis_names if explicit else self._dp_axes))
        return lambda params, batch: mapped(params, self._prepare(batch))

    def loss_fn(self) -> Callable[[nnx.State, Batch], jax.Array]:
        """Mean next-token loss over the global batch (plus the MoE router losses: the training
        loss), in the configured execution mode."""
        cfg, graphdef = self.cfg, self.graphdef
        remat = cfg.parallel.remat
        if self.degrees["pipeline"] > 1:  # the pipelined step's loss (backward included)
            step = staging.value_and_grad_fn(self)
            return lambda params, batch: step(params, batch)[0]

        # GSPMD evaluates the global loss directly, unless ring attention needs `context` manual
        if cfg.parallel.mode == "gspmd" and self.degrees["context"] == 1:
            ops = self._ops(manual_batch=False)
            outer = self._outer_specs(self.param_specs)

            def loss(params, batch):
                batch = self._prepare(batch)
                # a sharded embedding table is gathered before the lookup, not partitioned by it
                params = ops.gather(params, outer)
                per_token, aux = token_losses_and_aux(graphdef, params, batch, ops, remat=remat)
                value = jnp.mean(per_token)
                return value + aux["aux_loss"] if aux else value
            return loss

        n_tokens = cfg.train.batch_size * cfg.train.seq_len
        ops = self._ops(manual_batch=True)

        def local_loss(params, batch):
            params = self._gather_outer(
                mark_data_parallel(params, self.param_specs, self._replica_axes))
            per_token, aux = token_losses_and_aux(graphdef, params, batch, ops, remat=remat)
            value = jax.lax.psum(jnp.sum(per_token), self._dp_axes) / n_tokens
            return value + aux["aux_loss"] if aux else value  # aux: global on every device

        return self._shard_map(local_loss, out_specs=PartitionSpec())

    def value_and_grad_fn(self, *, with_metrics: bool = False):
        """``(params, batch) -> (loss, grads)``, grads in :attr:`grad_specs`, accumulated over
        ``train.microbatches``; ``with_metrics``: ``(loss, grads, metrics)``, the metrics of
        :func:`moe_metrics` (``{}`` for a dense model), averaged over the micro-batches.

        GSPMD with one micro-batch is ``jax.value_and_grad(loss_fn())`` and XLA places the sync.
        Otherwise each device computes *local* gradients (accumulated over its m micro-batches in a
        scan) and :func:`sync_grads` runs once per step after it, never once per micro-batch: the
        batch axes are manual (``shard_map``), and so is ``model`` in explicit mode. The exception
        is ZeRO-3: a sharded parameter is gathered, and its gradient reduce-scattered, inside every
        micro-batch, as in ZeRO and FSDP (holding whole gradients across micro-batches would undo
        the sharding).
        """
        if self.degrees["pipeline"] > 1:
            return staging.value_and_grad_fn(self, with_metrics=with_metrics)
        cfg, graphdef = self.cfg, self.graphdef
        m = cfg.train.microbatches
        n_tokens = cfg.train.batch_size * cfg.train.seq_len
        dp, replicas = self._dp_axes, self._replica_axes
        ops = self._ops(manual_batch=bool(dp))
        # each device's share of the (replicated) router loss in its local loss
        aux_scale = 1.0 / (self._n_token_ranks * m) if dp else 1.0 / m

        def micro_loss(params, micro):
            params = self._gather_outer(params)
            losses, aux = token_losses_and_aux(graphdef, params, micro, ops,
                                               remat=cfg.parallel.remat)
            value = jnp.sum(losses) / n_tokens
            if aux:
                value = value + aux["aux_loss"] * aux_scale
            return value, aux

        def local(params, batch):
            params = mark_data_parallel(params, self.param_specs, replicas)
            if m == 1:
                (loss, aux), grads = jax.value_and_grad(micro_loss, has_aux=True)(params, batch)
            else:
                # local row r*m + k goes to micro-batch k: a reshape, no data movement
                micro = jax.tree.map(
                    lambda x: x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1), batch)

                def body(acc, mb):
                    (loss, aux), grads = jax.value_and_grad(micro_loss, has_aux=True)(params, mb)
                    return jax.tree.map(jnp.add, acc, (loss, grads)), aux

                zero_loss = jnp.zeros((), jnp.float32)
                if dp:
                    zero_loss = jax.lax.pcast(zero_loss, dp, to="varying")
                zero = (zero_loss, jax.tree.map(jnp.zeros_like, params))
                (loss, grads), aux = jax.lax.scan(body, zero, micro)
                aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), aux)
            loss = jax.lax.psum(loss, dp) if dp else loss
            # the one gradient sync per step
            grads = sync_grads(grads, self.param_specs, self.grad_specs, replicas)
            if with_metrics:
                return (loss, moe_metrics(aux, loss)), grads
            return loss, grads

        fn = self._shard_map(local, out_specs=PartitionSpec(), param_out=self.grad_specs)
        if not with_metrics:
            return fn

        def with_aux(params, batch):
            (loss, metrics), grads = fn(params, batch)
            return loss, grads, metrics
        return with_aux

    def loss_and_grad(self, *, donate: bool = False):
        """``jit``-ed ``(params, batch) -> (loss, grads)``, grads in :attr:`grad_shardings`."""
        return jax.jit(
            self.value_and_grad_fn(),
            in_shardings=(self.param_shardings, self.batch_sharding),
            out_shardings=(NamedSharding(self.mesh, PartitionSpec()), self.grad_shardings),
            donate_argnums=(0,) if donate else ())

    def loss_grad_and_metrics(self, *, donate: bool = False):
        """``jit``-ed ``(params, batch) -> (loss, grads, metrics)``: :meth:`loss_and_grad` plus
        the MoE metrics of :func:`moe_metrics` (``{}`` for a dense model), replicated."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.jit(
            self.value_and_grad_fn(with_metrics=True),
            in_shardings=(self.param_shardings, self.batch_sharding),
            out_shardings=(replicated, self.grad_shardings, replicated),
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
    platform = mesh.devices.flat[0].platform
    if cfg.model.attention_impl != "default" and degrees["context"] > 1:
        raise ConfigError(f"model.attention_impl={cfg.model.attention_impl} has no effect with "
                          f"parallel.context={degrees['context']}: ring attention computes the "
                          f"blocks itself; use model.attention_impl=default or parallel.context=1")
    if cfg.model.attention_impl == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention_impl=cudnn needs NVIDIA GPUs, but the mesh is on "
                          f"{platform}; use model.attention_impl=default or xla")
    padded_vocab = cfg.model.padded_vocab_size(degrees["model"])
    abstract = nnx.eval_shape(
        lambda: Transformer(cfg.model, padded_vocab=padded_vocab, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return Engine(cfg=cfg, mesh=mesh, degrees=degrees, param_rules=param_rules(cfg.parallel),
                  activation_rules=activation_rules(cfg.parallel, degrees),
                  padded_vocab=padded_vocab, graphdef=graphdef, abstract_params=state)


def reference_loss_fn(cfg: Config, padded_vocab: int | None = None, *,
                      with_metrics: bool = False):
    """The single-device reference: the same model with no mesh and no collectives. The loss is
    the training loss (an MoE model's router losses included); ``with_metrics``:
    ``(loss, metrics)`` as :func:`moe_metrics`, for ``jax.value_and_grad(..., has_aux=True)``."""
    padded_vocab = padded_vocab or cfg.model.padded_vocab_size(1)
    abstract = nnx.eval_shape(
        lambda: Transformer(cfg.model, padded_vocab=padded_vocab, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)

    def loss(params, batch):
        per_token, aux = token_losses_and_aux(graphdef, params, batch, LocalOps(),
                                              remat=cfg.parallel.remat)
        value = jnp.mean(per_token)
        if aux:
            value = value + aux["aux_loss"]
        return (value, moe_metrics(aux, value)) if with_metrics else value
    return loss


def reference_params(cfg: Config, seed: int | None = None,
                     padded_vocab: int | None = None) -> nnx.State:
    seed = cfg.train.seed if seed is None else seed
    padded_vocab = padded_vocab or cfg.model.padded_vocab_size(1)
    return nnx.state(Transformer(cfg.model, padded_vocab=padded_vocab, rngs=nnx.Rngs(seed)))
