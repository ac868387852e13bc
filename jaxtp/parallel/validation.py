"""Every rule a config must satisfy on a mesh, checked once, before anything is allocated or
compiled.

:func:`validate` is the one entry point: the mesh builder, the engine, the public API and the
planner all call it, so a layout the planner proposes is exactly a layout the trainer accepts.
Each rule lives here once and its error names the constraint and the fix (DESIGN.md, Errors):
heads / KV heads / MLP width divisible by the tensor-parallel degree, experts by the
expert-parallel degree, the batch by its shards and micro-batches, the sequence by its
context / sequence-parallel splits, layers by pipeline stages, micro-batches by what the schedule
needs. Rules about one model's own fields (no mesh) run at config load
(:func:`jaxtp.configs.check_values.validate_model`) and again here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from jaxtp.configs import (
    CONTEXT,
    CONTEXT_LAYOUTS,
    EXPERT,
    MODEL,
    PIPELINE,
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    validate_model,
)
from jaxtp.pipeline import ScheduleError, check_pipeline


def validate(cfg: Config, degrees: Mapping[str, int], *, platform: str | None = None,
             training: bool = True) -> None:
    """Raise :class:`~jaxtp.configs.schema.ConfigError` for the first rule ``cfg`` breaks on a mesh of
    ``degrees`` (each axis' resolved size) on ``platform`` (``cpu``, ``gpu``, ``tpu``; ``None``
    skips the platform rules). ``training=False`` (scoring and generation with
    :class:`jaxtp.Model`): the ``train.*`` batch, sequence and micro-batch rules are skipped,
    since each call brings its own batch and is checked then."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train
    validate_model(model)
    _tensor_parallel(model, degrees)
    _experts(model, degrees)
    if training:
        _train_batch(model, parallel, train, degrees)
    _pipeline(model, parallel, train, degrees, training=training)
    _attention(model, degrees, platform)


def _train_batch(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                 degrees: Mapping[str, int]) -> None:
    _batch(train, degrees)
    if train.seq_len > model.max_seq_len:
        raise ConfigError(f"train.seq_len={train.seq_len} exceeds model.max_seq_len="
                          f"{model.max_seq_len}")
    if parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={parallel.zero_stage}: ZeRO stages are 0 (off), "
                          f"1 (moments), 2 (+ gradients) and 3 (+ parameters)")
    _sequence(parallel, train, degrees)


def _tensor_parallel(model: ModelConfig, degrees: Mapping[str, int]) -> None:
    t = degrees[MODEL]
    if model.n_heads % t:
        raise ConfigError(f"model.n_heads={model.n_heads} is not divisible by parallel.model={t}; "
                          f"use a tensor-parallel degree that divides {model.n_heads}")
    if model.n_kv_heads % t:
        raise ConfigError(
            f"model.n_kv_heads={model.n_kv_heads} is not divisible by parallel.model={t}: each "
            f"tensor-parallel rank needs whole KV heads; use parallel.model <= n_kv_heads "
            f"dividing it, or raise model.n_kv_heads")
    if model.d_ff % t:
        raise ConfigError(f"model.d_ff={model.d_ff} is not divisible by parallel.model={t}")


def check_experts(*, n_experts: int, top_k: int, capacity_factor: float, moe_every: int = 1,
                  router_aux_loss_coef: float = 0.0, router_z_loss_coef: float = 0.0,
                  expert_degree: int = 1) -> None:
    """The Mixture-of-Experts rules (the layer's own and expert parallelism's)."""
    if n_experts < 1:
        raise ConfigError(f"model.n_experts={n_experts} must be >= 1")
    if not 1 <= top_k <= n_experts:
        raise ConfigError(f"model.top_k={top_k} must be between 1 and model.n_experts="
                          f"{n_experts}: each token picks top_k distinct experts; lower "
                          f"model.top_k or raise model.n_experts")
    if n_experts % expert_degree:
        raise ConfigError(f"model.n_experts={n_experts} is not divisible by parallel.expert="
                          f"{expert_degree}: each expert rank holds n_experts / expert whole "
                          f"experts; use a parallel.expert that divides {n_experts} or change "
                          f"model.n_experts")
    if capacity_factor < 0:
        raise ConfigError(f"model.capacity_factor={capacity_factor} must be >= 0 "
                          f"(0 = dropless)")
    if moe_every < 1:
        raise ConfigError(f"model.moe_every={moe_every} must be >= 1")
    if router_aux_loss_coef < 0 or router_z_loss_coef < 0:
        raise ConfigError("model.router_aux_loss_coef and model.router_z_loss_coef must be >= 0")


