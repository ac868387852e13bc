"""A Mixture-of-Experts feed-forward block with expert parallelism (GShard, Lepikhin et al. 2020,
arXiv 2006.16668, sec. 2-3; Switch Transformer, Fedus et al. 2021, arXiv 2101.03961, sec. 2).

A learned router ``w_router[embed, E]`` (``E`` never sharded) scores each token (fp32 logits and
softmax) and sends it to its ``top_k`` experts, each an MLP like :mod:`jaxtp.layers.mlp` (SwiGLU or
GELU). Tokens are routed in *groups*: here one group is one batch row, ``S`` tokens (under context
parallelism, a rank's chunk of a row). Each expert takes at most ``C`` tokens of a group (its
capacity), first come first served by position; with top-2, all first choices of the group are
placed before any second choice (GShard's Algorithm 1). A token whose expert is full is dropped
from that expert: it gets zero output from it and so passes through the block's residual
unchanged. Dispatch and combine are GShard's einsums over a one-hot tensor ``[G, S, E, C]``; the
dispatched tokens ``[E, G, C, D]`` are where expert parallelism cuts.

Capacity: ``C = ceil(top_k x S x capacity_factor / E)``, clamped to ``[1, S]``. For top-1 this is
Switch's ``tokens / experts x capacity_factor``; for top-2 it is GShard's ``2S / E`` scaled by the
factor (every token makes two assignments). ``capacity_factor = 0`` means dropless: ``C = S``.
Gates: top-1 uses the raw router probability (Switch: renormalising one gate would give it no
gradient); top-k >= 2 renormalises the k probabilities to sum to 1 (GShard); a dropped choice just
loses its share (no second renormalisation). GShard's random dispatch of the second expert is not
used: routing is deterministic.

Losses (Switch eq. 4-6; the z-loss from ST-MoE, Zoph et al. 2022, arXiv 2202.08906):
``load_balancing_loss = alpha x E x sum_i f_i P_i``, ``f_i`` the fraction of tokens whose top-1
is expert ``i`` (before capacity), ``P_i`` the mean router probability of expert ``i``;
``z_loss = coef x mean(logsumexp(logits)^2)``. Both are means over all tokens of the global batch.

Expert parallelism over the ``expert`` axis (per device, inside ``jax.shard_map``): tokens are
sharded over the batch dim on the data axes *and* ``expert`` (expert ranks are data ranks for the
rest of the model), experts over ``expert``. :func:`~jaxtp.parallel.collectives.dispatch_to_experts` is
one all-to-all that sends each expert rank the ``[E_local, C, D]`` slots of every local group;
:func:`~jaxtp.parallel.collectives.combine_from_experts` is its inverse. JAX's transpose of an all-to-all
is the inverse all-to-all, so backward runs the same two, mirrored. The expert MLP may also be Megatron
tensor-parallel over ``model`` (``mlp`` sharded): ``f`` at the block input, ``g`` at its output,
exactly as the dense MLP. In the global view (single device, GSPMD) the same einsums run, and the
dispatched tensor is constrained from the token layout ``(None, "batch", None, "embed")`` to the
expert layout ``("experts", "batch_no_expert", None, "embed")`` and back: XLA turns each change
into one all-to-all, the same census as the explicit path (``batch_no_expert`` is the groups dim
once ``experts`` holds the ``expert`` axis; the activation table maps it to the data axes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.configs import BATCH_AXES, CONTEXT, EXPERT, ConfigError
from jaxtp.layers.params import param, residual_std

# the two all-to-alls of expert parallelism live with the other collectives; re-exported here
from jaxtp.parallel import check_experts, combine_from_experts, dispatch_to_experts
from jaxtp.pipeline import weight_einsum

# Mesh axes that shard tokens: the statistics of the routing are averaged over them. `pipeline`
# is not one (different stages hold different layers) and `model` holds copies of the same tokens
# (averaged too, so that each copy carries 1/t of the gradient; see `_mean_over_copies`).
TOKEN_AXES = BATCH_AXES + (CONTEXT, EXPERT)


# ---- settings --------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoESettings:
    """The MoE fields of a model config (the names ``ModelConfig`` uses)."""

    n_experts: int = 8
    top_k: int = 1
    capacity_factor: float = 1.25  # 0 = dropless (C = tokens per group)
    moe_every: int = 1  # an MoE block every `moe_every` layers (wired by the model)
    router_aux_loss_coef: float = 0.01  # Switch's alpha
    router_z_loss_coef: float = 0.0

    @classmethod
    def of(cls, cfg) -> MoESettings:
        """From any object with these attributes (``ModelConfig``, a namespace); the last three
        fall back to their defaults when absent."""
        required = ("n_experts", "top_k", "capacity_factor")
        missing = [n for n in required if not hasattr(cfg, n)]
        if missing:
            raise ConfigError(f"{type(cfg).__name__} has no MoE fields {missing}; an MoE layer "
                              f"needs n_experts, top_k and capacity_factor")
        return cls(**{f.name: getattr(cfg, f.name, f.default) for f in fields(cls)})


def check_moe(settings: MoESettings, expert_degree: int = 1) -> None:
    """Raise ``ConfigError`` (a ``ValueError``) naming the fix, before any compile (the rules live
    in :func:`jaxtp.parallel.validation.check_experts`)."""
    s = settings
    check_experts(n_experts=s.n_experts, top_k=s.top_k,
                           capacity_factor=s.capacity_factor, moe_every=s.moe_every,
                           router_aux_loss_coef=s.router_aux_loss_coef,
                           router_z_loss_coef=s.router_z_loss_coef, expert_degree=expert_degree)


def expert_capacity(tokens_per_group: int, settings: MoESettings) -> int:
    """Slots per expert per group: ``ceil(top_k x S x capacity_factor / E)`` in ``[1, S]``."""
    s, n = settings, tokens_per_group
    if s.capacity_factor == 0:
        return n
    # the epsilon keeps e.g. 1.1 x 100 / 10 = 11.000000000000002 from rounding up to 12
    c = math.ceil(s.top_k * n * s.capacity_factor / s.n_experts - 1e-9)
    return max(1, min(n, c))


# ---- routing ---------------------------------------------------------------------------------

def _top_k_one_hot(probs: jax.Array, k: int) -> jax.Array:
    """One-hot ``[..., k, E]`` of the ``k`` largest entries, ties to the lower index (as
    ``lax.top_k``). ``k`` rounds of argmax: XLA's partitioner all-gathers a batch-sharded
    ``top_k`` operand, but splits an argmax (a reduction along the unsharded ``E``) by batch."""
    e, picks = probs.shape[-1], []
    for _ in range(k):
        pick = jax.nn.one_hot(jnp.argmax(probs, axis=-1), e)                # (..., E)
        picks.append(pick)
        probs = jnp.where(pick > 0, -1.0, probs)                            # probs >= 0
    return jax.lax.stop_gradient(jnp.stack(picks, axis=-2))


def route(logits: jax.Array, settings: MoESettings, capacity: int):
    """GShard dispatch / combine tensors and local routing statistics for ``logits [G,S,E]``.

    Returns ``dispatch [G,S,E,C]`` (0/1, no gradient), ``combine [G,S,E,C]`` (gates at the kept
    slots, fp32, differentiable through the router) and a dict of per-token means over this
    array's tokens (reduce them with :func:`router_aux` before use).
    """
    g, s, e = logits.shape
    k = settings.top_k
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)                               # (G, S, E)
    onehot = _top_k_one_hot(probs, k)                                     # (G, S, k, E)
    top_p = jnp.sum(probs[:, :, None] * onehot, axis=-1)                  # (G, S, k)
    gates = top_p if k == 1 else top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    choice = onehot.astype(jnp.int32)
    # Priority: choice-major, then position (all first choices of the group before any second).
    queue = choice.transpose(0, 2, 1, 3).reshape(g, k * s, e)            # (G, k*S, E)
    ahead = jnp.cumsum(queue, axis=1).reshape(g, k, s, e).transpose(0, 2, 1, 3) - 1
    position = jnp.sum(ahead * choice, axis=-1)                          # (G, S, k)
    kept = position < capacity
    # one_hot of the out-of-range index `capacity` is all zeros: a dropped choice has no slot
    slot = jax.nn.one_hot(jnp.where(kept, position, capacity), capacity)  # (G, S, k, C)
    dispatch = jnp.einsum("gske,gskc->gsec", onehot, slot)                # (G, S, E, C)
    combine = jnp.einsum("gsk,gske,gskc->gsec", gates, onehot, slot)      # (G, S, E, C)
    stats = {
        "top1_fraction": jnp.mean(onehot[:, :, 0], axis=(0, 1)),         # f_i, (E,)
        "mean_prob": jnp.mean(probs, axis=(0, 1)),                        # P_i, (E,)
        "logsumexp_sq": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "dropped_fraction": 1.0 - jnp.mean(kept.astype(jnp.float32)),
        "expert_load": jnp.mean(jnp.sum(onehot, axis=2), axis=(0, 1)) / k,  # (E,), sums to 1
    }
    return dispatch, combine, stats


def _varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes ``x`` varies over (``{V_...}``); empty outside ``shard_map``."""
    t = jax.typeof(x)
    vma = getattr(t, "vma", None)  # JAX >= 0.11 spelling
    if vma is None:
        vma = getattr(getattr(t, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def _mean_over_copies(x: jax.Array) -> jax.Array:
    """Per-device mean -> global mean: ``pmean`` over the token axes ``x`` varies over, and over
    ``model``, whose ranks hold equal copies (forward: the value; backward: 1/t of the cotangent
    to each copy, which ``f``'s all-reduce sums back). Identity outside ``shard_map``."""
    axes = tuple(a for a in (*TOKEN_AXES, "model") if a in _varying_axes(x))
    return jax.lax.pmean(x, axes) if axes else x


def router_aux(stats: dict, settings: MoESettings) -> dict:
    """The layer's aux outputs (fp32, equal on every device) from :func:`route`'s local stats."""
    st = {name: _mean_over_copies(v) for name, v in stats.items()}
    f = jax.lax.stop_gradient(st["top1_fraction"])  # an argmax count: no gradient (Switch)
    lb = settings.router_aux_loss_coef * settings.n_experts * jnp.sum(f * st["mean_prob"])
    z = settings.router_z_loss_coef * st["logsumexp_sq"]
    return {"aux_loss": lb + z, "load_balancing_loss": lb, "z_loss": z,
            "dropped_fraction": st["dropped_fraction"], "expert_load": st["expert_load"]}


def summarize_aux(stacked: dict) -> dict:
    """Per-layer aux outputs stacked along a leading layer dim -> the model's: the losses summed
    over layers (each layer's router loss is a term of the training loss), the drop rate and the
    per-expert load averaged."""
    summed = ("aux_loss", "load_balancing_loss", "z_loss")
    return {k: jnp.sum(v, axis=0) if k in summed else jnp.mean(v, axis=0)
            for k, v in stacked.items()}


# ---- the layer ---------------------------------------------------------------------------------

def _expert_axis_is_manual() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and EXPERT in mesh.manual_axes


class MoE(nnx.Module):
    """``x [B,S,D] -> (out [B,S,D], aux)``: routed experts in place of the dense MLP.

    ``cfg`` needs ``d_model, d_ff, activation, init_std, n_layers, param_dtype, compute_dtype``
    and the :class:`MoESettings` fields. Runs the expert-parallel per-device path when the
    ``expert`` axis is manual (inside ``jax.shard_map``), the global view otherwise.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs, stack: int | None = None):
        self.settings = MoESettings.of(cfg)
        check_moe(self.settings)
        d, f, e, dt = cfg.d_model, cfg.d_ff, self.settings.n_experts, jnp.dtype(cfg.param_dtype)
        self.gated = cfg.activation == "swiglu"
        # the router's expert dim is never sharded: every rank scores its tokens for all experts
        self.w_router = param(rngs, (d, e), ("embed", None), std=cfg.init_std, dtype=dt,
                              stack=stack)
        # as mlp.py: SwiGLU's gate and up projections share one weight (one matmul, one cotangent)
        up_shape, up_names = ((e, d, 2, f), ("experts", "embed", None, "mlp")) if self.gated \
            else ((e, d, f), ("experts", "embed", "mlp"))
        self.w_up = param(rngs, up_shape, up_names, std=cfg.init_std, dtype=dt, stack=stack)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"),
                            std=residual_std(cfg.init_std, cfg.n_layers), dtype=dt, stack=stack)
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)

    def experts(self, x: jax.Array, ops) -> jax.Array:
        """Every (local) expert's MLP on its slots: ``[E, G, C, D] -> [E, G, C, D]{U_model}``."""
        cdt = self.compute_dtype
        if self.gated:
            gate_up = weight_einsum("egcd,edtf->egctf", x, self.w_up[...].astype(cdt))
            act = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]       # (E, G, C, F)
        else:
            act = jax.nn.gelu(weight_einsum("egcd,edf->egcf", x, self.w_up[...].astype(cdt)))
        act = ops.constrain(act, "experts", "batch_no_expert", None, "mlp")
        return weight_einsum("egcf,efd->egcd", act, self.w_down[...].astype(cdt))

    def __call__(self, x: jax.Array, ops) -> tuple[jax.Array, dict]:
        cdt = self.compute_dtype
        parallel = _expert_axis_is_manual()
        h = ops.copy_to_model(x)                                              # f; (B, S, D)
        logits = weight_einsum("gsd,de->gse", h.astype(jnp.float32),
                            self.w_router[...].astype(jnp.float32))           # (G, S, E) fp32
        capacity = expert_capacity(h.shape[1], self.settings)  # a group: one row (of this rank)
        dispatch, combine, stats = route(logits, self.settings, capacity)
        xe = jnp.einsum("gsec,gsd->egcd", dispatch.astype(cdt), h.astype(cdt))  # (E, G, C, D)
        if parallel:
            ep = jax.lax.axis_size(EXPERT)
            if self.w_up.shape[0] * ep != self.settings.n_experts:
                raise ValueError(f"{self.settings.n_experts} experts over expert={ep} ranks "
                                 f"needs {self.settings.n_experts // ep} per rank, got "
                                 f"{self.w_up.shape[0]}: shard `experts` over `expert`")
            if ep > 1:
                xe = dispatch_to_experts(xe)                                # (E/ep, ep*G, C, D)
            ye = self.experts(xe, ops)
            if ep > 1:
                ye = combine_from_experts(ye)                               # (E, G, C, D)
        else:
            # The same two layout changes as the explicit all-to-alls, as constraints: from the
            # token layout (groups split over every token axis) to experts over `expert`, and back.
            xe = ops.constrain(xe, None, "batch", None, "embed")
            xe = ops.constrain(xe, "experts", "batch_no_expert", None, "embed")
            ye = ops.constrain(self.experts(xe, ops), "experts", "batch_no_expert", None,
                               "embed")
            ye = ops.constrain(ye, None, "batch", None, "embed")
        out = jnp.einsum("gsec,egcd->gsd", combine.astype(cdt), ye)      # (B, S, D){U_model}
        return ops.reduce_from_model(out), router_aux(stats, self.settings)  # g
