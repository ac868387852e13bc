"""The MoE layer (GShard / Switch): against a per-token reference; expert-parallel per device
against the single-device layer (loss, aux and gradients in fp32: rtol 2e-5, atol 2e-6 of the
tensor's largest entry); capacity and dropping; the Switch aux loss; the all-to-all census in both
modes; errors; the experiment's --quick run."""

import os
import subprocess
import sys
import types
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from jaxtp.inspect import hlo
from jaxtp.parallel.execution import ExplicitOps, GSPMDOps, LocalOps
from jaxtp.layers import moe
from jaxtp.parallel.sharding import Rules, param_specs

AXES = ("pipeline", "data", "fsdp", "context", "expert", "model")
B, S, D, F, E = 8, 32, 32, 64, 8  # 256 tokens
RTOL, ATOL = 2e-5, 2e-6
REPO = Path(__file__).resolve().parents[3]


def _cfg(**kw):
    base = dict(d_model=D, d_ff=F, activation="swiglu", init_std=0.3, n_layers=2,
                param_dtype="float32", compute_dtype="float32", n_experts=E, top_k=1,
                capacity_factor=1.25, moe_every=1, router_aux_loss_coef=0.01,
                router_z_loss_coef=1e-3)
    return types.SimpleNamespace(**{**base, **kw})


def _layer(cfg, seed=0):
    graphdef, state = nnx.split(moe.MoE(cfg, rngs=nnx.Rngs(seed)))
    return graphdef, state


def _inputs(seed=1):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32),
            jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32))


def _apply(graphdef, ops):
    return lambda state, x: nnx.merge(graphdef, state)(x, ops)


def _loss_and_grads(fn, state, x, ct, *, hlo_text: list | None = None):
    """``sum(out * ct) + aux_loss`` and its gradients wrt (params, x), in one compile (whose
    optimized HLO is appended to ``hlo_text`` when given)."""
    def loss(state, x):
        out, aux = fn(state, x)
        return jnp.sum(out * ct) + aux["aux_loss"], (out, aux)
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)).lower(
        state, x).compile()
    if hlo_text is not None:
        hlo_text.append(compiled.as_text())
    (value, (out, aux)), grads = compiled(state, x)
    return value, out, aux, grads


