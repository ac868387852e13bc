"""The planner: analytic cost, memory and time models of a parallel layout, hardware
descriptions, the search over layouts, and the fit check run before a first step. No compiling."""
