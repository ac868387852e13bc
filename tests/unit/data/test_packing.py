"""Packed batches (documents with segment ids, per-document positions and a loss mask): no
attention or gradient leaks from one document into another, on one device and on every kind of
mesh (dense attention in both modes, ring attention under CP, a pipeline), and a packed batch's
loss and gradients equal the single-device reference's."""

import jax
import numpy as np
import pytest

import jaxtp
from jaxtp.step import engine
from jaxtp.testing import (assert_trees_close, pad_params, packed_batch, reference_loss_and_grad,
                           unpad)

BASE = {"train.batch_size": 4, "train.seq_len": 32, "model.max_seq_len": 64}
TOL = dict(rtol=2e-5, atol=2e-6)  # fp32, matmul precision "highest" (conftest)

LAYOUTS = {
    "one device": {},
    "data=2 x model=4": {"parallel.data": 2, "parallel.model": 4},
    "data=2 x model=4, explicit": {"parallel.data": 2, "parallel.model": 4,
                                   "parallel.mode": "explicit"},
    "data=2 x model=4, explicit, SP, ZeRO-3": {
        "parallel.data": 2, "parallel.model": 4, "parallel.mode": "explicit",
        "parallel.sequence_parallel": True, "parallel.zero_stage": 3},
    "context=2 zigzag x data=2 x model=2": {"parallel.context": 2, "parallel.data": 2,
                                            "parallel.model": 2},
    "context=4 contiguous x model=2, explicit": {
        "parallel.context": 4, "parallel.model": 2, "parallel.mode": "explicit",
        "parallel.context_layout": "contiguous"},
    "pipeline=2 x data=2 x model=2 (1f1b)": {
        "parallel.pipeline": 2, "parallel.data": 2, "parallel.model": 2,
        "parallel.pipeline_schedule": "1f1b", "train.microbatches": 2},
}


def _doc_a_changed(batch, seed=1):
    """The batch with every token of each row's first document replaced (inputs, and the targets
    that are that document's tokens)."""
    rng = np.random.default_rng(seed)
    out = {k: v.copy() for k, v in batch.items()}
    a = batch["segment_ids"] == 1
    out["inputs"] = np.where(a, (batch["inputs"] + rng.integers(1, 255, a.shape)) % 256,
                             batch["inputs"])
    # target i is input i + 1: it belongs to document 1 where input i + 1 does
    a_next = np.concatenate([a[:, 1:], np.zeros_like(a[:, :1])], axis=1)
    shifted = np.concatenate([out["inputs"][:, 1:], batch["targets"][:, -1:]], axis=1)
    out["targets"] = np.where(a_next, shifted, batch["targets"])
    assert (out["inputs"] != batch["inputs"]).sum() == a.sum()
    return out


def _only_later_docs(batch):
    """Count only the tokens of the documents after the first in each row."""
    return {**batch, "loss_mask": batch["loss_mask"] * (batch["segment_ids"] > 1)}


def _devices(overrides):
    return jax.devices()[:1] if not any(k.startswith("parallel.") for k in overrides) else None


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_changing_one_document_leaves_the_others_losses_and_gradients_unchanged(name):
    cfg = jaxtp.config("tiny", {**BASE, **LAYOUTS[name]})
    eng = engine.build_engine(cfg, _devices(LAYOUTS[name]))
    ref = engine.reference_params(cfg)
    params = eng.layout.shard_params(pad_params(ref, eng))
    step = eng.loss_and_grad()
    batch = packed_batch(cfg, seed=3)
    assert (batch["segment_ids"].max(axis=1) >= 2).all()  # every row holds >= 2 documents
    loss, grads = step(params, eng.layout.shard_batch(_only_later_docs(batch)))
    loss2, grads2 = step(params, eng.layout.shard_batch(_only_later_docs(_doc_a_changed(batch))))
    np.testing.assert_allclose(loss2, loss, **TOL)
    assert_trees_close(grads2, grads, **TOL)
    # ... and it is the single-device reference's (the whole packed batch's loss and grads)
    # (the mean over the whole batch's counted tokens, however it is cut into micro-batches)
    ref_loss, ref_grads = reference_loss_and_grad(cfg, ref, batch)
    loss, grads = step(params, eng.layout.shard_batch(batch))
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    assert_trees_close(unpad(eng.layout.natural_layers(grads), ref_grads), ref_grads, **TOL)


