"""Hardware descriptions for the planner: compute peak, memory, and two classes of links.

A machine is a set of *nodes* of ``devices_per_node`` accelerators. Inside a node the devices talk
over a fast link (NVLink / NVSwitch on GPU servers, ICI inside a TPU slice); between nodes over a
slow one (InfiniBand, or DCN between TPU slices). This two-class view is the one Narayanan et al.
2021 (arXiv 2104.04473, sec. 3) reason with: keep tensor parallelism inside a node, put pipeline
and data parallelism across nodes. Each link class is an alpha-beta model: a message of ``n``
bytes costs ``latency + n / bandwidth`` seconds per hop, bandwidth being what one device can push
in one direction (a ring collective's "bus bandwidth").

The presets are datasheet-level numbers (bf16 dense peak without sparsity, HBM capacity and
bandwidth, link bandwidth per device per direction); latencies and the two efficiency factors are
order-of-magnitude assumptions, not measurements. Every field can be changed: on the command line
with ``hardware.FIELD=VALUE`` overrides (e.g. ``hardware.hbm_bytes=40e9``), or with
``--hardware-file FILE.json`` holding an object of fields (``{"name": ..., "peak_flops": ...}``;
with ``"base": "a100"`` it starts from a preset and changes only the fields it names).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from jaxtp.configs import ConfigError

# Dense bf16 peak FLOP/s per device (vendor datasheets; no sparsity), keyed by a substring of
# JAX's ``device_kind``: the one peak table, for MFU at run time and for the presets below.
PEAK_FLOPS: dict[str, float] = {
    "a100": 312e12, "h100": 989e12, "h200": 989e12,
    "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12, "tpu v5p": 459e12,
    "tpu v5": 459e12, "tpu v6 lite": 918e12, "tpu v6e": 918e12,
}


@dataclass(frozen=True)
class Link:
    """One link class, per device and per direction."""

    bandwidth: float  # bytes / s
    latency: float  # s per hop (a ring collective over n devices makes 2 (n - 1) hops)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_bytes: float  # memory per device
    hbm_bandwidth: float  # bytes / s per device
    devices_per_node: int  # devices sharing the fast link (a GPU server; a TPU slice)
    intra: Link  # inside a node: NVLink / ICI
    inter: Link  # across nodes: InfiniBand / DCN
    # Fraction of peak a large bf16 matmul sustains (cuBLAS / XLA on big GEMMs); the planner's
    # one compute-efficiency factor.
    matmul_efficiency: float = 0.8
    # Fraction of HBM a layout may plan to use: the runtime, the allocator's fragmentation and
    # buffers the cost model does not see take the rest.
    usable_hbm_fraction: float = 0.9

    @property
    def usable_hbm_bytes(self) -> float:
        return self.hbm_bytes * self.usable_hbm_fraction


def _gpu_node(name: str, *, peak: float, hbm: float, hbm_bw: float, nvlink: float,
              ib: float, efficiency: float) -> Hardware:
    # NVSwitch: every GPU of the node reaches every other at full NVLink rate; one IB NIC per GPU.
    return Hardware(name=name, peak_flops=peak, hbm_bytes=hbm, hbm_bandwidth=hbm_bw,
                    devices_per_node=8, intra=Link(nvlink, 3e-6), inter=Link(ib, 10e-6),
                    matmul_efficiency=efficiency)


def _tpu_slice(name: str, *, peak: float, hbm: float, hbm_bw: float, ici_link: float,
               slice_chips: int, dcn: float) -> Hardware:
    # A ring along one torus dimension uses the links both ways round: 2 x one link's rate.
    return Hardware(name=name, peak_flops=peak, hbm_bytes=hbm, hbm_bandwidth=hbm_bw,
                    devices_per_node=slice_chips, intra=Link(2 * ici_link, 1e-6),
                    inter=Link(dcn, 20e-6), matmul_efficiency=0.8)


HARDWARE: dict[str, Hardware] = {
    # DGX A100 80GB (Narayanan et al.'s Selene nodes): NVLink 3 600 GB/s bidirectional per GPU,
    # 8 x HDR InfiniBand 200 Gb/s per node.
    "a100": _gpu_node(
        "a100", peak=PEAK_FLOPS["a100"], hbm=80e9, hbm_bw=2.04e12, nvlink=300e9, ib=25e9,
        efficiency=0.8),
    # DGX H100: NVLink 4 900 GB/s bidirectional per GPU, 8 x NDR 400 Gb/s per node.
    "h100": _gpu_node(
        "h100", peak=PEAK_FLOPS["h100"], hbm=80e9, hbm_bw=3.35e12, nvlink=450e9, ib=50e9,
        efficiency=0.7),
    # DGX H200: the H100's compute and links with 141 GB of HBM3e.
    "h200": _gpu_node(
        "h200", peak=PEAK_FLOPS["h200"], hbm=141e9, hbm_bw=4.8e12, nvlink=450e9, ib=50e9,
        efficiency=0.7),
    # TPU slices: ICI inside a slice (3D torus on v4 / v5p, 2D on v6e), DCN between slices.
    "tpu-v4": _tpu_slice(
        "tpu-v4", peak=PEAK_FLOPS["tpu v4"], hbm=32 * 2**30, hbm_bw=1.2e12, ici_link=45e9,
        slice_chips=4096, dcn=6.25e9),
    "tpu-v5p": _tpu_slice(
        "tpu-v5p", peak=PEAK_FLOPS["tpu v5p"], hbm=95 * 2**30, hbm_bw=2.76e12, ici_link=90e9,
        slice_chips=8960, dcn=6.25e9),
    "tpu-v6e": _tpu_slice(
        "tpu-v6e", peak=PEAK_FLOPS["tpu v6e"], hbm=32 * 2**30, hbm_bw=1.64e12, ici_link=90e9,
        slice_chips=256, dcn=6.25e9),
}


def _replace(hw: Hardware, key: str, value) -> Hardware:
    """``hw`` with one field changed; ``intra.bandwidth`` style keys reach into a link."""
    head, _, rest = key.partition(".")
    names = {f.name for f in dataclasses.fields(hw)}
    if head not in names:
        raise ConfigError(f"unknown hardware field {key!r}; fields are: "
                          + ", ".join(sorted(names - {"intra", "inter"})
                                      + ["intra.bandwidth", "intra.latency", "inter.bandwidth",
                                         "inter.latency"]))
    current = getattr(hw, head)
    if isinstance(current, Link):
        if rest not in ("bandwidth", "latency"):
            raise ConfigError(f"hardware.{key}: a link has bandwidth and latency")
        return dataclasses.replace(hw, **{head: dataclasses.replace(current,
                                                                    **{rest: float(value)})})
    if rest:
        raise ConfigError(f"hardware.{key}: {head} has no fields")
    try:
        typed = type(current)(value)
    except (TypeError, ValueError):
        raise ConfigError(f"hardware.{key}={value!r} is not a {type(current).__name__}") from None
    return dataclasses.replace(hw, **{head: typed})


def _from_json(obj: dict) -> Hardware:
    if not isinstance(obj, dict):
        raise ConfigError("a hardware file holds one JSON object of Hardware fields")
    obj = dict(obj)
    base = obj.pop("base", None)
    if base is None:
        try:
            links = {k: Link(**obj.pop(k)) for k in ("intra", "inter")}
            return Hardware(**obj, **links)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"hardware file: {e}; give every field of Hardware, or "
                              f'"base": "<preset>" and the fields to change') from None
    hw = get_hardware(base)
    for key, value in obj.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                hw = _replace(hw, f"{key}.{sub}", v)
        else:
            hw = _replace(hw, key, value)
    return hw


def get_hardware(name: str) -> Hardware:
    key = name.lower().replace("_", "-")
    key = {"v4": "tpu-v4", "v5p": "tpu-v5p", "v6e": "tpu-v6e"}.get(key, key)
    if key not in HARDWARE:
        raise ConfigError(f"unknown hardware {name!r}; presets are: {', '.join(HARDWARE)} "
                          f"(or --hardware-file FILE.json)")
    return HARDWARE[key]


def load_hardware(name: str = "a100", overrides: list[str] | tuple[str, ...] = (),
                  file: str | None = None) -> Hardware:
    """The preset ``name`` (or the JSON ``file``) with ``hardware.FIELD=VALUE`` overrides."""
    hw = _from_json(json.loads(Path(file).read_text())) if file else get_hardware(name)
    for item in overrides:
        key, _, value = item.partition("=")
        hw = _replace(hw, key.strip().removeprefix("hardware."), value.strip())
    if hw.devices_per_node < 1 or hw.peak_flops <= 0 or hw.hbm_bytes <= 0:
        raise ConfigError(f"hardware {hw.name}: devices_per_node, peak_flops and hbm_bytes must "
                          f"be positive")
    return hw


def to_json(hw: Hardware) -> dict:
    return dataclasses.asdict(hw)
