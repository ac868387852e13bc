"""Pipeline parallelism in the whole model (jaxtp/staging.py): the pipelined loss and gradients
equal the single-device reference for every schedule, p in {2, 4}, with and without TP, in both
execution modes (fp32, the 2e-5 / 2e-6 of test_model_parallel); only activations cross
``pipeline`` (two transfers per tick, ``1/t`` of them under sequence parallelism), the gradient
sync runs once per step; a trained step equals the unpipelined one; checkpoints move between
pipeline layouts; and every bad pipeline config is an error before compile.
"""

import jax
import numpy as np
import pytest

from jaxtp import testing
from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.inspect import placement as inspect
from jaxtp.step import pipelined as pipelined_step
from jaxtp.ckpt.checkpoint import Checkpointer
from jaxtp.configs.schema import ConfigError
from jaxtp.train.trainer import Trainer

RTOL, ATOL = 2e-5, 2e-6
B, S, H = 8, 16, 64  # global batch, seq, d_model
SMALL = ["model.n_layers=4", f"train.seq_len={S}"]


def _cfg(*overrides):
    return config.load("tiny", [*SMALL, *overrides])


def _pipe(schedule, p, m, v=1):
    return [f"parallel.pipeline={p}", f"parallel.pipeline_schedule={schedule}",
            f"parallel.virtual_stages={v}", f"train.microbatches={m}"]


CASES = [
    pytest.param(_pipe("gpipe", 2, 2) + ["parallel.data=4", "parallel.mode=explicit"],
                 id="gpipe-p2-dp4-explicit"),
    pytest.param(_pipe("gpipe", 4, 4) + ["parallel.model=2", "parallel.data=1"],
                 id="gpipe-p4-tp2-gspmd"),
    pytest.param(_pipe("1f1b", 2, 2) + ["parallel.data=2", "parallel.model=2",
                                        "model.tie_embeddings=true", "parallel.zero_stage=3"],
                 id="1f1b-p2-dp2-tp2-tied-zero3-gspmd"),
    pytest.param(_pipe("1f1b", 4, 4) + ["parallel.data=2", "parallel.zero_stage=1",
                                        "parallel.mode=explicit"], id="1f1b-p4-dp2-explicit"),
    pytest.param(_pipe("1f1b", 2, 2) + ["parallel.model=4", "parallel.data=1",
                                        "parallel.sequence_parallel=true",
                                        "parallel.mode=explicit"], id="1f1b-p2-tp4-sp-explicit"),
    pytest.param(_pipe("interleaved", 2, 2, 2) + ["parallel.fsdp=2", "parallel.model=2",
                                                  "parallel.data=1", "parallel.mode=explicit"],
                 id="interleaved-p2v2-fsdp2-tp2-explicit"),
    pytest.param(_pipe("interleaved", 4, 4, 2) + ["model.n_layers=8", "parallel.data=2",
                                                  "parallel.remat=selective"],
                 id="interleaved-p4v2-dp2-gspmd"),
    # ZB-H1: the backward split into B (input cotangent) and W (weight gradients)
    pytest.param(_pipe("zb1", 2, 2) + ["parallel.data=2", "parallel.model=2",
                                       "model.tie_embeddings=true", "parallel.zero_stage=3"],
                 id="zb1-p2-dp2-tp2-tied-zero3-gspmd"),
    pytest.param(_pipe("zb1", 4, 4) + ["parallel.data=2", "parallel.mode=explicit",
                                       "parallel.remat=selective"],
                 id="zb1-p4-dp2-selective-explicit"),
    pytest.param(_pipe("zb1", 2, 2) + ["parallel.model=4", "parallel.data=1",
                                       "parallel.sequence_parallel=true",
                                       "parallel.mode=explicit"], id="zb1-p2-tp4-sp-explicit"),
]


@pytest.mark.parametrize("overrides", CASES)
def test_matches_single_device_reference(overrides):
    testing.assert_matches_reference(_cfg(*overrides), rtol=RTOL, atol=ATOL)


def _pipeline_ops(*overrides):
    cfg = _cfg(*overrides)
    return cfg, inspect.report(engine.build_engine(cfg)).ops