def test_without_segment_ids_the_first_document_leaks_into_the_others():
    """The control: the same change does move the later documents' loss when attention may cross
    document boundaries, so the leakage test above can fail."""
    cfg = jaxtp.config("tiny", BASE)
    eng = engine.build_engine(cfg, jax.devices()[:1])
    params = eng.layout.shard_params(pad_params(engine.reference_params(cfg), eng))
    loss_fn = eng.loss()

    def unsegmented(b):
        return {k: v for k, v in _only_later_docs(b).items() if k != "segment_ids"}

    batch = packed_batch(cfg, seed=3)
    b1, b2 = unsegmented(batch), unsegmented(_doc_a_changed(batch))
    b1["segment_ids"] = b2["segment_ids"] = np.ones_like(batch["segment_ids"])
    assert abs(float(loss_fn(params, eng.layout.shard_batch(b1))) -
               float(loss_fn(params, eng.layout.shard_batch(b2)))) > 1e-3


def test_a_packed_document_scores_as_it_does_alone():
    """Per-token losses of each document inside a packed row equal those of the document run on
    its own at the start of a row."""
    cfg = jaxtp.config("tiny", BASE)
    model = jaxtp.Model(cfg, params=engine.reference_params(cfg), devices=jax.devices()[:1])
    batch = packed_batch(cfg, seed=5)
    packed = np.asarray(model.token_losses(batch["inputs"], batch["targets"],
                                           segment_ids=batch["segment_ids"],
                                           positions=batch["positions"]))
    row, seg = 0, batch["segment_ids"][0]
    for doc in range(1, seg.max() + 1):
        idx = np.flatnonzero((seg == doc) & (batch["loss_mask"][row] == 1))
        if not len(idx):
            continue
        alone = np.asarray(model.token_losses(batch["inputs"][row:row + 1, idx],
                                              batch["targets"][row:row + 1, idx]))[0]
        np.testing.assert_allclose(packed[row, idx], alone, rtol=2e-5, atol=2e-5)


def _census(overrides, packed):
    from jaxtp.inspect import hlo

    cfg = jaxtp.config("tiny", overrides)
    eng = engine.build_engine(cfg)
    params, batch = eng.abstract_inputs()
    if packed:
        batch = {**batch, **{k: batch["inputs"] for k in ("segment_ids", "positions",
                                                           "loss_mask")}}
    text = eng.loss_and_grad().lower(params, batch).compile().as_text()
    return [(o.kind, o.axes, o.bytes // o.tensors) for o in hlo.collectives(
        text, dict(eng.layout.degrees)) for _ in range(o.tensors * o.executions)]


def _extra(packed, plain):
    extra = list(packed)
    for op in plain:
        assert op in extra, f"packing removed {op}"
        extra.remove(op)
    return extra


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_packing_adds_one_scalar_all_reduce_to_the_tp_census(mode):
    """data=2 x model=4: a packed step's census is the unpacked one plus the global count of the
    loss mask's tokens (4 bytes over ``data``); the TP collectives are untouched."""
    over = {"parallel.data": 2, "parallel.model": 4, "parallel.mode": mode}
    assert _extra(_census(over, True), _census(over, False)) == [("all-reduce", ("data",), 4)]


def test_packing_under_context_parallelism_moves_only_ids():
    """context=4 zigzag x model=2: what packing adds is id-sized -- the key segment ids riding
    the ring, the extra batch entries put in the zigzag order, the token count -- never an
    activation (one ring K/V block is 32x larger)."""
    over = {"parallel.context": 4, "parallel.model": 2, "parallel.mode": "explicit"}
    extra = _extra(_census(over, True), _census(over, False))
    ids = 8 * 64 * 4  # the whole global [B, S] int32 array
    assert extra and max(size for _, _, size in extra) <= ids
    ring = [op for op in extra if op == ("collective-permute", ("context",), ids // 4)]
    assert ring  # the key segment ids travel with their K/V blocks
