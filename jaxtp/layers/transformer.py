"""A decoder-only Transformer, GPT / Llama style, in Flax NNX.

Architecture: pre-norm residual blocks (RMSNorm, Zhang & Sennrich 2019), rotary positions (RoPE,
Su et al. 2021), grouped-query attention (Ainslie et al. 2023), SwiGLU (Shazeer 2020) or GELU MLP,
vocab-parallel embedding and loss (Shoeybi et al. 2019), optional tied embeddings, optional
Mixture-of-Experts MLPs (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021). Layers are
stacked along a leading ``layers`` dim and run with ``jax.lax.scan``, so compile time does not grow
with depth and the collective census of one layer body is multiplied by the trip count.

One scan runs one kind of body, so an MoE model (``n_experts > 0``) scans over *groups* of
``moe_every`` layers, :class:`MoEBlock`: ``moe_every - 1`` dense layers, then one whose MLP is the
routed experts (GShard's every-other-layer placement for ``moe_every = 2``). Its parameter tree:
``blocks.{attn_norm, attn, mlp_norm, moe}`` for the MoE layer of each group (leading ``layers``
dim, ``n_layers / moe_every`` long) and, when ``moe_every > 1``, ``blocks.dense`` -- a dense
:class:`Block` with two leading ``layers`` dims ``[groups, moe_every - 1]``. A dense model's tree is
unchanged: ``blocks`` is the stacked :class:`Block`. Each MoE layer returns its router statistics
as a scan output; :func:`jaxtp.layers.moe.summarize_aux` sums the losses over layers.

The model knows logical names only: parallelism arrives as the ``ops`` object of
:mod:`jaxtp.parallel.execution` and the parameter / activation tables of :mod:`jaxtp.parallel.sharding`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.configs import ModelConfig
from jaxtp.layers.attention import Attention, positional
from jaxtp.layers.embedding import OutputHead, VocabParallelEmbedding, vocab_parallel_cross_entropy
from jaxtp.layers.mlp import MLP
from jaxtp.layers.moe import MoE, summarize_aux
from jaxtp.layers.norm import RMSNorm
from jaxtp.parallel import TP_REDUCED
from jaxtp.pipeline import is_splitting, with_split_markers


class Block(nnx.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``; params stacked ``stack`` deep."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
                 stack: int | tuple[int, ...] | None = None):
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


class MoEBlock(nnx.Module):
    """One scan step of an MoE model: ``moe_every - 1`` dense :class:`Block` s, then
    ``x + attn(norm(x))`` and ``x + moe(norm(x))``. ``[B,S,D] -> ([B,S,D], aux)``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        dt = jnp.dtype(cfg.param_dtype)
        self.n_dense = cfg.moe_every - 1
        if self.n_dense:
            self.dense = Block(cfg, rngs=rngs, stack=(stack, self.n_dense) if stack is not None
                               else self.n_dense)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, rngs=rngs, stack=stack)
        self.attn = Attention(cfg, rngs=rngs, stack=stack)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, rngs=rngs, stack=stack)
        self.moe = MoE(cfg, rngs=rngs, stack=stack)

    def __call__(self, x: jax.Array, rope, ops) -> tuple[jax.Array, dict]:
        if self.n_dense:
            # unrolled: moe_every is small (2 in GShard and Switch), and a nested scan would hide
            # these layers' collectives behind a second trip count
            graphdef, stacked = nnx.split(self.dense)
            for i in range(self.n_dense):
                layer = jax.tree.map(lambda a, i=i: a[i], stacked)
                x = nnx.merge(graphdef, layer)(x, rope, ops)
        x = x + self.attn(self.attn_norm(x), rope, ops)
        x = ops.constrain(x, "batch", "residual_seq", "embed")
        out, aux = self.moe(self.mlp_norm(x), ops)
        return ops.constrain(x + out, "batch", "residual_seq", "embed"), aux


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, padded_vocab: int, rngs: nnx.Rngs):
        if padded_vocab < cfg.vocab_size:
            raise ValueError(f"padded_vocab={padded_vocab} < vocab_size={cfg.vocab_size}")
        dt = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed = VocabParallelEmbedding(padded_vocab, cfg.d_model, std=cfg.init_std, dtype=dt,
                                            rngs=rngs)
        if cfg.n_experts > 0:
            self.blocks = MoEBlock(cfg, rngs=rngs, stack=cfg.n_layers // cfg.moe_every)
        else:
            self.blocks = Block(cfg, rngs=rngs, stack=cfg.n_layers)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = OutputHead(cfg.d_model, padded_vocab, std=cfg.init_std, dtype=dt,
                                   rngs=rngs)

    def hidden(self, tokens: jax.Array, positions: jax.Array, ops, *, remat: str = "none",
               segment_ids: jax.Array | None = None):
        """Final-norm hidden states ``[B,S,D]`` for ``tokens [B,S]``."""
        return self.hidden_and_aux(tokens, positions, ops, remat=remat,
                                   segment_ids=segment_ids)[0]

    def hidden_and_aux(self, tokens: jax.Array, positions: jax.Array, ops, *,
                       remat: str = "none", segment_ids: jax.Array | None = None
                       ) -> tuple[jax.Array, dict | None]:
        """``(hidden [B,S,D], aux)``: aux is each MoE layer's router outputs stacked along a
        leading layer dim (``None`` for a dense model). ``positions [B,S]`` are RoPE's (within
        each document for a packed batch); ``segment_ids [B,S]`` keep attention inside each
        document (``None``: one sequence per row)."""
        cfg = self.cfg
        x = embed_tokens(self.embed, tokens, ops, cfg)
        rope = positional(positions, cfg, segment_ids)
        graphdef, stacked = nnx.split(self.blocks)
        x, aux = scan_layers(graphdef, stacked, x, rope, ops, remat=remat,
                             moe=cfg.n_experts > 0)
        return self.final_norm(x), aux

    def logits(self, x: jax.Array, ops) -> jax.Array:  # [B,S,D] -> [B,S,V]{vocab-sharded}
        out = self.embed.attend(x, ops) if self.cfg.tie_embeddings else self.head(x, ops)
        return ops.constrain(out, "batch", "seq", "vocab")

    def token_losses_and_aux(self, tokens, targets, positions, ops, *,
                             remat: str = "none", segment_ids=None) -> tuple[jax.Array, dict]:
        """``(per-token cross-entropy [B,S], aux)``: aux is ``{}`` for a dense model, else the MoE
        layers' router outputs summarised over layers (:func:`~jaxtp.layers.moe.summarize_aux`:
        ``aux_loss`` summed, the statistics averaged), each already the global-batch value."""
        x, aux = self.hidden_and_aux(tokens, positions, ops, remat=remat, segment_ids=segment_ids)
        out = self.embed if self.cfg.tie_embeddings else self.head
        return token_losses_of(out, x, targets, ops, self.cfg), (
            {} if aux is None else summarize_aux(aux))


def embed_tokens(embed: VocabParallelEmbedding, tokens: jax.Array, ops,
                 cfg: ModelConfig) -> jax.Array:
    """Token ids ``[B,S]`` -> the residual stream ``[B,S,D]`` in the compute dtype."""
    x = embed(tokens, ops).astype(jnp.dtype(cfg.compute_dtype))
    return ops.constrain(x, "batch", "residual_seq", "embed")


def scan_layers(graphdef: nnx.GraphDef, stacked: nnx.State, x: jax.Array, rope, ops, *,
                remat: str, moe: bool) -> tuple[jax.Array, dict | None]:
    """Run the layers stacked along the leading dim of ``stacked`` (a :class:`Block` or
    :class:`MoEBlock` state, any depth: the whole model or one pipeline stage) over ``x``."""
    def body(x, layer_params):
        layer_params = ops.gather_layer(layer_params)  # ZeRO-3: this layer's weights, in time
        out = nnx.merge(graphdef, layer_params)(x, rope, ops)
        return out if moe else (out, None)  # MoE: (x, this layer's aux)

    return jax.lax.scan(_remat(body, remat, ops.gathers_layers), x, stacked)


def token_losses_of(out, x: jax.Array, targets: jax.Array, ops, cfg: ModelConfig) -> jax.Array:
    """Per-token cross-entropy ``[B,S]`` (fp32) of final-norm hidden states ``x`` through the
    output projection ``out`` (the :class:`OutputHead`, or the embedding when tied)."""
    logits = out.attend(x, ops) if isinstance(out, VocabParallelEmbedding) else out(x, ops)
    logits = ops.constrain(logits, "batch", "seq", "vocab")
    return vocab_parallel_cross_entropy(logits, targets, vocab_size=cfg.vocab_size, ops=ops)


def _and_tp_outputs(policy):
    """``policy`` that also saves the row-parallel collectives' outputs (explicit mode names them
    :data:`~jaxtp.parallel.execution.TP_REDUCED`): a saved partial sum would otherwise be all-reduced again
    in backward, an extra TP collective per layer that GSPMD mode (which saves the reduced
    value) and Megatron's selective recompute do not run."""
    return jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(TP_REDUCED))


# What each ``parallel.remat`` policy saves of a layer for the backward pass (the scan body's
# residuals); everything else is recomputed there from the layer's input.
REMAT_POLICIES = {
    # everything (no recompute)
    "none": None,
    # only the layer's input x: the whole layer runs twice (Chen et al. 2016), its forward
    # collectives included
    "full": jax.checkpoint_policies.nothing_saveable,
    # the outputs of the linear layers (matmuls without batch dims) and of the TP reductions;
    # recompute attention's score and softmax path (QK^T, softmax, PV: batched dots), norms and
    # activations -- Korthikanti et al.'s selective recompute: the s^2 terms are never saved
    "selective": _and_tp_outputs(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    # every matmul output, attention's included, and the TP reductions; recompute only
    # elementwise work
    "dots_saveable": _and_tp_outputs(jax.checkpoint_policies.dots_saveable),
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
        policy = REMAT_POLICIES["dots_saveable"]
    if policy is not None and is_splitting():  # keep the B / W split's markers
        policy = with_split_markers(policy)
    return body if policy is None else jax.checkpoint(body, policy=policy)

