"""Mixture of experts in the whole model: expert parallelism composed with data, tensor, sequence,
context, ZeRO and FSDP parallelism, micro-batches and remat, in both execution modes.

- Equivalence: the training loss (LM + the router losses) and every gradient equal the single-device
  reference (fp32; the tolerances of test_model_parallel). Routing is dropless here
  (``capacity_factor=0``) so that no float32 reassociation can move a token across a capacity
  boundary; tests/unit/layers/test_moe.py checks that dropping is the same on every mesh.
- Census, per MoE layer (the difference between models of 2 and 1 MoE layers), from compiled HLO:
  2 all-to-alls over ``expert`` forward (dispatch, combine), 4 with backward, each of the device's
  dispatched slots ``E x (B / token shards) x C x D`` fp32.
- Errors before compile; parameter count; a short training run that logs the router metrics, and
  its checkpoint restored onto other expert-parallel meshes.
"""

import jax
import numpy as np
import pytest

from jaxtp import testing
from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.inspect import placement as inspect
from jaxtp.train import trainer as train
from jaxtp.ckpt.checkpoint import Checkpointer
from jaxtp.configs.schema import ConfigError
from jaxtp.layers.moe import MoESettings, expert_capacity

RTOL, ATOL = 2e-5, 2e-6
B, S, D, E = 8, 32, 64, 8  # tiny preset at seq_len 32; 8 experts
MOE = [f"model.n_experts={E}", "model.top_k=2", f"train.seq_len={S}"]
# two scanned groups, each a dense layer then an MoE layer
MODEL = [*MOE, "model.n_layers=4", "model.moe_every=2", "model.capacity_factor=0"]

_reference = {}


def _reference_fn(cfg):
    """The jitted single-device ``(loss, grads)`` and the reference parameters, built once."""
    if not _reference:
        _reference["fn"] = jax.jit(jax.value_and_grad(engine.reference_loss_fn(cfg)))
        _reference["params"] = engine.reference_params(cfg)
    return _reference["fn"], _reference["params"]


