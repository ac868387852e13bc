"""Training: the Trainer (train state and the jitted step), the loop, the optimizer, prefetching,
the run guard, events, and the FLOP formula behind every MFU."""

from jaxtp.train.flops import model_flops
from jaxtp.train.loop import TrainingDiverged
from jaxtp.train.trainer import Trainer, TrainState, run

__all__ = [
    "TrainState", "Trainer", "TrainingDiverged", "model_flops", "run"
]
