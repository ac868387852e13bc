"""The planner's cost model: per-device memory and step time of one parallel layout, analytically.

A *layout* is one point of the space DESIGN.md's mesh spans: degrees over ``pipeline, data, fsdp,
context, expert, model`` whose product is N, a ZeRO stage, a recompute policy, sequence
parallelism, a pipeline schedule (GPipe, 1F1B, interleaved 1F1B with v virtual stages) and a number
of micro-batches. For each, an analytic cost model predicts per-device memory and step time; the
layouts that fit in memory are ranked by step time. The model follows Narayanan et al. 2021
(PTD-P, arXiv 2104.04473: FLOPs eq. 3, bubble (p-1)/(v m), TP inside a node, scatter/gather p2p),
Korthikanti et al. 2022 (arXiv 2205.05198: activation memory per layer sbh(34 + 5as/h), TP / SP /
selective / full recompute) and ZeRO (arXiv 1910.02054: 16 Psi of state split by stage).

Memory per device (bytes; the worst pipeline stage, which holds L/p layers and one vocab table):
- state: Psi_dev = params of the stage on this device (TP-split tensors / t, norms whole); fp32
  params 4 Psi_dev / n_p, Adam moments 8 Psi_dev / n_m, gradients 4 Psi_dev / n_p -- jaxtp keeps
  the whole local gradient until its one sync per step, so ZeRO-2 adds the 4 Psi_dev / n_g shard
  it scatters into. n_x: the ZeRO shards of each state (``fsdp`` always; ``data`` from stage 3 /
  2 / 1 for params / grads / moments). This is DESIGN.md's 16 Psi contract.
- activations: per layer and micro-batch by :func:`layer_activation_bytes` (Korthikanti's terms,
  either verbatim -- ``activations="megatron"``, Megatron-LM's fp16 + dropout implementation -- or
  re-derived for jaxtp's own ops and dtypes, ``"jaxtp"``), times L/p layers, times the micro-batches
  in flight (1 without a pipeline, m for GPipe, min(m, p) for 1F1B, the interleaved warm-up over v),
  plus the loss region and, without recompute in mixed precision, the compute-dtype weight copies
  autodiff keeps.
- transient: one layer's backward working set (its full activations: recomputed or cotangents) and,
  with ZeRO-3, the gathered layer and vocab table with their unreduced gradients.

Step time: compute is FLOPs / (peak x matmul_efficiency), recompute included, plus memory-bound
elementwise work (each activation byte written once forward, read and its cotangent written once
backward, at HBM bandwidth). Collectives are alpha-beta per link class (``jaxtp.hardware``), ring
algorithms: all-reduce 2(n-1)/n bytes, gather / scatter (n-1)/n. Exposed vs overlapped:
- TP: 2 all-reduces forward + 2 backward per layer per micro-batch of b s h (SP's gather / scatter
  pairs move the same bytes), +2 when full recompute re-runs the forward: all exposed.
- CP: ring K/V exchanges, overlapped with the layer's attention compute (exposed: the excess).
- ZeRO-3 / FSDP: each layer gathered forward and backward, its gradient reduce-scattered, per
  micro-batch; prefetched one layer ahead, so exposed only where it outlasts the layer's compute.
- DP gradient sync once per step over the replicas of each parameter (``data`` below ZeRO-3,
  and ``context``), bucketed per layer and overlapped with the last micro-batch's backward (the
  only time gradients become final), except the last bucket. ZeRO-1/2's all-gather of the
  updated parameters after the optimizer is exposed.
- Pipeline: one p2p of b s h / t per tick, exposed, and the bubble. ``activations="megatron"``:
  Megatron-LM's runtime, (p-1)/v micro-batch times. ``"jaxtp"``: jaxtp's lockstep runtime, in
  which a tick lasts as long as its slowest pass and each B re-runs its stage forward:
  ``schedules.lockstep_factor`` x one rank's busy time, the textbook bubble for GPipe, about
  1.5 x the busy time for 1F1B as m grows.
The step ends with the Adam update, memory-bound over the moment shard. A group of devices uses
the fast link iff it fits in one node, devices filling nodes in mesh order (``model`` innermost).

How well it predicts (tests/test_plan.py, on ``tiny`` compiled for 8 CPU devices): the compiled
step's arguments (parameters + batch) and outputs (gradients) to well under 1%; the per-layer
activations to 1% of what JAX's autodiff saves, for every recompute policy and dtype; the TP,
DP and CP bytes of the collective census to 1%. XLA's temporaries come out 0.73-1.46 x the
compiled ones: its buffer reuse and fusion are not modelled, and the estimate errs high. Step times
are not checked against hardware here; against Narayanan et al.'s Table 1 the model is 1.2-1.4x
optimistic (experiments/megatron_table1.py). Not modelled: kernel launch overheads, attention's
causal halving, load imbalance beyond the logits on the last stage, contention between concurrent
collectives, tree / hierarchical collectives, MoE capacity and routing (an MoE layer costs top_k
dense MLPs; expert weights are taken as split over ``expert``, its all-to-alls as exposed).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from jaxtp.config import Config, ConfigError
from jaxtp.hardware import Hardware, Link
from jaxtp.schedules import lockstep_factor

AXES = ("pipeline", "data", "fsdp", "context", "expert", "model")  # jaxtp.mesh order
SCHEDULES = ("gpipe", "1f1b", "interleaved")
REMATS = ("none", "selective", "full")  # fastest first


@dataclass(frozen=True)
class Layout:
    """One parallel configuration; field names are the config's ``parallel.*`` names (and
    ``microbatches`` from ``train``)."""

    data: int = 1
    fsdp: int = 1
    pipeline: int = 1
    model: int = 1
    context: int = 1
    expert: int = 1
    zero_stage: int = 0
    remat: str = "none"
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def overrides(self) -> list[str]:
        """The ``parallel.*`` / ``train.microbatches`` config overrides of this layout."""
        keys = AXES + ("zero_stage", "remat", "sequence_parallel", "pipeline_schedule",
                       "virtual_stages")
        return [f"parallel.{k}={getattr(self, k)}" for k in keys] + [
            f"train.microbatches={self.microbatches}"]


@dataclass(frozen=True)
class Shape:
    """The numbers of a :class:`Config` the cost model reads."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    vocab_pad_multiple: int
    seq: int
    batch: int
    gated: bool
    tied: bool
    compute_bytes: int
    param_bytes: int
    flash: bool  # attention keeps no s x s tensor (cuDNN flash attention)
    n_experts: int = 0  # 0: dense
    top_k: int = 1
    moe_every: int = 1  # every moe_every-th layer is a mixture of experts

    @classmethod
    def of(cls, cfg: Config) -> Shape:
        m, t = cfg.model, cfg.train
        size = {"float32": 4, "bfloat16": 2, "float16": 2}
        return cls(layers=m.n_layers, d_model=m.d_model, heads=m.n_heads, kv_heads=m.n_kv_heads,
                   head_dim=m.resolved_head_dim, d_ff=m.d_ff, vocab=m.vocab_size,
                   vocab_pad_multiple=m.vocab_pad_multiple, seq=t.seq_len, batch=t.batch_size,
                   gated=m.activation == "swiglu", tied=m.tie_embeddings,
                   compute_bytes=size[m.compute_dtype], param_bytes=size[m.param_dtype],
                   flash=getattr(m, "attention_impl", "default") == "cudnn",
                   n_experts=int(getattr(m, "n_experts", 0) or 0),
                   top_k=int(getattr(m, "top_k", 1) or 1),
                   moe_every=int(getattr(m, "moe_every", 1) or 1))

    def padded_vocab(self, t: int) -> int:
        multiple = self.vocab_pad_multiple * t
        return -(-self.vocab // multiple) * multiple

    @property
    def attn_params(self) -> int:  # w_qkv + wo, split over `model`
        return self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def mlp_params(self) -> int:  # one dense MLP, split over `model`
        return (3 if self.gated else 2) * self.d_model * self.d_ff

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def moe_fraction(self) -> float:
        return 1 / self.moe_every if self.moe else 0.0

    def layer_params(self, t: int, ep: int) -> float:
        """An (average) layer's parameters on one device: TP-split matrices / t, norm scales and
        the router whole, an MoE layer's experts split over ``expert`` too."""
        f = self.moe_fraction
        mlp = self.mlp_params * (1 - f + f * self.n_experts / ep)
        return (self.attn_params + mlp) / t + 2 * self.d_model + f * self.d_model * self.n_experts

    def layer_flops(self, t: int, tokens: float) -> float:
        """Forward matmul FLOPs of one layer on ``tokens`` local tokens per device: 2 per weight
        per token, plus QK^T and PV over the whole sequence (eq. 3's 4 b s^2 h, not halved for
        causality)."""
        mlp = self.mlp_params * (1 - self.moe_fraction + self.moe_fraction * self.top_k)
        return (2 * (self.attn_params + mlp) + self.attention_flops_per_token) * tokens / t

    @property
    def attention_flops_per_token(self) -> float:
        return 4 * self.seq * self.heads * self.head_dim

    def model_flops(self) -> float:
        """Training FLOPs per step without recompute (Narayanan eq. 3 with 72 for 96)."""
        tokens = self.batch * self.seq
        return 3 * tokens * (self.layers * self.layer_flops(1, 1) + 2 * self.d_model * self.vocab)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------

def effective_remat(layout: Layout) -> str:
    """jaxtp's model saves matmul outputs (``dots_saveable``) when ZeRO-3 gathers each layer and
    no recompute was asked for: gathered weights must not be saved (:func:`jaxtp.model._remat`)."""
    if layout.remat == "none" and zero_shards(layout)[0] > 1:
        return "dots_saveable"
    return layout.remat


def layer_activation_bytes(s: Shape, *, remat: str, b: int, s_loc: int, t: int, sp: bool,
                           ring: bool, activations: str = "jaxtp") -> float:
    """Bytes one layer keeps for backward, per micro-batch of ``b`` sequences of ``s_loc`` local
    positions, per device (Korthikanti et al. 2022, sec. 4; N = s b h, A = a s_loc s b).

    ``megatron``: the paper verbatim (fp16, dropout masks): 10N (norms, block inputs: replicated
    unless SP) + 24N / t + 5A / t; selective drops 5A; full keeps the 2N block input.
    ``jaxtp``, re-derived from what JAX's autodiff saves for this implementation (no dropout,
    RMSNorm in fp32, e = compute-dtype bytes, r = kv_heads / heads, F = d_ff / h):
    none: 2 e N / (t if SP) [the two norms' inputs; the norms are recomputed in backward] +
    2 e N [their outputs, the column-parallel inputs -- whole even under SP, where they are the
    all-gathered tensors] + (e N (2 + 2r + F_act) [q, k, v, attention out; the up projection's
    output and the activation, F_act = 2F for GELU, 3F for SwiGLU] + (4 + e) A [fp32 scores,
    probabilities]) / t; selective: 2eN + e N (1 + 2r + F_up) / t [block input, the linear layers'
    outputs; F_up = 2F for SwiGLU]; dots_saveable adds the two attention matmuls; full: eN.
    ``ring``: ring attention (context parallelism) or flash attention keeps no A term.
    """
    h, e = s.d_model, s.compute_bytes
    n = b * s_loc * h
    a = 0.0 if ring else s.heads * b * s_loc * s.seq
    rep = t if sp else 1
    if activations == "megatron":
        return {"none": 10 * n / rep + (24 * n + 5 * a) / t,
                "full": 2 * n / rep}.get(remat, 10 * n / rep + 24 * n / t)
    if activations != "jaxtp":
        raise ConfigError(f"activations={activations!r}: choose jaxtp or megatron")
    r, f = s.kv_heads / s.heads, s.d_ff / h
    f_up = 2 * f if s.gated else f
    if remat == "none":
        f_act = 3 * f if s.gated else 2 * f
        return 2 * e * n / rep + 2 * e * n + (e * n * (2 + 2 * r + f_act) + (4 + e) * a) / t
    if remat == "selective":
        return 2 * e * n / rep + e * n * (1 + 2 * r + f_up) / t
    if remat == "dots_saveable":
        return 2 * e * n / rep + (e * n * (2 + 2 * r + f_up) + 4 * a) / t
    return e * n / rep


def loss_region_bytes(s: Shape, *, b: int, s_loc: int, t: int, ring: bool, remat: str,
                      activations: str) -> float:
    """The embedding, final norm, logits and loss of one micro-batch, kept for backward."""
    n, e, v = b * s_loc * s.d_model, s.compute_bytes, s.padded_vocab(t)
    if activations == "megatron":
        return 4 * n + 4 * b * s_loc * v / t  # final norm input, fp32 logits
    # embedding rows (fp32) and their mask, final norm input and output, logits: two fp32 copies,
    # the softmax shift, two boolean masks; without recompute, the causal mask XLA's attention
    # builds once (bool + fp32) is kept too
    mask = 0.0 if ring or remat != "none" else 5 * s.heads * b * s_loc * s.seq / t
    return (5 + 2 * e) * n + 14 * b * s_loc * v / t + mask


def in_flight(layout: Layout) -> float:
    """Micro-batches of activations a stage holds at its peak, in units of its full L/p layers."""
    p, m, v = layout.pipeline, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 1.0  # gradient accumulation: each micro-batch's backward frees it
    if layout.pipeline_schedule == "gpipe":
        return float(m)
    if layout.pipeline_schedule == "1f1b":
        return float(min(m, p))
    # Megatron's interleaved warm-up: 2 (p - 1) + (v - 1) p forwards of 1/v-sized chunks, + 1
    return min(m * v, 2 * (p - 1) + (v - 1) * p + 1) / v


def zero_shards(layout: Layout) -> tuple[int, int, int]:
    """How many ways (params, grads, moments) are split over the ZeRO axes fsdp and data."""
    z, d, st = layout.fsdp, layout.data, layout.zero_stage
    return (z * (d if st >= 3 else 1), z * (d if st >= 2 else 1), z * (d if st >= 1 else 1))


def stage_params(s: Shape, layout: Layout) -> tuple[float, float]:
    """(parameters of the worst pipeline stage on one device, those of its vocab tables)."""
    t, p = layout.model, layout.pipeline
    # jaxtp replicates the embedding, final norm and head over `pipeline` (Megatron-LM keeps the
    # embedding on the first stage and the head on the last): every stage holds both tables
    table = (1 if s.tied else 2) * s.padded_vocab(t) * s.d_model / t
    return s.layers / p * s.layer_params(t, layout.expert) + table + s.d_model, table


def memory(s: Shape, layout: Layout, *, activations: str = "jaxtp") -> dict[str, float]:
    """Predicted bytes per device, by component; ``total`` is what must fit in HBM."""
    t, c, pb = layout.model, layout.context, s.param_bytes
    n_p, n_g, n_m = zero_shards(layout)
    psi, table = stage_params(s, layout)
    b = micro_batch_size(s, layout)
    s_loc, ring = s.seq // c, c > 1 or s.flash
    remat = effective_remat(layout)
    kw = dict(b=b, s_loc=s_loc, t=t, sp=layout.sequence_parallel, ring=ring,
              activations=activations)
    per_layer = layer_activation_bytes(s, remat=remat, **kw)
    layers = s.layers / layout.pipeline
    # the worst stage is taken to hold both the most micro-batches in flight and the loss
    # region (conservative for p > 1: those are the first and the last stage)
    acts = layers * in_flight(layout) * per_layer + loss_region_bytes(
        s, b=b, s_loc=s_loc, t=t, ring=ring, remat=remat, activations=activations)
    if activations == "jaxtp" and s.compute_bytes != pb:
        acts += s.compute_bytes * table  # the head's compute-dtype copy
        if remat == "none":  # autodiff keeps each layer's compute-dtype weight copies
            acts += s.compute_bytes * layers * (s.layer_params(t, layout.expert) - 2 * s.d_model)
    transient = layer_activation_bytes(s, remat="none", **kw)
    if n_p > 1:  # a gathered layer and the vocab tables, each with its unreduced gradient
        transient += 2 * pb * (s.layer_params(t, layout.expert) + table)
    out = {"params": pb * psi / n_p,
           "grads": pb * psi / n_p + (pb * psi / n_g if n_g != n_p else 0.0),
           "optimizer": 8 * psi / n_m,
           "activations": acts, "transient": transient}
    out["total"] = sum(out.values())
    return out


def micro_batch_size(s: Shape, layout: Layout) -> int:
    return s.batch // (layout.data * layout.fsdp * batch_expert(s, layout)
                       * layout.microbatches)