def _check(mode, overrides, *, microbatches=1):
    batch_size = B * microbatches
    cfg = config.load("tiny", [*MODEL, f"parallel.mode={mode}", *overrides,
                               f"train.batch_size={batch_size}",
                               f"train.microbatches={microbatches}"])
    eng = engine.build_engine(cfg)
    ref_fn, ref_params = _reference_fn(cfg)
    batch = testing.random_batch(cfg)
    # micro-batch k holds rows k, k+m, ...: its router loss is its own (then averaged)
    parts = [ref_fn(ref_params, jax.tree.map(lambda x, k=k: x[k::microbatches], batch))
             for k in range(microbatches)]
    ref_loss, ref_grads = jax.tree.map(lambda *xs: sum(xs) / microbatches, *parts)
    params = eng.layout.shard_params(testing.pad_params(ref_params, eng))
    loss, grads, metrics = eng.loss_grad_and_metrics()(params, eng.layout.shard_batch(batch))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    testing.assert_trees_close(testing.unpad(grads, ref_grads), ref_grads, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(metrics["lm_loss"] + metrics["aux_loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(np.sum(metrics["expert_load"]), 1.0, rtol=1e-5)
    assert float(metrics["dropped_fraction"]) == 0.0
    return eng, grads


@pytest.mark.parametrize("mode, overrides", [
    pytest.param("gspmd", ["parallel.expert=8", "parallel.remat=full"], id="gspmd-e8-remat"),
    pytest.param("explicit", ["parallel.expert=8"], id="explicit-e8"),
    pytest.param("gspmd", ["parallel.data=2", "parallel.expert=4", "parallel.zero_stage=1"],
                 id="gspmd-d2e4-zero1"),
    pytest.param("explicit", ["parallel.data=2", "parallel.expert=4"], id="explicit-d2e4"),
    pytest.param("gspmd", ["parallel.data=2", "parallel.expert=2", "parallel.model=2"],
                 id="gspmd-d2e2m2"),
    pytest.param("explicit", ["parallel.data=2", "parallel.expert=2", "parallel.model=2",
                              "parallel.sequence_parallel=true"], id="explicit-d2e2m2-sp"),
])
def test_matches_single_device(mode, overrides):
    eng, grads = _check(mode, overrides)
    # the experts live split over `expert`, and their gradients come back that way
    w_up = grads["blocks"]["moe"]["w_up"][...]
    assert w_up.sharding.spec == eng.layout.param_specs["blocks"]["moe"]["w_up"]
    assert w_up.sharding.shard_shape(w_up.shape)[1] == E // eng.layout.degrees["expert"]


def test_microbatches_fsdp_and_context():
    """Two micro-batches, composed with FSDP (ZeRO-3 over `fsdp`: each layer group gathered in
    the scan) and ring attention over `context`: the router loss is each micro-batch's, averaged,
    as in the reference above. (Under CP a routing group is a device's chunk of a row, so only
    dropless routing is independent of the context degree.)"""
    _check("explicit", ["parallel.fsdp=2", "parallel.context=2", "parallel.expert=2"],
           microbatches=2)


# ---- census ----------------------------------------------------------------------------------

def _all_to_alls(overrides, n_layers, step):
    """Executions of the all-to-alls over `expert` in the step's forward and backward halves
    (backward ops are those under ``transpose(...)``), and the set of their per-device bytes."""
    cfg = config.load("tiny", [*MOE, *overrides, f"model.n_layers={n_layers}"])
    ops = inspect.report(engine.build_engine(cfg), step=step).ops
    a2a = [o for o in ops if o.kind == "all-to-all"]
    assert all(o.axes == ("expert",) for o in a2a), a2a
    backward = sum(o.executions for o in a2a if "transpose(" in o.op_name)
    return sum(o.executions for o in a2a) - backward, backward, {o.bytes for o in a2a}


@pytest.mark.parametrize("mode, steps", [("gspmd", ("loss", "grad")), ("explicit", ("grad",))])
def test_census_two_all_to_alls_per_moe_layer(mode, steps):
    """Per MoE layer (2 layers minus 1): 2 all-to-alls forward, 2 more backward. GSPMD's forward
    step is the global view (the dispatched tensor's two layout changes as constraints); its
    gradient step, like explicit mode, writes the all-to-alls out per device."""
    overrides = [f"parallel.mode={mode}", "parallel.data=2", "parallel.expert=4"]
    c = expert_capacity(S, MoESettings(n_experts=E, top_k=2))
    slots = E * (B // 8) * c * D * 4  # one row per device: E experts x C slots x D, fp32
    for step in steps:
        (f1, b1, sizes1), (f2, b2, sizes2) = (_all_to_alls(overrides, n, step) for n in (1, 2))
        assert (f2 - f1, b2 - b1) == ((2, 0) if step == "loss" else (2, 2)), (step, f1, b1, f2, b2)
        assert sizes1 == sizes2 == {slots}


# ---- errors, parameter count ----------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    ([*MOE, "model.n_experts=6", "parallel.expert=4", "parallel.data=2"],
     "n_experts=6 is not divisible by parallel.expert=4"),
    ([*MOE, "model.n_experts=2", "model.top_k=3"], "top_k=3 must be between 1 and"),
    ([*MOE, "model.moe_every=2", "model.n_layers=3"],
     "n_layers=3 is not divisible by model.moe_every=2"),
    (["parallel.expert=4", "parallel.data=2"], "parallel.expert=4 needs model.n_experts > 0"),
    ([*MOE, "parallel.expert=8", "train.batch_size=4"],
     ("batch_size=4 is not divisible by the batch shards parallel.data x parallel.fsdp x "
      "parallel.expert = 8")),
])
def test_errors_before_compile(overrides, match):
    with pytest.raises(ConfigError, match=match):
        engine.build_engine(config.load("tiny", overrides))


@pytest.mark.parametrize("every", [1, 2])
def test_param_count_counts_the_experts(every):
    cfg = config.load("tiny", [*MOE, f"model.moe_every={every}", "model.n_layers=4"])
    eng = engine.build_engine(cfg)  # vocab 256 needs no padding at TP = 1
    n_params = sum(v.size for v in jax.tree.leaves(eng.layout.abstract_params))
    assert n_params == cfg.model.param_count()
    dense = config.load("tiny", ["model.n_layers=4"]).model.param_count()
    mlp = 3 * cfg.model.d_model * cfg.model.d_ff
    moe_layers = 4 // every
    assert cfg.model.param_count() == dense + moe_layers * ((E - 1) * mlp + D * E)
    assert cfg.model.param_count(active=True) == dense + moe_layers * (mlp + D * E)


# ---- training and checkpoints ---------------------------------------------------------------

STEPS = 30


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_run")
    cfg = config.load("tiny-moe", [f"train.seq_len={S}", f"train.steps={STEPS}",
                                   f"train.out_dir={out}", "parallel.data=2",
                                   "parallel.expert=4", "train.log_every=5",
                                   "train.eval_every=1000", "train.eval_batches=1",
                                   "train.checkpoint_every=0"])
    return cfg, train.run(cfg)


def test_training_logs_router_metrics_and_learns(run):
    _, records = run
    assert [r["step"] for r in records] == list(range(5, STEPS + 1, 5))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    for r in records:
        np.testing.assert_allclose(r["lm_loss"] + r["aux_loss"], r["loss"], rtol=1e-5)
        # Switch's load-balancing loss is alpha per layer at perfect balance, alpha x E at worst
        assert 0.01 * 2 * 0.9 < r["aux_loss"] < 0.01 * 2 * E
        assert 0.0 <= r["dropped_fraction"] < 0.5
        assert len(r["expert_load"]) == E
        np.testing.assert_allclose(sum(r["expert_load"]), 1.0, rtol=1e-5)
        assert r["expert_load_max"] >= 1.0


@pytest.mark.parametrize("data, expert", [(4, 2), (8, 1)])
def test_checkpoint_restores_onto_other_expert_meshes(run, data, expert):
    """Saved on (data=2, expert=4); restored bit-exactly onto (data=4, expert=2) and the
    expert-replicated (data=8), each leaf in the target's sharding."""
    cfg, _ = run
    directory = f"{cfg.train.out_dir}/checkpoints"
    states = []
    for d, e in ((2, 4), (data, expert)):
        trainer = train.Trainer(config.load("tiny-moe", [
            f"train.seq_len={S}", f"parallel.data={d}", f"parallel.expert={e}"]))
        like = trainer.abstract_state()
        ckpt = Checkpointer(directory, keep=1, cfg=trainer.cfg)
        state, _ = ckpt.restore(STEPS, like=like)
        ckpt.close()
        for got, target in zip(jax.tree.leaves(state), jax.tree.leaves(like)):
            assert got.sharding == target.sharding
        states.append(state)
    w_up = states[1].params["blocks"]["moe"]["w_up"][...]
    assert w_up.sharding.shard_shape(w_up.shape)[1] == E // expert
    for got, want in zip(jax.tree.leaves(states[1]), jax.tree.leaves(states[0])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
