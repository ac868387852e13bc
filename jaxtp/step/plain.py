"""The loss-and-gradient step of the unpipelined model, in either execution mode.

``value_and_grad_fn(layout, region)`` returns ``(params, batch) -> (loss, grads, metrics)``: the
mean next-token loss over the global batch (plus the MoE router losses: the training loss),
gradients in the layout's gradient specs, and the metrics of :func:`moe_metrics` (``{}`` for a
dense model). Each device computes *local* gradients, accumulated over ``train.microbatches`` in a
scan, and :func:`jaxtp.parallel.grad_sync.sync_grads` runs once per step after it, never once per
micro-batch (in GSPMD mode with nothing manual, ``jax.value_and_grad`` of the global loss, and XLA
places the sync). ZeRO-3 gathers each sharded parameter, and reduce-scatters its gradient, inside
every micro-batch, as ZeRO and FSDP do.

Mixture-of-Experts router losses: each layer's aux is already the global-batch value on every
device, so where each device differentiates its *local* loss (whose sum over the token ranks is
the step loss) it adds ``aux_loss / n_token_ranks``; in the global view it is added once. With
micro-batches the aux is that of each micro-batch, averaged (as Megatron-LM does).

The forward-only functions (:func:`loss_fn`, :func:`token_losses_fn`, :func:`logits_fn`) serve
evaluation and the public :class:`jaxtp.Model`. The step loss's mean over tokens
(:func:`masked_sum` / :func:`token_count`) is here too: the pipelined step and the single-device
reference divide by the same count.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxtp.configs import CONTEXT
from jaxtp.parallel import from_layout, mark_data_parallel, sync_grads
from jaxtp.step.layout import Batch, Layout
from jaxtp.step.region import Region

# ----------------------------------------------------------------------------------------------
# The step loss: a mean over tokens (both steps, pipelined or not, and the reference)
# ----------------------------------------------------------------------------------------------
# The step loss as a mean over tokens: every token of the global batch, or -- for a packed batch
# -- only those its ``loss_mask`` counts (not the position after a document's end, not padding).
#
# A packed batch's mean is over a data-dependent count, so each device sums its own masked losses
# and the count is summed over the token axes once per step (one scalar all-reduce, only for packed
# batches); an unpacked batch divides by the static ``batch_size x seq_len``.

def masked_sum(losses: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``sum(losses)`` over the tokens ``mask`` counts (all of them for ``None``)."""
    return jnp.sum(losses) if mask is None else jnp.sum(losses * mask.astype(losses.dtype))


def token_count(batch: dict, n_tokens: int, axes: tuple[str, ...] = ()):
    """What the step's loss sum is divided by: ``n_tokens`` for an unpacked batch, else the
    number of counted tokens in the global batch (summed over ``axes``, the manual token axes,
    when this runs per device); at least 1."""
    mask = batch.get("loss_mask")
    if mask is None:
        return n_tokens
    count = jnp.sum(mask.astype(jnp.float32))
    if axes:
        missing = tuple(a for a in axes if a not in jax.typeof(count).manual_axis_type.varying)
        count = jax.lax.pcast(count, missing, to="varying") if missing else count
        count = jax.lax.psum(count, axes)
    return jnp.maximum(count, 1.0)


# ----------------------------------------------------------------------------------------------
# The unpipelined step
# ----------------------------------------------------------------------------------------------

def moe_metrics(aux: dict, loss: jax.Array) -> dict:
    """What the trainer logs of an MoE step: the total loss split into LM and router parts, the
    router losses, the fraction of token-to-expert assignments dropped at capacity and each
    expert's share of the assignments (``expert_load``, sums to 1; uniform is 1/n_experts)."""
    if not aux:
        return {}
    return {"lm_loss": loss - aux["aux_loss"], **aux}


def token_losses_and_aux(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, ops, *,
                         remat: str) -> tuple[jax.Array, dict]:
    """``(per-token cross-entropy [B,S], MoE aux)`` of the model ``(graphdef, params)``; the aux
    is ``{}`` for a dense model."""
    model = nnx.merge(graphdef, params)
    inputs = batch["inputs"]
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    return model.token_losses_and_aux(inputs, batch["targets"], positions, ops, remat=remat,
                                      segment_ids=batch.get("segment_ids"))


