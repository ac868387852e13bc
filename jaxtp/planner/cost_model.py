"""The planner's cost model: per-device memory and step time of one parallel layout, analytically.

A *layout* is one point of the space DESIGN.md's mesh spans: degrees over ``pipeline, data, fsdp,
context, expert, model`` whose product is N, a ZeRO stage, a recompute policy, sequence
parallelism, a pipeline schedule (GPipe, 1F1B, interleaved 1F1B with v virtual stages) and a number
of micro-batches. For each, an analytic cost model predicts per-device memory and step time; the
layouts that fit in memory are ranked by step time. The model follows Narayanan et al. 2021
(PTD-P, arXiv 2104.04473: FLOPs eq. 3, bubble (p-1)/(v m), TP inside a node, scatter/gather p2p),
Korthikanti et al. 2022 (arXiv 2205.05198: activation memory per layer sbh(34 + 5as/h), TP / SP /
selective / full recompute) and ZeRO (arXiv 1910.02054: 16 Psi of state split by stage).

This module holds what the two halves read and what they produce: the :class:`Candidate` layout,
the model's :class:`Shape` (its parameters and FLOPs per layer) and the :class:`Estimate` of one
layout. The memory model is :mod:`jaxtp.planner.memory_model`, the time model
:mod:`jaxtp.planner.time_model`.

How well it predicts (tests/unit/planner/test_plan.py, on ``tiny`` compiled for 8 CPU devices): the compiled
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
from dataclasses import dataclass

from jaxtp.configs import AXES, PIPELINE_SCHEDULES, Config

# what the search weighs unless SearchSpace names others: every schedule but ZB-H1 (zb1)
SCHEDULES = tuple(s for s in PIPELINE_SCHEDULES if s != "zb1")
REMATS = ("none", "selective", "full")  # the recompute policies modelled, fastest first


@dataclass(frozen=True)
class Candidate:
    """One parallel layout the planner weighs (no mesh, no model: the choices only); field names
    are the config's ``parallel.*`` names (and ``microbatches`` from ``train``)."""

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


@dataclass(frozen=True)
class Estimate:
    layout: Candidate
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
