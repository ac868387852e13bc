"""Parallel degrees -> a named ``jax.sharding.Mesh``.

Axes run outermost (slowest links) to innermost (fastest links):
``pipeline, data, fsdp, context, expert, model``. ``model`` is the tensor-parallel axis and is
innermost so Megatron's per-layer all-reduces stay on NVLink / ICI (Narayanan et al. 2021, sec. 3).
Degrees are validated once, as torchtitan's ``ParallelDims`` does: their product must equal the
device count, and at most one degree may be ``-1`` (inferred). A multi-host mesh is the product of a
per-host (ICI) shape and a cross-host (DCN) shape, built by ``create_hybrid_device_mesh``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxtp.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from jaxtp.layers.moe import MoESettings, check_moe
from jaxtp.pipeline import check_pipeline
from jaxtp.schedules import ScheduleError

AXES: tuple[str, ...] = ("pipeline", "data", "fsdp", "context", "expert", "model")
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")


def resolve_degrees(parallel: ParallelConfig, n_devices: int) -> dict[str, int]:
    """Degrees per axis with the one ``-1`` filled in; errors name the degree to change."""
    degrees = {a: getattr(parallel, a) for a in AXES}
    inferred = [a for a, d in degrees.items() if d == -1]
    bad = [f"parallel.{a}={d}" for a, d in degrees.items() if d == 0 or d < -1]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: degrees must be positive (or -1 for one inferred axis)")
    if len(inferred) > 1:
        raise ConfigError(f"at most one parallel degree may be -1 (inferred); got "
                          f"{', '.join('parallel.' + a for a in inferred)}: set all but one")
    fixed = math.prod(d for d in degrees.values() if d != -1)
    if inferred:
        if n_devices % fixed:
            raise ConfigError(
                f"cannot infer parallel.{inferred[0]}: the other degrees multiply to {fixed}, "
                f"which does not divide the {n_devices} devices; choose degrees whose product "
                f"divides {n_devices}")
        degrees[inferred[0]] = n_devices // fixed
    total = math.prod(degrees.values())
    if total != n_devices:
        shape = " x ".join(f"{a}={d}" for a, d in degrees.items() if d != 1) or "all 1"
        hint = ""
        others = total // degrees["data"]
        if n_devices % others == 0:
            hint = f"; e.g. set parallel.data={n_devices // others} (or -1 to infer it)"
        raise ConfigError(f"mesh {shape} needs {total} devices but {n_devices} are available"
                          f"{hint}")
    return degrees


def dcn_degrees(parallel: ParallelConfig, degrees: dict[str, int],
                n_processes: int) -> dict[str, int]:
    """How many of each axis' degree spans hosts. Defaults to putting all hosts on ``data``."""
    dcn = {a: 1 for a in AXES}
    dcn.update(pipeline=parallel.dcn_pipeline, data=parallel.dcn_data, fsdp=parallel.dcn_fsdp)
    if n_processes > 1 and math.prod(dcn.values()) == 1:
        if degrees["data"] % n_processes == 0:
            dcn["data"] = n_processes
        else:
            raise ConfigError(
                f"{n_processes} processes but parallel.data={degrees['data']} is not a multiple "
                f"of it; set parallel.dcn_data / dcn_pipeline / dcn_fsdp so their product is "
                f"{n_processes}")
    if math.prod(dcn.values()) != n_processes:
        raise ConfigError(f"DCN degrees {dcn} multiply to {math.prod(dcn.values())}, but there are "
                          f"{n_processes} processes (hosts); make parallel.dcn_* multiply to it")
    for a, d in dcn.items():
        if degrees[a] % d:
            raise ConfigError(f"parallel.{a}={degrees[a]} is not divisible by parallel.dcn_{a}={d}")
    return dcn


def build_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The 6-axis mesh for ``parallel`` over ``devices`` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    degrees = resolve_degrees(parallel, len(devices))
    shape = tuple(degrees[a] for a in AXES)
    n_processes = len({d.process_index for d in devices})
    if n_processes > 1:
        dcn = dcn_degrees(parallel, degrees, n_processes)
        ici = tuple(degrees[a] // dcn[a] for a in AXES)
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, tuple(dcn[a] for a in AXES), devices, process_is_granule=True)
    else:
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except (AssertionError, NotImplementedError, ValueError):
            grid = np.asarray(devices).reshape(shape)
    # GSPMD propagation is intended: Auto axis types (jax.make_mesh defaults to Explicit).
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    return {a: int(s) for a, s in mesh.shape.items()}