def _experts(model: ModelConfig, degrees: Mapping[str, int]) -> None:
    """A dense model takes no expert parallelism; an MoE model's experts split over it."""
    if model.n_experts == 0:
        if degrees[EXPERT] > 1:
            raise ConfigError(f"parallel.expert={degrees[EXPERT]} needs model.n_experts > 0: "
                              f"expert parallelism splits the experts of MoE layers, and this "
                              f"model is dense; set model.n_experts (e.g. to a multiple of "
                              f"{degrees[EXPERT]}) or parallel.expert=1")
        return
    check_experts(n_experts=model.n_experts, top_k=model.top_k,
                  capacity_factor=model.capacity_factor, moe_every=model.moe_every,
                  router_aux_loss_coef=model.router_aux_loss_coef,
                  router_z_loss_coef=model.router_z_loss_coef, expert_degree=degrees[EXPERT])


def batch_shards(degrees: Mapping[str, int]) -> int:
    """How many ways the batch dim is split: ``data x fsdp`` (x ``expert`` under EP)."""
    return degrees["data"] * degrees["fsdp"] * degrees[EXPERT]


def _batch(train: TrainConfig, degrees: Mapping[str, int]) -> None:
    shards = batch_shards(degrees)
    if train.batch_size % shards:
        names = "parallel.data x parallel.fsdp" + (
            " x parallel.expert" if degrees[EXPERT] > 1 else "")
        raise ConfigError(f"train.batch_size={train.batch_size} is not divisible by the batch "
                          f"shards {names} = {shards}")
    if train.batch_size % (shards * train.microbatches):
        raise ConfigError(f"train.batch_size={train.batch_size} must split into "
                          f"train.microbatches={train.microbatches} on each of {shards} "
                          f"batch shards")


def _context_chunks(context: int, layout: str) -> int:
    """The pieces context parallelism cuts a sequence into: one per ``context`` device, two per
    device for zig-zag (none below a degree of 2)."""
    if context == 1:
        return 1
    return 2 * context if layout == "zigzag" else context


def _sequence_multiple(*, context: int, layout: str, model: int,
                       sequence_parallel: bool) -> int:
    """The sequence lengths :func:`check_sequence` accepts are the multiples of this: the context
    chunks, and under sequence parallelism ``model`` pieces of each device's context shard."""
    chunks = _context_chunks(context, layout)
    return math.lcm(chunks, context * model) if sequence_parallel else chunks


