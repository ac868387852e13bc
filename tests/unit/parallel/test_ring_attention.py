"""Ring attention over the `context` axis against ``jax.nn.dot_product_attention`` on the global
arrays: output and dq/dk/dv in fp32 (rtol = atol = 1e-5), the layouts, and the HLO census."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxtp.inspect import hlo
from jaxtp.parallel import ring as ra

B, S, N, K, H = 2, 32, 4, 2, 16
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(seed=0, s=S):
    rng = np.random.default_rng(seed)
    q, k, v, ct = (jnp.asarray(rng.normal(size=shape), jnp.float32)
                   for shape in ((B, s, N, H), (B, s, K, H), (B, s, K, H), (B, s, N, H)))
    return q, k, v, ct


def _mesh(cp, data=1, model=1):
    devices = np.array(jax.devices()[:data * cp * model]).reshape(data, cp, model)
    return Mesh(devices, ("data", "context", "model"))


def _sharded(mesh, *, causal, layout):
    """Global arrays in -> global array out; inside, ring attention per device."""
    cp = mesh.shape["context"]
    q_spec = P("data", "context", "model", None)

    def local(q, k, v):
        return ra.ring_attention(q, k, v, axis="context", causal=causal, layout=layout)

    f = jax.shard_map(local, mesh=mesh, in_specs=(q_spec,) * 3, out_specs=q_spec)

    def attend(q, k, v):
        q, k, v = (ra.to_layout(x, cp, layout) for x in (q, k, v))
        return ra.from_layout(f(q, k, v), cp, layout)
    return attend


def _value_and_grads(fn, q, k, v, ct):
    """``fn(q, k, v)`` and the gradients of ``sum(fn(q, k, v) * ct)``, in one compile."""
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(ct)


def _assert_matches_dense(ring, q, k, v, ct, *, causal):
    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

    out, got = jax.jit(_value_and_grads, static_argnums=0)(ring, q, k, v, ct)
    want_out, want = _value_and_grads(ref, q, k, v, ct)
    chex.assert_shape(out, (B, S, N, H))
    np.testing.assert_allclose(out, want_out, **TOL)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, **TOL, err_msg=f"d{name}")


def _check(mesh, *, causal, layout):
    _assert_matches_dense(_sharded(mesh, causal=causal, layout=layout), *_inputs(),
                          causal=causal)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_causal_matches_dense(cp, layout):
    _check(_mesh(cp), causal=True, layout=layout)


@pytest.mark.parametrize("cp", [2, 4])
def test_non_causal_matches_dense(cp):
    _check(_mesh(cp), causal=False, layout="contiguous")


def test_composes_with_data_and_model_axes():
    """Batch over `data`, heads (and kv heads) over `model`, sequence over `context`: 2x2x2."""
    _check(_mesh(2, data=2, model=2), causal=True, layout="zigzag")


def test_kv_replicated_over_model():
    """One kv head per rank group replicated over `model` while query heads are sharded: dk/dv
    are summed over `model` (the transpose of the implicit broadcast)."""
    mesh = _mesh(2, model=4)
    q, k, v, ct = _inputs(1)
    k, v = k[:, :, :1], v[:, :, :1]
    q_spec, kv_spec = P(None, "context", "model", None), P(None, "context", None, None)

    def local(q, k, v):
        return ra.ring_attention(q, k, v, axis="context", layout="zigzag")

    f = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)

    def ring(q, k, v):
        q, k, v = (ra.to_layout(x, 2, "zigzag") for x in (q, k, v))
        return ra.from_layout(f(q, k, v), 2, "zigzag")

    _assert_matches_dense(ring, q, k, v, ct, causal=True)


def test_layout_round_trip_and_positions():
    x = jnp.arange(2 * 16).reshape(2, 16)
    zz = ra.to_layout(x, 4, "zigzag")
    # device i holds chunks i and 2cp-1-i (chunk = 2 positions)
    np.testing.assert_array_equal(zz[0, :4], [0, 1, 14, 15])
    np.testing.assert_array_equal(zz[0, 4:8], [2, 3, 12, 13])
    np.testing.assert_array_equal(ra.from_layout(zz, 4, "zigzag"), x)
    np.testing.assert_array_equal(ra.positions_for_layout(16, 4, "zigzag"), zz[0])
    np.testing.assert_array_equal(ra.positions_for_layout(16, 4, "contiguous"), np.arange(16))
    np.testing.assert_array_equal(ra.to_layout(x, 4, "contiguous"), x)


def _permutes(text, mesh):
    ops = hlo.collectives(text, dict(mesh.shape))
    assert not [o for o in ops if o.kind == "all-gather" and "context" in o.axes]
    return sum(o.executions for o in ops if o.kind == "collective-permute"
               and o.axes == ("context",))


@pytest.mark.parametrize("cp", [2, 4])
def test_census_permutes(cp):
    """Forward: cp-1 K/V exchanges. Backward alone: cp-1 K/V + cp dK/dV. In one jitted grad XLA
    shares the first K/V hop between forward and backward (the same ppermute of the same local
    K/V), so the step runs 3cp-3. No all-gather over `context` anywhere."""
    mesh = _mesh(cp)
    q, k, v, ct = _inputs()
    spec = P("data", "context", "model", None)
    f = jax.shard_map(lambda q, k, v: ra.ring_attention(q, k, v, axis="context"), mesh=mesh,
                      in_specs=(spec,) * 3, out_specs=spec)
    fwd = jax.jit(f).lower(q, k, v).compile().as_text()
    _, vjp = jax.vjp(f, q, k, v)
    bwd = jax.jit(lambda vjp, ct: vjp(ct)).lower(vjp, ct).compile().as_text()
    assert _permutes(fwd, mesh) == cp - 1
    assert _permutes(bwd, mesh) == (cp - 1) + cp
    if cp == 4:  # one more compile; the sharing does not depend on cp
        both = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2))).lower(
            q, k, v).compile().as_text()
        assert _permutes(both, mesh) == 3 * cp - 3


def test_errors():
    with pytest.raises(ValueError, match="divisible by 8"):
        ra.to_layout(jnp.zeros((1, 12)), 4, "zigzag")
    with pytest.raises(ValueError, match="divisible by 4"):
        ra.positions_for_layout(10, 4, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        ra.check_sequence(16, 2, "striped")
    mesh = _mesh(2)
    spec = P(None, "context", None, None)
    q = jnp.zeros((1, 6, 2, 4))  # 3 per device: zigzag needs an even local length
    f = jax.shard_map(lambda q: ra.ring_attention(q, q, q, axis="context"), mesh=mesh,
                      in_specs=spec, out_specs=spec)
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
        f(q)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        jax.shard_map(lambda q, k: ra.ring_attention(q, k, k, axis="context"), mesh=mesh,
                      in_specs=(spec, spec), out_specs=spec)(jnp.zeros((1, 8, 3, 4)),
                                                              jnp.zeros((1, 8, 2, 4)))