def batch_expert(s: Shape, layout: Layout) -> int:
    """Expert ranks are data ranks for the dense part of an MoE model (GShard)."""
    return layout.expert if s.moe else 1


# ---------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------

def link(layout: Layout, axes: tuple[str, ...], hw: Hardware) -> Link:
    """The link a collective over ``axes`` is bound by. Devices fill nodes in mesh order (``model``
    innermost), so a group stays in a node iff the degrees from its outermost axis inward fit."""
    outer = min(AXES.index(a) for a in axes)
    span = math.prod(getattr(layout, a) for a in AXES[outer:])
    return hw.intra if span <= hw.devices_per_node else hw.inter


def all_reduce_s(nbytes: float, n: int, ln: Link) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / ln.bandwidth + 2 * (n - 1) * ln.latency


def gather_s(nbytes: float, n: int, ln: Link) -> float:
    """All-gather (of an ``nbytes`` result) or reduce-scatter (of an ``nbytes`` input)."""
    return 0.0 if n == 1 else (n - 1) / n * nbytes / ln.bandwidth + (n - 1) * ln.latency


def step_time(s: Shape, layout: Layout, hw: Hardware, *,
              activations: str = "jaxtp") -> dict[str, float]:
    """Predicted seconds per step by component (see the module docstring for what overlaps).

    ``activations`` also picks the pipeline runtime: ``"megatron"`` models Megatron-LM's, whose
    passes each take their own time (bubble (p-1)/v micro-batch times); ``"jaxtp"`` models
    jaxtp's (:mod:`jaxtp.pipeline`): each B re-runs its stage's forward (+1 forward of FLOPs and
    of TP collectives) and every tick lasts as long as its slowest pass, so the pipelined time
    is :func:`jaxtp.schedules.lockstep_factor` times one rank's busy time."""
    t, p, c, d, ep = layout.model, layout.pipeline, layout.context, layout.data, layout.expert
    m, v, e, pb = layout.microbatches, layout.virtual_stages, s.compute_bytes, s.param_bytes
    b = micro_batch_size(s, layout)
    s_loc, layers = s.seq // c, s.layers // p
    tokens = b * s_loc
    rate = hw.peak_flops * hw.matmul_efficiency
    remat = effective_remat(layout)

    f_layer = s.layer_flops(t, tokens)
    f_attn = s.attention_flops_per_token * tokens / t
    f_logits = 2 * tokens * s.d_model * s.padded_vocab(t) / t  # the last stage's head
    f_re = {"full": f_layer, "selective": f_attn}.get(remat, 0.0)
    lockstep = p > 1 and activations == "jaxtp"
    if lockstep:  # jaxtp's B recomputes the stage's forward (jaxtp.pipeline)
        f_re += f_layer
    kw = dict(b=b, s_loc=s_loc, t=t, sp=layout.sequence_parallel, ring=c > 1 or s.flash,
              activations=activations)
    a_none = layer_activation_bytes(s, remat="none", **kw)
    a_kept = layer_activation_bytes(s, remat=remat, **kw)
    # elementwise work is memory-bound: written forward, read + cotangent written backward,
    # and what recompute regenerates written once more
    hbm = layers * (3 * a_none + max(a_none - a_kept, 0.0)) / hw.hbm_bandwidth
    fwd = (layers * f_layer + f_logits) / rate
    bwd = (2 * (layers * f_layer + f_logits) + layers * f_re) / rate
    compute = fwd + bwd + hbm

    tp = 0.0
    if t > 1:
        per_layer = 4 + (2 if remat == "full" else 0) + (2 if lockstep else 0)
        tp = (layers * per_layer + 2) * all_reduce_s(tokens * s.d_model * e, t,
                                                     link(layout, ("model",), hw))
    cp = 0.0
    if c > 1:
        ln, kv = link(layout, ("context",), hw), 2 * tokens * s.kv_heads * s.head_dim / t
        hop = lambda nbytes: ln.latency + nbytes / ln.bandwidth  # noqa: E731
        # forward: c - 1 K/V hops; backward: K/V again with the fp32 dK/dV accumulators, which
        # take one more hop home (jaxtp.layers.ring_attention)
        ring_f, ring_b = (c - 1) * hop(kv * e), (c - 1) * hop(kv * (e + 4)) + hop(kv * 4)
        att = f_attn / rate
        cp = layers * (max(0.0, ring_f - att) + max(0.0, ring_b - 2 * att)
                       + (max(0.0, ring_f - att) if remat == "full" else 0.0))
    moe = 0.0
    if s.moe and ep > 1:  # dispatch + combine, forward and backward, every MoE layer
        moe = layers * s.moe_fraction * 4 * gather_s(tokens * s.top_k * s.d_model * e, ep,
                                                     link(layout, ("expert",), hw))
    n_p = zero_shards(layout)[0]
    psi, table = stage_params(s, layout)
    zero3 = 0.0
    if n_p > 1:
        axes = ("data", "fsdp") if layout.zero_stage >= 3 else ("fsdp",)
        ln = link(layout, axes, hw)
        layer_bytes = pb * s.layer_params(t, ep)
        ag = gather_s(layer_bytes, n_p, ln)
        t_f, t_b = f_layer / rate, (2 * f_layer + f_re) / rate
        zero3 = (layers * (max(0.0, ag - t_f) + max(0.0, 2 * ag - t_b)) + ag
                 + 2 * gather_s(pb * table, n_p, ln))
    micro = compute + tp + cp + moe + zero3

    if lockstep:
        factor = lockstep_factor(layout.pipeline_schedule, p, m, v, backward=bwd / fwd)
        bubble = (factor - 1.0) * m * micro
    else:
        bubble = (p - 1) / v * micro
    p2p = 0.0
    if p > 1:
        ln = link(layout, ("pipeline",), hw)
        p2p = 2 * (v * m + p - 1) * (ln.latency + tokens * s.d_model * e / t / ln.bandwidth)

    sync = update_gather = 0.0
    grads = pb * psi / n_p  # the local gradient after any per-layer ZeRO-3 reduce-scatter
    full = 0.0
    for kind, axes, nbytes in gradient_sync(layout, grads):
        n = math.prod(getattr(layout, a) for a in axes)
        full += (all_reduce_s if kind == "all-reduce" else gather_s)(nbytes, n,
                                                                     link(layout, axes, hw))
    sync = max(full / layers, full - bwd)  # hidden behind the last backward, but one bucket
    if d > 1 and layout.zero_stage in (1, 2):
        update_gather = gather_s(grads, d, link(layout, ("data",), hw))
    optimizer = 28 * psi / zero_shards(layout)[2] / hw.hbm_bandwidth  # read p g m v, write p m v
    out = {"compute": m * compute, "tp": m * tp, "cp": m * cp, "ep": m * moe,
           "zero3": m * zero3, "bubble": bubble, "p2p": p2p, "dp_sync": sync,
           "update_gather": update_gather, "optimizer": optimizer}
    out["total"] = sum(out.values())
    out["recompute_flops"] = s.batch * s.seq / tokens * layers * p * f_re * t  # all devices
    return out


