"""Megatron sequence parallelism and context parallelism (ring attention) in the whole model.

Equivalence: loss and gradients equal the single-device reference (fp32; the tolerances of
test_model_parallel, a few ulps of reassociation). Census, per layer (the difference between models
of L+1 and L layers), from the compiled HLO:

- SP, explicit mode: 2 all-gathers + 2 reduce-scatters over ``model`` forward, each of the
  ``b_local x s x h`` bytes a TP all-reduce moves, the same again in backward, and no all-reduce over
  ``model`` (the norm-scale gradients are all-reduced once per step, outside the layer loop).
- CP: ``cp-1`` K/V collective-permutes over ``context`` forward; backward ``cp-1`` K/V and ``cp``
  dK/dV permutes; nothing gathers the activations' sequence (only the int32 token ids are
  gathered, once per step, to put them in the zigzag order).
"""

from collections import Counter

import numpy as np
import pytest

from jaxtp import testing
from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.inspect import placement as inspect
from jaxtp.configs.schema import ConfigError

RTOL, ATOL = 2e-5, 2e-6
B, S, H = 8, 64, 64  # tiny preset: global batch, seq, d_model
KV_HEADS, HEAD_DIM = 8, 8


def _check(overrides):
    cfg = config.load("tiny", overrides)
    eng, params, batch, ref_loss, _ = testing.assert_matches_reference(cfg, rtol=RTOL, atol=ATOL)
    # the evaluation loss (forward only) goes through the same layout
    np.testing.assert_allclose(eng.loss()(params, batch), ref_loss, rtol=RTOL)


SP = ["parallel.sequence_parallel=true"]


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
@pytest.mark.parametrize("overrides", [
    pytest.param(["parallel.data=2", "parallel.model=4", *SP], id="sp-dp2-tp4"),
    pytest.param(["parallel.data=4", "parallel.context=2"], id="cp2-zigzag"),
    pytest.param(["parallel.data=2", "parallel.context=4", "parallel.context_layout=contiguous"],
                 id="cp4-contiguous"),
    pytest.param(["parallel.data=2", "parallel.context=2", "parallel.model=2", *SP],
                 id="sp-cp-tp-dp"),
])
def test_matches_reference(mode, overrides):
    _check([f"parallel.mode={mode}", *overrides])


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_composes_with_microbatches_zero_gqa_and_remat(mode):
    _check([f"parallel.mode={mode}", "parallel.data=2", "parallel.context=2", "parallel.model=2",
            *SP, "train.microbatches=2", "parallel.zero_stage=3", "model.n_kv_heads=4",
            "parallel.remat=selective"])


# ---- census ----------------------------------------------------------------------------------

