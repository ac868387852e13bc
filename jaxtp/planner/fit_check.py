"""Will this layout fit? The planner's memory prediction, checked before the first step.

``jaxtp train`` compares :func:`jaxtp.planner.memory_model.memory`'s per-device total for the run's layout
with the memory the devices report (``memory_stats()["bytes_limit"]``; CPU devices report none,
so a simulated mesh is never warned about) and warns before step 1 when the prediction exceeds
it, so a layout that will run out of memory says so before minutes of compilation.
"""

from __future__ import annotations

from jaxtp.configs import AXES, Config
from jaxtp.planner.cost_model import Candidate, Shape
from jaxtp.planner.memory_model import memory


def predicted_bytes(cfg: Config, degrees: dict[str, int]) -> float:
    """The planner's per-device memory total for ``cfg`` on a mesh of ``degrees``."""
    par = cfg.parallel
    layout = Candidate(**{a: degrees[a] for a in AXES},
                       zero_stage=par.zero_stage, remat=par.remat,
                       sequence_parallel=par.sequence_parallel,
                       pipeline_schedule=par.pipeline_schedule, virtual_stages=par.virtual_stages,
                       microbatches=cfg.train.microbatches)
    return memory(Shape.of(cfg), layout)["total"]


def device_bytes(devices) -> int | None:
    """The smallest memory limit the devices report (``None``: they report none, e.g. CPU)."""
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # some backends do not implement it
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def fit_warning(cfg: Config, degrees: dict[str, int], devices) -> str | None:
    """A one-line warning when the predicted bytes per device exceed the device's memory."""
    limit = device_bytes(devices)
    if limit is None:
        return None
    need = predicted_bytes(cfg, degrees)
    if need <= limit:
        return None
    return (f"jaxtp: warning: this layout is predicted to need {need / 2**30:.2f} GiB per device "
            f"but the devices hold {limit / 2**30:.2f} GiB; it will likely run out of memory "
            f"(see jaxtp plan for layouts that fit: more ZeRO, TP or pipeline stages, remat)")
