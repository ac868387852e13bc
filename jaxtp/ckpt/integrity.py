"""Checkpoint integrity: a checksum per array, written with each checkpoint and verified on restore.

Orbax commits a step atomically, but nothing checks the bytes it reads back: a flipped byte in an
array file restores silently. :func:`fingerprint` computes, on the devices where the arrays live
(one jitted pass, no gather), a 32-bit checksum of every array of the train state and whether every
float is finite:

    checksum(x) = sum over elements i of  mix(bits(x_i)) * w(i)   (mod 2^32)

``bits`` is the element's bit pattern, ``mix`` a multiply-xorshift with ``mix(0) = 0``, and the
weight ``w(i) = prod_d (2 i_d + 1) c_d`` depends only on the element's own index along each dim.
Sums mod 2^32 do not depend on the order of the reduction, so any sharding gives the same value;
and zero elements add nothing, so the checksum of an embedding whose zero vocab-padding rows were
truncated or zero-padded on a restore onto another tensor-parallel degree is unchanged. It is a
corruption check (a changed bit changes it), not a cryptographic hash.

:class:`jaxtp.ckpt.checkpoint.Checkpointer` stores the checksums in the ``meta`` item of the same step
and refuses to save a state with NaN / Inf; :func:`restore_latest_good` restores the newest step
that verifies, and moves corrupt newer steps aside (saying so) so that new saves can take their
place.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from jaxtp.configs import ConfigError

_MIX = (0x9E3779B1, 0x85EBCA6B)


class CorruptCheckpointError(ConfigError):
    """A checkpoint step that cannot be read, or whose arrays differ from their checksums."""


def _bits(x: jax.Array) -> jax.Array:
    """The element bit patterns as uint32."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if width == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if width == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if width == 8:  # two 32-bit halves
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return halves[..., 0] ^ (halves[..., 1] * jnp.uint32(_MIX[1]))
    raise TypeError(f"no checksum for dtype {x.dtype}")


def _checksum(x: jax.Array, vocab_dims: tuple[int, ...], vocab: int) -> jax.Array:
    h = _bits(x) * jnp.uint32(_MIX[0])
    h = (h ^ (h >> 15)) * jnp.uint32(_MIX[1])
    h = h ^ (h >> 13)
    weight = jnp.ones(h.shape, jnp.uint32)
    for d in range(h.ndim):
        index = jax.lax.broadcasted_iota(jnp.uint32, h.shape, d)
        weight = weight * (jnp.uint32(2) * index + jnp.uint32(1)) * jnp.uint32(2 * d + 0x27D4EB2F)
        if d in vocab_dims:  # padding rows are masked out of the model, and of the checksum
            weight = jnp.where(index < vocab, weight, jnp.uint32(0))
    return jnp.sum(h * weight, dtype=jnp.uint32)


def _all_finite(flat: dict) -> jax.Array:
    checks = [jnp.all(jnp.isfinite(x)) for x in flat.values()
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


@partial(jax.jit, static_argnames=("vocab_dims", "vocab"))
def _fingerprint(flat: dict, vocab_dims: tuple, vocab: int) -> tuple[dict, jax.Array]:
    dims = dict(vocab_dims)
    return ({k: _checksum(v, dims.get(k, ()), vocab) for k, v in flat.items()},
            _all_finite(flat))


def vocab_dims(flat: dict, padded_vocab: int, vocab: int) -> dict[str, list[int]]:
    """The dims of each array that are vocab-padded (size ``padded_vocab`` > ``vocab``); their
    rows past ``vocab`` are left out of the checksum, as a restore onto another tensor-parallel
    degree truncates or zero-pads them."""
    if padded_vocab == vocab:
        return {}
    dims = {k: [d for d, n in enumerate(v.shape) if n == padded_vocab] for k, v in flat.items()}
    return {k: d for k, d in dims.items() if d}


def start_fingerprint(flat: dict, dims: dict[str, list[int]] | None = None, vocab: int = 0
                      ) -> tuple[dict[str, jax.Array], jax.Array]:
    """:func:`fingerprint` dispatched and not waited for: the checksums and the finite flag as
    device scalars."""
    static = tuple(sorted((k, tuple(d)) for k, d in (dims or {}).items()))
    return _fingerprint(flat, static, vocab)


def fingerprint(flat: dict, dims: dict[str, list[int]] | None = None, vocab: int = 0
                ) -> tuple[dict[str, int], bool]:
    """``({key: checksum}, all floats finite)`` of a flat dict of (sharded) arrays; ``dims``:
    :func:`vocab_dims`."""
    sums, finite = jax.device_get(start_fingerprint(flat, dims, vocab))
    return {k: int(v) for k, v in sums.items()}, bool(finite)


def verify(flat: dict, meta: dict, where) -> None:
    """Raise :class:`CorruptCheckpointError` unless every array matches the checksum saved in
    the step's ``meta`` (a checkpoint written before checksums existed is not checked)."""
    expected = meta.get("checksums")
    if expected is None:
        return
    expected = {k: int(v) for k, v in expected.items()}
    got, _ = fingerprint(flat, meta.get("checksum_vocab_dims", {}),
                         int(meta.get("model", {}).get("vocab_size", 0)))
    bad = sorted(k for k in got if k in expected and expected[k] != got[k])
    missing = sorted(set(got) - set(expected))
    if bad or missing:
        what = (f"{len(bad)} of {len(got)} arrays differ from their checksums "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else
                f"no checksum for {', '.join(missing[:3])}")
        raise CorruptCheckpointError(f"checkpoint {where} is corrupt: {what}")


def restore_latest_good(ckpt, like, *, log: Callable[[str], None] = print):
    """``(step, state, data_state)`` of the newest step of ``ckpt`` that reads and verifies, or
    ``None`` when there are no checkpoints. Corrupt newer steps are reported through ``log`` and
    moved to ``<checkpoints>/../corrupt-checkpoints/<step>`` once a good step is found; when no
    step is good, a :class:`CorruptCheckpointError` lists them and nothing is moved. Other
    errors (a checkpoint of another model) are raised as they are."""
    steps = ckpt.all_steps()
    if not steps:
        return None
    corrupt: list[tuple[int, str]] = []
    for step in reversed(steps):
        try:
            state, data_state = ckpt.restore(step, like=like)
        except CorruptCheckpointError as e:
            corrupt.append((step, str(e)))
            log(f"jaxtp: {e}")
            continue
        if corrupt:
            _move_aside(ckpt, [s for s, _ in corrupt])
            log(f"jaxtp: resuming from step {step}, the newest checkpoint that verifies; "
                f"corrupt step(s) {[s for s, _ in corrupt]} moved to "
                f"{Path(ckpt.directory).parent / 'corrupt-checkpoints'}")
        return step, state, data_state
    raise CorruptCheckpointError(
        f"no checkpoint in {ckpt.directory} verifies (steps {[s for s, _ in corrupt]} are corrupt "
        f"or incomplete); move them away to start from scratch, or restore a backup")


def _move_aside(ckpt, steps: list[int]) -> None:
    """Move corrupt steps out of the checkpoint directory (process 0), so new saves can use their
    step numbers; every process then re-reads the directory."""
    if jax.process_index() == 0:
        target = Path(ckpt.directory).parent / "corrupt-checkpoints"
        target.mkdir(exist_ok=True)
        for step in steps:
            dest = target / str(step)
            if dest.exists():
                shutil.rmtree(dest)
            shutil.move(str(Path(ckpt.directory) / str(step)), dest)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxtp-corrupt-checkpoints-moved")
    ckpt.reload()
