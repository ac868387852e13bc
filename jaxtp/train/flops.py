"""Model FLOPs and peak FLOP/s: the one formula behind every MFU jaxtp reports.

Training FLOPs per step are ``6 N T`` for the matmuls plus ``12 L s (n_heads x head_dim) T`` for
the attention scores (Kaplan et al. 2020; the attention term is Narayanan et al. 2021 eq. 3
without the causal halving), ``T`` the tokens per step. MFU divides them by the step time and the
devices' peak: a datasheet peak per accelerator (:data:`jaxtp.planner.hardware.PEAK_FLOPS`), and on CPU a
peak measured once with a large matmul.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from jaxtp.configs import ModelConfig
from jaxtp.planner import PEAK_FLOPS


def training_flops(*, matmul_params: float, n_layers: int, seq_len: int, attn_width: int,
                   tokens: float) -> float:
    """``6 N T + 12 L s w T``: forward and backward of ``N`` matmul parameters and of the
    attention scores of width ``w = n_heads x head_dim``."""
    return 6.0 * matmul_params * tokens + 12.0 * n_layers * seq_len * attn_width * tokens


def model_flops(model: ModelConfig, *, batch_size: int, seq_len: int) -> float:
    """Training FLOPs per step of ``model`` on ``batch_size x seq_len`` tokens. ``N`` counts the
    non-embedding parameters plus the output head; of an MoE layer, the router and the ``top_k``
    experts a token uses (the active parameters), not the capacity padding."""
    # the input lookup is no matmul; the output projection is one, tied or not
    n = model.param_count(active=True) - (0 if model.tie_embeddings
                                          else model.vocab_size * model.d_model)
    return training_flops(matmul_params=n, n_layers=model.n_layers, seq_len=seq_len,
                          attn_width=model.n_heads * model.resolved_head_dim,
                          tokens=batch_size * seq_len)


def measure_cpu_peak(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of one large fp32 matmul on the host: the CPU's usable peak, measured once."""
    a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.local_devices(backend="cpu")[0])
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def peak_flops(devices) -> float:
    """Peak FLOP/s of all ``devices`` together."""
    kind = devices[0].device_kind.lower()
    if devices[0].platform == "cpu":
        # Simulated CPU devices share their host's cores: each host's matmul peak is its budget.
        return measure_cpu_peak() * jax.process_count()
    for key, flops in PEAK_FLOPS.items():
        if key in kind:
            return flops * len(devices)
    return math.nan
