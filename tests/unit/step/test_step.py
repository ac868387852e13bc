"""jaxtp.step.plain and jaxtp.step.pipelined: one return arity, (loss, grads, metrics), for every
layout, and a forward-only pipelined loss that runs no backward."""

import jax
import numpy as np
import pytest

from jaxtp import testing
from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.inspect import hlo
from jaxtp.step import pipelined as pipelined_step

BASE = ["train.batch_size=8", "train.seq_len=32"]


@pytest.mark.parametrize("over", [
    ["parallel.data=2", "parallel.model=4"],
    ["parallel.data=2", "parallel.model=4", "parallel.mode=explicit", "train.microbatches=2"],
    ["parallel.pipeline=2", "parallel.data=4", "train.microbatches=2"],
])
def test_value_and_grad_returns_loss_grads_metrics(over):
    cfg = config.load("tiny", BASE + over)
    eng = engine.build_engine(cfg)
    ref = engine.reference_params(cfg)
    params = eng.layout.shard_params(testing.pad_params(ref, eng))
    batch = eng.layout.shard_batch(testing.random_batch(cfg))
    loss, grads, metrics = jax.jit(eng.value_and_grad_fn())(params, batch)
    assert metrics == {}
    want_loss, want_grads = testing.reference_loss_and_grad(cfg, ref, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    testing.assert_trees_close(testing.unpad(eng.layout.natural_layers(grads), ref), want_grads,
                               rtol=2e-4, atol=2e-5)


def test_moe_metrics_come_with_the_step():
    cfg = config.load("tiny-moe", BASE + ["parallel.expert=2", "parallel.data=4"])
    eng = engine.build_engine(cfg)
    params = eng.layout.init_params()
    loss, _, metrics = jax.jit(eng.value_and_grad_fn())(
        params, eng.layout.shard_batch(testing.random_batch(cfg)))
    assert {"lm_loss", "aux_loss", "dropped_fraction", "expert_load"} <= set(metrics)
    np.testing.assert_allclose(float(metrics["lm_loss"] + metrics["aux_loss"]), float(loss),
                               rtol=1e-6)


def test_pipelined_eval_runs_forward_only():
    """The pipelined loss is the reference loss and compiles to about one forward's matmul FLOPs
    (it used to run the whole backward: about 3x)."""
    over = ["parallel.pipeline=2", "parallel.data=4", "train.microbatches=2"]
    piped = engine.build_engine(config.load("tiny", BASE + over))
    flat = engine.build_engine(config.load("tiny", BASE + ["parallel.data=8"]))
    cfg = piped.layout.cfg
    ref = engine.reference_params(cfg)
    batch = testing.random_batch(cfg)
    loss = piped.loss()(piped.layout.shard_params(testing.pad_params(ref, piped)),
                        piped.layout.shard_batch(batch))
    np.testing.assert_allclose(float(loss), float(engine.reference_loss_fn(cfg)(ref, batch)),
                               rtol=1e-5)

    def flops(eng, branches=None):
        compiled = eng.loss().lower(*eng.abstract_inputs()).compile()
        return hlo.dot_flops(compiled.as_text(), branches) * 8
    # each rank runs its own stage (the switch's second branch, 1 stage in p); the output
    # head runs on every rank (+1 head per extra rank: tiny's head is 1/9 of its matmuls)
    ratio = flops(piped, pipelined_step.forward_branch_weights(piped.layout)) / flops(flat)
    assert 0.99 < ratio < 1.15, ratio


@pytest.mark.parametrize("mode", ["explicit", "gspmd"])
def test_pipelined_eval_census_is_one_forward(mode):
    """The forward-only pipelined loss runs Megatron's forward census once per layer: on pipeline
    rank 0 (which takes the switch's run branch for 1 stage in p), 2 all-reduces over `model` of
    b x s x h per layer of its stages, counted from the compiled HLO with the switch's weights."""
    over = ["parallel.pipeline=2", "parallel.data=2", "parallel.model=2", f"parallel.mode={mode}",
            "train.microbatches=2", "model.n_layers=4"]
    eng = engine.build_engine(config.load("tiny", BASE + over))
    cfg = eng.layout.cfg
    text = eng.loss().lower(*eng.abstract_inputs()).compile().as_text()
    ops = hlo.collectives(text, dict(eng.layout.mesh.shape),
                          pipelined_step.forward_branch_weights(eng.layout))
    b_local = cfg.train.batch_size // 2
    act = b_local * cfg.train.seq_len * cfg.model.d_model * 4
    tp = [op for op in ops if op.kind == "all-reduce" and op.axes == ("model",)
          and op.bytes == act]
    layers_per_rank = cfg.model.n_layers // 2
    # the embedding's g is one more b x s x h all-reduce, outside the stages
    assert sum(op.executions for op in tp) == pytest.approx(2 * layers_per_rank + 1), [
        (op.executions, op.op_name) for op in tp]
    assert not [op for op in ops if "data" in op.axes and op.bytes >= act]  # no activation sync
    ref = engine.reference_params(cfg)
    batch = testing.random_batch(cfg)
    loss = eng.loss()(eng.layout.shard_params(testing.pad_params(ref, eng)),
                      eng.layout.shard_batch(batch))
    np.testing.assert_allclose(float(loss), float(engine.reference_loss_fn(cfg)(ref, batch)),
                               rtol=1e-5)
