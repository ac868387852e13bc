"""jaxtp.step.layout: the specs and shardings of one config on one mesh, the layer order, and the
batch preparation (ring attention's layout and positions)."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtp.configs import schema as config
from jaxtp.pipeline import layer_order
from jaxtp.parallel.ring import positions_for_layout, to_layout
from jaxtp.step.layout import build_layout


def _layout(*over, training=True):
    return build_layout(config.load("tiny", ["train.batch_size=8", "train.seq_len=32", *over]),
                        training=training)


def test_tensor_parallel_and_zero_specs():
    lo = _layout("parallel.fsdp=2", "parallel.model=4")
    attn = lo.param_specs["blocks"]["attn"]
    # w_qkv [layers, embed, kv_heads, q_per_kv + 2, head_dim]: KV heads over model, embed over
    # fsdp (ZeRO-3 inside fsdp)
    assert attn["w_qkv"] == P(None, "fsdp", "model", None, None)
    assert lo.tp_specs["blocks"]["attn"]["w_qkv"] == P(None, None, "model", None, None)
    assert lo.batch_spec == P(("data", "fsdp"), None)
    assert lo.layer_specs is not None  # ZeRO-3 gathers each layer inside the scan
    assert lo.layer_specs["attn"]["w_qkv"] == P("fsdp", "model", None, None)
    # the layers' entries of the outer specs are replicated: gathered inside the scan instead
    assert lo.outer_specs["blocks"]["attn"]["w_qkv"] == P()
    assert lo.outer_specs["embed"]["table"] == lo.param_specs["embed"]["table"] == P("model",
                                                                                      "fsdp")


def test_zero_stages_shard_moments_then_grads_then_params():
    specs = {}
    for stage in (0, 1, 2, 3):
        lo = _layout("parallel.data=8", f"parallel.zero_stage={stage}")
        w = lambda t: t["blocks"]["mlp"]["w_up"]  # noqa: E731
        specs[stage] = (w(lo.param_specs), w(lo.grad_specs), w(lo.moment_specs))
    has = lambda s: "data" in jax.tree.leaves(tuple(s), is_leaf=lambda x: x is None)  # noqa
    assert [tuple(has(s) for s in specs[k]) for k in range(4)] == [
        (False, False, False), (False, False, True), (False, True, True), (True, True, True)]


def test_abstract_inputs_carry_shardings_and_allocate_nothing():
    lo = _layout("parallel.data=2", "parallel.model=4")
    params = lo.abstract_params_sharded()
    leaf = params["blocks"]["attn"]["w_qkv"].get_value()
    assert isinstance(leaf, jax.ShapeDtypeStruct)
    assert leaf.sharding.spec == P(None, None, "model", None, None)
    batch = lo.abstract_batch()
    assert batch["inputs"].shape == (8, 32) and batch["inputs"].sharding == lo.batch_sharding


@pytest.mark.parametrize("cp, order", [(1, "zigzag"), (2, "zigzag"), (4, "contiguous")])
def test_prepare_puts_tokens_in_the_context_layout_with_their_positions(cp, order):
    lo = _layout(f"parallel.context={cp}", f"parallel.context_layout={order}",
                 "parallel.data=-1")
    tok = np.arange(8 * 32, dtype=np.int32).reshape(8, 32)
    out = jax.jit(lo.prepare)({"inputs": tok, "targets": tok + 1})
    want = np.asarray(to_layout(tok, cp, order)) if cp > 1 else tok
    np.testing.assert_array_equal(np.asarray(out["inputs"]), want)
    np.testing.assert_array_equal(np.asarray(out["targets"]), want + 1)
    pos = np.asarray(positions_for_layout(32, cp, order)) if cp > 1 else np.arange(32)
    np.testing.assert_array_equal(np.asarray(out["positions"]), np.broadcast_to(pos, (8, 32)))


def test_interleaved_layer_order_round_trips():
    lo = _layout("parallel.pipeline=2", "parallel.data=4", "parallel.virtual_stages=2",
                 "parallel.pipeline_schedule=interleaved", "model.n_layers=4",
                 "train.microbatches=2")
    assert lo.layer_units == 4
    tree = {"blocks": {"w": np.arange(4)}, "embed": {"w": np.arange(4)}}
    ranked = layer_order.to_pipeline_order(tree, 2, 2, 4)
    # stage k on rank k % 2 as chunk k // 2: rank 0 holds stages 0, 2; rank 1 holds 1, 3
    assert ranked["blocks"]["w"].tolist() == [0, 2, 1, 3]
    assert ranked["embed"]["w"].tolist() == [0, 1, 2, 3]  # only the stacked layers move
    back = layer_order.to_natural_order(ranked, 2, 2, 4)
    assert np.asarray(back["blocks"]["w"]).tolist() == [0, 1, 2, 3]
    params = lo.init_params(seed=0)
    np.testing.assert_array_equal(
        np.asarray(lo.natural_layers(lo.natural_layers(params), inverse=True)["blocks"]["attn"]
                   ["w_qkv"][...]), np.asarray(params["blocks"]["attn"]["w_qkv"][...]))


def test_scoring_layouts_skip_the_train_batch_rules():
    """A batch of 6 does not split over 4 data shards: the trainer refuses it, a model for
    scoring (each call brings its own batch) does not."""
    over = ("parallel.data=4", "parallel.model=2", "train.microbatches=3", "train.batch_size=6")
    with pytest.raises(config.ConfigError, match="batch_size=6"):
        _layout(*over)
    lo = _layout(*over, training=False)
    assert dataclasses.asdict(lo.cfg.train)["microbatches"] == 3


@pytest.mark.parametrize("over", [("parallel.model=4",), ("parallel.model=8",),
                                  ("parallel.pipeline=2", "parallel.model=4",
                                   "train.microbatches=2")])
def test_initial_parameters_are_the_same_on_every_layout(over):
    """Issue 37: ``model=4`` pads the 256-token vocabulary to 512; the padded table used to be
    drawn whole, so a ``jaxtp train`` on that layout started from other weights than one device
    (step-1 loss 5.5552 vs 5.5564). Now the model is drawn at its own vocabulary on every
    layout and the padding is zeros."""
    ref = jax.device_get(_layout("model.n_layers=4").init_params(seed=3))
    lo = _layout("model.n_layers=4", *over)
    got = jax.device_get(lo.natural_layers(lo.init_params(seed=3)))
    padded = 0
    for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
        want, have = np.asarray(want), np.asarray(have)
        head = tuple(slice(0, n) for n in want.shape)
        np.testing.assert_array_equal(have[head], want, err_msg=str(path))
        assert np.abs(have).sum() == np.abs(have[head]).sum(), path  # the padding is zeros
        padded += have.size > want.size
    assert padded == 2  # the embedding table and the head
