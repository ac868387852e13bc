"""The feed-forward block, tensor-parallel over its hidden dim (Shoeybi et al. 2019, sec. 3,
Fig. 3a): the up (and gate) projections are column-parallel, the down projection row-parallel, so
the nonlinearity runs on local shards with no communication in between. SwiGLU (Shazeer 2020) for
Llama-style models, GELU for GPT-style ones.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.configs import ModelConfig
from jaxtp.layers.params import param, residual_std
from jaxtp.pipeline import weight_einsum


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        d, f, dt = cfg.d_model, cfg.d_ff, jnp.dtype(cfg.param_dtype)
        self.gated = cfg.activation == "swiglu"
        # SwiGLU's gate and up projections share one weight ``[embed, 2, mlp]``: one matmul, one
        # cotangent, one backward all-reduce.
        up_shape, up_names = ((d, 2, f), ("embed", None, "mlp")) if self.gated else \
            ((d, f), ("embed", "mlp"))
        self.w_up = param(rngs, up_shape, up_names, std=cfg.init_std, dtype=dt, stack=stack)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"),
                            std=residual_std(cfg.init_std, cfg.n_layers), dtype=dt, stack=stack)
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)

    def __call__(self, x: jax.Array, ops) -> jax.Array:
        cdt = self.compute_dtype
        h = ops.copy_to_model(x).astype(cdt)                                  # f; (B, S, D)
        if self.gated:
            gate_up = weight_einsum("bsd,dcf->bscf", h, self.w_up[...].astype(cdt))  # (B, S, 2, F)
            act = _swiglu(gate_up)
        else:
            act = _gelu(weight_einsum("bsd,df->bsf", h, self.w_up[...].astype(cdt)))
        act = ops.constrain(act, "batch", "seq", "mlp")
        out = weight_einsum("bsf,fd->bsd", act, self.w_down[...].astype(cdt))   # (B, S, D){U_model}
        return ops.reduce_from_model(out)                                    # g


# The nonlinearity is recomputed in backward from its input: the layer keeps the up projection's
# output and, for the down projection's weight gradient, the activation -- Korthikanti et al.'s
# 2 sbf -- instead of every intermediate of tanh-GELU / SiLU that autodiff would save.
_gelu = jax.checkpoint(jax.nn.gelu, prevent_cse=False)


@partial(jax.checkpoint, prevent_cse=False)
def _swiglu(gate_up: jax.Array) -> jax.Array:  # (B, S, 2, F) -> (B, S, F)
    return jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
