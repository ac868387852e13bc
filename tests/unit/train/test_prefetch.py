"""The loop that never waits on the host: batches prefetched on a thread (each with the loader
state after it), metrics read one step late, and resume still exact."""

import json
from pathlib import Path

import numpy as np
import pytest

from jaxtp.configs import schema as config
from jaxtp.train import TrainingDiverged
from jaxtp.train import trainer as train
from jaxtp.ckpt.checkpoint import Checkpointer
from jaxtp.train.prefetch import Prefetcher

COMMON = ["train.eval_every=1000", "train.eval_batches=1"]


class _Counting:
    """A loader stand-in: batch k is {"x": k}; log_fields says which batch was read."""

    def __init__(self, fail_at=None):
        self.step, self.fail_at = 0, fail_at

    def __next__(self):
        if self.step == self.fail_at:
            raise ValueError(f"bad batch {self.step}")
        self.step += 1
        return {"x": self.step - 1}

    def state(self):
        return {"step": self.step}

    def log_fields(self):
        return {"read": self.step - 1}


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_items_come_in_order_with_the_state_after_each(depth):
    loader = _Counting()
    feed = Prefetcher(loader, lambda b: b, depth=depth)
    items = [feed.next() for _ in range(6)]
    feed.close()
    assert [i.batch["x"] for i in items] == list(range(6))
    assert [i.data_state for i in items] == [{"step": k + 1} for k in range(6)]
    assert [i.log_fields for i in items] == [{"read": k} for k in range(6)]
    assert 6 <= loader.step <= 6 + depth + 1  # the loader runs ahead by at most the depth


def test_a_loader_error_is_raised_by_next():
    feed = Prefetcher(_Counting(fail_at=2), lambda b: b, depth=2)
    assert feed.next().batch["x"] == 0 and feed.next().batch["x"] == 1
    with pytest.raises(ValueError, match="bad batch 2"):
        feed.next()
    feed.close()


def test_prefetch_must_not_be_negative():
    with pytest.raises(config.ConfigError, match="train.prefetch"):
        config.load("tiny", ["train.prefetch=-1"])


def _losses(out):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_resume_with_prefetch_is_exact(tmp_path):
    """Stop at 20 (checkpoints every 7 and at the end) with two batches prefetched, resume to
    30: each checkpoint's data state is the batches its steps consumed, and every loss equals
    an uninterrupted run's without prefetch, bit for bit."""
    common = ["train.log_every=1", "train.checkpoint_every=7", *COMMON]
    cut, full = tmp_path / "cut", tmp_path / "full"

    def run(out, *o):
        return train.run(config.load("tiny", [f"train.out_dir={out}", *common, *o]))

    run(cut, "train.steps=20", "train.prefetch=2")
    cfg = config.load("tiny", [f"train.out_dir={cut}", *common])
    ckpt = Checkpointer(cut / "checkpoints", keep=3, cfg=cfg)
    like = train.Trainer(cfg).abstract_state()
    for step in ckpt.all_steps():
        _, data_state = ckpt.restore(step, like=like)
        assert data_state["step"] == step, (step, data_state)
    ckpt.close()
    records = run(cut, "train.steps=30", "train.prefetch=2")
    run(full, "train.steps=30", "train.prefetch=0")
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(np.isfinite(r["host_time_s"]) and r["host_time_s"] >= 0 for r in records)
    assert _losses(cut) == _losses(full)


def test_nan_seen_one_step_late_still_keeps_the_last_good_checkpoint(tmp_path):
    """Log windows are read after the next step is dispatched; a divergence found there stops
    the run with the last checkpoint (saved every 2 steps, each checking its own loss first)
    finite and restorable."""
    cfg = config.load("tiny", ["train.steps=200", "train.checkpoint_every=2", "train.lr=1e12",
                               "train.warmup_steps=1", "train.grad_clip=1e30", "train.log_every=1",
                               f"train.out_dir={tmp_path}", *COMMON])
    with pytest.raises(TrainingDiverged, match="last good checkpoint is step"):
        train.run(cfg)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3, cfg=cfg)
    step = ckpt.latest_step()
    assert step is not None
    state, data_state = ckpt.restore(step, like=train.Trainer(cfg).abstract_state())
    ckpt.close()
    assert data_state["step"] == step
    import jax

    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
