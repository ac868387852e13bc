"""What XLA compiled, shown: the placement report, the collective census read from optimized
HLO, where each collective came from, and the planner's predictions verified against it."""
