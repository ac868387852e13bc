"""Engine: a config on a device set, as one object with the jitted functions tests and tools use.

A thin facade over the redesigned pieces: :class:`jaxtp.step.layout.Layout` (mesh, tables, specs and
shardings, layer order), the execution :class:`jaxtp.step.region.Region` of the configured mode, and
the steps (:mod:`jaxtp.step.plain`, :mod:`jaxtp.step.pipelined`). The layout's data is read from
the layout (``engine.layout.param_specs``, ``engine.layout.mesh``). :func:`abstract_inputs` gives
ShapeDtypeStructs so a step for a mesh far larger than the machine can be compiled without
allocating anything. The single-device reference every parallel run is checked against is
:func:`reference_loss_fn` with :func:`reference_params`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtp.configs import PIPELINE, Config
from jaxtp.layers import Transformer
from jaxtp.parallel import LocalOps
from jaxtp.step import pipelined as pipelined_step
from jaxtp.step import plain as step
from jaxtp.step.layout import Batch, Layout, abstract_model, build_layout
from jaxtp.step.plain import masked_sum, moe_metrics, token_count, token_losses_and_aux
from jaxtp.step.region import Region, region_for


class Engine:
    """A :class:`~jaxtp.step.layout.Layout` with its :class:`~jaxtp.step.region.Region` and jitted steps."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.region: Region = region_for(layout)

    @property
    def pipelined(self) -> bool:
        return self.layout.degrees[PIPELINE] > 1

    def abstract_inputs(self) -> tuple[nnx.State, Batch]:
        """ShapeDtypeStructs with shardings for (params, batch): compile without allocating."""
        return self.layout.abstract_params_sharded(), self.layout.abstract_batch()

    # ---- steps --------------------------------------------------------------------------------
    def value_and_grad_fn(self) -> Callable:
        """``(params, batch) -> (loss, grads, metrics)``, grads in ``layout.grad_specs``,
        accumulated over ``train.microbatches``, synced once per step."""
        steps = pipelined_step if self.pipelined else step
        return steps.value_and_grad_fn(self.layout, self.region)

    def loss_fn(self) -> Callable:
        """``(params, batch) -> scalar``: the training loss, forward only."""
        if self.pipelined:
            return pipelined_step.forward_fn(self.layout, self.region, "loss")
        return step.loss_fn(self.layout, self.region)

    def token_losses_fn(self) -> Callable:
        """``(params, batch) -> [B,S]`` per-token next-token losses, forward only."""
        if self.pipelined:
            return pipelined_step.forward_fn(self.layout, self.region, "losses")
        return step.token_losses_fn(self.layout, self.region)

    def logits_fn(self) -> Callable:
        """``(params, batch) -> [B,S,padded_vocab]`` logits, forward only."""
        if self.pipelined:
            return pipelined_step.forward_fn(self.layout, self.region, "logits")
        return step.logits_fn(self.layout, self.region)

    @cached_property
    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.layout.mesh, PartitionSpec())

    def _jit(self, fn, out_shardings, *, donate: bool = False):
        return jax.jit(fn, in_shardings=(self.layout.param_shardings, self.layout.batch_sharding),
                       out_shardings=out_shardings, donate_argnums=(0,) if donate else ())

    def loss_and_grad(self, *, donate: bool = False):
        """``jit``-ed ``(params, batch) -> (loss, grads)``, grads in ``layout.grad_shardings``."""
        vg = self.value_and_grad_fn()
        return self._jit(lambda p, b: vg(p, b)[:2],
                         (self._replicated, self.layout.grad_shardings), donate=donate)

    def loss_grad_and_metrics(self, *, donate: bool = False):
        """``jit``-ed ``(params, batch) -> (loss, grads, metrics)``: :meth:`loss_and_grad` plus
        the MoE metrics of :func:`~jaxtp.step.plain.moe_metrics` (``{}`` for a dense model)."""
        return self._jit(self.value_and_grad_fn(),
                         (self._replicated, self.layout.grad_shardings, self._replicated),
                         donate=donate)

    def loss(self):
        """``jit``-ed forward loss ``(params, batch) -> scalar``."""
        return self._jit(self.loss_fn(), self._replicated)


def build_engine(cfg: Config, devices=None, *, training: bool = True) -> Engine:
    """Validate ``cfg`` against the devices and derive the layout, region and steps
    (``training=False``: for scoring only, see :func:`jaxtp.parallel.validation.validate`)."""
    return Engine(build_layout(cfg, devices, training=training))


def reference_loss_fn(cfg: Config, padded_vocab: int | None = None, *,
                      with_metrics: bool = False):
    """The single-device reference: the same model with no mesh and no collectives. The loss is
    the training loss (an MoE model's router losses included); ``with_metrics``:
    ``(loss, metrics)`` as :func:`~jaxtp.step.plain.moe_metrics`, for
    ``jax.value_and_grad(..., has_aux=True)``."""
    graphdef, _ = abstract_model(cfg, padded_vocab or cfg.model.padded_vocab_size(1))

    def loss(params, batch):
        per_token, aux = token_losses_and_aux(graphdef, params, batch, LocalOps(),
                                              remat=cfg.parallel.remat)
        value = masked_sum(per_token, batch.get("loss_mask")) / token_count(batch,
                                                                            per_token.size)
        if aux:
            value = value + aux["aux_loss"]
        return (value, moe_metrics(aux, value)) if with_metrics else value
    return loss


def reference_params(cfg: Config, seed: int | None = None,
                     padded_vocab: int | None = None) -> nnx.State:
    seed = cfg.train.seed if seed is None else seed
    padded_vocab = padded_vocab or cfg.model.padded_vocab_size(1)
    return nnx.state(Transformer(cfg.model, padded_vocab=padded_vocab, rngs=nnx.Rngs(seed)))
