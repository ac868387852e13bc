"""A plain single-device GPT-style decoder and AdamW train step in jax.numpy: the baseline that
jaxtp's throughput is measured against.

Written from scratch, with no jaxtp import, no mesh and no sharding: the architecture a person
would write for one accelerator (nanoGPT-sized, in the spirit of its ``model.py``), chosen so that
its FLOPs match jaxtp's model exactly:
pre-norm residual blocks with RMSNorm (Zhang & Sennrich 2019), rotary positions (RoPE, Su et al.
2021; rotate-half convention), grouped-query attention via ``jax.nn.dot_product_attention``,
SwiGLU (Shazeer 2020) or GELU MLP, optional tied embeddings, layers stacked along a leading dim and
run with ``jax.lax.scan``. Q/K/V share one weight grouped by KV head ``[D, K, G+2, H]`` and SwiGLU's
gate and up share one ``[D, 2, F]`` (fused weights, as fast single-device code fuses them). The
vocabulary is padded to a multiple of 128 (nanoGPT's 50304) and the padded logits are masked out of
the softmax. AdamW (optax) with warmup + cosine, global-norm clipping and weight decay on matrices
only; master weights and moments fp32, the compute dtype configurable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import optax

_MASKED = -1e9


@dataclass(frozen=True)
class Shape:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 256
    head_dim: int = 0  # 0 = d_model // n_heads
    tie_embeddings: bool = False
    activation: str = "swiglu"  # or "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    vocab_pad_multiple: int = 128
    compute_dtype: str = "float32"

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_pad_multiple
        return -(-self.vocab_size // m) * m

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul: every block weight plus the output head."""
        d, f, hd = self.d_model, self.d_ff, self.hd
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = (3 if self.activation == "swiglu" else 2) * d * f
        return self.n_layers * (attn + mlp + 2 * d) + d + self.vocab_size * d

    def train_flops(self, batch: int, seq: int) -> float:
        """6 N T + 12 L s (n_heads * head_dim) T: the same analytic count jaxtp reports."""
        tokens = batch * seq
        return (6.0 * self.matmul_params() * tokens
                + 12.0 * self.n_layers * seq * self.n_heads * self.hd * tokens)


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------

def init_params(shape: Shape, key: jax.Array) -> dict:
    d, f, hd, L = shape.d_model, shape.d_ff, shape.hd, shape.n_layers
    k_heads, g = shape.n_kv_heads, shape.n_heads // shape.n_kv_heads
    std, out_std = shape.init_std, shape.init_std / math.sqrt(2 * L)
    keys = iter(jax.random.split(key, 8))

    def normal(s, sd):
        return sd * jax.random.normal(next(keys), s, jnp.float32)

    up = (L, d, 2, f) if shape.activation == "swiglu" else (L, d, f)
    params = {
        "embed": normal((shape.padded_vocab, d), std),
        "blocks": {
            "attn_norm": jnp.ones((L, d), jnp.float32),
            "w_qkv": normal((L, d, k_heads, g + 2, hd), std),
            "wo": normal((L, shape.n_heads, hd, d), out_std),
            "mlp_norm": jnp.ones((L, d), jnp.float32),
            "w_up": normal(up, std),
            "w_down": normal((L, f, d), out_std),
        },
        "final_norm": jnp.ones((d,), jnp.float32),
    }
    if not shape.tie_embeddings:
        params["head"] = normal((d, shape.padded_vocab), std)
    return params


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------

def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * scale).astype(x.dtype)


