"""Checkpoints and run directories: sharded asynchronous orbax checkpoints, their integrity
checksums, and the run directory's resolved config."""
