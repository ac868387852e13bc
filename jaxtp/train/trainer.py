"""Train state, the jitted train step, and the training loop with metrics.

One step is one ``jax.jit`` call with explicit in / out shardings and a donated state: loss and
gradients from :class:`jaxtp.step.engine.Engine` (in either execution mode), then the optax update.
The loop logs ``loss``, ``tokens_per_s`` and ``mfu`` to ``<out_dir>/metrics.jsonl`` (eval records
carry ``eval_loss``) and plots the loss curve at the end; an MoE model's records also carry its
router metrics (``lm_loss``, ``aux_loss``, ``dropped_fraction``, ``expert_load``). MFU is model
FLOPs per second (the analytic ``6 N T`` + attention count of :func:`jaxtp.train.flops.model_flops`)
over the devices' peak (:func:`jaxtp.train.flops.peak_flops`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtp.ckpt import restore_latest_good, write_run_config
from jaxtp.configs import Config, check_run_files
from jaxtp.data import loaders
from jaxtp.parallel import cpu_fallback_warning, cpu_pool_threads, describe_mesh
from jaxtp.planner import fit_warning
from jaxtp.step import build_engine
from jaxtp.train import events, optim, run_guard
from jaxtp.train.flops import model_flops, peak_flops
from jaxtp.train.loop import Loop


@dataclass
class TrainState:
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array


jax.tree_util.register_dataclass(TrainState, data_fields=["params", "opt_state", "step"],
                                 meta_fields=[])


class Trainer:
    """The training step of ``cfg`` on the devices: the optax update on the loss and gradients of
    :class:`jaxtp.step.engine.Engine`, state sharded and donated. Use :meth:`init_state` and
    :meth:`step` from a script, or :meth:`run` for the CLI's whole loop (data, checkpoints,
    metrics)."""

    def __init__(self, cfg: Config, devices=None):
        self.cfg = cfg
        self.engine = build_engine(cfg, devices)
        self.tx = optim.build(cfg.train, self.engine.layout.abstract_params)
        self._replicated = NamedSharding(self.engine.layout.mesh, PartitionSpec())
        self._step = None  # the jitted step, built by the first step()

    def init_state(self, params: nnx.State | None = None) -> TrainState:
        """A fresh train state at step 0: ``params`` (sharded like this trainer's, e.g. a
        :class:`jaxtp.Model`'s) or a random init, and a fresh optimizer."""
        params = self.engine.layout.init_params() if params is None else params
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings())(params)
        return TrainState(params, opt_state, jax.device_put(jnp.int32(0), self._replicated))

    def opt_shardings(self):
        """Adam moments in the engine's moment shardings (ZeRO >= 1 splits them over ``data``);
        counters replicated."""
        abstract = jax.eval_shape(self.tx.init, self.engine.layout.abstract_params)
        return optax.tree_map_params(
            self.tx, lambda _, sharding: sharding, abstract, self.engine.layout.moment_shardings,
            transform_non_params=lambda _: self._replicated,
            is_leaf=lambda x: isinstance(x, nnx.Variable))

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings of the train state: a restore target, no allocation."""
        params, _ = self.engine.abstract_inputs()
        def with_sharding(a, sharding):
            struct = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
            return a.replace(struct) if isinstance(a, nnx.Variable) else struct

        opt = jax.tree.map(with_sharding,
                           jax.eval_shape(self.tx.init, self.engine.layout.abstract_params),
                           self.opt_shardings(), is_leaf=lambda x: isinstance(x, nnx.Variable))
        return TrainState(params, opt, jax.ShapeDtypeStruct((), jnp.int32,
                                                            sharding=self._replicated))

    def state_shardings(self, state: TrainState):
        return jax.tree.map(lambda x: x.sharding, state)

    def step_fn(self, state: TrainState):
        """The jitted ``(state, batch) -> (state, metrics)``, state donated; ``metrics`` has
        ``loss`` and ``grad_norm`` (and an MoE model's router metrics)."""
        value_and_grad = self.engine.value_and_grad_fn()
        tx = self.tx
        moments = self.engine.layout.moment_shardings

        def step(state: TrainState, batch):
            loss, grads, extra = value_and_grad(state.params, batch)
            # ZeRO >= 1: each data rank updates only its moment shard (a local slice of the
            # gradient, no communication); the new parameters are all-gathered where stage < 3.
            grads = jax.lax.with_sharding_constraint(grads, moments)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            updates = jax.lax.with_sharding_constraint(updates, moments)
            params = optax.apply_updates(state.params, updates)
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **extra}
            return TrainState(params, opt_state, state.step + 1), metrics

        shardings = self.state_shardings(state)
        return jax.jit(step, in_shardings=(shardings, self.engine.layout.batch_sharding),
                       out_shardings=(shardings, self._replicated), donate_argnums=(0,))

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One optimizer step: ``(state, batch) -> (new state, metrics)``; ``state`` is donated
        (use the returned one). ``batch`` is ``{"inputs", "targets"}``, each ``[batch_size,
        seq_len]`` int32 token ids, numpy (this process's rows, see :meth:`put_batch`) or
        already-sharded jax arrays. The jitted step is built on first use."""
        if self._step is None:
            self._step = self.step_fn(state)
        return self._step(state, self.put_batch(batch))

    def eval_fn(self):
        return self.engine.loss()

    def put_batch(self, batch: dict) -> dict:
        """``{"inputs", "targets"}`` (packed: and ``segment_ids``, ``positions``, ``loss_mask``)
        -> sharded device arrays. numpy rows are this process's
        share of the global batch (all rows on one process); jax arrays are placed as they are.
        A wrong key, shape or dtype is a ``ValueError`` naming the expected one."""
        check_batch(batch, self.cfg, processes=jax.process_count())
        sharding = self.engine.layout.batch_sharding
        return {k: v if isinstance(v, jax.Array) and v.sharding == sharding
                else jax.make_array_from_process_local_data(sharding, np.asarray(v))
                for k, v in batch.items()}

    def run(self) -> list[dict]:
        """The training loop the CLI runs (:func:`run`), on this trainer."""
        return run(self.cfg, trainer=self)


PACKED_KEYS = ("segment_ids", "positions", "loss_mask")


def check_batch(batch: dict, cfg: Config, *, processes: int = 1) -> None:
    """Raise ``ValueError`` unless ``batch`` is ``{"inputs", "targets"}`` -- plus, for a packed
    batch, all of :data:`PACKED_KEYS` -- of integers shaped ``[train.batch_size / processes,
    train.seq_len]`` (jax arrays: the global shape)."""
    t = cfg.train
    keys = set(batch) if isinstance(batch, dict) else None
    if keys not in ({"inputs", "targets"}, {"inputs", "targets", *PACKED_KEYS}):
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"a batch is a dict with keys 'inputs' and 'targets' (a packed batch "
                         f"also 'segment_ids', 'positions' and 'loss_mask'); got {keys}")
    for k, v in batch.items():
        rows = t.batch_size if isinstance(v, jax.Array) else t.batch_size // processes
        if tuple(v.shape) != (rows, t.seq_len):
            per = "" if rows == t.batch_size else " / processes"
            raise ValueError(f"batch[{k!r}] has shape {tuple(v.shape)}; expected ({rows}, "
                             f"{t.seq_len}) = (train.batch_size{per}, train.seq_len)")
        if not jnp.issubdtype(v.dtype, jnp.integer):
            raise ValueError(f"batch[{k!r}] has dtype {v.dtype}; batches hold integers (int32)")


def _read_records(path: Path, upto: int) -> list[dict]:
    """Metric records of an earlier run, up to and including step ``upto`` (the resume point)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if rec.get("step", upto + 1) <= upto:
            records.append(rec)
    return records


def run(cfg: Config, devices=None, *, trainer: Trainer | None = None) -> list[dict]:
    """Train to ``cfg.train.steps``, resuming from the latest checkpoint in ``train.out_dir``.

    Returns the metric records of the whole run (earlier segments included), as written to
    ``metrics.jsonl``. The run holds ``<out_dir>/jaxtp.lock`` (one trainer per directory); SIGTERM
    or SIGINT saves a checkpoint at the current step and returns; a step that makes no progress
    for ``train.step_timeout_s`` ends the process (:mod:`jaxtp.train.run_guard`).
    """
    check_run_files(cfg)  # data, tokenizer and out_dir: one-line errors before any compile
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (run_guard.RunLock(out, enabled=jax.process_index() == 0) as lock,
          run_guard.StopSignals(jax.process_count()) as stop,
          run_guard.Watchdog(cfg.train.step_timeout_s, stacks_path=out / "watchdog-stacks.txt",
                             on_timeout=lock.release) as watchdog,
          run_guard.brief_background_errors()):
        return _train(cfg, devices, stop=stop, watchdog=watchdog, trainer=trainer)


def _initial_state(trainer: Trainer, ckpt, loader, *, log: bool) -> tuple[TrainState, int]:
    """``(state, start step)``: the newest checkpoint that verifies (corrupt newer ones set
    aside, :func:`jaxtp.ckpt.integrity.restore_latest_good`), with the loader restored; a saved model
    (params only: :meth:`jaxtp.Model.save`) with a fresh optimizer at step 0; else a new
    state."""
    def say(line):
        if log:
            print(line, flush=True)

    latest = ckpt.latest_step()
    if latest is not None and ckpt.is_params_only(latest):
        params = ckpt.restore_params(latest, like=trainer.engine.abstract_inputs()[0])
        say(f"starting from the model in {ckpt.directory / str(latest)} (fresh optimizer, "
            f"step 0)")
        return trainer.init_state(params), 0
    good = restore_latest_good(ckpt, trainer.abstract_state(), log=say)
    if good is None:
        return trainer.init_state(), 0
    _, state, data_state = good
    changed = loader.restore(data_state)
    if changed:
        say(changed)
    return state, int(state.step)


def _train(cfg: Config, devices, *, stop: run_guard.StopSignals, watchdog: run_guard.Watchdog,
           trainer: Trainer | None = None) -> list[dict]:
    from jaxtp.ckpt import Checkpointer

    t = cfg.train
    loader, eval_loader = loaders(cfg, cache_dir=t.out_dir,
                                           process_index=jax.process_index(),
                                           process_count=jax.process_count())
    trainer = trainer or Trainer(cfg, devices)
    eng = trainer.engine
    devices = list(eng.layout.mesh.devices.flat)
    out = Path(t.out_dir)
    is_main = jax.process_index() == 0
    if is_main:  # what it runs on, before anything is restored or compiled
        print("\n".join(events.start_lines(cfg, devices, eng.layout.degrees)), flush=True)
        if warning := cpu_fallback_warning(devices):
            print(warning, file=sys.stderr, flush=True)

    layout = describe_mesh(dict(eng.layout.degrees))
    watchdog.checkpoints = out / "checkpoints"
    watchdog.context = lambda: run_guard.hang_hint(
        layout=layout, platform=devices[0].platform, processes=jax.process_count(),
        devices=len(devices), pool_threads=cpu_pool_threads(len(jax.local_devices())), nproc=os.environ.get("NPROC"))
    ckpt = Checkpointer(out / "checkpoints", keep=t.keep_checkpoints, cfg=cfg,
                        layer_order=trainer.engine.layout.natural_layers)
    state, start = _initial_state(trainer, ckpt, loader, log=is_main)
    metrics_path = out / "metrics.jsonl"
    records = _read_records(metrics_path, start) if start else []
    if is_main:
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    if start and is_main:
        print(f"resuming from step {start} ({ckpt.directory})", flush=True)
    if is_main:  # the resolved config beside the metrics, and what differs in the log
        write_run_config(cfg, out)
        print("\n".join(events.config_lines(cfg, out / "config.json")), flush=True)
        print(loader.describe(), flush=True)
    if start >= t.steps:
        if is_main:
            print(f"nothing to train: the checkpoint is at step {start} and train.steps="
                  f"{t.steps}; raise train.steps to train further", flush=True)
        ckpt.close()
        return records
    warning = fit_warning(cfg, eng.layout.degrees, devices)
    if warning and is_main:  # the planner's prediction, before minutes of compilation
        print(warning, flush=True)
    loop = Loop(cfg=cfg, trainer=trainer, ckpt=ckpt, loader=loader, eval_loader=eval_loader,
                out=out, records=records, start=start, stop=stop, watchdog=watchdog,
                flops_per_step=model_flops(cfg.model, batch_size=t.batch_size,
                                           seq_len=t.seq_len),
                peak=peak_flops(devices), is_main=is_main)
    loop.run(state)
    loop.summary()
    return records
