"""Pipeline parallelism, model-agnostic: schedules as data, their packing into per-rank programs,
the runtime that executes them over the ``pipeline`` axis, the B/W split of a stage's backward
(ZB-H1) and the order of the stacked layers."""

from jaxtp.pipeline.layer_order import (
    ranks_to_stages,
    stages_to_ranks,
    to_natural_order,
    to_pipeline_order,
)
from jaxtp.pipeline.program import (
    Branch,
    Program,
    Segment,
    Step,
    compile_schedule,
    stores_residuals,
)
from jaxtp.pipeline.runtime import pipeline_value_and_grad, vary_over, varying_axes
from jaxtp.pipeline.schedules import (
    Schedule,
    ScheduleError,
    build_schedule,
    check_pipeline,
    lockstep_factor,
)
from jaxtp.pipeline.weight_grad import is_splitting, weight_einsum, with_split_markers

__all__ = [
    "Branch", "Program", "Schedule", "ScheduleError", "Segment", "Step", "build_schedule",
    "check_pipeline", "compile_schedule", "is_splitting", "lockstep_factor",
    "pipeline_value_and_grad", "ranks_to_stages", "stages_to_ranks", "stores_residuals",
    "to_natural_order", "to_pipeline_order", "vary_over", "varying_axes", "weight_einsum",
    "with_split_markers"
]