def padded_seq_len(seq_len: int, *, context: int, layout: str, model: int = 1,
                   sequence_parallel: bool = False) -> int:
    """The shortest length ``>= seq_len`` that :func:`check_sequence` accepts (what
    :class:`jaxtp.Model` pads a batch's positions to)."""
    multiple = _sequence_multiple(context=context, layout=layout, model=model,
                                  sequence_parallel=sequence_parallel)
    return -(-seq_len // multiple) * multiple


def check_sequence(seq_len: int, *, context: int, layout: str, model: int = 1,
                   sequence_parallel: bool = False) -> None:
    """The sequence splits: ``context`` chunks (two per device for zig-zag), then ``model`` pieces
    of each device's chunk under sequence parallelism."""
    s, cp, t = seq_len, context, model
    if cp < 1:
        raise ConfigError(f"parallel.context={cp}: the context-parallel degree must be >= 1")
    if layout not in CONTEXT_LAYOUTS:
        raise ConfigError(f"parallel.context_layout={layout!r}: the ring attention layout must "
                          f"be one of {', '.join(CONTEXT_LAYOUTS)}")
    chunks = _context_chunks(cp, layout)
    if s % chunks:
        why = ("the zigzag layout cuts it into 2 x parallel.context chunks, two per device"
               if layout == "zigzag" else "it is cut into parallel.context chunks")
        raise ConfigError(f"train.seq_len={s} is not divisible by {chunks}: {why} "
                          f"(parallel.context={cp}); use a seq_len that is a multiple of "
                          f"{chunks} or change parallel.context")
    multiple = _sequence_multiple(context=cp, layout=layout, model=t,
                                  sequence_parallel=sequence_parallel)
    if s % multiple:
        where = f"each context shard's {s // cp} positions" if cp > 1 else f"train.seq_len={s}"
        raise ConfigError(f"parallel.sequence_parallel splits {where} over parallel.model={t}, "
                          f"which does not divide it; use a seq_len that is a multiple of "
                          f"{multiple}")


def _sequence(parallel: ParallelConfig, train: TrainConfig, degrees: Mapping[str, int]) -> None:
    check_sequence(train.seq_len, context=degrees[CONTEXT], layout=parallel.context_layout,
                   model=degrees[MODEL], sequence_parallel=parallel.sequence_parallel)


def _pipeline(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
              degrees: Mapping[str, int], *, training: bool = True) -> None:
    """Pipeline stages: ``pipeline x virtual_stages`` equal slices of the layer scan, a schedule
    that can run ``train.microbatches``, and the features a stage supports."""
    p, v, m = degrees[PIPELINE], parallel.virtual_stages, train.microbatches
    if p == 1:
        if v != 1:
            raise ConfigError(f"parallel.virtual_stages={v} needs parallel.pipeline > 1")
        return
    if model.n_experts > 0:
        raise ConfigError(f"parallel.pipeline={p} with model.n_experts={model.n_experts} (MoE) is "
                          f"not supported yet: a stage does not carry the router losses; use "
                          f"parallel.pipeline=1 or a dense model")
    stages, n = p * v, model.n_layers
    if n < stages:
        raise ConfigError(f"model.n_layers={n} is fewer than the parallel.pipeline={p} x "
                          f"parallel.virtual_stages={v} = {stages} pipeline stages, which need at "
                          f"least one layer each; use fewer stages or more layers")
    if n % stages:
        raise ConfigError(f"model.n_layers={n} does not split evenly into parallel.pipeline={p} "
                          f"x parallel.virtual_stages={v} = {stages} stages (uneven stages are "
                          f"not supported yet); use a stage count that divides {n}")
    try:
        check_pipeline(parallel.pipeline_schedule, p, m if training else max(m, p * v), v)
    except ScheduleError as e:
        raise ConfigError(f"parallel.pipeline_schedule: {e} (train.microbatches sets the "
                          f"micro-batch count)") from None
    if degrees[CONTEXT] > 1:
        # Ring attention's ppermutes would run inside the schedule's per-tick branch, which
        # pipeline ranks take at different ticks; XLA:CPU joins a collective-permute across all
        # devices, so the ranks would pair up the wrong permutes.
        raise ConfigError(f"parallel.pipeline={p} with parallel.context={degrees[CONTEXT]} is "
                          f"not supported: ring attention cannot run inside a pipeline stage yet; "
                          f"use parallel.context=1 (sequence_parallel still splits activations "
                          f"over model) or parallel.pipeline=1")


def _attention(model: ModelConfig, degrees: Mapping[str, int], platform: str | None) -> None:
    if model.attention_impl != "default" and degrees[CONTEXT] > 1:
        raise ConfigError(f"model.attention_impl={model.attention_impl} has no effect with "
                          f"parallel.context={degrees[CONTEXT]}: ring attention computes the "
                          f"blocks itself; use model.attention_impl=default or parallel.context=1")
    if platform is not None and model.attention_impl == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention_impl=cudnn needs NVIDIA GPUs, but the mesh is on "
                          f"{platform}; use model.attention_impl=default or xla")
