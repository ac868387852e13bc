"""The Transformer cut into pipeline stages and trained by a :mod:`jaxtp.schedules` table.

``parallel.pipeline = p`` with ``parallel.virtual_stages = v`` cuts the layer scan into ``p * v``
equal stages of ``L / (p v)`` layers. Stage ``k`` runs on pipeline rank ``k % p`` as its chunk
``k // p`` (Megatron-LM's interleaved assignment; for ``v = 1`` rank ``r`` simply holds stage
``r``). Stage 0 also embeds the tokens and the last stage also runs the final norm, the output
projection and the vocab-parallel loss, as in Megatron-LM; those parameters are replicated over
``pipeline`` and their gradients summed over it once per step (with tied embeddings the input and
output uses of the table add up there). Inside a stage everything else composes unchanged: the
same layer body, Megatron TP over ``model`` in either execution mode (a stage sends each TP
rank's ``1/t`` slice of the activations and the next all-gathers them over ``model``: Narayanan
et al.'s scatter/gather; under sequence parallelism the stream is already sliced), data parallelism, ZeRO 1-3 and FSDP. Not yet: context parallelism (ring attention's
``ppermute`` s would run inside the schedule's per-tick ``lax.switch``, and XLA:CPU joins a
collective-permute over all devices, so ranks in different branches would pair the wrong ones)
and MoE (a stage does not carry router losses); :func:`jaxtp.mesh.validate` says so before compile.

**Layout.** The blocks' stacked ``layers`` dim is sharded over ``pipeline``. For ``v = 1`` that
is the natural layer order, so parameters, optimizer state and checkpoints look exactly as without
a pipeline. For ``v > 1`` a rank's chunks are not contiguous in depth, so the engine stores the
``layers`` dim in *rank-major* order (:func:`to_pipeline_order`); :func:`to_natural_order` undoes
it, and checkpoints are written and read in natural order, so a run saved with one pipeline
layout resumes on any other (or on none).

**The step.** Per device (``jax.shard_map`` over ``pipeline`` and the token axes; every axis in
explicit mode), the local batch is split into ``train.microbatches`` micro-batches (local row
``i * m + k`` in micro-batch ``k``, as without a pipeline) and handed to
:func:`jaxtp.pipeline.pipeline_value_and_grad`, which runs the schedule. The data-parallel gradient
sync runs once, after the last micro-batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxtp import pipeline, schedules
from jaxtp.layers.attention import rope_tables
from jaxtp.model import embed_tokens, scan_layers, token_losses_of
from jaxtp.sharding import restrict

PIPELINE = pipeline.PIPELINE


def _reorder(tree, p: int, v: int, units: int, inverse: bool):
    """Reorder the leading ``layers`` dim of every leaf under a ``blocks`` key whose leading dim
    is ``units`` (parameters, gradients, optimizer moments alike)."""
    if v == 1:
        return tree
    move = pipeline.ranks_to_stages if inverse else pipeline.stages_to_ranks

    def one(path, a):
        keys = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        if "blocks" not in keys or not a.shape or a.shape[0] != units:
            return a
        chunks = a.reshape(p * v, units // (p * v), *a.shape[1:])
        return move(chunks, p, v).reshape(a.shape)
    return jax.tree_util.tree_map_with_path(one, tree)


def to_pipeline_order(tree, p: int, v: int, units: int):
    """Natural layer order -> the engine's rank-major order (rank ``r``'s ``v`` chunks contiguous,
    so sharding the ``layers`` dim over ``pipeline`` hands each rank its stages)."""
    return _reorder(tree, p, v, units, inverse=False)


def to_natural_order(tree, p: int, v: int, units: int):
    """Inverse of :func:`to_pipeline_order`: layer ``i`` at index ``i`` again."""
    return _reorder(tree, p, v, units, inverse=True)


def branch_weights(engine, rank: int = 0) -> dict[int, tuple[float, ...]]:
    """How often pipeline ``rank`` takes each branch of the schedule's per-tick ``lax.switch``,
    as fractions of the ticks, keyed by the branch count (:data:`jaxtp.hlo.BranchWeights`): what
    the census needs to count the stages' collectives as executed, not once per tick each."""
    par = engine.cfg.parallel
    prog = pipeline.compile_schedule(schedules.build(
        par.pipeline_schedule, engine.degrees[PIPELINE], engine.cfg.train.microbatches,
        par.virtual_stages))
    kinds = prog.rows[:, rank, pipeline.KIND]
    n = len(prog.passes) + 1
    return {n: tuple(float((kinds == k).sum()) / len(kinds) for k in range(n))}


