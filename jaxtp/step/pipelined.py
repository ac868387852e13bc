"""The Transformer cut into pipeline stages and trained by a :mod:`jaxtp.pipeline.schedules` table.

``parallel.pipeline = p`` with ``parallel.virtual_stages = v`` cuts the layer scan into ``p * v``
equal stages of ``L / (p v)`` layers. Stage ``k`` runs on pipeline rank ``k % p`` as its chunk
``k // p`` (Megatron-LM's interleaved assignment; for ``v = 1`` rank ``r`` simply holds stage
``r``). Stage 0 also embeds the tokens and the last stage also runs the final norm, the output
projection and the vocab-parallel loss, as in Megatron-LM; those parameters are replicated over
``pipeline`` and their gradients summed over it once per step (with tied embeddings the input and
output uses of the table add up there). Inside a stage everything else composes unchanged: the
same layer body, Megatron TP over ``model`` in either execution mode (a stage sends each TP
rank's ``1/t`` slice of the activations and the next all-gathers them over ``model``: Narayanan
et al.'s scatter/gather; under sequence parallelism the stream is already sliced), data
parallelism, ZeRO 1-3 and FSDP. Not yet: context parallelism (ring attention's ``ppermute`` s
would run inside the schedule's per-tick ``lax.switch``, and XLA:CPU joins a collective-permute
over all devices, so ranks in different branches would pair the wrong ones) and MoE (a stage does
not carry router losses); :func:`jaxtp.parallel.validation.validate` says so before compile.

**Layout.** The blocks' stacked ``layers`` dim is sharded over ``pipeline``, in the order of
:mod:`jaxtp.pipeline.layer_order` (rank-major for interleaved pipelines; checkpoints stay in natural order).

**The step.** Per device (``jax.shard_map`` over ``pipeline`` and the token axes; every axis in
explicit mode), the local batch is split into ``train.microbatches`` micro-batches (local row
``i * m + k`` in micro-batch ``k``, as without a pipeline) and handed to
:func:`jaxtp.pipeline.runtime.pipeline_value_and_grad`, which runs the schedule. The data-parallel gradient
sync runs once, after the last micro-batch. It returns ``(loss, grads, metrics)`` like
:func:`jaxtp.step.plain.value_and_grad_fn`.

**Forward only** (evaluation, logits): :func:`forward_fn` runs the ``p * v`` stages in order, one
per iteration of a scan: the rank that holds the stage runs it and ``ppermute`` s the result to
the next rank, which holds the next stage; no schedule, no backward, no stored activations, one
forward's FLOPs (the ranks take turns: this is for evaluation, not throughput). The last stage's
output is then made replicated over ``pipeline`` (one all-reduce of ``b x s x h``) so every rank
computes the same logits or losses.
"""


from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxtp.configs import MODEL, PIPELINE
from jaxtp.layers import embed_tokens, positional, scan_layers, token_losses_of
from jaxtp.parallel import mark_data_parallel, sync_grads
from jaxtp.pipeline import (
    Program,
    build_schedule,
    compile_schedule,
    pipeline_value_and_grad,
    stores_residuals,
    vary_over,
    varying_axes,
)
from jaxtp.step.layout import Layout
from jaxtp.step.plain import masked_sum, token_count
from jaxtp.step.region import Region


def keeps_residuals(layout: Layout) -> bool:
    """Whether a stage's backward reads the VJP residuals its forward kept (what
    ``parallel.remat`` saves) or recomputes the stage from its input
    (:func:`jaxtp.pipeline.program.stores_residuals`: under ``remat=full`` and for GPipe)."""
    par = layout.cfg.parallel
    return stores_residuals(par.pipeline_schedule, par.remat)


def program(layout: Layout) -> Program:
    """The compiled schedule the pipelined step runs."""
    par = layout.cfg.parallel
    return compile_schedule(build_schedule(
        par.pipeline_schedule, layout.degrees[PIPELINE], layout.cfg.train.microbatches,
        par.virtual_stages), residuals=keeps_residuals(layout))


def branch_weights(layout: Layout, rank: int = 0) -> dict[int, tuple[float, ...]]:
    """How often pipeline ``rank`` takes each branch of the schedule's per-tick ``lax.switch`` es,
    as fractions of their ticks, keyed by the branch count (:data:`jaxtp.inspect.hlo.BranchWeights`):
    what the census needs to count the stages' collectives as executed, not once per tick each."""
    return program(layout).branch_weights(rank)


