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

from jaxtp.configs import AXES, ConfigError, ParallelConfig
from jaxtp.parallel.devices import simulate_hint


def resolve_degrees(parallel: ParallelConfig, n_devices: int, *,
                    platform: str | None = None) -> dict[str, int]:
    """Degrees per axis with the one ``-1`` filled in; errors name the degree to change (and,
    when the devices are CPUs (``platform``) and too few, how to simulate more)."""
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
        if platform == "cpu" and total > n_devices:
            hint += f"; {simulate_hint(total)}"
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
    degrees = resolve_degrees(parallel, len(devices), platform=devices[0].platform)
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


def describe_mesh(shape: dict[str, int]) -> str:
    """``data=2 x model=4``: the axes of more than one device, outermost first."""
    return " x ".join(f"{a}={d}" for a, d in shape.items() if d > 1) or "1 device"