def rope(x, cos, sin):  # x (B, S, N, H); cos / sin (1, S, 1, H/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def block(shape: Shape, x, p, cos, sin):
    cdt = jnp.dtype(shape.compute_dtype)
    b, s, _ = x.shape
    g = shape.n_heads // shape.n_kv_heads
    h = rms_norm(x, p["attn_norm"], shape.norm_eps)
    qkv = jnp.einsum("bsd,dkgh->bskgh", h, p["w_qkv"].astype(cdt))         # (B, S, K, G+2, H)
    q = rope(qkv[:, :, :, :g].reshape(b, s, shape.n_heads, shape.hd), cos, sin)
    k = rope(qkv[:, :, :, g], cos, sin)
    v = qkv[:, :, :, g + 1]
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)                # (B, S, N, H)
    x = x + jnp.einsum("bsnh,nhd->bsd", o, p["wo"].astype(cdt))
    h = rms_norm(x, p["mlp_norm"], shape.norm_eps)
    if shape.activation == "swiglu":
        gu = jnp.einsum("bsd,dcf->bscf", h, p["w_up"].astype(cdt))           # (B, S, 2, F)
        a = jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]
    else:
        a = jax.nn.gelu(jnp.einsum("bsd,df->bsf", h, p["w_up"].astype(cdt)))
    return x + jnp.einsum("bsf,fd->bsd", a, p["w_down"].astype(cdt))


def loss_fn(shape: Shape, params: dict, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy over ``batch["inputs"] / ["targets"]`` (both ``[B, S]``)."""
    cdt = jnp.dtype(shape.compute_dtype)
    tokens, targets = batch["inputs"], batch["targets"]
    seq = tokens.shape[1]
    freqs = shape.rope_theta ** (-jnp.arange(0, shape.hd, 2, dtype=jnp.float32) / shape.hd)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs                 # (S, H/2)
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]

    x = jnp.take(params["embed"], tokens, axis=0).astype(cdt)                     # (B, S, D)

    def body(x, p):
        return block(shape, x, p, cos, sin), None

    x, _ = jax.lax.scan(body, x, params["blocks"])
    x = rms_norm(x, params["final_norm"], shape.norm_eps)
    if shape.tie_embeddings:
        logits = jnp.einsum("bsd,vd->bsv", x, params["embed"].astype(cdt))
    else:
        logits = jnp.einsum("bsd,dv->bsv", x, params["head"].astype(cdt))
    logits = logits.astype(jnp.float32)
    logits = jnp.where(jnp.arange(logits.shape[-1]) < shape.vocab_size, logits, _MASKED)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - target)


# ----------------------------------------------------------------------------------------------
# Optimizer and train step
# ----------------------------------------------------------------------------------------------

def optimizer(*, lr: float = 3e-4, warmup: int = 20, steps: int = 1000, weight_decay: float = 0.1,
              clip: float = 1.0, min_lr_ratio: float = 0.1) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1),
                                               max(steps, warmup + 1), lr * min_lr_ratio)

    def mask(params):  # decay matrices, not norm scales
        return {k: (jax.tree.map(lambda a: a.ndim >= 3 if k == "blocks" else a.ndim >= 2, v))
                for k, v in params.items()}

    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay,
                                   mask=mask))


def init_state(shape: Shape, tx: optax.GradientTransformation, *, seed: int = 0, device=None):
    device = device or jax.devices()[0]

    def init():
        params = init_params(shape, jax.random.key(seed))
        return {"params": params, "opt": tx.init(params), "step": jnp.int32(0)}

    with jax.default_device(device):
        return jax.jit(init)()


def make_train_step(shape: Shape, tx: optax.GradientTransformation):
    """The jitted ``(state, batch) -> (state, metrics)``, state donated."""

    @partial(jax.jit, donate_argnums=(0,))
    def step(state, batch):
        loss, grads = jax.value_and_grad(partial(loss_fn, shape))(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics

    return step


if __name__ == "__main__":  # smoke run: python benchmarks/baseline.py
    import time

    import numpy as np

    shape = Shape()
    tx = optimizer(lr=3e-3)
    state = init_state(shape, tx)
    step = make_train_step(shape, tx)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, shape.vocab_size, (8, 65), dtype=np.int32)
    batch = {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:])}
    for i in range(20):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        loss = float(m["loss"])
        if i % 5 == 0:
            print(f"step {i}: loss {loss:.3f} ({1e3 * (time.perf_counter() - t0):.1f} ms)")