def _census(overrides, n_layers, step):
    cfg = config.load("tiny", [*overrides, f"model.n_layers={n_layers}"])
    out = Counter()
    for op in inspect.report(engine.build_engine(cfg), step=step).ops:
        out[(op.kind, op.axes, op.bytes // op.tensors)] += op.executions * op.tensors
    return out


def _per_layer(overrides, step):
    """{(kind, axes, bytes): executions} of one more layer. The once-per-step gradient syncs (over
    axes that include ``data``), whose fused bytes grow with depth, are left out."""
    small, big = _census(overrides, 2, step), _census(overrides, 3, step)
    diff = {k: big[k] - small.get(k, 0) for k in big}
    return {k: n for k, n in diff.items() if n > 0 and "data" not in k[1]}


def test_sp_census_explicit():
    ov = ["parallel.mode=explicit", "parallel.data=2", "parallel.model=4", *SP]
    bsh = (B // 2) * S * H * 4  # what a TP all-reduce of the block moves
    assert _per_layer(ov, "loss") == {("all-gather", ("model",), bsh): 2,
                                      ("reduce-scatter", ("model",), bsh): 2}
    assert _per_layer(ov, "grad") == {("all-gather", ("model",), bsh): 4,
                                      ("reduce-scatter", ("model",), bsh): 4}


def test_sp_census_gspmd_gathers_the_sequence():
    """GSPMD mode gets the same all-gathers. XLA's CPU pipeline has no reduce-scatter creator (the
    GPU one does), so on this backend each SP reduce-scatter runs as an all-reduce of the same
    ``b x s x h`` buffer followed by a local slice, and the norm-scale gradients are all-reduced
    inside the layer loop (h floats each)."""
    ov = ["parallel.data=2", "parallel.model=4", *SP]
    bsh = (B // 2) * S * H * 4
    forward = _per_layer(ov, "loss")
    assert forward[("all-gather", ("model",), bsh)] == 2
    scatters = forward.get(("reduce-scatter", ("model",), bsh), 0)
    assert scatters + forward.get(("all-reduce", ("model",), bsh), 0) == 2
    grad = _per_layer(ov, "grad")
    assert grad[("all-gather", ("model",), bsh)] == 4


@pytest.mark.parametrize("mode, cp", [("gspmd", 2), ("explicit", 4)])  # each mode, each degree
def test_cp_census(mode, cp):
    ov = [f"parallel.mode={mode}", f"parallel.data={8 // cp}", f"parallel.context={cp}"]
    kv = 2 * (B // (8 // cp)) * (S // cp) * KV_HEADS * HEAD_DIM * 4  # stacked K and V blocks
    assert _per_layer(ov, "loss") == {("collective-permute", ("context",), kv): cp - 1}
    # backward: cp-1 K/V rotations and cp hops of the fp32 dK/dV accumulators
    assert _per_layer(ov, "grad") == {("collective-permute", ("context",), kv): 3 * cp - 2}
    # Nothing in the whole step gathers activations over `context`; the one permitted gather is of
    # the int32 token ids, once per step, when the batch is put in the zigzag order.
    whole = _census(ov, 2, "grad")
    gathers = {k: n for k, n in whole.items()
               if "context" in k[1] and k[0] in ("all-gather", "all-to-all")}
    token_ids = (B // (8 // cp)) * S * 4
    assert all(k[2] == token_ids for k in gathers) and sum(gathers.values()) <= 2, gathers


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    (["parallel.data=4", "parallel.context=2", "train.seq_len=66"], "divisible by 4.*zigzag"),
    (["parallel.data=4", "parallel.context=2", "parallel.context_layout=contiguous",
      "train.seq_len=63"], "divisible by 2"),
    (["parallel.data=2", "parallel.model=4", *SP, "train.seq_len=62"], "multiple of 4"),
    (["parallel.data=1", "parallel.context=2", "parallel.model=4", *SP, "train.seq_len=68"],
     "each context shard's 34 positions"),
    (["parallel.data=4", "parallel.context=2", "model.attention_impl=xla"],
     "ring attention computes the blocks itself"),
])
def test_bad_sequence_or_context_config_is_a_clear_error(overrides, match):
    with pytest.raises(ConfigError, match=match):
        engine.build_engine(config.load("tiny", overrides))


# ---- memory ----------------------------------------------------------------------------------

def _saved_per_layer(overrides, n_devices):
    import jax

    base = ["parallel.mode=explicit", "parallel.data=1", "train.batch_size=4", *overrides]
    return (testing.saved_activation_bytes(config.load("tiny", [*base, "model.n_layers=3"]),
                                           jax.devices()[:n_devices])
            - testing.saved_activation_bytes(config.load("tiny", [*base, "model.n_layers=2"]),
                                             jax.devices()[:n_devices]))


def test_saved_activations_fall_by_about_t_with_sp_and_stay_flat_with_cp():
    """Per layer, per device, the residuals ``jax.vjp`` keeps (experiments/activation_memory.py
    has the term-by-term table). SP divides everything by t except the two all-gathered inputs of
    the column-parallel linears, which are kept whole (Megatron re-gathers them in backward
    instead; that would add an all-gather per linear to the backward census), hence "about"."""
    t = 4
    alone = _saved_per_layer([], 1)
    tp = _saved_per_layer([f"parallel.model={t}"], t)
    sp = _saved_per_layer([f"parallel.model={t}", *SP], t)
    assert sp < tp < alone
    assert 0.8 * t < alone / sp <= t
    # s and cp grow together: each device keeps the same bytes
    long = ["model.max_seq_len=256", "parallel.context_layout=zigzag"]
    cp2 = _saved_per_layer([*long, "parallel.context=2", "train.seq_len=128"], 2)
    cp4 = _saved_per_layer([*long, "parallel.context=4", "train.seq_len=256"], 4)
    assert cp2 == cp4
