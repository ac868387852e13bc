"""The public Python API (jaxtp.config / jaxtp.Model / jaxtp.Trainer): every layout gives the
single-device reference's logits and losses; save / from_run / fine-tune round trips; one-line
errors for bad input."""

import json

import numpy as np
import pytest

import jaxtp
from jaxtp.step import engine

# tiny, shrunk: every case below compiles a forward in a few seconds
BASE = {"train.batch_size": 8, "train.seq_len": 32, "model.max_seq_len": 64}
TOL = dict(rtol=2e-5, atol=2e-5)  # fp32, matmul precision "highest" (conftest)


def _tokens(b=4, s=32, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (b, s)).astype(np.int32)


@pytest.fixture(scope="module")
def reference():
    """Single-device logits and per-token losses of the reference parameters."""
    import jax

    cfg = jaxtp.config("tiny", BASE)
    model = jaxtp.Model(cfg, params=engine.reference_params(cfg, 0), devices=jax.devices()[:1])
    tok = _tokens()
    return model, np.asarray(model.logits(tok)), np.asarray(model.token_losses(tok[:, :-1],
                                                                               tok[:, 1:]))


LAYOUTS = {
    "data=2 x model=4": {"parallel.data": 2, "parallel.model": 4},
    "data=2 x model=4, explicit": {"parallel.data": 2, "parallel.model": 4,
                                   "parallel.mode": "explicit"},
    "context=2 x model=4": {"parallel.context": 2, "parallel.model": 4},
    "context=2 x data=2 x model=2, explicit, SP": {
        "parallel.context": 2, "parallel.data": 2, "parallel.model": 2,
        "parallel.mode": "explicit", "parallel.sequence_parallel": True},
    "pipeline=2 x data=2 x model=2": {"parallel.pipeline": 2, "parallel.data": 2,
                                      "parallel.model": 2, "train.microbatches": 2},
    "pipeline=2 x fsdp=4, explicit, interleaved": {
        "parallel.pipeline": 2, "parallel.fsdp": 4, "parallel.mode": "explicit",
        "parallel.pipeline_schedule": "interleaved", "parallel.virtual_stages": 2,
        "model.n_layers": 4, "train.microbatches": 2},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logits_and_losses_equal_the_single_device_reference(name, reference):
    import jax

    cfg = jaxtp.config("tiny", {**BASE, **LAYOUTS[name]})
    ref_cfg = jaxtp.config("tiny", {**BASE, "model.n_layers": cfg.model.n_layers})
    params = engine.reference_params(ref_cfg, 0)
    ref_model, want_logits, want_losses = reference
    tok = _tokens()
    if ref_cfg.model.n_layers != ref_model.cfg.model.n_layers:  # a deeper model: its own
        ref_model = jaxtp.Model(ref_cfg, params=params, devices=jax.devices()[:1])
        want_logits = np.asarray(ref_model.logits(tok))
        want_losses = np.asarray(ref_model.token_losses(tok[:, :-1], tok[:, 1:]))
    model = jaxtp.Model(cfg, params=params)
    logits = np.asarray(model.logits(tok))
    losses = np.asarray(model.token_losses(tok[:, :-1], tok[:, 1:]))
    assert logits.shape == (4, 32, cfg.model.vocab_size) and losses.shape == (4, 31)
    np.testing.assert_allclose(logits, want_logits, **TOL)
    np.testing.assert_allclose(losses, want_losses, **TOL)


def test_batches_of_any_shape_are_padded_and_cut(reference):
    """3 rows on 2 batch shards and 30 positions on a zig-zag context split of 4 chunks: padded
    to what the layout splits, then cut; the rows equal the reference's."""
    ref_model, want, _ = reference
    cfg = jaxtp.config("tiny", {**BASE, "parallel.data": 2, "parallel.context": 2,
                                "parallel.model": 2})
    model = jaxtp.Model(cfg, params=engine.reference_params(ref_model.cfg, 0))
    tok = _tokens()[:3, :30]
    np.testing.assert_allclose(np.asarray(model.logits(tok)),
                               np.asarray(ref_model.logits(tok)), **TOL)


# (seq_len, context, context_layout, model, sequence_parallel) -> the padded length, by hand from
# the rule: context > 1 cuts the sequence into context chunks (zigzag: 2 x context); sequence
# parallelism cuts each context shard into `model` pieces
PADDED = [
    ((30, 1, "zigzag", 4, False), 30),      # nothing splits the positions
    ((30, 2, "zigzag", 2, False), 32),      # 4 chunks
    ((30, 2, "contiguous", 2, False), 30),  # 2 chunks
    ((31, 2, "contiguous", 4, False), 32),
    ((30, 1, "zigzag", 4, True), 32),       # SP alone: 4 pieces
    ((30, 2, "zigzag", 2, True), 32),       # 4 chunks, each shard of 16 in 2: multiples of 4
    ((17, 2, "contiguous", 4, True), 24),   # 2 chunks, each of 12 in 4: multiples of 8
    ((13, 2, "zigzag", 3, True), 24),       # 4 chunks and each shard in 3: multiples of 12
    ((24, 4, "zigzag", 2, False), 24),
    ((25, 4, "zigzag", 2, False), 32),      # 8 chunks
]


@pytest.mark.parametrize("case, want", PADDED, ids=[str(c) for c, _ in PADDED])
def test_padded_length_is_the_shortest_the_sequence_rule_accepts(case, want):
    """Model pads positions to padded_seq_len: the shortest length check_sequence accepts (what
    a search from seq_len upwards would find), computed from the rule, not searched."""
    from jaxtp.configs import ConfigError
    from jaxtp.parallel import check_sequence, padded_seq_len

    s, cp, layout, t, sp = case
    split = dict(context=cp, layout=layout, model=t, sequence_parallel=sp)
    assert padded_seq_len(s, **split) == want
    check_sequence(want, **split)
    for shorter in range(s, want):
        with pytest.raises(ConfigError):
            check_sequence(shorter, **split)


def test_save_from_run_and_fine_tune(tmp_path, reference):
    """Model.save writes a run directory: from_run on another layout reads the same parameters,
    and jaxtp train continues it at step 0 with a fresh optimizer (from the saved parameters,
    not from its own seed's init)."""
    ref_model, want, _ = reference
    cfg = jaxtp.config("tiny", {**BASE, "parallel.data": 2, "parallel.model": 4})
    model = jaxtp.Model(cfg, params=engine.reference_params(ref_model.cfg, 7))  # seed 7
    run = model.save(tmp_path / "run")
    assert json.loads((run / "config.json").read_text())["parallel"]["model"] == 4
    again = jaxtp.Model.from_run(run, {"parallel.data": 8, "parallel.model": 1})
    tok = _tokens()
    saved_logits = np.asarray(model.logits(tok))
    np.testing.assert_allclose(np.asarray(again.logits(tok)), saved_logits, **TOL)
    with pytest.raises(jaxtp.ConfigError, match="already holds checkpoints"):
        model.save(run)

    tuned = jaxtp.config("tiny", {**BASE, "parallel.data": 2, "parallel.model": 4,
                                  "train.steps": 2, "train.log_every": 1,
                                  "train.checkpoint_every": 0, "train.eval_batches": 1,
                                  "train.out_dir": str(run), "train.tensorboard": False,
                                  "train.lr": 1e-5})
    records = jaxtp.Trainer(tuned).run()
    assert [r["step"] for r in records] == [1, 2]
    after = np.asarray(jaxtp.Model.from_run(run).logits(tok))
    seed0 = want  # what a fresh run (train.seed=0) would have started from
    assert np.abs(after - saved_logits).max() < 0.1 * np.abs(after - seed0).max()


def test_trainer_step_takes_numpy_batches_and_checks_them():
    cfg = jaxtp.config("tiny", {**BASE, "parallel.data": 2, "parallel.model": 4})
    trainer = jaxtp.Trainer(cfg)
    state = trainer.init_state()
    tok = _tokens(8, 33)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    losses = []
    for _ in range(3):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 3 and losses[-1] < losses[0]
    assert set(metrics) >= {"loss", "grad_norm"}
    with pytest.raises(ValueError, match=r"expected \(8, 32\)"):
        trainer.step(state, {"inputs": tok[:4, :-1], "targets": tok[:4, 1:]})
    with pytest.raises(ValueError, match="keys 'inputs' and 'targets'"):
        trainer.step(state, {"inputs": tok[:, :-1]})
    with pytest.raises(ValueError, match="integers"):
        trainer.step(state, {"inputs": tok[:, :-1] * 1.0, "targets": tok[:, 1:]})


def test_bad_input_is_one_clear_error(tmp_path, reference):
    model = reference[0]
    with pytest.raises(ValueError, match=r"\[batch, seq\] integer array"):
        model.logits(np.zeros(8, np.int32))
    with pytest.raises(ValueError, match="more than model.max_seq_len=64"):
        model.logits(np.zeros((1, 65), np.int32))
    with pytest.raises(ValueError, match="outside"):
        model.logits(np.full((1, 4), 256, np.int32))
    with pytest.raises(jaxtp.ConfigError, match="not a jaxtp run directory"):
        jaxtp.Model.from_run(tmp_path / "nowhere")
    with pytest.raises(jaxtp.ConfigError, match="parallel.modle"):
        jaxtp.config("tiny", {"parallel.modle": 4})
    with pytest.raises(jaxtp.ConfigError, match="n_kv_heads"):
        jaxtp.Model(jaxtp.config("tiny", {"parallel.model": 8, "model.n_kv_heads": 4}))