class _Parts:
    """The model cut into what a pipeline runs: the embedding (stage 0), the stacked blocks (the
    stages), the final norm and output projection (the last stage), as graph definitions."""

    def __init__(self, layout: Layout, region: Region, *, manual: bool = True):
        self.layout, self.cfg = layout, layout.cfg
        self.ops = region.ops(manual=manual)
        model = nnx.merge(layout.graphdef, layout.abstract_params)
        self.tied = self.cfg.model.tie_embeddings
        self.out_key = "embed" if self.tied else "head"
        self.defs = {k: nnx.split(getattr(model, k))[0]
                     for k in ("embed", "blocks", "final_norm") + (() if self.tied else ("head",))}

    def embed(self, params, tokens):
        return embed_tokens(nnx.merge(self.defs["embed"], params["embed"]), tokens, self.ops,
                            self.cfg.model)

    def stage(self, chunk, x, rope):
        return scan_layers(self.defs["blocks"], chunk, x, rope, self.ops,
                           remat=self.cfg.parallel.remat, moe=False)[0]

    def final(self, params, y):
        """Final norm and the output projection module."""
        x = nnx.merge(self.defs["final_norm"], params["final_norm"])(y)
        return x, nnx.merge(self.defs[self.out_key], params[self.out_key])

    def token_losses(self, params, y, targets):
        x, out = self.final(params, y)
        return token_losses_of(out, x, targets, self.ops, self.cfg.model)

    def logits(self, params, y):
        x, out = self.final(params, y)
        logits = out.attend(x, self.ops) if self.tied else out(x, self.ops)
        return self.ops.constrain(logits, "batch", "seq", "vocab")

    def rope(self, positions, segment_ids=None):
        """The layers' :class:`~jaxtp.layers.attention.Positional` (RoPE tables, segments)."""
        return positional(positions, self.cfg.model, segment_ids)


def _send_split(layout: Layout) -> tuple[str, int] | None:
    """Plain TP: the stream between stages is replicated over ``model``, so send each TP rank's
    ``1/t`` slice of it (under SP it is already each rank's sequence slice)."""
    t, par = layout.degrees[MODEL], layout.cfg.parallel
    local_seq = layout.cfg.train.seq_len // layout.degrees["context"]
    if t > 1 and not par.sequence_parallel and local_seq % t == 0:
        return (MODEL, 1)
    return None


def _assemble_grads(layout: Layout, gathered, g, ungather):
    """The pipeline runtime's stage / embedding / head gradients -> one parameter-shaped tree
    (ZeRO-3: the outer parameters' gradients reduce-scattered back through ``ungather``)."""
    grads = jax.tree.map(jnp.zeros_like, gathered)
    grads["blocks"] = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), g.stages)
    grads["final_norm"] = g.head["final_norm"]
    grads["embed"] = g.embed["embed"]
    if layout.cfg.model.tie_embeddings:
        grads["embed"] = jax.tree.map(jnp.add, grads["embed"], g.head["embed"])
    else:
        grads["head"] = g.head["head"]
    if layout.zero.params:
        blocks = grads["blocks"]  # not gathered here (each layer is, inside its stage)
        grads = ungather(grads)[0]
        grads["blocks"] = blocks
    return grads


def _chunks(layout: Layout, blocks):
    """This rank's stacked layers ``[v * L/(p v), ...]`` -> ``[v, L/(p v), ...]`` chunks."""
    v = layout.cfg.parallel.virtual_stages
    return jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), blocks)


def value_and_grad_fn(layout: Layout, region: Region) -> Callable:
    """``(params, batch) -> (loss, grads, metrics)`` of the pipelined model, grads in
    ``layout.grad_specs``; ``metrics`` is ``{}`` (a pipelined model is dense)."""
    cfg = layout.cfg
    par = cfg.parallel
    p, v, m = layout.degrees[PIPELINE], par.virtual_stages, cfg.train.microbatches
    schedule = build_schedule(par.pipeline_schedule, p, m, v)
    n_tokens = cfg.train.batch_size * cfg.train.seq_len
    dp, replicas = region.token_axes, region.replica_axes
    parts = _Parts(layout, region)
    out_key = parts.out_key

    def split(x):  # local row i * m + k -> micro-batch k
        return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

    def local(params, batch):
        params = mark_data_parallel(params, layout.param_specs, replicas)
        # ZeRO-3: the embedding, final norm and head are gathered once per step, before the
        # pipeline, and their gradients reduce-scattered once after it (the gather's transpose)
        gathered, ungather = jax.vjp(region.gather_outer, params)
        tokens = split(batch["inputs"])
        targets = {k: split(batch[k]) for k in ("targets", "loss_mask") if k in batch}
        denom = token_count(batch, n_tokens, dp)  # a packed batch: its counted tokens
        if "segment_ids" in batch:  # packed: each micro-batch's own positions and documents
            side = {k: split(batch[k]) for k in ("positions", "segment_ids")}

            def stage(chunk, x, sd):
                return parts.stage(chunk, x, parts.rope(sd["positions"], sd["segment_ids"]))
        else:  # one sequence per row: the same RoPE tables for every micro-batch
            side, rope = None, parts.rope(batch["positions"][: tokens.shape[1]])
            # varying over `pipeline` as a tick's operands are: a stage's backward then casts
            # nothing (ZB-H1's B / W split runs it as a jaxpr traced once, outside the ticks)
            rope = jax.tree.map(lambda a: vary_over(a, {PIPELINE}), rope)

            def stage(chunk, x):
                return parts.stage(chunk, x, rope)

        def loss_fn(hp, y, tgt):  # this micro-batch's share of the global mean, times m
            losses = parts.token_losses(hp, y, tgt["targets"])
            return masked_sum(losses, tgt.get("loss_mask")) * (m / denom)

        loss, g = pipeline_value_and_grad(
            stage, loss_fn, _chunks(layout, params["blocks"]), (tokens, targets),
            schedule=schedule, send_split=_send_split(layout), embed_fn=parts.embed,
            embed_params={"embed": gathered["embed"]}, side=side,
            head_params={"final_norm": gathered["final_norm"], out_key: gathered[out_key]},
            residuals=keeps_residuals(layout))
        grads = _assemble_grads(layout, gathered, g, ungather)
        loss = jax.lax.psum(loss, dp) if dp else loss
        grads = sync_grads(grads, layout.param_specs, layout.grad_specs, replicas)  # once
        return loss, grads, {}

    return region.per_device(local, out_specs=(PartitionSpec(), layout.grad_specs, {}),
                             extra=(PIPELINE,))


