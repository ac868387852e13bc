"""Each Megatron operator's value and VJP against a single-device reference (STYLE.md layer 1)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxtp.parallel import collectives

MESH = Mesh(np.array(jax.devices()), ("model",))
RNG = np.random.default_rng(0)


def test_f_then_column_parallel_matches_dense():
    """f (identity forward, all-reduce backward) before a column-parallel matmul."""
    x = jnp.asarray(RNG.normal(size=(4, 16)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(16, 32)), jnp.float32)
    c = jnp.asarray(RNG.normal(size=(4, 32)), jnp.float32)

    def dense(x, w):
        return jnp.sum((x @ w) * c)

    def local(x, w, c):
        y = collectives.copy_to_model(x) @ w      # (4, 32/8) per rank
        return jax.lax.psum(jnp.sum(y * c), "model")

    sharded = jax.shard_map(local, mesh=MESH, in_specs=(P(), P(None, "model"), P(None, "model")),
                            out_specs=P())
    np.testing.assert_allclose(sharded(x, w, c), dense(x, w), rtol=1e-5)
    gx, gw = jax.grad(lambda x, w: sharded(x, w, c), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(dense, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)


def test_g_after_row_parallel_matches_dense():
    """g (all-reduce forward, identity backward) after a row-parallel matmul."""
    x = jnp.asarray(RNG.normal(size=(4, 32)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(32, 16)), jnp.float32)
    c = jnp.asarray(RNG.normal(size=(4, 16)), jnp.float32)

    def dense(x, w):
        return jnp.sum((x @ w) * c)

    def local(x, w):
        y = collectives.reduce_from_model(x @ w)   # (4, 16), a partial sum before g
        return jnp.sum(y * c)

    sharded = jax.shard_map(local, mesh=MESH, in_specs=(P(None, "model"), P("model", None)),
                            out_specs=P())
    np.testing.assert_allclose(sharded(x, w), dense(x, w), rtol=1e-5)
    for got, want in zip(jax.grad(sharded, argnums=(0, 1))(x, w),
                         jax.grad(dense, argnums=(0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_g_forward_is_a_sum_over_ranks():
    parts = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
    out = jax.shard_map(lambda p: collectives.reduce_from_model(p[0]), mesh=MESH,
                        in_specs=P("model"), out_specs=P())(parts)
    np.testing.assert_allclose(out, parts.sum(0))


def test_max_over_model_has_no_gradient():
    x = jnp.asarray(RNG.normal(size=(8, 5)), jnp.float32)
    f = jax.shard_map(lambda v: jnp.sum(collectives.max_over_model(v[0])), mesh=MESH,
                      in_specs=P("model"), out_specs=P())
    np.testing.assert_allclose(f(x), jnp.sum(jnp.max(x, axis=0)), rtol=1e-6)
    np.testing.assert_array_equal(jax.grad(f)(x), np.zeros_like(x))


def test_data_parallel_params_all_reduces_gradients():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    w = jnp.float32(2.0)
    xs = jnp.arange(8, dtype=jnp.float32)

    def local(w, x):
        w = collectives.data_parallel_params(w, ("data",))
        return jax.lax.psum(jnp.sum(w * x), "data")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    np.testing.assert_allclose(jax.grad(f)(w, xs), xs.sum())