@pytest.mark.parametrize("mode", ["explicit", "gspmd"])
@pytest.mark.parametrize("sp", [False, True])
def test_census_only_activations_cross_pipeline(mode, sp):
    """(pipeline=2, data=2, model=2), 1F1B, m=2: per tick one forward and one backward transfer
    of each TP rank's 1/t of a micro-batch's activations, b x s/t x h x 4 bytes, never the
    replicated whole (plain TP: all-gathered over ``model`` after the transfer; SP: the stream
    is already the rank's sequence slice); over ``pipeline`` otherwise only the
    loss and the embedding / head gradients, once per step; over ``data`` the gradients, once."""
    p, m, t = 2, 2, 2
    cfg, ops = _pipeline_ops(*_pipe("1f1b", p, m), "parallel.data=2", f"parallel.model={t}",
                             f"parallel.mode={mode}", f"parallel.sequence_parallel={sp}")
    transfers = pipelined_step.program(engine.build_engine(cfg).layout).transfers
    b = B // 2 // m  # micro-batch rows per data shard
    act = b * S * H * 4
    sends = [op for op in ops if op.axes == ("pipeline",) and op.kind == "collective-permute"]
    assert sum(op.executions for op in sends) == transfers
    assert {op.bytes for op in sends} == {act // t}
    # plain TP: the slices are all-gathered over `model` after each transfer (SP: never)
    # (outside the schedule's per-tick branches: the stages' own SP gathers are inside them)
    after_send = [op for op in ops if op.axes == ("model",) and op.kind == "all-gather"
                  and "branch" not in op.op_name]
    assert sum(op.executions for op in after_send) == (0 if sp else transfers)
    assert all(op.bytes == act for op in after_send)
    others = [op for op in ops if "pipeline" in op.axes and op.kind != "collective-permute"]
    assert others and all(op.kind == "all-reduce" and op.executions == 1 for op in others)
    grad_sync = [op for op in ops if op.axes == ("data",) and op.kind == "all-reduce"
                 and op.bytes > 4]
    assert grad_sync and all(op.executions == 1 for op in grad_sync)
    if mode == "explicit" and not sp:
        # the census counts what pipeline rank 0 runs: per micro-batch and layer of its stage, 2
        # TP all-reduces forward and 2 backward (the backward reads the forward's residuals, it
        # does not recompute), plus the vocab-parallel embedding's forward one; never once per
        # tick per branch
        tp = [op for op in ops if op.axes == ("model",) and op.kind == "all-reduce"
              and op.bytes == act]
        assert sum(op.executions for op in tp) == m * (4 * 4 // p + 1)
    # no activation ever moves over `pipeline` as anything but a point-to-point send
    assert not [op for op in ops if "pipeline" in op.axes and op.kind in
                ("all-gather", "reduce-scatter", "all-to-all")]


@pytest.mark.parametrize("schedule, remat, ratio", [("1f1b", "none", 1.0), ("1f1b", "full", 5 / 4),
                                                    ("zb1", "none", 1.0)])
def test_matmul_flops_equal_the_unpipelined_step(schedule, remat, ratio):
    """Compiled matmul FLOPs per step over all ranks (each pipeline rank's own branch
    frequencies), against the same batch on data=8: under remat=none the backward reads the
    forward's residuals, so no forward matmul runs twice (the dots per layer per micro-batch are
    the unpipelined step's); under remat=full the backward recomputes its stage (5F against the
    unpipelined full recompute's 4F); ZB-H1's B and W split the backward without repeating a
    matmul. tiny, 4 layers, p=2 x data=4, 1F1B / ZB-H1, m=4."""
    from jaxtp.inspect import hlo

    def flops(cfg):
        eng = engine.build_engine(cfg)
        text = eng.loss_and_grad().lower(*eng.abstract_inputs()).compile().as_text()
        if not eng.pipelined:
            return hlo.dot_flops(text)
        return sum(hlo.dot_flops(text, pipelined_step.branch_weights(eng.layout, r))
                   for r in range(2)) / 2

    common = ["model.n_layers=4", "train.seq_len=32", "train.batch_size=32",
              f"parallel.remat={remat}"]
    piped = flops(config.load("tiny", [*common, *_pipe(schedule, 2, 4), "parallel.data=4"]))
    flat = flops(config.load("tiny", [*common, "parallel.data=8"]))
    assert piped / flat == pytest.approx(ratio, rel=0.02)


def test_trained_step_equals_unpipelined_and_checkpoints_move_between_layouts(tmp_path):
    """One AdamW step with an interleaved pipeline (p=2, v=2: the engine stores layers
    rank-major) equals the step without a pipeline; its checkpoint, written in natural layer
    order, restores bit-exactly onto pipeline=1 and back onto the interleaved layout."""
    base = ["train.lr=3e-4", "train.warmup_steps=0"]
    piped = _cfg(*base, *_pipe("interleaved", 2, 2, 2), "parallel.data=2", "parallel.model=2")
    flat = _cfg(*base, "parallel.data=4", "parallel.model=2", "train.microbatches=2")
    results = {}
    for name, cfg in (("piped", piped), ("flat", flat)):
        trainer = Trainer(cfg)
        state = trainer.init_state()
        state, _ = trainer.step_fn(state)(state, trainer.put_batch(testing.random_batch(cfg)))
        results[name] = trainer, state
    trainer, state = results["piped"]
    natural = jax.tree.map(np.asarray, trainer.engine.layout.natural_layers(state))
    testing.assert_trees_close(natural.params, jax.tree.map(np.asarray, results["flat"][1].params),
                               rtol=1e-4, atol=1e-5)  # a peak-lr Adam step: see test_zero

    ckpt = Checkpointer(tmp_path, keep=1, cfg=piped,
                        layer_order=trainer.engine.layout.natural_layers)
    ckpt.save(1, state, data_state={"step": 1})
    ckpt.close()
    for target, want in ((Trainer(_cfg(*base, "parallel.data=8")), natural),
                         (trainer, jax.tree.map(np.asarray, state))):
        testing.assert_restores(tmp_path, 1, target, want,
                                layer_order=target.engine.layout.natural_layers)


def test_eval_loss_through_the_pipeline():
    cfg = _cfg(*_pipe("1f1b", 2, 2), "parallel.data=4")
    eng, params, batch, ref_loss, _ = testing.assert_matches_reference(cfg, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(eng.loss()(params, batch), ref_loss, rtol=RTOL)


@pytest.mark.parametrize("overrides, match", [
    (["model.n_layers=2", *_pipe("1f1b", 4, 4)], "fewer than the parallel.pipeline=4"),
    (["model.n_layers=6", *_pipe("1f1b", 4, 4)], "does not split evenly"),
    (_pipe("interleaved", 2, 2, 4), "fewer than the parallel.pipeline=2 x "),
    (_pipe("1f1b", 4, 2), "microbatches=2 is fewer than pipeline=4"),
    (_pipe("interleaved", 2, 3, 2), "must be a multiple of pipeline=2"),
    (_pipe("gpipe", 2, 2, 2), "virtual_stages=2 needs pipeline_schedule=interleaved"),
    (["parallel.virtual_stages=2"], "needs parallel.pipeline > 1"),
    ([*_pipe("1f1b", 2, 2), "parallel.context=2"], "ring attention"),
    ([*_pipe("1f1b", 2, 2), "model.n_experts=4", "model.moe_every=1"], "MoE"),
    ([*_pipe("zigzag", 2, 2)], "pipeline_schedule"),
])
def test_bad_pipeline_configs_are_errors_before_compile(overrides, match):
    with pytest.raises(ConfigError, match=match):
        engine.build_engine(config.load("tiny", [*SMALL, "train.batch_size=24", *overrides]))


def test_each_rank_holds_its_stage_of_the_layers():
    """The memory point of a pipeline: a rank holds ``1/p`` of every stacked layer parameter
    (the embedding and head stay replicated over ``pipeline``)."""
    eng = engine.build_engine(_cfg(*_pipe("1f1b", 4, 4), "parallel.data=2"))
    blocks = zip(jax.tree.leaves(eng.layout.abstract_params["blocks"]),
                 jax.tree.leaves(eng.layout.param_shardings["blocks"]))
    for var, sharding in blocks:
        assert sharding.shard_shape(var.shape) == (var.shape[0] // 4, *var.shape[1:])
    embed = jax.tree.leaves(eng.layout.param_shardings["embed"])
    assert all("pipeline" not in str(s.spec) for s in embed)