def validate(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
             degrees: dict[str, int]) -> None:
    """Every DESIGN.md constraint that applies to this model on this mesh, checked before compile."""
    t = degrees["model"]
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
    _validate_experts(model, degrees)
    batch_shards = degrees["data"] * degrees["fsdp"] * degrees["expert"]
    if train.batch_size % batch_shards:
        names = "parallel.data x parallel.fsdp" + (
            " x parallel.expert" if degrees["expert"] > 1 else "")
        raise ConfigError(f"train.batch_size={train.batch_size} is not divisible by the batch "
                          f"shards {names} = {batch_shards}")
    if train.batch_size % (batch_shards * train.microbatches):
        raise ConfigError(f"train.batch_size={train.batch_size} must split into "
                          f"train.microbatches={train.microbatches} on each of {batch_shards} "
                          f"batch shards")
    if train.seq_len > model.max_seq_len:
        raise ConfigError(f"train.seq_len={train.seq_len} exceeds model.max_seq_len="
                          f"{model.max_seq_len}")
    if parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={parallel.zero_stage}: ZeRO stages are 0 (off), "
                          f"1 (moments), 2 (+ gradients) and 3 (+ parameters)")
    _validate_sequence(parallel, train, degrees)
    _validate_pipeline(model, parallel, train, degrees)


def _validate_pipeline(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                       degrees: dict[str, int]) -> None:
    """Pipeline stages: ``pipeline x virtual_stages`` equal slices of the layer scan, a schedule
    that can run ``train.microbatches``, and the features a stage supports."""
    p, v, m = degrees["pipeline"], parallel.virtual_stages, train.microbatches
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
        check_pipeline(parallel.pipeline_schedule, p, m, v)
    except ScheduleError as e:
        raise ConfigError(f"parallel.pipeline_schedule: {e} (train.microbatches sets the "
                          f"micro-batch count)") from None
    if degrees["context"] > 1:
        # Ring attention's ppermutes would run inside the schedule's per-tick branch, which pipeline
        # ranks take at different ticks; XLA:CPU joins a collective-permute across all devices,
        # so the ranks would pair up the wrong permutes.
        raise ConfigError(f"parallel.pipeline={p} with parallel.context={degrees['context']} is "
                          f"not supported: ring attention cannot run inside a pipeline stage yet; "
                          f"use parallel.context=1 (sequence_parallel still splits activations "
                          f"over model) or parallel.pipeline=1")


def _validate_experts(model: ModelConfig, degrees: dict[str, int]) -> None:
    """Mixture of experts: the layer's own constraints (:func:`jaxtp.layers.moe.check_moe`:
    top_k, capacity, experts divisible by ``parallel.expert``); a dense model takes no EP."""
    if model.n_experts == 0:
        if degrees["expert"] > 1:
            raise ConfigError(f"parallel.expert={degrees['expert']} needs model.n_experts > 0: "
                              f"expert parallelism splits the experts of MoE layers, and this "
                              f"model is dense; set model.n_experts (e.g. to a multiple of "
                              f"{degrees['expert']}) or parallel.expert=1")
        return
    check_moe(MoESettings.of(model), degrees["expert"])  # n_layers % moe_every: validate_model


def _validate_sequence(parallel: ParallelConfig, train: TrainConfig,
                       degrees: dict[str, int]) -> None:
    """The sequence splits: ``context`` chunks (two per device for zig-zag), then ``model`` pieces
    of each device's chunk under sequence parallelism."""
    s, cp, t = train.seq_len, degrees["context"], degrees["model"]
    if parallel.context_layout not in ("zigzag", "contiguous"):
        raise ConfigError(f"parallel.context_layout={parallel.context_layout!r}: choose zigzag "
                          f"or contiguous")
    if cp > 1:
        chunks = 2 * cp if parallel.context_layout == "zigzag" else cp
        if s % chunks:
            why = ("the zigzag layout cuts it into 2 x parallel.context chunks, two per device"
                   if parallel.context_layout == "zigzag" else "it is cut into parallel.context "
                                                                "chunks")
            raise ConfigError(f"train.seq_len={s} is not divisible by {chunks}: {why} "
                              f"(parallel.context={cp}); use a seq_len that is a multiple of "
                              f"{chunks} or change parallel.context")
    if parallel.sequence_parallel and (s // cp) % t:
        where = f"each context shard's {s // cp} positions" if cp > 1 else f"train.seq_len={s}"
        raise ConfigError(f"parallel.sequence_parallel splits {where} over parallel.model={t}, "
                          f"which does not divide it; use a seq_len that is a multiple of "
                          f"{cp * t}")
