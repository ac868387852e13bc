"""The planner: every valid parallel layout for a model on N devices, costed and ranked.

A *layout* is one point of the space DESIGN.md's mesh spans: degrees over ``pipeline, data, fsdp,
context, expert, model`` whose product is N, a ZeRO stage, a recompute policy, sequence
parallelism, a pipeline schedule (GPipe, 1F1B, interleaved 1F1B with v virtual stages) and a number
of micro-batches. :mod:`jaxtp.planner.cost_model` predicts each one's per-device memory and step time; the
layouts that fit in memory are ranked by step time (a branch and bound over degree groups, ordered
by a lower bound on step time). ``--verify K`` compiles the best K that this version of the engine
runs on simulated CPU devices and sets predicted beside compiled bytes and census. The command
line and its report are :mod:`jaxtp.cli.plan`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

from jaxtp.configs import AXES, BATCH_AXES, Config, ConfigError
from jaxtp.parallel import validate
from jaxtp.pipeline import stores_residuals
from jaxtp.planner.cost_model import REMATS, SCHEDULES, Candidate, Estimate, Shape
from jaxtp.planner.hardware import Hardware
from jaxtp.planner.memory_model import (
    batch_expert,
    effective_remat,
    memory,
    micro_batch_size,
    program,
    stage_params,
    zero_shards,
)
from jaxtp.planner.time_model import gradient_sync, link, step_time

# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose; ``fixed`` pins Candidate fields (e.g. ``(("model", 8),)``)."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    remats: tuple[str, ...] = REMATS
    schedules: tuple[str, ...] = SCHEDULES
    sequence_parallel: tuple[bool, ...] = (False, True)
    context: bool = True
    fsdp: bool = True
    fixed: tuple[tuple[str, object], ...] = ()


def divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


def _pinned(space: SearchSpace, name: str, value) -> bool:
    return all(v == value for k, v in space.fixed if k == name)


def _degree_tuples(s: Shape, n: int, space: SearchSpace):
    ok = lambda name, v: _pinned(space, name, v)  # noqa: E731
    for t in divisors(n):
        if s.heads % t or s.kv_heads % t or s.d_ff % t or not ok("model", t):
            continue
        for p in divisors(n // t):
            if s.layers % p or not ok("pipeline", p):
                continue
            for c in divisors(n // (t * p)) if space.context else [1]:
                if (c > 1 and s.seq % (2 * c)) or not ok("context", c):
                    continue
                for ep in divisors(n // (t * p * c)) if s.moe else [1]:
                    if (ep > 1 and s.n_experts % ep) or not ok("expert", ep):
                        continue
                    rest = n // (t * p * c * ep)
                    for z in divisors(rest) if space.fsdp else [1]:
                        d = rest // z
                        if ok("fsdp", z) and ok("data", d) and s.batch % (rest * (ep if s.moe
                                                                                   else 1)) == 0:
                            yield dict(pipeline=p, data=d, fsdp=z, context=c, expert=ep, model=t)


def _schedules(s: Shape, deg: dict, local_batch: int, space: SearchSpace,
               activations: str = "jaxtp"):
    """(schedule, virtual stages, micro-batches): micro-batch sizes that are powers of two (or the
    whole local batch), every schedule the space allows."""
    p = deg["pipeline"]
    ms = [local_batch // b for b in divisors(local_batch)
          if b & (b - 1) == 0 or b == local_batch]
    for m in sorted(set(ms)):
        if not _pinned(space, "microbatches", m):
            continue
        if p == 1:
            yield "1f1b", 1, m  # no pipeline: the schedule is moot
            continue
        for name in space.schedules:
            # Megatron's runtime: GPipe holds m micro-batches to 1F1B's min(m, p) for the same
            # bubble, only worth listing where 1F1B cannot run (m < p) or is not allowed. In
            # jaxtp's runtime 1F1B holds 2p - 2 micro-batches to GPipe's m: both are candidates.
            gpipe = name == "gpipe" and (m < p or "1f1b" not in space.schedules
                                         or activations == "jaxtp")
            if gpipe or (name == "1f1b" and m >= p):
                yield name, 1, m
            elif name == "zb1" and m >= p and activations == "jaxtp":
                yield name, 1, m  # a runtime of jaxtp's (Megatron's prices its own passes)
            elif name == "interleaved" and m >= p and m % p == 0:
                for v in divisors(s.layers // p)[1:]:
                    yield name, v, m


def _lower_bound(s: Shape, base: Candidate, local: int, hw: Hardware, activations: str) -> float:
    """A step time no layout of these degrees and stage beats, whatever its schedule,
    micro-batches and recompute: every component of :func:`step_time` is smallest at one
    micro-batch without recompute, except the bubble and the p2p, bounded by their values at
    micro-batches of one sequence and the most virtual stages."""
    sp = base.model > 1 and s.seq // base.context % base.model == 0  # SP: less HBM traffic
    one = step_time(s, dataclasses.replace(base, sequence_parallel=sp), hw,
                    activations=activations)  # m = 1, no recompute
    p = base.pipeline
    if p == 1:
        return one["total"]
    v_max = divisors(s.layers // p)[-1] if "interleaved" in SCHEDULES else 1
    ln = link(base, ("pipeline",), hw)
    seq_bytes = s.seq // base.context * s.d_model * s.compute_bytes / base.model
    return (one["total"] - one["bubble"] - one["p2p"] + (p - 1) / (v_max * local) * one["compute"]
            + 2 * (p - 1) * ln.latency + 2 * local * seq_bytes / ln.bandwidth)


def plan(cfg: Config, n_devices: int, hw: Hardware, *, space: SearchSpace = SearchSpace(),
         activations: str = "jaxtp", top: int | None = None) -> tuple[list[Estimate], dict]:
    """The ``top`` fastest valid layouts that fit ``hw``'s usable HBM (all when ``top`` is None),
    fastest first, and search statistics.

    For each degree tuple, stage, schedule and micro-batch count only the fastest memory-saving
    variant that fits is kept: no recompute before selective before full, and sequence
    parallelism wherever it is valid (it moves the same bytes as TP's all-reduces and saves
    memory and elementwise work) unless pinned off.
    Degree tuples are visited in order of a lower bound on their step time; with ``top`` set, the
    search stops when the bound passes the ``top``-th best time found (branch and bound: the same
    answer as the exhaustive search, faster).
    """
    s = Shape.of(cfg)
    limit = hw.usable_hbm_bytes
    remats = [r for r in REMATS if r in space.remats and _pinned(space, "remat", r)]
    sps = [x for x in (True, False) if x in space.sequence_parallel
           and _pinned(space, "sequence_parallel", x)]
    groups = []
    for deg in _degree_tuples(s, n_devices, space):
        local = s.batch // (deg["data"] * deg["fsdp"] * (deg["expert"] if s.moe else 1))
        for stage in space.zero_stages:
            if not _pinned(space, "zero_stage", stage) or (deg["data"] == 1 and stage > 0):
                continue  # stages act on `data` only
            if deg["fsdp"] > 1 and (deg["data"] == 1 or stage == 3):
                continue  # the same shards as data = data x fsdp at stage 3: listed once, so
            base = Candidate(**deg, zero_stage=stage)
            n_p, _, n_m = zero_shards(base)
            psi, _ = stage_params(s, base)
            if s.param_bytes * psi * 2 / n_p + 8 * psi / n_m > limit:
                continue  # the state alone does not fit
            groups.append((_lower_bound(s, base, local, hw, activations), base, local))
    groups.sort(key=lambda g: g[0])
    found, best, costed, kth = [], [], 0, math.inf
    for bound, base, local in groups:
        if top and bound >= kth:
            break
        deg = base.degrees()
        done = False  # without a pipeline, more micro-batches only add latency: the smallest
        # count at which no recompute fits is the fastest of them
        for name, v, m in _schedules(s, deg, local, space, activations):
            if done:
                break
            if not (_pinned(space, "pipeline_schedule", name)
                    and _pinned(space, "virtual_stages", v)):
                continue
            for remat in remats:
                fits = None
                for sp in sps:
                    if sp and (base.model == 1 or s.seq // base.context % base.model):
                        continue
                    lo = Candidate(**deg, zero_stage=base.zero_stage, remat=remat,
                                   sequence_parallel=sp, pipeline_schedule=name,
                                   virtual_stages=v, microbatches=m)
                    costed += 1
                    mem = memory(s, lo, activations=activations)
                    if mem["total"] <= limit:
                        fits = (lo, mem)
                        break
                if fits:
                    found.append(Estimate(
                        layout=fits[0], memory=fits[1],
                        time=step_time(s, fits[0], hw, activations=activations),
                        n_devices=n_devices, peak_flops=hw.peak_flops,
                        model_flops=s.model_flops()))
                    done = base.pipeline == 1 and remat == remats[0]
                    if top:  # keep the `top` best times: a max-heap of negatives
                        heapq.heappush(best, -found[-1].step_time_s)
                        if len(best) > top:
                            heapq.heappop(best)
                        if len(best) == top:
                            kth = -best[0]
                    break
    found.sort(key=lambda est: (est.step_time_s, est.memory_bytes))
    stats = {"groups": len(groups), "costed": costed, "fit": len(found)}
    found = found[:top] if top else found
    return [dataclasses.replace(est, supported=engine_support(cfg, est.layout))
            for est in found], stats


def engine_support(cfg: Config, layout: Candidate) -> str:
    """"" when this version of jaxtp's trainer accepts ``layout`` (:func:`jaxtp.parallel.validation.validate`,
    the trainer's own rules), else its reason."""
    par = dataclasses.replace(cfg.parallel, **{a: getattr(layout, a) for a in AXES},
                              zero_stage=layout.zero_stage, remat=layout.remat,
                              sequence_parallel=layout.sequence_parallel,
                              pipeline_schedule=layout.pipeline_schedule,
                              virtual_stages=layout.virtual_stages)
    train = dataclasses.replace(cfg.train, microbatches=layout.microbatches)
    try:
        validate(dataclasses.replace(cfg, parallel=par, train=train), layout.degrees())
    except ConfigError as e:
        return str(e)
    return ""


