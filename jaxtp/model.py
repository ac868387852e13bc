"""A decoder-only Transformer, GPT / Llama style, in Flax NNX.

Architecture: pre-norm residual blocks (RMSNorm, Zhang & Sennrich 2019), rotary positions (RoPE,
Su et al. 2021), grouped-query attention (Ainslie et al. 2023), SwiGLU (Shazeer 2020) or GELU MLP,
vocab-parallel embedding and loss (Shoeybi et al. 2019), optional tied embeddings. Layers are
stacked along a leading ``layers`` dim and run with ``jax.lax.scan``, so compile time does not grow
with depth and the collective census of one layer body is multiplied by the trip count.

The model knows logical names only: parallelism arrives as the ``ops`` object of
:mod:`jaxtp.execution` and the parameter / activation tables of :mod:`jaxtp.sharding`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.config import ModelConfig
from jaxtp.layers.attention import Attention, rope_tables
from jaxtp.layers.embedding import OutputHead, VocabParallelEmbedding, vocab_parallel_cross_entropy
from jaxtp.layers.mlp import MLP
from jaxtp.layers.norm import RMSNorm


class Block(nnx.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``; params stacked ``stack`` deep."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        dt = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, rngs=rngs, stack=stack)
        self.attn = Attention(cfg, rngs=rngs, stack=stack)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, rngs=rngs, stack=stack)
        self.mlp = MLP(cfg, rngs=rngs, stack=stack)

    def __call__(self, x: jax.Array, rope, ops) -> jax.Array:  # [B,S,D] -> [B,S,D]
        x = x + self.attn(self.attn_norm(x), rope, ops)
        x = ops.constrain(x, "batch", "residual_seq", "embed")
        x = x + self.mlp(self.mlp_norm(x), ops)
        return ops.constrain(x, "batch", "residual_seq", "embed")


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, padded_vocab: int, rngs: nnx.Rngs):
        if padded_vocab < cfg.vocab_size:
            raise ValueError(f"padded_vocab={padded_vocab} < vocab_size={cfg.vocab_size}")
        dt = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed = VocabParallelEmbedding(padded_vocab, cfg.d_model, std=cfg.init_std, dtype=dt,
                                            rngs=rngs)
        self.blocks = Block(cfg, rngs=rngs, stack=cfg.n_layers)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = OutputHead(cfg.d_model, padded_vocab, std=cfg.init_std, dtype=dt,
                                   rngs=rngs)

    def hidden(self, tokens: jax.Array, positions: jax.Array, ops, *, remat: str = "none"):
        """Final-norm hidden states ``[B,S,D]`` for ``tokens [B,S]``."""
        cfg = self.cfg
        x = self.embed(tokens, ops).astype(jnp.dtype(cfg.compute_dtype))       # (B, S, D)
        x = ops.constrain(x, "batch", "residual_seq", "embed")
        rope = rope_tables(positions, cfg.resolved_head_dim, cfg.rope_theta)
        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer_params):
            layer_params = ops.gather_layer(layer_params)  # ZeRO-3: this layer's weights, in time
            return nnx.merge(graphdef, layer_params)(x, rope, ops), None

        body = _remat(body, remat, ops.gathers_layers)
        x, _ = jax.lax.scan(body, x, stacked)
        return self.final_norm(x)

    def logits(self, x: jax.Array, ops) -> jax.Array:  # [B,S,D] -> [B,S,V]{vocab-sharded}
        out = self.embed.attend(x, ops) if self.cfg.tie_embeddings else self.head(x, ops)
        return ops.constrain(out, "batch", "seq", "vocab")

    def token_losses(self, tokens, targets, positions, ops, *, remat: str = "none"):
        """Per-token cross-entropy ``[B,S]`` in fp32."""
        logits = self.logits(self.hidden(tokens, positions, ops, remat=remat), ops)
        return vocab_parallel_cross_entropy(logits, targets, vocab_size=self.cfg.vocab_size,
                                            ops=ops)


# What each ``parallel.remat`` policy saves of a layer for the backward pass (the scan body's
# residuals); everything else is recomputed there from the layer's input.
REMAT_POLICIES = {
    # everything (no recompute)
    "none": None,
    # only the layer's input x: the whole layer runs twice (Chen et al. 2016)
    "full": jax.checkpoint_policies.nothing_saveable,
    # the outputs of the linear layers (matmuls without batch dims); recompute attention's score
    # and softmax path (QK^T, softmax, PV: batched dots), norms and activations -- Korthikanti
    # et al.'s selective recompute: the s^2 terms are never saved
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # every matmul output, attention's included; recompute only elementwise work
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def _remat(body, remat: str, gathers_layers: bool):
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}: supported policies are {sorted(REMAT_POLICIES)}")
    policy = REMAT_POLICIES[remat]
    if policy is None and gathers_layers:
        # ZeRO-3 frees each gathered layer after use: save the matmul outputs (the activations),
        # recompute the rest in backward, gathers included. (Saving "all but the gathered names"
        # is not enough: ops on the weights, e.g. a layout copy, would be saved.) Every other
        # policy already leaves the gathered weights (all-gather outputs) unsaved.
        policy = jax.checkpoint_policies.dots_saveable
    return body if policy is None else jax.checkpoint(body, policy=policy)

