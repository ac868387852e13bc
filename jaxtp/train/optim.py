"""The optimizer: optax AdamW with linear warmup and cosine decay, global-norm clipping, and weight
decay masked off norms and biases (Loshchilov & Hutter 2019; the GPT-3 recipe of Brown et al.
2020). Master weights stay fp32; the compute dtype is the model config's.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from jaxtp.configs import TrainConfig


def schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 over ``warmup_steps``, then cosine decay to ``lr x min_lr_ratio`` at
    ``steps``; ``warmup_steps=0`` starts at the peak ``lr`` on the first step."""
    if t.warmup_steps == 0:
        return optax.cosine_decay_schedule(init_value=t.lr, decay_steps=max(t.steps, 1),
                                           alpha=t.min_lr_ratio)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
        decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.lr * t.min_lr_ratio)


def decay_mask(params: nnx.State):
    """True for matrices (two or more dims besides ``layers``); False for norm scales."""
    def is_matrix(v):
        names = v.get_metadata().get("names", ())
        return len([n for n in names if n != "layers"]) >= 2
    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def build(t: TrainConfig, params: nnx.State) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule(t), b1=0.9, b2=0.95, eps=1e-8, weight_decay=t.weight_decay,
                    mask=decay_mask(params)),
    )
