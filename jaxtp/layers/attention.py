"""Causal self-attention with RoPE (Su et al. 2021) and grouped-query attention (Ainslie et al.
2023), tensor-parallel over heads (Shoeybi et al. 2019, sec. 3, Fig. 3b).

Heads keep their own dims. Q, K and V come from one weight grouped by KV head,
``w_qkv[embed, kv_heads, q_per_kv + 2, head_dim]`` (Megatron-LM's grouped layout): each KV head's
slot holds its ``q_per_kv`` query heads, then its key, then its value. Sharding ``kv_heads`` over
``model`` makes the projection column-parallel with no reshuffle (each rank owns whole KV groups),
and a single matmul means a single cotangent, so backward runs one all-reduce, not three. The output
projection ``wo[heads, head_dim, embed]`` is row-parallel; the block costs exactly one ``f`` and one
``g``. Scores go through ``ops.attention``: ``jax.nn.dot_product_attention`` (so GPUs and TPUs get
fused kernels), or ring attention over ``context`` under context parallelism. A packed batch's
``segment_ids`` ride along in :class:`Positional`: a token attends only to earlier tokens of its
own document, and RoPE sees its position within that document.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.configs import ModelConfig
from jaxtp.layers.norm import rms_norm
from jaxtp.layers.params import param, residual_std
from jaxtp.pipeline import weight_einsum


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """The ``head_dim / 2`` rotation frequencies ``theta^(-2i/H)``, rescaled for ``llama3``:
    wavelengths longer than ``original / low_freq_factor`` slow down by ``factor``, shorter than
    ``original / high_freq_factor`` stay, and those between are interpolated (Llama 3.1)."""
    hd = cfg.resolved_head_dim
    freqs = cfg.rope_theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)   # (H/2,)
    if cfg.rope_scaling == "none":
        return freqs
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, \
        cfg.rope_high_freq_factor
    wavelen = 2 * jnp.pi / freqs
    original = cfg.rope_original_max_len
    slow = jnp.where(wavelen > original / low, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    between = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(between, (1 - smooth) * slow / factor + smooth * slow, slow)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos / sin of shape ``[B,S,1,head_dim/2]`` for integer ``positions [B,S]``, in fp32."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(cfg)  # (B, S, H/2)
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


class Positional(NamedTuple):
    """What the layers know of where each token sits: the RoPE tables of its position within its
    document and, for packed batches, its document's ``segment_ids [B,S]`` (attention stays
    inside a document; ``None``: the whole row is one sequence)."""

    cos: jax.Array
    sin: jax.Array
    segment_ids: jax.Array | None = None


def positional(positions: jax.Array, cfg: ModelConfig,
               segment_ids: jax.Array | None = None) -> Positional:
    """:class:`Positional` of integer ``positions [B,S]`` (and ``segment_ids [B,S]``)."""
    return Positional(*rope_tables(positions, cfg), segment_ids)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (first half, second half) of the head dim; ``x [B,S,N,H]``."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        d, hd, dt = cfg.d_model, cfg.resolved_head_dim, jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.init_std, residual_std(cfg.init_std, cfg.n_layers)
        self.q_per_kv = cfg.n_heads // cfg.n_kv_heads
        self.w_qkv = param(rngs, (d, cfg.n_kv_heads, self.q_per_kv + 2, hd),
                           ("embed", "kv_heads", None, "head_dim"), std=std, dtype=dt, stack=stack)
        self.wo = param(rngs, (cfg.n_heads, hd, d), ("heads", "head_dim", "embed"),
                        std=out_std, dtype=dt, stack=stack)
        if cfg.qkv_bias:  # Qwen2: zero-initialised, grouped like w_qkv
            self.b_qkv = param(rngs, (cfg.n_kv_heads, self.q_per_kv + 2, hd),
                               ("kv_heads", None, "head_dim"), std=0.0, dtype=dt, stack=stack)
        if cfg.qk_norm:  # Qwen3: one RMSNorm scale over head_dim for all query / key heads
            self.q_norm = param(rngs, (hd,), ("head_dim",), std=None, dtype=dt, stack=stack)
            self.k_norm = param(rngs, (hd,), ("head_dim",), std=None, dtype=dt, stack=stack)
        self.norm_eps = cfg.norm_eps
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        # passed only when asked for, so that the default call is jax.nn's own default
        self.attention_impl = None if cfg.attention_impl == "default" else cfg.attention_impl

    def __call__(self, x: jax.Array, pos: Positional, ops) -> jax.Array:
        q, k, v = self.project_qkv(x, pos, ops)
        o = ops.attention(q, k, v, self.attention_impl,
                          segment_ids=getattr(pos, "segment_ids", None))   # (B, S, N, H)
        return self.project_out(o, ops)

    def project_qkv(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], ops
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``f`` and the column-parallel projection: ``x [B,S,D] -> q [B,S,N,H], k, v [B,S,K,H]``
        (RoPE applied to q and k). Decode (:mod:`jaxtp.serve.decode`) stores k and v in its cache."""
        cdt = self.compute_dtype
        h = ops.copy_to_model(x).astype(cdt)                                   # f; (B, S, D)
        qkv = weight_einsum("bsd,dkgh->bskgh", h, self.w_qkv[...].astype(cdt))  # (B, S, K, G+2, H)
        if hasattr(self, "b_qkv"):
            qkv = qkv + self.b_qkv[...].astype(cdt)
        g = self.q_per_kv
        b, s, k_heads, _, hd = qkv.shape
        q = qkv[:, :, :, :g].reshape(b, s, k_heads * g, hd)                  # (B, S, N, H)
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]                           # (B, S, K, H)
        if hasattr(self, "q_norm"):
            q = rms_norm(q, self.q_norm[...], self.norm_eps)
            k = rms_norm(k, self.k_norm[...], self.norm_eps)
        cos, sin = rope[0], rope[1]
        q = ops.constrain(apply_rope(q, cos, sin), "batch", "seq", "heads", "head_dim")
        k = ops.constrain(apply_rope(k, cos, sin), "batch", "seq", "kv_heads", "head_dim")
        v = ops.constrain(v, "batch", "seq", "kv_heads", "head_dim")
        return q, k, v

    def project_out(self, o: jax.Array, ops) -> jax.Array:
        """The row-parallel output projection and ``g``: ``o [B,S,N,H] -> [B,S,D]``."""
        o = ops.constrain(o, "batch", "seq", "heads", "head_dim")
        out = weight_einsum("bsnh,nhd->bsd", o, self.wo[...].astype(self.compute_dtype))
        return ops.reduce_from_model(out)                                     # g; {U_model} -> D