def value_and_grad_fn(engine, *, with_metrics: bool = False):
    """``(params, batch) -> (loss, grads)`` of the pipelined model (``with_metrics``: also ``{}``,
    as :meth:`jaxtp.engine.Engine.value_and_grad_fn`), grads in ``engine.grad_specs``."""
    from jaxtp.engine import mark_data_parallel, sync_grads

    cfg = engine.cfg
    par, mcfg = cfg.parallel, cfg.model
    p, v, m = engine.degrees[PIPELINE], par.virtual_stages, cfg.train.microbatches
    schedule = schedules.build(par.pipeline_schedule, p, m, v)
    n_tokens = cfg.train.batch_size * cfg.train.seq_len
    dp, replicas = engine._dp_axes, engine._replica_axes
    ops = engine._ops(manual_batch=True)
    tied = mcfg.tie_embeddings

    model = nnx.merge(engine.graphdef, engine.abstract_params)
    defs = {k: nnx.split(getattr(model, k))[0]
            for k in ("embed", "blocks", "final_norm") + (() if tied else ("head",))}
    out_key = "embed" if tied else "head"
    # plain TP: the stream between stages is replicated over `model`, so send 1/t of it (under SP
    # it is already each rank's sequence slice)
    t = engine.degrees["model"]
    send_split = (("model", 1) if t > 1 and not par.sequence_parallel
             and (cfg.train.seq_len // engine.degrees["context"]) % t == 0 else None)

    def local(params, batch):
        params = mark_data_parallel(params, engine.param_specs, replicas)
        # ZeRO-3: the embedding, final norm and head are gathered once per step, before the
        # pipeline, and their gradients reduce-scattered once after it (the gather's transpose)
        gathered, ungather = jax.vjp(engine._gather_outer, params)
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]),
                              params["blocks"])

        def split(x):  # local row i * m + k -> micro-batch k
            return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

        tokens, targets = split(batch["inputs"]), split(batch["targets"])
        rope = rope_tables(batch["positions"][: tokens.shape[1]], mcfg.resolved_head_dim,
                           mcfg.rope_theta)

        def embed_fn(ep, tok):
            return embed_tokens(nnx.merge(defs["embed"], ep["embed"]), tok, ops, mcfg)

        def stage_fn(chunk, x):
            return scan_layers(defs["blocks"], chunk, x, rope, ops, remat=par.remat,
                               moe=False)[0]

        def loss_fn(hp, y, tgt):  # this micro-batch's share of the global mean, times m
            x = nnx.merge(defs["final_norm"], hp["final_norm"])(y)
            out = nnx.merge(defs[out_key], hp[out_key])
            return jnp.sum(token_losses_of(out, x, tgt, ops, mcfg)) * (m / n_tokens)

        loss, g = pipeline.pipeline_value_and_grad(
            stage_fn, loss_fn, chunks, (tokens, targets), schedule=schedule, send_split=send_split,
            embed_fn=embed_fn,
            embed_params={"embed": gathered["embed"]},
            head_params={"final_norm": gathered["final_norm"], out_key: gathered[out_key]})
        grads = jax.tree.map(jnp.zeros_like, gathered)
        grads["blocks"] = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), g.stages)
        grads["final_norm"] = g.head["final_norm"]
        grads["embed"] = g.embed["embed"]
        if tied:
            grads["embed"] = jax.tree.map(jnp.add, grads["embed"], g.head["embed"])
        else:
            grads["head"] = g.head["head"]
        if engine.zero.params:
            blocks = grads["blocks"]  # not gathered here (each layer is, inside its stage)
            grads = ungather(grads)[0]
            grads["blocks"] = blocks
        loss = jax.lax.psum(loss, dp) if dp else loss
        grads = sync_grads(grads, engine.param_specs, engine.grad_specs, replicas)  # once
        return loss, grads

    explicit = par.mode == "explicit"
    manual = tuple(engine.mesh.axis_names) if explicit else dp + (PIPELINE,)

    def region(specs):
        return jax.tree.map(lambda s: restrict(s, manual), specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    mapped = jax.shard_map(
        local, mesh=engine.mesh,
        in_specs=(region(engine.param_specs), restrict(engine.batch_spec, manual)),
        out_specs=(PartitionSpec(), region(engine.grad_specs)), axis_names=frozenset(manual))

    def fn(params, batch):
        loss, grads = mapped(params, engine._prepare(batch))
        return (loss, grads, {}) if with_metrics else (loss, grads)
    return fn
