"""What XLA compiled, shown: the placement report, the collective census read from optimized
HLO, where each collective came from, and the planner's predictions verified against it."""

from jaxtp.inspect.hlo import census, collectives
from jaxtp.inspect.placement import compile_step, format_report, report
from jaxtp.inspect.plan_check import verify

__all__ = [
    "census", "collectives", "compile_step", "format_report", "report", "verify"
]
