"""Helpers for checking a parallel run against the single-device reference on fake CPU devices.

Typical use (tests, notebooks)::

    eng = engine.build(cfg)                       # a mesh over the 8 simulated devices
    ref = engine.reference_params(cfg)            # unsharded, vocab padded for TP=1
    params = eng.shard_params(pad_params(ref, eng))
    assert_close(eng.loss_and_grad()(params, batch), reference_loss_and_grad(cfg, ref, batch))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtp.config import Config
from jaxtp.engine import Engine, reference_loss_fn


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
    return jax.tree.map(pad, reference, engine.abstract_params)


def unpad(tree, like):
    """Slice each leaf of ``tree`` down to the shape of the matching leaf of ``like``."""
    return jax.tree.map(lambda x, r: np.asarray(x)[tuple(slice(0, s) for s in r.shape)],
                        tree, like)


def reference_loss_and_grad(cfg: Config, params: nnx.State, batch):
    return jax.jit(jax.value_and_grad(reference_loss_fn(cfg)))(params, batch)


def assert_trees_close(actual, expected, *, rtol: float, atol: float) -> None:
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, e), a in zip(paths, jax.tree.leaves(actual)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))
