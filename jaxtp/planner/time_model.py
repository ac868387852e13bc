"""The cost model's time half: predicted seconds per step of one parallel layout.

It follows Narayanan et al. 2021 (PTD-P, arXiv 2104.04473: FLOPs eq. 3, bubble (p-1)/(v m), TP
inside a node, scatter/gather p2p); :mod:`jaxtp.planner.cost_model` says what a layout is and how well the
model predicts, :mod:`jaxtp.planner.memory_model` gives the activation bytes the elementwise work moves.

Step time: compute is FLOPs / (peak x matmul_efficiency), recompute included, plus memory-bound
elementwise work (each activation byte written once forward, read and its cotangent written once
backward, at HBM bandwidth). Collectives are alpha-beta per link class (``jaxtp.planner.hardware``), ring
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
- Pipeline: one p2p of b s h / t each way per tick of the table, exposed, and the bubble.
  ``activations="megatron"``: Megatron-LM's runtime, (p-1)/v micro-batch times. ``"jaxtp"``:
  jaxtp's lockstep runtime, in which a tick (at most one F and one B per rank) lasts as long as
  its busiest rank's: ``Program.lockstep_time``, the textbook bubble for GPipe and for 1F1B
  (whose ticks pair a forward with a backward; interleaved: the one-pass-per-tick table's, an
  upper bound); a B re-runs its stage forward only under ``remat=full`` and for GPipe.
The step ends with the Adam update, memory-bound over the moment shard. A group of devices uses
the fast link iff it fits in one node, devices filling nodes in mesh order (``model`` innermost).
"""

from __future__ import annotations

import math

from jaxtp.configs import AXES
from jaxtp.pipeline import lockstep_factor, stores_residuals
from jaxtp.planner.cost_model import Candidate, Shape
from jaxtp.planner.hardware import Hardware, Link
from jaxtp.planner.memory_model import (
    effective_remat,
    layer_activation_bytes,
    micro_batch_size,
    stage_params,
    zero_shards,
)


def link(layout: Candidate, axes: tuple[str, ...], hw: Hardware) -> Link:
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


def step_time(s: Shape, layout: Candidate, hw: Hardware, *,
              activations: str = "jaxtp") -> dict[str, float]:
    """Predicted seconds per step by component (see the module docstring for what overlaps).

    ``activations`` also picks the pipeline runtime: ``"megatron"`` models Megatron-LM's, whose
    passes each take their own time (bubble (p-1)/v micro-batch times); ``"jaxtp"`` models
    jaxtp's (:mod:`jaxtp.pipeline.runtime`): a B reads its forward's stored residuals (under
    ``remat=full`` and for GPipe it re-runs its stage's forward: +1 forward of FLOPs and TP
    collectives) and a tick, at most one F and one B per rank, lasts as long as its busiest
    rank's, so the pipelined time is the program's ``Program.lockstep_time``."""
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
    if lockstep and not stores_residuals(layout.pipeline_schedule, layout.remat):
        # jaxtp's B then recomputes the stage's forward
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
        # take one more hop home (jaxtp.parallel.ring)
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
        # GPipe and the packed 1F1B: (m + p - 1) (F + B) (Program.lockstep_time, tested);
        # interleaved: the one-pass-per-tick table's, an upper bound of its packed program's
        factor = ((m + p - 1) / m if v == 1 and m >= p or layout.pipeline_schedule == "gpipe"
                  else lockstep_factor(layout.pipeline_schedule, p, m, v, backward=bwd / fwd))
        if layout.pipeline_schedule == "zb1" and m >= p:
            # ZB-H1 packed as 1F1B, its cool-down's deferred W (half the backward) sharing
            # ticks with the last B: (p - 1) W less (Program.lockstep_time, tested)
            factor = (m + p - 1) / m - (p - 1) * (bwd / 2) / (m * (fwd + bwd))
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


def gradient_sync(layout: Candidate, grads: float) -> list[tuple[str, tuple[str, ...], float]]:
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
