"""Pipeline parallelism, model-agnostic: schedules as data, their packing into per-rank programs,
the runtime that executes them over the ``pipeline`` axis, the B/W split of a stage's backward
(ZB-H1) and the order of the stacked layers."""
