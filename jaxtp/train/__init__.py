"""Training: the Trainer (train state and the jitted step), the loop, the optimizer, prefetching,
the run guard, events, and the FLOP formula behind every MFU."""