def _split_micro(batch: Batch, m: int) -> Batch:
    """Local row ``r * m + k`` goes to micro-batch ``k``: a reshape, no data movement."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1),
                        batch)


def value_and_grad_fn(layout: Layout, region: Region) -> Callable:
    """``(params, batch) -> (loss, grads, metrics)``, grads in ``layout.grad_specs``."""
    cfg, graphdef = layout.cfg, layout.graphdef
    m = cfg.train.microbatches
    n_tokens = cfg.train.batch_size * cfg.train.seq_len
    manual = region.manual_axes()
    dp, replicas = (region.token_axes, region.replica_axes) if manual else ((), ())
    ops = region.ops(manual=bool(manual))
    # each device's share of the (replicated) router loss in its local loss
    aux_scale = 1.0 / (region.n_token_ranks * m) if manual else 1.0 / m
    gather_outer = region.gather_outer if manual else (lambda p: p)

    def micro_loss(params, micro, denom):
        params = gather_outer(params)
        losses, aux = token_losses_and_aux(graphdef, params, micro, ops,
                                           remat=cfg.parallel.remat)
        value = masked_sum(losses, micro.get("loss_mask")) / denom
        if aux:
            value = value + aux["aux_loss"] * aux_scale
        return value, aux

    grad = jax.value_and_grad(micro_loss, has_aux=True)

    def accumulate(params, batch, denom):
        def body(acc, mb):
            (loss, aux), grads = grad(params, mb, denom)
            return jax.tree.map(jnp.add, acc, (loss, grads)), aux

        zero_loss = jnp.zeros((), jnp.float32)
        if dp:
            zero_loss = jax.lax.pcast(zero_loss, dp, to="varying")
        zero = (zero_loss, jax.tree.map(jnp.zeros_like, params))
        (loss, grads), aux = jax.lax.scan(body, zero, _split_micro(batch, m))
        return (loss, jax.tree.map(lambda a: jnp.mean(a, axis=0), aux)), grads

    def local(params, batch):
        params = mark_data_parallel(params, layout.param_specs, replicas)
        denom = token_count(batch, n_tokens, dp)  # a packed batch: its counted tokens
        (loss, aux), grads = (grad(params, batch, denom) if m == 1 else
                              accumulate(params, batch, denom))
        loss = jax.lax.psum(loss, dp) if dp else loss
        grads = sync_grads(grads, layout.param_specs, layout.grad_specs, replicas)  # once
        return loss, grads, moe_metrics(aux, loss)

    # loss and the (MoE) metrics replicated, gradients in their specs
    return region.per_device(local, out_specs=(PartitionSpec(), layout.grad_specs,
                                               PartitionSpec()))


def _hidden(model, batch: Batch, ops, remat: str) -> jax.Array:
    return model.hidden(batch["inputs"], batch["positions"], ops, remat=remat,
                        segment_ids=batch.get("segment_ids"))


def _forward(layout: Layout, region: Region, body: Callable, out_names: tuple[str, ...]):
    """``(params, batch) -> out`` of ``body(params, prepared batch, ops, manual)`` in the global
    view or per device; ``out`` has dims named ``out_names`` (``batch``, ``seq``, ...) and comes
    back in natural sequence order (ring attention's layout undone)."""
    manual = not region.global_view
    ops = region.ops(manual=manual)

    def fn(params, batch):
        params = region.gather_outer(params) if manual else ops.gather(params, layout.outer_specs)
        return body(params, batch, ops)

    if manual:
        spec = layout.activation_rules.spec(out_names)
        run = region.per_device(fn, out_specs=spec)
    else:
        def run(params, batch):
            return fn(params, layout.prepare(batch))
    cp = layout.degrees[CONTEXT]
    if cp == 1:
        return run
    return lambda params, batch: from_layout(run(params, batch), cp,
                                             layout.cfg.parallel.context_layout)


def token_losses_fn(layout: Layout, region: Region) -> Callable:
    """``(params, batch) -> [B,S]`` fp32 next-token cross-entropy of every position."""
    remat = layout.cfg.parallel.remat

    def body(params, batch, ops):
        return token_losses_and_aux(layout.graphdef, params, batch, ops, remat=remat)[0]
    return _forward(layout, region, body, ("batch", "seq"))


def logits_fn(layout: Layout, region: Region) -> Callable:
    """``(params, batch) -> [B,S,padded_vocab]`` logits of ``batch["inputs"]`` (the vocab
    padding is the caller's to strip)."""
    remat = layout.cfg.parallel.remat

    def body(params, batch, ops):
        model = nnx.merge(layout.graphdef, params)
        return model.logits(_hidden(model, batch, ops, remat), ops)
    return _forward(layout, region, body, ("batch", "seq", "vocab"))


def loss_fn(layout: Layout, region: Region) -> Callable:
    """``(params, batch) -> scalar``: the training loss (mean next-token loss plus the MoE router
    losses) of the global batch, forward only."""
    cfg, graphdef = layout.cfg, layout.graphdef
    remat = cfg.parallel.remat
    n_tokens = cfg.train.batch_size * cfg.train.seq_len
    manual = not region.global_view
    ops = region.ops(manual=manual)
    if not manual:
        def loss(params, batch):
            batch = layout.prepare(batch)
            params = ops.gather(params, layout.outer_specs)
            per_token, aux = token_losses_and_aux(graphdef, params, batch, ops, remat=remat)
            value = masked_sum(per_token, batch.get("loss_mask")) / token_count(batch,
                                                                                per_token.size)
            return value + aux["aux_loss"] if aux else value
        return loss

    dp, replicas = region.token_axes, region.replica_axes

    def local_loss(params, batch):
        params = region.gather_outer(mark_data_parallel(params, layout.param_specs, replicas))
        per_token, aux = token_losses_and_aux(graphdef, params, batch, ops, remat=remat)
        total = jax.lax.psum(masked_sum(per_token, batch.get("loss_mask")), dp)
        value = total / token_count(batch, n_tokens, dp)
        return value + aux["aux_loss"] if aux else value  # aux: global on every device
    return region.per_device(local_loss, out_specs=PartitionSpec())