def _run_stages(layout: Layout, parts: _Parts, params, tokens, rope):
    """Forward through all ``p * v`` stages in order (see the module docstring): the rank that
    holds stage ``k`` runs it (a two-way ``lax.switch``: the others pass their carry through),
    then sends it on. Returns the last stage's output ``[b, s, h]``, replicated over
    ``pipeline``."""
    p = layout.degrees[PIPELINE]
    n_stages = p * layout.cfg.parallel.virtual_stages
    chunks = _chunks(layout, params["blocks"])
    rank = jax.lax.axis_index(PIPELINE)
    perm = [(r, (r + 1) % p) for r in range(p)]

    def chunk_at(c):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, 0, False), chunks)

    # the carry varies like a stage's output (over `pipeline`, and whatever the stage adds)
    x = vary_over(parts.embed(params, tokens), (PIPELINE,))
    vma = varying_axes(parts.stage(chunk_at(0), x, rope))
    x = vary_over(x, vma)

    def one_stage(x, k):
        def run(x):
            return vary_over(parts.stage(chunk_at(k // p), x, rope), vma)
        owner = (rank == k % p).astype(jnp.int32)
        y = jax.lax.switch(owner, [lambda x: x, run], x)
        return jax.lax.ppermute(y, PIPELINE, perm), None

    x, _ = jax.lax.scan(one_stage, x, jnp.arange(n_stages))
    # after the last send the output is on rank p * v % p = 0
    return jax.lax.psum(jnp.where(rank == 0, x, jnp.zeros_like(x)), PIPELINE)


def forward_branch_weights(layout: Layout) -> dict[int, tuple[float, ...]]:
    """How often a rank takes each branch of the forward-only pass's per-stage switch (pass
    through, run): :data:`jaxtp.inspect.hlo.BranchWeights` for the census of the ``loss`` step."""
    p = layout.degrees[PIPELINE]
    return {2: (1 - 1 / p, 1 / p)}


def forward_fn(layout: Layout, region: Region, head: str) -> Callable:
    """``(params, batch) -> out`` of the pipelined model, forward only: ``head`` is ``"losses"``
    (per-token cross-entropy ``[B,S]``), ``"logits"`` (``[B,S,padded_vocab]``) or ``"loss"``
    (the mean next-token loss)."""
    parts = _Parts(layout, region)
    names = {"losses": ("batch", "seq"), "logits": ("batch", "seq", "vocab"), "loss": ()}[head]

    def local(params, batch):
        params = region.gather_outer(params)
        rope = parts.rope(batch["positions"], batch.get("segment_ids"))
        y = _run_stages(layout, parts, params, batch["inputs"], rope)
        if head == "logits":
            return parts.logits(params, y)
        losses = parts.token_losses(params, y, batch["targets"])
        if head == "losses":
            return losses
        n_tokens = losses.size * region.n_token_ranks
        # invariant over a size-1 token axis (explicit mode names them all): cast, then sum
        total = vary_over(masked_sum(losses, batch.get("loss_mask")), region.token_axes)
        total = jax.lax.psum(total, region.token_axes) if region.token_axes else total
        return total / token_count(batch, n_tokens, region.token_axes)

    spec = layout.activation_rules.spec(names) if names else PartitionSpec()
    return region.per_device(local, out_specs=spec, extra=(PIPELINE,))
