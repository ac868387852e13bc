"""The training loop: steps, the log / checkpoint / eval windows, and the run's summary.

One host sync per log or checkpoint window (``float(loss)``), never per step. Each logged record
carries ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``step_time_s`` and ``mfu`` (model
FLOPs of :func:`jaxtp.flops.model_flops` over the devices' peak) -- with checkpoint-save time left
out of the window, and the first window flagged ``includes_compile`` -- plus ``eval_loss`` at
eval steps and an MoE model's router metrics. Records go to ``metrics.jsonl`` and TensorBoard;
SIGTERM / SIGINT (:class:`jaxtp.run_guard.StopSignals`) save the current step and stop.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxtp import events, optim

MOE_METRICS = ("lm_loss", "aux_loss", "load_balancing_loss", "z_loss", "dropped_fraction",
               "expert_load")


class TrainingDiverged(RuntimeError):
    """The loss became NaN / Inf; the last good checkpoint is kept."""


def moe_record(metrics: dict) -> dict:
    """The MoE fields of a metrics record (none for a dense model): ``loss`` is the training loss
    (LM + router losses), ``lm_loss`` the next-token part, ``aux_loss`` the router losses summed
    over layers, ``dropped_fraction`` the share of token-to-expert assignments over capacity,
    ``expert_load`` each expert's share of the assignments (averaged over layers) and
    ``expert_load_max`` its largest entry times n_experts (1 = perfectly balanced)."""
    rec = {}
    for k in MOE_METRICS:
        if k in metrics:
            v = np.asarray(metrics[k])
            rec[k] = [float(x) for x in v] if v.ndim else float(v)
    if "expert_load" in rec:
        rec["expert_load_max"] = max(rec["expert_load"]) * len(rec["expert_load"])
    return rec


@dataclass
class Loop:
    """The loop of one run segment, from ``start`` to ``train.steps``. ``trainer`` is a
    :class:`jaxtp.train.Trainer`; ``ckpt`` a :class:`jaxtp.checkpoint.Checkpointer`."""

    cfg: object
    trainer: object
    ckpt: object
    loader: object
    eval_loader: object
    out: Path
    records: list[dict]
    start: int
    stop: object
    watchdog: object
    flops_per_step: float
    peak: float
    is_main: bool
    stopped_at: int | None = None
    _window: list = field(default_factory=lambda: [0.0, 0, True])  # start, steps, first

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    def run(self, state):
        """Steps ``start + 1 .. train.steps``; returns the final state."""
        from tqdm import tqdm

        t = self.cfg.train
        step_fn, self.eval_fn = self.trainer.step_fn(state), self.trainer.eval_fn()
        self.tensorboard = events.EventWriter(self.out, enabled=t.tensorboard and self.is_main)
        profile = events.ProfileWindow(t.profile_steps, self.out)
        bar = tqdm(range(self.start + 1, t.steps + 1), desc="train", disable=not self.is_main,
                   initial=self.start, total=t.steps)
        self._window = [time.perf_counter(), 0, True]
        try:
            for step in bar:
                self.watchdog.beat(step)
                profile.before_step(step)
                self.ckpt.raise_save_errors()  # a failed background save stops the run here
                state, metrics = step_fn(state, self.trainer.put_batch(next(self.loader)))
                self._window[1] += 1
                if self.stop.should_stop(step):  # SIGTERM / SIGINT: save this step, then return
                    self.stopped_at = step
                    break
                rec = self._window_end(step, state, metrics)
                if rec is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                    mfu=f"{100 * rec['mfu']:.1f}%")
            bar.close()
            self._final_save(state)
        finally:
            self.watchdog.beat(t.steps)  # the last save may take a while; it is progress
            profile.stop()
            self.tensorboard.close()
            try:
                self.ckpt.wait()
                self.ckpt.close()
            except Exception:  # already reported by raise_save_errors, or by the error in flight
                pass
        return state

    def _window_end(self, step: int, state, metrics) -> dict | None:
        """At a log or checkpoint step: check the loss, save, and write the record."""
        t = self.cfg.train
        log_now = step % t.log_every == 0 or step == t.steps
        save_now = t.checkpoint_every and step % t.checkpoint_every == 0
        if not (log_now or save_now):
            return None
        loss = float(metrics["loss"])  # the one host sync per log / checkpoint interval
        grad_norm = float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._diverged(step, loss, grad_norm)
        if save_now:  # the save's time is left out of the window's step time
            save_start = time.perf_counter()
            self.ckpt.save(step, state, data_state=self.loader.state())
            self._window[0] += time.perf_counter() - save_start
        if not log_now:
            return None
        rec = self._record(step, loss, grad_norm, metrics, state)
        self._window = [time.perf_counter(), 0, False]
        return rec

    def _diverged(self, step: int, loss: float, grad_norm: float):
        self.ckpt.wait()
        saved = self.ckpt.committed_steps()  # each checksummed and finite when saved
        where = (f"The last good checkpoint is step {saved[-1]} in {self.ckpt.directory} (its "
                 f"arrays were finite and checksummed when saved, and are verified when "
                 f"restored)" if saved else
                 "No checkpoint was saved before it (raise the frequency with "
                 "train.checkpoint_every)")
        raise TrainingDiverged(
            f"loss is {loss} (gradient norm {grad_norm}) at step {step}; stopping. {where}. "
            f"Lower train.lr or raise train.warmup_steps, then resume")

    def _record(self, step: int, loss: float, grad_norm: float, metrics, state) -> dict:
        t = self.cfg.train
        start, steps, first = self._window
        dt = (time.perf_counter() - start) / steps
        rec = {"step": step, "loss": loss, "grad_norm": grad_norm,
               "lr": float(optim.schedule(t)(step - 1)),
               "tokens_per_s": t.batch_size * t.seq_len / dt, "step_time_s": dt,
               "mfu": self.flops_per_step / dt / self.peak}
        rec.update(moe_record(metrics))
        rec.update(self.loader.log_fields())  # a mixture's realised proportions
        if first:  # the first window includes compilation
            rec["includes_compile"] = True
        if step % t.eval_every == 0 or step == t.steps:
            self.eval_loader.step = 0  # the same held-out batches every time
            rec["eval_loss"] = float(np.mean([
                float(self.eval_fn(state.params, self.trainer.put_batch(next(self.eval_loader))))
                for _ in range(t.eval_batches)]))
        self.records.append(rec)
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.tensorboard.write(rec)
        return rec

    def _final_save(self, state) -> None:
        t, ckpt = self.cfg.train, self.ckpt
        if self.stopped_at is not None:
            ckpt.save(self.stopped_at, state, data_state=self.loader.state(), force=True)
            ckpt.wait()
            ckpt.raise_save_errors()
            if self.is_main:
                print(f"jaxtp: {self.stop.received} at step {self.stopped_at} of {t.steps}: "
                      f"saved checkpoint {ckpt.directory / str(self.stopped_at)}; run the same "
                      f"command to resume", flush=True)
        elif self.start < t.steps and ckpt.latest_step() != t.steps:
            ckpt.save(t.steps, state, data_state=self.loader.state(), force=True)
        ckpt.wait()
        ckpt.raise_save_errors()

    def summary(self) -> None:
        """The closing lines: losses, steady-state speed (compile, saves and evals excluded)."""
        if not (self.is_main and self.records and self.stopped_at is None):
            return
        t, records = self.cfg.train, self.records
        events.plot_loss(records, self.out / "loss.png")
        last = records[-1]
        steady = events.steady_state(records)  # median of the windows without compilation
        speed = (f"{steady[0]:.0f} tokens/s, MFU {100 * steady[1]:.2f}% (steady state: median "
                 f"over logged windows, compile, saves and evals excluded)" if steady else
                 "no steady-state window (every logged window included compilation)")
        print(f"done: {t.steps} steps ({t.steps - self.start} in this run), loss "
              f"{records[0]['loss']:.3f} -> {last['loss']:.3f}, eval loss "
              f"{last.get('eval_loss', float('nan')):.3f}, {speed}; metrics in "
              f"{self.metrics_path}, curve in {self.out / 'loss.png'}")
        if "aux_loss" in last:
            print(f"moe: lm loss {last['lm_loss']:.3f}, router aux loss {last['aux_loss']:.4f}, "
                  f"dropped {100 * last['dropped_fraction']:.1f}% of assignments, max expert "
                  f"load {last['expert_load_max']:.2f} x uniform")
