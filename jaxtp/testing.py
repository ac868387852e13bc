"""Helpers for checking a parallel run against the single-device reference on fake CPU devices.

Typical use (tests, notebooks)::

    eng = engine.build_engine(cfg)                       # a mesh over the 8 simulated devices
    ref = engine.reference_params(cfg)            # unsharded, vocab padded for TP=1
    params = eng.layout.shard_params(pad_params(ref, eng))
    assert_close(eng.loss_and_grad()(params, batch), reference_loss_and_grad(cfg, ref, batch))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtp.configs import Config
from jaxtp.step import Engine, reference_loss_fn
from jaxtp.step import build_engine as engine_build
from jaxtp.step import reference_params as _reference_params


def random_batch(cfg: Config, seed: int = 0) -> dict[str, jax.Array]:
    """A ``[batch_size, seq_len]`` next-token batch of random ids in ``[0, vocab_size)``."""
    t = cfg.train
    tokens = np.random.default_rng(seed).integers(0, cfg.model.vocab_size,
                                                  (t.batch_size, t.seq_len + 1))
    return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
            "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}


def pad_params(reference: nnx.State, engine: Engine) -> nnx.State:
    """Reference parameters zero-padded to ``engine``'s (TP-dependent) padded vocab size."""
    def pad(r, e):
        r = np.asarray(r)
        return jnp.asarray(np.pad(r, [(0, es - rs) for rs, es in zip(r.shape, e.shape)]))
    return jax.tree.map(pad, reference, engine.layout.abstract_params)


def unpad(tree, like):
    """Slice each leaf of ``tree`` down to the shape of the matching leaf of ``like``."""
    return jax.tree.map(lambda x, r: np.asarray(x)[tuple(slice(0, s) for s in r.shape)],
                        tree, like)


def reference_loss_and_grad(cfg: Config, params: nnx.State, batch, *, microbatches: int = 1,
                            with_metrics: bool = False):
    """Single-device ``(loss, grads)`` (``with_metrics``: ``((loss, metrics), grads)``).

    ``microbatches = m``: the mean over the engine's micro-batches (micro-batch ``k`` holds the
    rows ``i`` with ``i % m == k`` when every data shard's row count is a multiple of ``m``). The
    same as the whole batch for a dense model; an MoE model's router loss is then that of each
    micro-batch, averaged, as the engine computes it.
    """
    loss = reference_loss_fn(cfg, with_metrics=with_metrics)
    if microbatches > 1:
        m, whole = microbatches, loss

        def loss(params, batch):
            parts = [whole(params, jax.tree.map(lambda x, k=k: x[k::m], batch))
                     for k in range(m)]
            return jax.tree.map(lambda *xs: sum(xs) / m, *parts)
    return jax.jit(jax.value_and_grad(loss, has_aux=with_metrics))(params, batch)


