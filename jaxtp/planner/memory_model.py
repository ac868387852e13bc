"""The cost model's memory half: predicted bytes per device of one parallel layout.

It follows Korthikanti et al. 2022 (arXiv 2205.05198: activation memory per layer
sbh(34 + 5as/h), TP / SP / selective / full recompute) and ZeRO (arXiv 1910.02054: 16 Psi of
state split by stage); :mod:`jaxtp.planner.cost_model` says what a layout is and how well the model
predicts, :mod:`jaxtp.planner.time_model` times the same layout.

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
"""

from __future__ import annotations

import functools

from jaxtp.configs import ConfigError
from jaxtp.pipeline import (
    Program,
    ScheduleError,
    build_schedule,
    compile_schedule,
    stores_residuals,
)
from jaxtp.planner.cost_model import Candidate, Shape


def effective_remat(layout: Candidate) -> str:
    """jaxtp's model saves matmul outputs (``dots_saveable``) when ZeRO-3 gathers each layer and
    no recompute was asked for: gathered weights must not be saved (:func:`jaxtp.layers.transformer._remat`)."""
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


@functools.lru_cache(maxsize=4096)
def program(name: str, p: int, m: int, v: int, residuals: bool) -> Program | None:
    """The pipeline program jaxtp runs for a schedule (cached: the planner asks for many);
    ``None`` for one its runtime does not run (e.g. 1F1B with fewer micro-batches than stages,
    which the planner may still price for Megatron-LM's runtime)."""
    try:
        return compile_schedule(build_schedule(name, p, m, v), residuals=residuals)
    except ScheduleError:
        return None


def residual_buffer(p: int, m: int) -> int:
    """Residual sets in the buffer of jaxtp's 1F1B / ZB-H1 program (``Program.buffer_slots
    ("res")``, tested against it): ``min(2p - 2, m)`` slots, and a scratch slot for the
    ticks that write nothing while every slot is live, which happens when ``m < 2p - 2``. A
    closed form, so that the planner compiles no program per candidate layout."""
    return min(2 * p - 2, m + 1)


def in_flight(layout: Candidate, activations: str = "jaxtp") -> float:
    """Micro-batches of activations a stage holds at its peak, in units of its full L/p layers.

    jaxtp's pipeline runtime (unless ``remat=full``, when it keeps only stage inputs and
    recomputes) keeps each forward's VJP residuals in the residual buffer of its compiled
    program (:func:`residual_buffer`; GPipe recomputes), plus two residual-sized buffers: the
    tick's branch output and the backward's copy of its slot. Interleaved pipelines are priced
    by Megatron-LM's warm-up, as before."""
    p, m, v = layout.pipeline, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 1.0  # gradient accumulation: each micro-batch's backward frees it
    if (activations == "jaxtp" and v == 1
            and stores_residuals(layout.pipeline_schedule, layout.remat)):
        held = residual_buffer(p, m) + 2.0
        if layout.pipeline_schedule == "zb1":
            # ZB-H1 also holds, from a B to its W, each linear's input and output cotangent
            # (priced as a residual set) for p - 1 micro-batches, and B's output of them
            held += (p - 1) + 1.0
        return held
    if layout.pipeline_schedule == "gpipe":
        return float(m)
    if layout.pipeline_schedule == "1f1b":
        return float(min(m, p))
    # Megatron's interleaved warm-up: 2 (p - 1) + (v - 1) p forwards of 1/v-sized chunks, + 1
    return min(m * v, 2 * (p - 1) + (v - 1) * p + 1) / v


def zero_shards(layout: Candidate) -> tuple[int, int, int]:
    """How many ways (params, grads, moments) are split over the ZeRO axes fsdp and data."""
    z, d, st = layout.fsdp, layout.data, layout.zero_stage
    return (z * (d if st >= 3 else 1), z * (d if st >= 2 else 1), z * (d if st >= 1 else 1))


def stage_params(s: Shape, layout: Candidate) -> tuple[float, float]:
    """(parameters of the worst pipeline stage on one device, those of its vocab tables)."""
    t, p = layout.model, layout.pipeline
    # jaxtp replicates the embedding, final norm and head over `pipeline` (Megatron-LM keeps the
    # embedding on the first stage and the head on the last): every stage holds both tables
    table = (1 if s.tied else 2) * s.padded_vocab(t) * s.d_model / t
    return s.layers / p * s.layer_params(t, layout.expert) + table + s.d_model, table


def memory(s: Shape, layout: Candidate, *, activations: str = "jaxtp") -> dict[str, float]:
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
    acts = layers * in_flight(layout, activations) * per_layer + loss_region_bytes(
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


def micro_batch_size(s: Shape, layout: Candidate) -> int:
    return s.batch // (layout.data * layout.fsdp * batch_expert(s, layout)
                       * layout.microbatches)


def batch_expert(s: Shape, layout: Candidate) -> int:
    """Expert ranks are data ranks for the dense part of an MoE model (GShard)."""
    return layout.expert if s.moe else 1
