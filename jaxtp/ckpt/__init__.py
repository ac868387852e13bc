"""Checkpoints and run directories: sharded asynchronous orbax checkpoints, their integrity
checksums, and the run directory's resolved config."""

from jaxtp.ckpt.checkpoint import Checkpointer, CheckpointSaveError
from jaxtp.ckpt.integrity import restore_latest_good
from jaxtp.ckpt.run_dir import read_run_config, write_run_config

__all__ = [
    "CheckpointSaveError", "Checkpointer", "read_run_config", "restore_latest_good",
    "write_run_config"
]