# ---------------------------------------------------------------------------------------------
# Checking predictions against compiled programs
# ---------------------------------------------------------------------------------------------

def predicted_grad_step(s: Shape, layout: Candidate, *, activations: str = "jaxtp") -> dict:
    """What the compiled loss-and-gradient step (``Engine.loss_and_grad``) should show: its
    arguments (parameters + the int32 token batch), outputs (gradients in the stage's sharding +
    the loss), the rest (full local gradients before the sync, activations, transients: XLA's
    temporaries), and the bytes per device per step of each (collective, mesh axes) in
    :mod:`jaxtp.inspect.hlo`'s convention (all-reduce: the buffer; all-gather: the result;
    reduce-scatter: the input). The optimizer state is not part of this step."""
    mem = memory(s, layout, activations=activations)
    n_p, n_g, _ = zero_shards(layout)
    psi, table = stage_params(s, layout)
    pb, e, m, t = s.param_bytes, s.compute_bytes, layout.microbatches, layout.model
    local = s.batch // (layout.data * layout.fsdp * batch_expert(s, layout))
    grads_out = pb * psi / n_g
    out = {"arguments": mem["params"] + 2 * 4 * local * s.seq, "outputs": grads_out + 4,
           "temporaries": mem["grads"] - grads_out + mem["activations"] + mem["transient"]}
    census: dict[tuple[str, tuple[str, ...]], float] = {}
    tokens = micro_batch_size(s, layout) * s.seq // layout.context
    if t > 1:
        per_layer = 4 + (2 if effective_remat(layout) == "full" else 0)
        census["all-reduce", ("model",)] = m * (s.layers * per_layer + 2) * tokens * s.d_model * e
    d_axes = tuple(a for a in BATCH_AXES if getattr(layout, a) > 1)
    for kind, axes, nbytes in gradient_sync(layout, pb * psi / n_p):
        census[kind, axes] = census.get((kind, axes), 0.0) + nbytes
    c = layout.context
    if c > 1:  # ring attention: K/V hops forward, K/V + fp32 dK/dV backward (+ recompute)
        kv = 2 * tokens * s.kv_heads * s.head_dim / t
        hops = (c - 1) * kv * e * (3 if effective_remat(layout) == "full" else 2) + c * kv * 4
        census["collective-permute", ("context",)] = m * s.layers * hops
    p = layout.pipeline
    if p > 1:  # the program's sends (each TP rank's 1/t slice), the table gradients once
        transfers = program(layout.pipeline_schedule, p, m, layout.virtual_stages,
                            stores_residuals(layout.pipeline_schedule, layout.remat)).transfers
        sliced = layout.sequence_parallel or tokens // micro_batch_size(s, layout) % t == 0
        census["collective-permute", ("pipeline",)] = (
            transfers * tokens * s.d_model * e / (t if sliced else 1))
        # stage 0's embedding gradient and the last stage's head (+ final norm) gradient are
        # summed over `pipeline` separately: a tied table twice
        census["all-reduce", ("pipeline",)] = pb * ((2 if s.tied else 1) * table + s.d_model)
    if n_p > 1:
        axes = d_axes if layout.zero_stage >= 3 else ("fsdp",)
        layer = pb * s.layer_params(t, layout.expert)
        census["all-gather", axes] = m * (2 * s.layers * layer + pb * table)
        census["reduce-scatter", axes] = census.get(("reduce-scatter", axes), 0.0) + m * (
            s.layers * layer + pb * table)
    out["collectives"] = census
    return out