def gradient_sync(layout: Layout, grads: float) -> list[tuple[str, tuple[str, ...], float]]:
    """The once-per-step gradient reduction as (collective, mesh axes, bytes in): over the
    replicas that hold the same parameters -- ``data`` below ZeRO-3 and ``context`` (its ranks
    see different positions of the same sequences). ZeRO-2 reduce-scatters over ``data`` and
    all-reduces the shard over ``context``."""
    d = layout.data if layout.zero_stage < 3 else 1
    c = layout.context
    if layout.zero_stage == 2 and d > 1:
        out = [("reduce-scatter", ("data",), grads)]
        return out + ([("all-reduce", ("context",), grads / d)] if c > 1 else [])
    axes = tuple(a for a, n in (("data", d), ("context", c)) if n > 1)
    return [("all-reduce", axes, grads)] if axes else []


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    n_devices: int
    peak_flops: float
    model_flops: float
    supported: str = ""  # "" when this version of jaxtp runs the layout, else why not

    @property
    def memory_bytes(self) -> float:
        return self.memory["total"]

    @property
    def step_time_s(self) -> float:
        return self.time["total"]

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time_s * self.n_devices * self.peak_flops)

    @property
    def tflops_per_device(self) -> float:
        """Achieved FLOP/s per device as Narayanan et al. count them (eq. 3: recompute included)."""
        return (self.model_flops + self.time["recompute_flops"]) / (
            self.step_time_s * self.n_devices) / 1e12

    @property
    def exposed_comm_fraction(self) -> float:
        comm = ("tp", "cp", "ep", "zero3", "p2p", "dp_sync", "update_gather")
        return sum(self.time[k] for k in comm) / self.step_time_s

    def to_json(self) -> dict:
        out = dataclasses.asdict(self.layout)
        out.update(memory_bytes=self.memory_bytes, step_time_s=self.step_time_s, mfu=self.mfu,
                   exposed_comm_fraction=self.exposed_comm_fraction,
                   tflops_per_device=self.tflops_per_device,
                   bubble_fraction=self.time["bubble"] / self.step_time_s,
                   memory={k: v for k, v in self.memory.items() if k != "total"},
                   time={k: v for k, v in self.time.items()
                         if k not in ("total", "recompute_flops")},
                   supported=not self.supported, unsupported_reason=self.supported)
        return out
