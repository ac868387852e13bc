"""The training loop: steps, the log / checkpoint / eval windows, and the run's summary.

The host never waits on the step it just dispatched. Batches are read and placed on the devices
ahead of time (:mod:`jaxtp.train.prefetch`, ``train.prefetch`` steps), and a log window's metrics are read
(``float(loss)``, the one host sync per window) only after the next step has been dispatched, so a
step is always in flight; NaN / Inf is therefore seen at most one step late, and a checkpoint step
checks its own loss before it saves, so the last good checkpoint is kept. A step whose state is
saved or evaluated dispatches a copy of that state on the devices, its checksums and the eval
batches, then the next step (which donates the state), and only then reads them and hands the copy
to the checkpointer, whose copy to the host runs beside the next step (``train.checkpoint_overlap``;
"off": the save and eval run before the next dispatch, with no copy; "auto": on for accelerators
with the memory, off on CPU). Each logged record carries ``loss``, ``grad_norm``, ``lr``,
``tokens_per_s``, ``step_time_s`` and ``mfu`` (model FLOPs of :func:`jaxtp.train.flops.model_flops` over
the devices' peak) -- with the waits for saves and evals left out of the windows, and the first
window flagged ``includes_compile`` -- plus ``host_time_s``, the main thread's own work per step
outside the compiled step (data hand-over, loop bookkeeping, logging; waits on the devices, saves
and evals excluded) and ``host_parts_s``, those parts and ``dispatch``, the step call itself (on
XLA:CPU a step with collectives returns only once the previous step has finished, so there it holds
that wait and is not counted as host work), then ``eval_loss`` at eval steps and an MoE model's
router metrics.
Records go to ``metrics.jsonl`` and TensorBoard; SIGTERM / SIGINT
(:class:`jaxtp.train.run_guard.StopSignals`) save the current step and stop.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from jaxtp.train import events, optim
from jaxtp.train.prefetch import Prefetcher

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


HOST_PARTS = ("data", "dispatch", "loop", "logging")


@dataclass
class _Window:
    """The steps since the last logged record: when the first began, how many, the main
    thread's host seconds in them, and whether compilation is among them."""

    start: float
    steps: int = 0
    host: dict = field(default_factory=lambda: dict.fromkeys(HOST_PARTS, 0.0))
    first: bool = False


@dataclass
class _StateWork:
    """What a save / eval step dispatched from its state before the next step donated it."""

    snapshot: object | None  # a jaxtp.ckpt.checkpoint.Snapshot (a device copy) to save
    data_state: dict | None  # the loader state after the step's batch
    eval_losses: list | None  # the eval batches' losses, device scalars


def _copy_pays(state) -> bool:
    """Whether the copy pays: not on CPU devices (they are the host's cores, so the copy and the
    save compete with the next step for them: benchmarks/checkpoint_overlap.py measured 1.77 s
    against 1.59 s a save), and elsewhere where every local device has room for one more copy
    of its part of ``state`` beside the step's peak (or reports no memory statistics)."""
    need: dict = {}
    for leaf in jax.tree.leaves(state):
        for shard in getattr(leaf, "addressable_shards", ()):
            need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
    if any(getattr(d, "platform", "") == "cpu" for d in need):
        return False
    for device, nbytes in need.items():
        stats = device.memory_stats() or {}
        limit, peak = stats.get("bytes_limit"), stats.get("peak_bytes_in_use")
        if limit and peak is not None and peak + nbytes > 0.95 * limit:
            print(f"jaxtp: checkpoint saves wait for the copy to the host: {device} has "
                  f"{(limit - peak) / 2**30:.1f} GiB free at the step's peak, a copy of the "
                  f"train state needs {nbytes / 2**30:.1f} GiB (train.checkpoint_overlap=on "
                  f"copies anyway)", flush=True)
            return False
    return True