def assert_trees_close(actual, expected, *, rtol: float, atol: float) -> None:
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, e), a in zip(paths, jax.tree.leaves(actual)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def assert_matches_reference(cfg: Config, *, rtol: float, atol: float, seed: int = 0):
    """Loss and gradients of ``cfg`` on its mesh equal the single-device reference on the same
    parameters and batch (gradients compared leaf by leaf, vocab padding cut off). Returns
    ``(engine, sharded params, sharded batch, reference loss, grads)`` for further checks."""
    eng = engine_build(cfg)
    ref_params = _reference_params(cfg)
    batch = random_batch(cfg, seed)
    ref_loss, ref_grads = reference_loss_and_grad(cfg, ref_params, batch)
    params = eng.layout.shard_params(pad_params(ref_params, eng))
    sharded_batch = eng.layout.shard_batch(batch)
    loss, grads = eng.loss_and_grad()(params, sharded_batch)
    grads = eng.layout.natural_layers(grads)  # interleaved pipelines store their layers rank-major
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
    assert_trees_close(unpad(grads, ref_grads), ref_grads, rtol=rtol, atol=atol)
    return eng, params, sharded_batch, ref_loss, grads


def saved_residuals(cfg: Config, devices=None) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(per-device shape, dtype) of every activation one device keeps for the backward pass: the
    residuals ``jax.vjp`` holds for the loss, parameters excluded. Compiled ahead of time from
    abstract inputs (nothing runs); each residual's per-device shape comes from the sharding XLA
    gives it."""
    eng = engine_build(cfg, devices)
    params, batch = eng.abstract_inputs()
    loss = eng.loss_fn()

    def residuals(p, b):
        return jax.tree.leaves(jax.vjp(lambda q: loss(q, b), p)[1])

    compiled = jax.jit(residuals).lower(params, batch).compile()
    avals = jax.eval_shape(residuals, params, batch)
    shardings = compiled.output_shardings
    leaves = jax.tree.leaves(params)
    # A parameter kept for backward comes back as itself, or, from inside ``shard_map`` (a cast
    # to varying), as its per-device shard: both are weights, not activations.
    weights = {(tuple(v.shape), v.dtype) for v in leaves} | \
        {(tuple(v.sharding.shard_shape(v.shape)), v.dtype) for v in leaves}
    out = []
    for a, sharding in zip(avals, shardings):
        local = tuple(sharding.shard_shape(a.shape))
        if (tuple(a.shape), a.dtype) in weights or (local, a.dtype) in weights:
            continue
        out.append((local, np.dtype(a.dtype)))
    return out


def saved_activation_bytes(cfg: Config, devices=None) -> int:
    """Bytes of :func:`saved_residuals`. Per layer: the difference between ``model.n_layers`` =
    L+1 and L (the scan stacks the layer residuals along ``layers``; embedding and loss cancel)."""
    return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in saved_residuals(cfg, devices))


def assert_restores(directory, step: int, trainer, want, *, layer_order=None) -> None:
    """The checkpoint ``step`` under ``directory`` restores onto ``trainer``'s layout in exactly
    the shardings ``trainer.abstract_state()`` asks for, and bit-equal to ``want`` (host arrays
    in the state's tree order). ``layer_order``: the target's ``Layout.natural_layers`` when its
    layers are stored in pipeline order."""
    from jaxtp.ckpt import Checkpointer  # orbax is only needed here

    like = trainer.abstract_state()
    ckpt = Checkpointer(directory, keep=1, cfg=trainer.cfg, layer_order=layer_order)
    try:
        restored, _ = ckpt.restore(step, like=like)
    finally:
        ckpt.close()
    got_leaves, want_leaves, like_leaves = (jax.tree.leaves(t) for t in (restored, want, like))
    assert len(got_leaves) == len(want_leaves) == len(like_leaves), (
        len(got_leaves), len(want_leaves), len(like_leaves))
    for got, expected, spec in zip(got_leaves, want_leaves, like_leaves):
        assert got.sharding == spec.sharding, (got.sharding, spec.sharding)
        np.testing.assert_array_equal(np.asarray(got), expected)


def packed_batch(cfg: Config, seed: int = 0, *, max_doc: int | None = None,
                 pad: int = 3) -> dict[str, np.ndarray]:
    """A packed ``[batch_size, seq_len]`` batch of random documents (the data contract of
    :mod:`jaxtp.data.batches`): each row is documents of random lengths (2 to ``max_doc`` tokens,
    default ``seq_len // 2``) then ``pad`` padding tokens, with ``segment_ids`` (1, 2, ... per
    row; 0 = padding), ``positions`` within each document and ``loss_mask`` (1 where the target
    is the next token of the same document)."""
    t = cfg.train
    rng = np.random.default_rng(seed)
    width = t.seq_len + 1  # a window: inputs are its first seq_len tokens, targets its last
    tokens = rng.integers(0, cfg.model.vocab_size, (t.batch_size, width))
    seg = np.zeros((t.batch_size, width), np.int32)
    pos = np.zeros((t.batch_size, width), np.int32)
    for row in range(t.batch_size):
        start, doc = 0, 1
        while start < width - pad:
            n = min(int(rng.integers(2, (max_doc or t.seq_len // 2) + 1)), width - pad - start)
            seg[row, start:start + n], pos[row, start:start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
    mask = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0)
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
            "segment_ids": seg[:, :-1], "positions": pos[:, :-1],
            "loss_mask": mask.astype(np.int32)}


# The tests' conftest makes one directory per test session and names it here; train_env hands
# it to the `jaxtp train` subprocesses as their persistent XLA compilation cache.
TEST_COMPILE_CACHE = "JAXTP_TEST_COMPILE_CACHE"


def train_env(**extra: str) -> dict[str, str]:
    """The environment for a test's ``jaxtp train`` (or ``sample`` / ``eval``) subprocess: this
    one without ``XLA_FLAGS`` (``--devices`` sets the device count), plus ``extra``. Runs of one
    program (a run and its resume, two processes of one job) share a persistent compilation
    cache when the session has one (:data:`TEST_COMPILE_CACHE`): a repeat compile then costs a
    read, about 10 s less for ``tiny`` on 2 cores. Not for ``jaxtp inspect``: on a cache hit the
    executable's HLO text has no stack frames (jax 0.10.2), so its census by source would be
    empty."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cache = env.get(TEST_COMPILE_CACHE)
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return env | extra


def kill_when_saved(cmd: list[str], env: dict, checkpoint: Path, timeout: float = 240) -> None:
    """Start ``cmd`` (a ``jaxtp train``), wait until ``checkpoint`` (a step directory) exists,
    then SIGKILL it: a preemption with no warning, mid-run."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not checkpoint.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


# ----------------------------------------------------------------------------------------------
# The composition matrix (issue 37): every layout the validator accepts on 8 devices, run through
# ``jaxtp train``'s real loop by tests/integration/test_composition_matrix.py (a covering subset)
# and experiments/composition_matrix.py (all of them)
# ----------------------------------------------------------------------------------------------

MATRIX_AXES = ("pipeline", "data", "fsdp", "context", "expert", "model")
MATRIX_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")
# the model and batch every matrix run shares (tiny widths; MoE layouts use tiny-moe with
# capacity = every token, so that no layout drops a token another keeps)
MATRIX_BASE = ("train.batch_size=16", "train.seq_len=32", "train.lr=1e-2", "train.warmup_steps=0",
               "train.min_lr_ratio=1.0",  # a constant rate: the 4-step run and its resume to 6
               # follow the 6-step reference's schedule
               "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
               "train.checkpoint_every=2", "train.keep_checkpoints=2", "train.tensorboard=false",
               "data.eval_fraction=0.05")
MATRIX_MOE = ("model.capacity_factor=0",)


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    """One layout of the composition matrix: the axes of degree > 1 and the ways of running it."""

    degrees: tuple[tuple[str, int], ...]  # (axis, degree) for the axes of degree > 1
    schedule: str | None = None  # pipelined layouts only
    sequence_parallel: bool = False
    zero_stage: int = 0
    mode: str = "gspmd"

    @property
    def degree(self) -> dict[str, int]:
        return {a: 1 for a in MATRIX_AXES} | dict(self.degrees)

    @property
    def moe(self) -> bool:
        return self.degree["expert"] > 1

    @property
    def n_layers(self) -> int:
        """Enough layers for every stage (and virtual stage) to hold one or more."""
        p = self.degree["pipeline"]
        return max(4, p * (2 if self.schedule == "interleaved" else 1))

    def preset(self) -> str:
        return "tiny-moe" if self.moe else "tiny"

    def model_overrides(self) -> list[str]:
        """What the layout's one-device reference shares with it (the model and the batch)."""
        return [*MATRIX_BASE, f"model.n_layers={self.n_layers}", *(MATRIX_MOE if self.moe else ())]

    def overrides(self) -> list[str]:
        d = self.degree
        out = self.model_overrides() + [f"parallel.{a}={d[a]}" for a in MATRIX_AXES]
        if self.schedule:
            out += [f"parallel.pipeline_schedule={self.schedule}",
                    f"train.microbatches={2 * d['pipeline']}"]
            if self.schedule == "interleaved":
                out.append("parallel.virtual_stages=2")
        if self.sequence_parallel:
            out.append("parallel.sequence_parallel=true")
        if self.zero_stage:
            out.append(f"parallel.zero_stage={self.zero_stage}")
        return out + [f"parallel.mode={self.mode}"]

    def features(self) -> frozenset[str]:
        """What the covering subset must pair up: each axis in use, the schedule, SP, the ZeRO
        stage and the mode."""
        f = {a for a, _ in self.degrees}
        if self.schedule:
            f.add(f"schedule={self.schedule}")
        if self.sequence_parallel:
            f.add("sequence_parallel")
        if self.zero_stage:
            f.add(f"zero={self.zero_stage}")
        f.add(f"mode={self.mode}")
        return frozenset(f)

    @property
    def name(self) -> str:
        parts = [" x ".join(f"{a}={n}" for a, n in self.degrees) or "1 device"]
        if self.schedule:
            parts.append(self.schedule)
        if self.sequence_parallel:
            parts.append("SP")
        if self.zero_stage:
            parts.append(f"ZeRO-{self.zero_stage}")
        parts.append(self.mode)
        return ", ".join(parts)


def _degree_splits(n: int, axes: int) -> list[tuple[int, ...]]:
    """Every way to write ``n`` (a power of two) as an ordered product of ``axes`` powers of two."""
    if axes == 1:
        return [(n,)]
    out, d = [], 1
    while d <= n:
        out += [(d, *rest) for rest in _degree_splits(n // d, axes - 1)]
        d *= 2
    return out


def composition_layouts(n_devices: int = 8) -> tuple[list[MatrixLayout], list[tuple[MatrixLayout, str]]]:
    """``(accepted, refused)``: every layout over :data:`MATRIX_AXES` x schedule x sequence
    parallelism x ZeRO stage x mode on ``n_devices`` devices, split by what the validator says
    (``refused`` carries its one-line error). ZeRO stages are tried where a data axis shards
    them, sequence parallelism where there is a model axis, schedules where there is a pipeline."""
    from jaxtp.configs import ConfigError, load
    from jaxtp.parallel import resolve_degrees, validate

    accepted, refused = [], []
    for split in _degree_splits(n_devices, len(MATRIX_AXES)):
        degrees = tuple((a, d) for a, d in zip(MATRIX_AXES, split) if d > 1)
        deg = dict(degrees)
        for schedule in MATRIX_SCHEDULES if deg.get("pipeline") else (None,):
            for sp in (False, True) if deg.get("model") else (False,):
                for zero in (0, 1, 2, 3) if deg.get("data") else (0,):
                    for mode in ("gspmd", "explicit"):
                        layout = MatrixLayout(degrees, schedule, sp, zero, mode)
                        try:
                            cfg = load(layout.preset(), layout.overrides())
                            validate(cfg, resolve_degrees(cfg.parallel, n_devices),
                                     platform="cpu")
                        except ConfigError as e:
                            refused.append((layout, str(e)))
                        else:
                            accepted.append(layout)
    return accepted, refused


# the features the covering subset pairs up (every pair of axes); schedules, SP, ZeRO stages and
# modes are each covered at least once
MATRIX_PAIRED = MATRIX_AXES
# the pipeline example (issue 37's deadlock, which hung in both modes), always in the subset
README_PIPELINE = MatrixLayout((("pipeline", 2), ("data", 2), ("model", 2)), "1f1b")
README_PIPELINE_EXPLICIT = dataclasses.replace(README_PIPELINE, mode="explicit")


def covering_subset(layouts: list[MatrixLayout],
                    seed: tuple[MatrixLayout, ...] = (README_PIPELINE, README_PIPELINE_EXPLICIT)
                    ) -> list[MatrixLayout]:
    """A small subset of ``layouts``, starting from ``seed``, in which every pair of
    :data:`MATRIX_PAIRED` features that some layout has together (two axes) occurs at least
    once, and every feature at all (each schedule, SP, each ZeRO stage, each mode) once; greedy
    set cover, deterministic, the cheaper layout (fewer layers and stages) first among equals."""
    def pairs(layout):
        f = sorted(layout.features())
        paired = [g for g in f if g.split("=")[0] in MATRIX_PAIRED]
        return ({(a, b) for i, a in enumerate(paired) for b in paired[i + 1:]}
                | {(a, a) for a in f})

    todo = set().union(*(pairs(x) for x in layouts)) if layouts else set()
    chosen = [x for x in seed if x in layouts]
    for x in chosen:
        todo -= pairs(x)
    while todo:
        best = max(layouts, key=lambda x: (len(pairs(x) & todo), -x.n_layers,
                                           -x.degree["pipeline"], x.name))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


MATRIX_STEPS = (4, 6)  # the first run saves at 2 and 4 and evaluates there; the resume runs 5-6


def _train_records(cmd: list[str], env: dict, out: Path, timeout: float) -> tuple[list[dict], str]:
    import json
    import subprocess

    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        lines = [x for x in r.stderr.splitlines() if x.startswith("jaxtp: error")]
        raise RuntimeError(lines[-1] if lines else f"exit {r.returncode}: "
                           + " | ".join(r.stderr.strip().splitlines()[-3:]))
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")], r.stdout


def matrix_reference(layout: MatrixLayout, root: Path, env: dict,
                     timeout: float = 600) -> list[dict]:
    """The one-device run of ``layout``'s model and batch, steps 1 .. the last of
    :data:`MATRIX_STEPS`, straight through (cached in ``root`` by model)."""
    import json
    import sys

    out = root / f"reference-{layout.preset()}-{layout.n_layers}"
    done = out / "records.json"
    if not done.exists():
        cmd = [sys.executable, "-m", "jaxtp", "train", "--devices", "1", "--config",
               layout.preset(), *layout.model_overrides(), f"train.steps={MATRIX_STEPS[-1]}",
               f"train.out_dir={out}"]
        records, _ = _train_records(cmd, env, out, timeout)
        done.write_text(json.dumps(records))
    return json.loads(done.read_text())


def run_matrix_layout(layout: MatrixLayout, root: Path, env: dict, *,
                      timeout: float = 600) -> dict:
    """``layout`` through ``jaxtp train`` on 8 simulated devices: a run to step 4 (checkpoints
    and evals at 2 and 4), then the same command to step 6, which resumes from step 4's
    checkpoint; its losses against the one-device run's (:func:`matrix_reference`). Returns
    ``{"layout", "steps", "max_loss_diff", "max_eval_diff", "resumed_diff", "resumed"}``
    (``resumed_diff``: the largest difference after the resume) or ``{"layout", "error"}``."""
    import re
    import sys
    import time

    out = root / re.sub(r"[^A-Za-z0-9=]+", "_", layout.name)
    cmd = [sys.executable, "-m", "jaxtp", "train", "--devices", "8", "--config", layout.preset(),
           *layout.overrides(), f"train.out_dir={out}"]
    t0 = time.perf_counter()
    try:
        reference = {r["step"]: r for r in matrix_reference(layout, root, env, timeout)}
        _train_records(cmd + [f"train.steps={MATRIX_STEPS[0]}"], env, out, timeout)
        records, stdout = _train_records(cmd + [f"train.steps={MATRIX_STEPS[-1]}"], env, out,
                                         timeout)
    except (RuntimeError, OSError) as e:
        return {"layout": layout.name, "error": str(e)}
    except Exception as e:  # a timeout: the hang this matrix exists to catch
        return {"layout": layout.name, "error": f"{type(e).__name__}: {e}"}
    loss = {r["step"]: abs(r["loss"] - reference[r["step"]]["loss"]) for r in records}
    evals = [abs(r["eval_loss"] - reference[r["step"]]["eval_loss"])
             for r in records if "eval_loss" in r]
    return {"layout": layout.name, "steps": sorted(loss), "max_loss_diff": max(loss.values()),
            "max_eval_diff": max(evals, default=float("nan")),
            "resumed_diff": max(v for s, v in loss.items() if s > MATRIX_STEPS[0]),
            "resumed": f"resuming from step {MATRIX_STEPS[0]}" in stdout,
            "seconds": round(time.perf_counter() - t0, 1)}
