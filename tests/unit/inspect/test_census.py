"""The Megatron collective census, read from compiled HLO (DESIGN.md's contract).

Per transformer layer: 2 all-reduces over ``model`` forward and 2 backward, each of
``b_local x s x h`` elements, identical in both modes. Measured as the difference between models of
L+1 and L layers, so the embedding and the loss are factored out.
"""

import pytest

from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.inspect import placement as inspect

DATA, MODEL = 2, 4
B, S, H = 8, 64, 64  # global batch, seq, d_model of the tiny preset


def _ops(mode, n_layers, step, extra=()):
    cfg = config.load("tiny", [f"parallel.mode={mode}", f"parallel.data={DATA}",
                               f"parallel.model={MODEL}", f"model.n_layers={n_layers}", *extra])
    return inspect.report(engine.build_engine(cfg), step=step).ops


def _model_all_reduces(ops):
    """(executions, bytes) of each all-reduce over `model`, expanded per execution."""
    out = []
    for op in ops:
        if op.kind == "all-reduce" and op.axes == ("model",):
            out += [op.bytes // op.tensors] * (op.executions * op.tensors)
    return sorted(out)


def _per_layer(mode, step, extra=()):
    small, big = (_model_all_reduces(_ops(mode, n, step, extra)) for n in (2, 3))
    extra_ops = list(big)
    for b in small:
        extra_ops.remove(b)
    return extra_ops


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_per_layer_census(mode):
    b_local_s_h_bytes = (B // DATA) * S * H * 4
    forward = _per_layer(mode, "loss")
    both = _per_layer(mode, "grad")
    assert forward == [b_local_s_h_bytes] * 2
    assert both == [b_local_s_h_bytes] * 4


def test_both_modes_same_census():
    g = inspect.report(engine.build_engine(config.load("tiny", [
        "parallel.mode=gspmd", f"parallel.data={DATA}", f"parallel.model={MODEL}"])))
    e = inspect.report(engine.build_engine(config.load("tiny", [
        "parallel.mode=explicit", f"parallel.data={DATA}", f"parallel.model={MODEL}"])))
    model = [{k: c[k] for k in ("kind", "axes", "count", "bytes")} for c in g.collectives
             if c["axes"] == ["model"]]
    assert model == [{k: c[k] for k in ("kind", "axes", "count", "bytes")}
                     for c in e.collectives if c["axes"] == ["model"]]
    # the data-parallel gradient sync moves each local gradient byte once per step, in both modes
    params = g.per_device_bytes["params"]
    for r in (g, e):
        dp = [c for c in r.collectives if c["axes"] == ["data"]]
        assert len(dp) == 1 and dp[0]["kind"] == "all-reduce"
        assert params <= dp[0]["bytes"] <= params + 64  # + the loss scalar
    # nothing but all-reduces: no all-gather of weights, no all-to-all, no permutes
    assert {c["kind"] for c in g.collectives + e.collectives} == {"all-reduce"}


# Compositions whose whole census (train step: loss, gradients, sync, optimizer) must be the same
# in both modes (ZeRO-2 + TP: test_zero.test_zero2_with_tp_reduce_scatters_each_tp_block). Known,
# documented exceptions are left out: under SP, XLA's CPU pipeline has no reduce-scatter creator
# (test_sequence_parallel), and GSPMD MoE with TP all-reduces the expert capacity buffer rather
# than the tokens (benchmarks/README.md).
COMPOSITIONS = {
    "data=2 x model=4, ZeRO-3, selective": ["parallel.data=2", "parallel.model=4",
                                            "parallel.zero_stage=3", "parallel.remat=selective"],
    "data=2 x fsdp=2 x model=2": ["parallel.data=2", "parallel.fsdp=2", "parallel.model=2"],
    "context=2 x data=2 x model=2, ZeRO-2": ["parallel.context=2", "parallel.data=2",
                                             "parallel.model=2", "parallel.zero_stage=2"],
    "pipeline=2 x data=2 x model=2, ZeRO-3": ["parallel.pipeline=2", "parallel.data=2",
                                              "parallel.model=2", "parallel.zero_stage=3",
                                              "train.microbatches=2"],
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_compositions_have_the_same_census_in_both_modes(name):
    """Per (kind, mesh axes), the bytes per device of the compiled train step agree within 2%
    (+256 B for scalar reductions that the two modes group differently). This caught GSPMD's
    ZeRO-2 + TP reduce-scatter (t times the bytes, plus an all-gather over ``model``) and
    explicit mode re-running the attention all-reduce under partial recompute."""
    census = {}
    for mode in ("gspmd", "explicit"):
        cfg = config.load("tiny", [f"parallel.mode={mode}", *COMPOSITIONS[name]])
        report = inspect.report(engine.build_engine(cfg), step="train")
        census[mode] = {(c["kind"], tuple(c["axes"])): c["bytes"] for c in report.collectives}
    g, e = census["gspmd"], census["explicit"]
    for key in sorted(set(g) | set(e)):
        a, b = g.get(key, 0), e.get(key, 0)
        assert abs(a - b) <= 0.02 * max(a, b) + 256, (key, a, b)


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_loss_never_moves_logits(mode):
    """Vocab-parallel cross-entropy exchanges O(b x s) values, never the b x s x v logits."""
    cfg = config.load("tiny", [f"parallel.mode={mode}", f"parallel.data={DATA}",
                               f"parallel.model={MODEL}", "model.vocab_size=2048"])
    eng = engine.build_engine(cfg)
    local_logits = (B // DATA) * S * (eng.layout.padded_vocab // MODEL) * 4
    r = inspect.report(eng)
    assert local_logits > 4 * (B // DATA) * S * H * 4  # the check below can tell them apart
    for op in r.ops:
        assert op.bytes // op.tensors < local_logits, op
    # the loss itself: three [b, s] all-reduces over `model` (max, sum of exp, target logit)
    loss_ops = [op for op in _ops(mode, 2, "loss", ["model.vocab_size=2048"])
                if op.axes == ("model",) and op.bytes // op.tensors == (B // DATA) * S * 4]
    assert sum(op.tensors * op.executions for op in loss_ops) == 3


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_data_parallel_only_has_no_model_collectives(mode):
    # explicit mode psums over the size-1 `model` axis; XLA keeps those as one-device
    # all-reduces, which move nothing and must not be counted
    r = inspect.report(engine.build_engine(config.load("tiny", ["parallel.data=8",
                                                         f"parallel.mode={mode}"])))
    assert [c["axes"] for c in r.collectives] == [["data"]]


def test_remat_full_reruns_forward_collectives():
    """Recompute re-runs forward all-reduces in backward, and the census reports it.

    Backward needs the attention block's all-reduced output again (it is the MLP's input), but not
    the MLP's: its result only feeds the next layer, whose input is the saved carry. So XLA re-runs
    one of the two forward all-reduces: 2 + 2 + 1 per layer (Megatron's eager full recompute
    re-runs both, 6).
    """
    assert len(_per_layer("explicit", "grad", ["parallel.remat=full"])) == 5
    assert len(_per_layer("gspmd", "grad", ["parallel.remat=full"])) == 5


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_micro_batches_sync_gradients_once_per_step(mode):
    """Accumulating over m micro-batches: TP collectives run m times, the DP sync once."""
    m = 4
    cfg = config.load("tiny", [f"parallel.mode={mode}", f"parallel.data={DATA}",
                               f"parallel.model={MODEL}", f"train.microbatches={m}"])
    r = inspect.report(engine.build_engine(cfg))
    dp = [op for op in r.ops if op.axes == ("data",)]
    assert len(dp) == 1 and dp[0].executions == 1
    params = r.per_device_bytes["params"]
    assert params <= dp[0].bytes <= params + 64  # every local gradient byte once (+ the loss)
    layer_ops = [op for op in r.ops if op.axes == ("model",) and op.executions == 2 * m]
    assert sum(op.tensors for op in layer_ops) == 4  # 2 fwd + 2 bwd per layer, per micro-batch
    assert all(op.bytes == (B // DATA // m) * S * H * 4 for op in layer_ops)


def test_param_table_flags_a_mis_sharded_parameter():
    """The placement report's sanity table: with the engine's own layout nothing sizeable is
    flagged; replicate the MLP up-projection over `model` and it tops the table, flagged, holding
    t times its ideal bytes."""
    import jax

    eng = engine.build_engine(config.load("tiny", ["parallel.data=2", "parallel.model=4"]))
    good = inspect.param_table(eng)
    assert not [r for r in good if r["flagged"]]
    w_up = next(r for r in good if r["param"] == "blocks.mlp.w_up")
    assert w_up["bytes"] == w_up["ideal_bytes"] == 2 * 64 * 2 * 256 * 4 / 4
    bad_specs = jax.tree_util.tree_map_with_path(
        lambda path, s: jax.sharding.PartitionSpec() if "w_up" in jax.tree_util.keystr(path)
        else s, eng.layout.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    bad = inspect.param_table(eng, bad_specs)
    assert bad[0]["param"] == "blocks.mlp.w_up" and bad[0]["flagged"]
    assert bad[0]["bytes"] == 4 * bad[0]["ideal_bytes"]
    assert [r["param"] for r in bad if r["flagged"]] == ["blocks.mlp.w_up"]
