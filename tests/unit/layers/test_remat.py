"""Recompute policies (``parallel.remat``): same loss and gradients as the single-device
reference in both modes, and the residuals each policy saves for backward are what it promises.

Tolerances are test_model_parallel's (fp32; reassociation of the tensor-parallel all-reduces).
"""

import jax
import numpy as np
import pytest

from jaxtp import testing
from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.inspect import hlo
from jaxtp.configs.schema import ConfigError
from jaxtp.parallel.mesh import mesh_shape
from jaxtp.layers.transformer import REMAT_POLICIES

RTOL, ATOL = 2e-5, 2e-6
SEQ = 96  # distinct from every other dim of `tiny`, so an s x s residual is recognisable


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
@pytest.mark.parametrize("remat, extra", [
    ("full", []), ("selective", []), ("dots_saveable", []),
    ("selective", ["parallel.zero_stage=3"]),
])
def test_policy_matches_single_device(mode, remat, extra):
    cfg = config.load("tiny", [f"parallel.mode={mode}", f"parallel.remat={remat}",
                               "parallel.data=4", "parallel.model=2", *extra])
    eng = engine.build_engine(cfg)
    ref_params = engine.reference_params(cfg)
    batch = testing.random_batch(cfg)
    ref_loss, ref_grads = testing.reference_loss_and_grad(
        config.load("tiny", ["parallel.data=1", "parallel.model=1"]), ref_params, batch)
    params = eng.layout.shard_params(testing.pad_params(ref_params, eng))
    loss, grads = eng.loss_and_grad()(params, eng.layout.shard_batch(batch))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    testing.assert_trees_close(testing.unpad(grads, ref_grads), ref_grads, rtol=RTOL, atol=ATOL)


def _residuals(remat):
    """The arrays ``jax.vjp`` keeps for the backward pass of the single-device loss."""
    cfg = config.load("tiny", [f"parallel.remat={remat}", f"train.seq_len={SEQ}",
                               "parallel.data=1", "parallel.model=1"])
    params = engine.reference_params(cfg)
    batch = testing.random_batch(cfg)
    loss_fn = engine.reference_loss_fn(cfg)
    _, vjp = jax.vjp(lambda p: loss_fn(p, batch), params)
    leaves = jax.tree.leaves(vjp)
    total = sum(a.size * a.dtype.itemsize for a in leaves)
    squares = [a.shape for a in leaves if list(a.shape).count(SEQ) >= 2]
    return total, squares


def test_saved_residuals_per_policy():
    saved = {r: _residuals(r) for r in REMAT_POLICIES}
    total = {r: t for r, (t, _) in saved.items()}
    # full keeps the least, then selective (linear outputs), dots_saveable (all matmul outputs),
    # none (everything)
    assert total["full"] < total["selective"] < total["dots_saveable"] < total["none"]
    # the point of selective recompute: no s x s attention tensor is saved, as under full;
    # without recompute (and saving every dot) the scores are kept
    assert saved["selective"][1] == [] and saved["full"][1] == []
    assert saved["none"][1] and saved["dots_saveable"][1]


def _model_all_reduce_bytes(mode, remat, *extra):
    cfg = config.load("tiny", [f"parallel.mode={mode}", f"parallel.remat={remat}",
                               "parallel.data=2", "parallel.model=4", *extra])
    eng = engine.build_engine(cfg)
    params, batch = eng.abstract_inputs()
    text = eng.loss_and_grad().lower(params, batch).compile().as_text()
    return sum(o.total_bytes for o in hlo.collectives(text, mesh_shape(eng.layout.mesh))
               if o.kind == "all-reduce" and o.axes == ("model",))


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_partial_recompute_does_not_rerun_tp_all_reduces(mode):
    """selective and dots_saveable (and ZeRO-3's default, which saves the matmul outputs) keep
    the row-parallel all-reduce outputs: backward runs the TP collectives of no recompute, as
    Megatron's selective recompute does. (Explicit mode saved the partial sums and all-reduced
    them again in backward: one attention all-reduce per layer more than GSPMD mode.)"""
    none = _model_all_reduce_bytes(mode, "none")
    # dots_saveable saves the TP outputs the same way (model._and_tp_outputs) as these two
    for remat, extra in [("selective", ()), ("none", ("parallel.zero_stage=3",))]:
        assert _model_all_reduce_bytes(mode, remat, *extra) == none, (remat, extra)
    # full re-runs them: test_census.test_remat_full_reruns_forward_collectives


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="remat"):
        config.load("tiny", ["parallel.remat=sometimes"])
