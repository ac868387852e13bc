"""The planner: analytic cost, memory and time models of a parallel layout, hardware
descriptions, the search over layouts, and the fit check run before a first step. No compiling."""

from jaxtp.planner.cost_model import Candidate, Estimate, Shape
from jaxtp.planner.fit_check import fit_warning
from jaxtp.planner.hardware import HARDWARE, PEAK_FLOPS, Hardware, get_hardware, load_hardware
from jaxtp.planner.search import SearchSpace, plan, predicted_grad_step

__all__ = [
    "Candidate", "Estimate", "HARDWARE", "Hardware", "PEAK_FLOPS", "SearchSpace", "Shape",
    "fit_warning", "get_hardware", "load_hardware", "plan", "predicted_grad_step"
]
