"""ZB-H1's backward split (jaxtp.pipeline.weight_grad) on the real model's blocks: B then W equals the
joint backward, and what B hands to W is exactly each weight matmul's input and output cotangent
(nothing else of the stage is kept from B to W)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.step import pipelined as pipelined_step
from jaxtp.pipeline import runtime
from jaxtp.pipeline import weight_grad

D, F, LAYERS, B, S = 64, 256, 2, 2, 16


def _stage():
    cfg = config.load("tiny", [f"model.n_layers={LAYERS}", f"model.d_model={D}",
                               f"model.d_ff={F}", f"train.seq_len={S}", "parallel.data=1",
                               f"train.batch_size={B}"])
    eng = engine.build_engine(cfg, jax.devices()[:1])
    parts = pipelined_step._Parts(eng.layout, eng.region, manual=False)
    rope = parts.rope(jnp.broadcast_to(jnp.arange(S), (B, S)))
    return cfg, eng.layout.init_params()["blocks"], (lambda pc, x: parts.stage(pc, x, rope))


def test_split_backward_equals_joint_and_hands_w_only_matmul_operands():
    cfg, blocks, stage = _stage()
    x = jax.random.normal(jax.random.key(0), (B, S, D))
    g = jax.random.normal(jax.random.key(1), (B, S, D))
    with weight_grad.splitting(True):
        _, vjp = jax.vjp(stage, blocks, x)
    recipe, kept = runtime.split_vjp(vjp, blocks)
    leaves, treedef = jax.tree_util.tree_flatten(vjp)
    sp = weight_grad.split(
        lambda lv, g: jax.tree.leaves(jax.tree_util.tree_unflatten(treedef, lv)(g)), leaves, g)
    known, handoff = weight_grad.run_known(sp, runtime.vjp_leaves(recipe, blocks, kept),
                                           g)
    unknown = weight_grad.run_unknown(sp, handoff, [leaves[i] for i in sp.markers])
    split = [k if u is None else u for k, u in zip(known, unknown)]
    assert all(a is not None for a in split)
    assert known[-1] is not None and unknown[-1] is None  # B alone gives the input cotangent
    # the reference: the model's own backward, traced without the split's markers
    joint = jax.tree.leaves(jax.vjp(stage, blocks, x)[1](g))
    assert len(joint) == len(split)
    for a, b in zip(split, joint):
        chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)
    # per token and layer: qkv (D -> 3D), attention out (D -> D), SwiGLU up (D -> 2F),
    # down (F -> D): inputs and output cotangents, 8 D + 3 F floats
    n_heads = cfg.model.n_heads
    assert n_heads * (D // n_heads) == D
    want = LAYERS * B * S * (8 * D + 3 * F)
    assert sum(int(np.prod(a.shape)) for a in sp.residuals) == want
    assert {jnp.dtype(a.dtype) for a in sp.residuals} == {jnp.dtype(jnp.float32)}