@dataclass
class Loop:
    """The loop of one run segment, from ``start`` to ``train.steps``. ``trainer`` is a
    :class:`jaxtp.train.trainer.Trainer`; ``ckpt`` a :class:`jaxtp.ckpt.checkpoint.Checkpointer`;
    ``loader`` anything with ``next`` and ``state()`` (and optionally ``log_fields()``)."""

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
    # the main thread's seconds per part over the whole segment (HOST_PARTS), and the steps run
    host_time: dict = field(default_factory=lambda: dict.fromkeys(HOST_PARTS, 0.0))
    steps_run: int = 0
    _overlap_on: bool | None = None  # train.checkpoint_overlap, decided at the first save step
    _win: _Window = field(default_factory=lambda: _Window(0.0))
    _data_state: dict | None = None  # the loader state after the last consumed batch

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    def _host(self, part: str, since: float) -> float:
        now = time.perf_counter()
        self.host_time[part] += now - since
        self._win.host[part] += now - since
        return now

    def run(self, state):
        """Steps ``start + 1 .. train.steps``; returns the final state."""
        from tqdm import tqdm

        t = self.cfg.train
        step_fn, self.eval_fn = self.trainer.step_fn(state), self.trainer.eval_fn()
        self.tensorboard = events.EventWriter(self.out, enabled=t.tensorboard and self.is_main)
        profile = events.ProfileWindow(t.profile_steps, self.out)
        bar = tqdm(range(self.start + 1, t.steps + 1), desc="train", disable=not self.is_main,
                   initial=self.start, total=t.steps)
        self._data_state = self.loader.state()
        feed = Prefetcher(self.loader, self.trainer.put_batch, depth=t.prefetch)
        self._win = _Window(time.perf_counter(), first=True)
        pending = None  # a log window's (step, metrics, steps, fields), read after the next step
        try:
            for step in bar:
                t0 = time.perf_counter()
                self.watchdog.beat(step)
                profile.before_step(step)
                self.ckpt.raise_save_errors()  # a failed background save stops the run here
                t0 = self._host("loop", t0)
                item = feed.next()
                t0 = self._host("data", t0)
                state, metrics = step_fn(state, item.batch)
                self._host("dispatch", t0)
                self._data_state = item.data_state
                self._win.steps += 1
                self.steps_run += 1
                if pending is not None:  # the previous step's window, now that this one runs
                    self._show(bar, self._window_end(*pending))
                    pending = None
                if self.stop.should_stop(step):  # SIGTERM / SIGINT: save this step, then return
                    self.stopped_at = step
                    if step % t.log_every == 0:  # its record too: a resume starts after it
                        self._show(bar, self._window_end(step, metrics, self._win.steps,
                                                            item.log_fields))
                    break
                if self._needs_state(step):  # save / eval read this step's state
                    if self._overlap(state):  # from a copy, once the next step is dispatched
                        pending = (step, metrics, self._win.steps, item.log_fields, None,
                                   self._start_state_work(step, state))
                    else:  # now: the next step's dispatch donates it
                        self._show(bar, self._window_end(step, metrics, self._win.steps,
                                                            item.log_fields, state))
                elif step % t.log_every == 0 or step == t.steps:
                    pending = (step, metrics, self._win.steps, item.log_fields)
            if pending is not None:
                self._show(bar, self._window_end(*pending))
            bar.close()
            self._final_save(state)
        finally:
            feed.close()
            self.watchdog.beat(t.steps)  # the last save may take a while; it is progress
            profile.stop()
            self.tensorboard.close()
            try:
                self.ckpt.wait()
                self.ckpt.close()
            except Exception:  # already reported by raise_save_errors, or by the error in flight
                pass
        return state

    @staticmethod
    def _show(bar, rec: dict | None) -> None:
        if rec is not None:
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                            mfu=f"{100 * rec['mfu']:.1f}%")

    def _needs_state(self, step: int) -> bool:
        t = self.cfg.train
        log_now = step % t.log_every == 0 or step == t.steps
        save_now = t.checkpoint_every and step % t.checkpoint_every == 0
        return bool(save_now or (log_now and (step % t.eval_every == 0 or step == t.steps)))

    def _overlap(self, state) -> bool:
        """Whether a save / eval step's work waits for the next step's dispatch
        (``train.checkpoint_overlap``); "auto" decides once, at the first such step."""
        if self._overlap_on is None:
            choice = self.cfg.train.checkpoint_overlap
            self._overlap_on = choice == "on" or (choice == "auto" and _copy_pays(state))
        return self._overlap_on

    def _start_state_work(self, step: int, state) -> _StateWork:
        """Dispatch what a save / eval step needs from ``state`` before the next step donates
        it: a copy of it on the devices and its checksums to save, the eval batches' losses."""
        t = self.cfg.train
        save = bool(t.checkpoint_every and step % t.checkpoint_every == 0)
        log_now = step % t.log_every == 0 or step == t.steps
        evaluate = log_now and (step % t.eval_every == 0 or step == t.steps)
        return _StateWork(snapshot=self.ckpt.snapshot(state) if save else None,
                          data_state=self._data_state,
                          eval_losses=self._start_eval(state) if evaluate else None)

    def _window_end(self, step: int, metrics, steps: int, fields: dict,
                    state=None, work: _StateWork | None = None) -> dict | None:
        """At a log or checkpoint step, the window's first ``steps`` steps ending there: check
        the loss, save and evaluate (``state`` given: this step's, now; ``work``: from what
        :meth:`_start_state_work` dispatched), and write the record."""
        t = self.cfg.train
        log_now = step % t.log_every == 0 or step == t.steps
        save_now = state is not None and t.checkpoint_every and step % t.checkpoint_every == 0
        loss = float(metrics["loss"])  # the one host sync per log / checkpoint interval
        grad_norm = float(metrics["grad_norm"])
        end = time.perf_counter()  # the window's steps are done (a later one may be in flight)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._diverged(step, loss, grad_norm)
        eval_loss = None
        if work is not None:
            # The copy, checksums and eval ran on the devices before the next step: waiting for
            # them is left out of the next window; the save's copy to the host overlaps it.
            if work.eval_losses is not None:
                eval_loss = float(np.mean(jax.device_get(work.eval_losses)))
            if work.snapshot is not None:
                jax.block_until_ready((work.snapshot.sums, work.snapshot.finite))
            end_wait = time.perf_counter()
            if work.snapshot is not None:
                self.ckpt.save(step, work.snapshot, data_state=work.data_state)
                work.snapshot = None  # the device copy is free once on the host
        if save_now:  # the save's time is left out of the window's step time
            self.ckpt.save(step, state, data_state=self._data_state)
        if not log_now:
            self._win.start += (end_wait if work is not None else time.perf_counter()) - end
            return None
        win = self._win
        dt = (end - win.start) / steps
        rec = {"step": step, "loss": loss, "grad_norm": grad_norm,
               "lr": float(optim.schedule(t)(step - 1)),
               "tokens_per_s": t.batch_size * t.seq_len / dt, "step_time_s": dt,
               "mfu": self.flops_per_step / dt / self.peak,
               "host_time_s": sum(v for k, v in win.host.items() if k != "dispatch") / win.steps,
               "host_parts_s": {k: v / win.steps for k, v in win.host.items()}, **fields}
        rec.update(moe_record(metrics))
        if win.first:  # the first window includes compilation
            rec["includes_compile"] = True
        if state is not None and (step % t.eval_every == 0 or step == t.steps):
            rec["eval_loss"] = self._eval(state)
        if eval_loss is not None:
            rec["eval_loss"] = eval_loss
        t0 = time.perf_counter()
        self._write(rec)
        rest = win.steps - steps  # steps dispatched after this window's last one
        # a step in flight has run on the devices since `end` (after the wait for a save / eval
        # step's device work); otherwise the next window starts now, with the save and eval
        # left out. The logging is that next window's host work.
        start = end if work is None else end_wait
        self._win = _Window(start if rest else time.perf_counter(), steps=rest)
        self._host("logging", t0)
        return rec

    def _start_eval(self, state) -> list:
        """The held-out batches' losses, dispatched (device scalars)."""
        self.eval_loader.step = 0  # the same held-out batches every time
        return [self.eval_fn(state.params, self.trainer.put_batch(next(self.eval_loader)))
                for _ in range(self.cfg.train.eval_batches)]

    def _eval(self, state) -> float:
        return float(np.mean(jax.device_get(self._start_eval(state))))

    def _write(self, rec: dict) -> None:
        self.records.append(rec)
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.tensorboard.write(rec)

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

    def _final_save(self, state) -> None:
        t, ckpt = self.cfg.train, self.ckpt
        if self.stopped_at is not None:
            ckpt.save(self.stopped_at, state, data_state=self._data_state, force=True)
            ckpt.wait()
            ckpt.raise_save_errors()
            if self.is_main:
                print(f"jaxtp: {self.stop.received} at step {self.stopped_at} of {t.steps}: "
                      f"saved checkpoint {ckpt.directory / str(self.stopped_at)}; run the same "
                      f"command to resume", flush=True)
        elif self.start < t.steps and ckpt.latest_step() != t.steps:
            ckpt.save(t.steps, state, data_state=self._data_state, force=True)
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