def _close(got, want, name=""):
    """rtol 2e-5, and atol 2e-6 of the tensor's largest entry: the router gradient sums large
    terms of both signs, so a small entry carries the rounding of its big neighbours."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL,
                               atol=ATOL * max(1.0, float(np.abs(want).max())), err_msg=name)


def _assert_grads(got, want):
    (gs, gx), (ws, wx) = got, want
    for name in ("w_router", "w_up", "w_down"):
        _close(gs[name][...], ws[name][...], name)
    _close(gx, wx, "dx")


# ---- (a) the layer equals a per-token reference ------------------------------------------------

def _reference(params, x, cfg):
    """Each token through its top-k experts, weighted by its gates (top-1: the router
    probability; top-2: the two probabilities renormalised to sum to 1), with no capacity."""
    w_r, w_up, w_down = params["w_router"], params["w_up"], params["w_down"]

    def expert(t, e):
        if cfg.activation == "swiglu":
            gu = jnp.einsum("d,dtf->tf", t, w_up[e])
            act = jax.nn.silu(gu[0]) * gu[1]
        else:
            act = jax.nn.gelu(t @ w_up[e])
        return act @ w_down[e]

    def token(t):
        p = jax.nn.softmax(t @ w_r)
        top_p, top_e = jax.lax.top_k(p, cfg.top_k)
        gates = top_p if cfg.top_k == 1 else top_p / jnp.sum(top_p)
        return sum(gates[j] * expert(t, top_e[j]) for j in range(cfg.top_k))

    flat = x.reshape(-1, x.shape[-1])
    out = jax.vmap(token)(flat).reshape(x.shape)
    logits = flat @ w_r
    probs = jax.nn.softmax(logits)
    f = jnp.mean(jax.nn.one_hot(jnp.argmax(probs, -1), cfg.n_experts), axis=0)
    lb = cfg.router_aux_loss_coef * cfg.n_experts * jnp.sum(f * jnp.mean(probs, axis=0))
    z = cfg.router_z_loss_coef * jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    return out, lb + z


@pytest.mark.parametrize("top_k, activation", [(1, "swiglu"), (2, "gelu")])
def test_matches_per_token_reference(top_k, activation):
    cfg = _cfg(top_k=top_k, activation=activation, capacity_factor=0.0)  # dropless: C = S
    graphdef, state = _layer(cfg)
    x, ct = _inputs()
    value, out, aux, grads = _loss_and_grads(_apply(graphdef, LocalOps()), state, x, ct)
    chex.assert_shape(out, (B, S, D))
    assert float(aux["dropped_fraction"]) == 0.0

    def ref_loss(params, x):
        out, aux_loss = _reference(params, x, cfg)
        return jnp.sum(out * ct) + aux_loss, out
    params = {k: state[k][...] for k in ("w_router", "w_up", "w_down")}
    (want_value, want_out), (wp, wx) = jax.jit(
        jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True))(params, x)
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(value, want_value, rtol=RTOL)
    for name in params:
        _close(grads[0][name][...], wp[name], name)
    _close(grads[1], wx, "dx")


# ---- (b) expert parallelism per device == the single-device layer ------------------------------

def _mesh(**degrees):
    shape = tuple(degrees.get(a, 1) for a in AXES)
    devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


PARAM_RULES = Rules((("experts", "expert"), ("mlp", "model")))
TOKENS = P(("data", "expert"))  # batch rows over the data axes and `expert`


def _explicit(mesh, graphdef, state):
    """Global arrays in -> global arrays out; inside, the expert-parallel layer per device."""
    return jax.shard_map(_apply(graphdef, ExplicitOps()), mesh=mesh,
                         in_specs=(param_specs(state, PARAM_RULES), TOKENS),
                         out_specs=(TOKENS, P()))


@pytest.mark.parametrize("degrees", [dict(expert=8), dict(data=2, expert=4),
                                     dict(expert=4, model=2)],
                         ids=["e8", "d2e4", "e4m2"])
def test_expert_parallel_matches_single_device(degrees):
    # top-2 with capacity 1.25: tokens are dropped, and the same ones must be on every mesh
    cfg = _cfg(top_k=2)
    graphdef, state = _layer(cfg)
    x, ct = _inputs()
    want = _loss_and_grads(_apply(graphdef, LocalOps()), state, x, ct)
    assert 0 < float(want[2]["dropped_fraction"]) < 0.5
    got = _loss_and_grads(_explicit(_mesh(**degrees), graphdef, state), state, x, ct)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
    for name in want[2]:
        np.testing.assert_allclose(got[2][name], want[2][name], rtol=RTOL, atol=1e-7,
                                   err_msg=name)
    _assert_grads(got[3], want[3])


def test_local_loss_convention():
    """The explicit engine's recipe: each rank differentiates its *local* loss, whose sum over
    the token ranks is the step loss, and sums the gradients once. ``aux`` is already the global
    value on every rank, so each rank adds ``aux_loss / n_token_ranks``."""
    cfg = _cfg(top_k=2)
    graphdef, state = _layer(cfg)
    x, ct = _inputs()
    want = _loss_and_grads(_apply(graphdef, LocalOps()), state, x, ct)
    mesh, axes, n = _mesh(data=2, expert=4), ("data", "expert"), 8
    specs = param_specs(state, PARAM_RULES)

    def local(state, x, ct):
        def loss(state, x):
            out, aux = nnx.merge(graphdef, state)(x, ExplicitOps())
            return jnp.sum(out * ct) + aux["aux_loss"] / n
        # parameters a token rank does not shard feed every rank: their gradients get summed
        state = jax.tree.map(
            lambda s, v: v.replace(jax.lax.pcast(
                v[...], tuple(a for a in axes if a not in jax.tree.leaves(tuple(s))),
                to="varying")),
            specs, state, is_leaf=lambda z: isinstance(z, P))
        value, (gs, gx) = jax.value_and_grad(loss, argnums=(0, 1))(state, x)
        gs = jax.tree.map(lambda s, g: jax.lax.psum(g, tuple(
            a for a in axes if a not in jax.tree.leaves(tuple(s)))), specs, gs,
            is_leaf=lambda z: isinstance(z, P))
        return jax.lax.psum(value, axes), (gs, gx)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, TOKENS, TOKENS),
                              out_specs=(P(), (specs, TOKENS))))
    value, grads = f(state, x, ct)
    np.testing.assert_allclose(value, want[0], rtol=RTOL)
    _assert_grads(grads, want[3])


# ---- (c) capacity: everything routed to one expert ----------------------------------------------

def test_collapsed_routing_keeps_capacity_tokens():
    cfg = _cfg(top_k=1, capacity_factor=1.0)
    c = moe.expert_capacity(S, moe.MoESettings.of(cfg))
    assert c == S // E == 4
    graphdef, state = _layer(cfg)
    w = np.zeros((D, E), np.float32)
    w[0, 3] = 50.0  # feature 0 is 1 for every token: expert 3 wins with probability ~1
    state["w_router"].set_value(jnp.asarray(w))
    x, _ = _inputs()
    x = x.at[..., 0].set(1.0)
    out, aux = jax.jit(_apply(graphdef, LocalOps()))(state, x)
    np.testing.assert_allclose(aux["dropped_fraction"], 1 - c / S, rtol=1e-6)
    np.testing.assert_allclose(aux["expert_load"], np.eye(E)[3], atol=1e-7)
    # the first C tokens of each row (first come, first served) get expert 3; the rest get zero
    np.testing.assert_array_equal(out[:, c:], 0.0)
    gu = jnp.einsum("bsd,dtf->bstf", x[:, :c], state["w_up"][...][3])
    want = (jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]) @ state["w_down"][...][3]
    np.testing.assert_allclose(out[:, :c], want, rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(np.asarray(out[:, :c])).max(axis=-1) > 0)


# ---- (d) the Switch load-balancing loss ----------------------------------------------------------

def test_aux_loss_uniform_and_collapsed():
    """Balanced: token s carries feature s mod E and the router is the identity on those features,
    so token s goes to expert s mod E (f_i = 1/E exactly) and, by symmetry, every expert's mean
    probability is 1/E exactly (whatever the logit scale): loss = alpha x E x E / E^2 = alpha.
    Collapsed: every token to expert 0 with probability ~1: f_0 = P_0 = 1, loss = alpha x E."""
    alpha = 0.01
    route = jax.jit(moe.route, static_argnums=(1, 2))
    settings = moe.MoESettings(n_experts=E, top_k=1, capacity_factor=1.0,
                               router_aux_loss_coef=alpha, router_z_loss_coef=0.0)
    balanced = jnp.tile(jnp.eye(E)[jnp.arange(S) % E], (B, 1, 1)) * 2.0      # (B, S, E)
    _, _, stats = route(balanced, settings, moe.expert_capacity(S, settings))
    aux = moe.router_aux(stats, settings)
    np.testing.assert_allclose(stats["top1_fraction"], np.full(E, 1 / E), rtol=1e-5)
    np.testing.assert_allclose(stats["mean_prob"], np.full(E, 1 / E), rtol=1e-5)
    np.testing.assert_allclose(aux["load_balancing_loss"], alpha, rtol=1e-5)
    assert float(aux["dropped_fraction"]) == 0.0  # balanced at capacity factor 1: nothing drops
    collapsed = jnp.zeros((B, S, E)).at[..., 0].set(30.0)
    _, _, stats = route(collapsed, settings, moe.expert_capacity(S, settings))
    np.testing.assert_allclose(moe.router_aux(stats, settings)["load_balancing_loss"],
                               alpha * E, rtol=1e-5)
    # the z-loss: coef x mean(logsumexp(logits)^2)
    z = moe.MoESettings(n_experts=E, router_aux_loss_coef=0.0, router_z_loss_coef=0.1)
    _, _, stats = route(balanced, z, 4)
    lse = np.log(np.exp(2.0) + E - 1)
    np.testing.assert_allclose(moe.router_aux(stats, z)["z_loss"], 0.1 * lse ** 2, rtol=1e-5)


# ---- (e) the census: 2 all-to-alls over `expert` forward, 2 more backward ------------------------

GSPMD_RULES = Rules((("batch", ("data", "expert")), ("batch_no_expert", "data"),
                     ("experts", "expert"), ("mlp", "model")))


def _gspmd(mesh, graphdef, state, x):
    """The global-view layer under GSPMD, with its inputs placed in the mesh."""
    def put(tree, spec):
        return jax.device_put(tree, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s),
                                                 spec, is_leaf=lambda z: isinstance(z, P)))
    fn = _apply(graphdef, GSPMDOps(mesh, GSPMD_RULES))
    return fn, put(state, param_specs(state, PARAM_RULES)), put(x, TOKENS)


def _census(fn, state, x, ct, mesh, grad_text=None):
    """(forward ops, forward+backward ops) of ``fn`` from the compiled HLO. The gradient step
    returns the output too (with the gradient alone, the forward output's all-reduce is dead)."""
    fwd = jax.jit(fn).lower(state, x).compile().as_text()
    if grad_text is None:
        grad_text = []
        _loss_and_grads(fn, state, x, ct, hlo_text=grad_text)
    return [hlo.collectives(t, dict(mesh.shape)) for t in (fwd, grad_text[0])]


def _executions(ops, kind, axes):
    return sum(o.executions for o in ops if o.kind == kind and o.axes == axes)


@pytest.mark.parametrize("mode", ["explicit", "gspmd"])
def test_census_all_to_all(mode):
    """Both modes: 2 all-to-alls over `expert` forward, 4 in the gradient step, each of the local
    groups' dispatched slots E x (B/8 rows) x C x D fp32 per device; besides them only
    all-reduces (router statistics, the expert weights' gradient over `data`, the router's)."""
    cfg = _cfg(top_k=2)
    graphdef, state = _layer(cfg)
    x, ct = _inputs()
    mesh = _mesh(data=2, expert=4)
    grad_text = None
    if mode == "explicit":  # its values are checked in test_expert_parallel_matches_...
        fn = _explicit(mesh, graphdef, state)
    else:
        want = _loss_and_grads(_apply(graphdef, LocalOps()), state, x, ct)
        fn, state, x = _gspmd(mesh, graphdef, state, x)
        grad_text = []
        got = _loss_and_grads(fn, state, x, ct, hlo_text=grad_text)
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
        np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
        _assert_grads(got[3], want[3])
    fwd, grad = _census(fn, state, x, ct, mesh, grad_text)
    a2a = [o for o in fwd + grad if o.kind == "all-to-all"]
    assert all(o.axes == ("expert",) for o in a2a)
    assert _executions(fwd, "all-to-all", ("expert",)) == 2
    assert _executions(grad, "all-to-all", ("expert",)) == 4
    slots = E * (B // 8) * moe.expert_capacity(S, moe.MoESettings.of(cfg)) * D * 4
    assert {o.bytes for o in a2a} == {slots}
    assert {o.kind for o in fwd + grad} == {"all-to-all", "all-reduce"}


def test_census_tensor_parallel_experts():
    """Experts also Megatron-TP over `model` (explicit): the dense MLP's census, one all-reduce
    of the block output b x s x h forward and one of its input gradient backward."""
    graphdef, state = _layer(_cfg(top_k=2))
    x, ct = _inputs()
    mesh = _mesh(expert=4, model=2)
    fwd, grad = _census(_explicit(mesh, graphdef, state), state, x, ct, mesh)
    bsh = (B // 4) * S * D * 4
    assert [(o.bytes, o.tensors) for o in fwd if o.axes == ("model",)] == [(bsh, 1)]
    assert sum(o.bytes for o in grad if o.axes == ("model",)) == 2 * bsh
    assert _executions(grad, "all-to-all", ("expert",)) == 4


# ---- (f) errors ----------------------------------------------------------------------------------

def test_errors():
    with pytest.raises(ValueError, match="not divisible by parallel.expert=4"):
        moe.check_moe(moe.MoESettings(n_experts=6), expert_degree=4)
    with pytest.raises(ValueError, match="top_k=3 must be between 1 and model.n_experts=2"):
        moe.check_moe(moe.MoESettings(n_experts=2, top_k=3))
    with pytest.raises(ValueError, match="capacity_factor"):
        moe.check_moe(moe.MoESettings(capacity_factor=-1.0))
    with pytest.raises(ValueError, match="needs n_experts, top_k and capacity_factor"):
        moe.MoESettings.of(types.SimpleNamespace(d_model=8))
    with pytest.raises(ValueError, match="top_k"):
        moe.MoE(_cfg(top_k=9), rngs=nnx.Rngs(0))
    s = moe.MoESettings(n_experts=10, top_k=2, capacity_factor=1.1)
    assert moe.expert_capacity(50, s) == 11  # ceil(2 x 50 x 1.1 / 10), not 12 from float error
    assert moe.expert_capacity(50, moe.MoESettings(capacity_factor=0.0)) == 50
    assert moe.expert_capacity(4, moe.MoESettings(n_experts=8, capacity_factor=0.5)) == 1


def test_experiment_quick(tmp_path):
    proc = subprocess.run(
        [sys.executable, "experiments/moe.py", "--quick", "--out", str(tmp_path)],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "moe_quick.md").is_file()
    assert (tmp_path / "moe_quick.png").is_file()
