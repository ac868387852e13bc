"""One model on one mesh, stepped: the Layout (where every byte lives), the Region (the one reader
of ``parallel.mode``), the plain and pipelined loss-and-gradient steps, and the Engine that
gathers them."""

from jaxtp.step.engine import Engine, build_engine, reference_loss_fn, reference_params
from jaxtp.step.layout import Layout, build_layout
from jaxtp.step.pipelined import branch_weights, forward_branch_weights
from jaxtp.step.region import ExplicitRegion, GSPMDRegion, Region, region_for

__all__ = [
    "Engine", "ExplicitRegion", "GSPMDRegion", "Layout", "Region", "branch_weights",
    "build_engine", "build_layout", "forward_branch_weights", "reference_loss_fn",
    "reference_params", "region_for"
]
