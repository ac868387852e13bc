"""Helpers for checking a parallel run against the single-device reference on fake CPU devices.

Typical use (tests, notebooks)::

    eng = engine.build_engine(cfg)                       # a mesh over the 8 simulated devices
    ref = engine.reference_params(cfg)            # unsharded, vocab padded for TP=1
    params = eng.layout.shard_params(pad_params(ref, eng))
    assert_close(eng.loss_and_grad()(params, batch), reference_loss_and_grad(cfg, ref, batch))
"""

from __future__ import annotations

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
