"""Configuration: frozen dataclasses, named presets, and dotted ``key=value`` overrides.

Config flows one way (STYLE.md): CLI ``--config NAME`` plus ``section.field=value`` overrides ->
these frozen dataclasses -> validated mesh -> sharding tables -> model -> jitted step. Presets are
plain Python functions returning a :class:`Config`, as torchtitan and Flax's Gemma configs do; the
field names are public interface and stay stable.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Callable, Literal

from jaxtp.configs.check_values import validate_model, validate_settings
from jaxtp.configs.errors import ConfigError

Mode = Literal["gspmd", "explicit"]
Activation = Literal["swiglu", "gelu"]
Remat = Literal["none", "full", "selective", "dots_saveable"]
DType = Literal["float32", "bfloat16", "float16"]
AttentionImpl = Literal["default", "xla", "cudnn"]
ContextLayout = Literal["zigzag", "contiguous"]
RopeScaling = Literal["none", "llama3"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved", "zb1"]

# the names each of these fields accepts, for the code that branches on them
CONTEXT_LAYOUTS: tuple[str, ...] = typing.get_args(ContextLayout)
PIPELINE_SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)




@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only Transformer shape (GPT / Llama style: RMSNorm, RoPE, GQA, SwiGLU or GELU)."""

    vocab_size: int = 256  # token ids; a trained BPE tokenizer gets this size
    d_model: int = 64  # hidden size h
    n_layers: int = 2  # Transformer blocks, run as one lax.scan
    n_heads: int = 4  # query heads (split over `model`)
    n_kv_heads: int = 4  # key / value heads (GQA when < n_heads)
    d_ff: int = 256  # MLP hidden size
    max_seq_len: int = 128  # longest sequence: RoPE table, eval window, decode cache
    head_dim: int = 0  # 0 = d_model // n_heads
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    # RoPE frequency scaling: "none", or "llama3" (Llama 3.1's piecewise rescaling of the low
    # frequencies by rope_scaling_factor between the low / high frequency factors, relative to
    # rope_original_max_len)
    rope_scaling: RopeScaling = "none"
    rope_scaling_factor: float = 8.0  # llama3 scaling only, as the next three
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    qkv_bias: bool = False  # biases on the Q / K / V projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
    tie_embeddings: bool = False  # the output head reuses the embedding table
    activation: Activation = "swiglu"  # MLP: SwiGLU (gate and up) or GELU
    # The embedding rows are padded to a multiple of vocab_pad_multiple x (tensor-parallel degree),
    # as Megatron-LM does; padded logits are masked, so padding never changes the loss.
    vocab_pad_multiple: int = 128
    init_std: float = 0.02  # std of the normal initialiser
    param_dtype: DType = "float32"  # dtype the parameters are stored in
    compute_dtype: DType = "float32"  # dtype of matmuls and activations
    # jax.nn.dot_product_attention's implementation: "default" lets JAX choose (XLA's softmax(QK^T)V
    # today), "cudnn" is cuDNN's fused flash attention (NVIDIA GPUs only).
    attention_impl: AttentionImpl = "default"
    # Mixture of experts (GShard / Switch; jaxtp.layers.moe): 0 = dense. With n_experts > 0 every
    # `moe_every`-th layer (the last of each group of moe_every) routes each token to `top_k` of
    # `n_experts` expert MLPs, each taking at most ceil(top_k x tokens x capacity_factor /
    # n_experts) tokens of a batch row (0 = dropless); the router's losses are added to the loss.
    n_experts: int = 0
    top_k: int = 1  # experts per token
    capacity_factor: float = 1.25  # 0 = dropless
    moe_every: int = 1  # an MoE layer every this many layers
    router_aux_loss_coef: float = 0.01  # Switch load-balancing loss
    router_z_loss_coef: float = 0.0  # router z-loss

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        multiple = self.vocab_pad_multiple * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    @property
    def n_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (every ``moe_every``-th; 0 when dense)."""
        return self.n_layers // self.moe_every if self.n_experts > 0 and self.moe_every > 0 else 0

    def param_count(self, *, active: bool = False) -> int:
        """Parameters of the unpadded model (embedding counted once when tied). ``active``: those
        one token uses -- of an MoE layer, the router and ``top_k`` experts (the FLOP count)."""
        d, f, hd = self.d_model, self.d_ff, self.resolved_head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = (3 if self.activation == "swiglu" else 2) * d * f
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        experts = (self.top_k if active else self.n_experts) - 1  # beyond the dense MLP
        moe = self.n_moe_layers * (experts * mlp + d * self.n_experts)
        return self.n_layers * per_layer + moe + emb + d


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees over the mesh axes (one may be -1: inferred) and how the step is run."""

    pipeline: int = 1  # pipeline stages (axis `pipeline`)
    data: int = -1  # data-parallel replicas (axis `data`)
    fsdp: int = 1  # FSDP group: ZeRO-3 over `fsdp`
    context: int = 1  # ring attention over `context`
    expert: int = 1  # MoE experts split over `expert`
    model: int = 1  # tensor parallelism (Megatron TP)
    # How many of each outer axis' degree spans hosts (DCN); the rest stays inside a host (ICI).
    dcn_pipeline: int = 1
    dcn_data: int = 1  # of `data`
    dcn_fsdp: int = 1  # of `fsdp`
    mode: Mode = "gspmd"  # gspmd: XLA places collectives; explicit: f / g in shard_map
    # Megatron sequence parallelism on the `model` axis: norms and residuals split along the sequence
    sequence_parallel: bool = False
    # How the sequence is laid out over `context` for ring attention: "zigzag" balances the causal
    # work (device i holds chunks i and 2cp-1-i), "contiguous" does not (device i holds chunk i).
    context_layout: ContextLayout = "zigzag"
    zero_stage: int = 0  # ZeRO over data / fsdp: 0-3
    remat: Remat = "none"  # what the backward recomputes
    # Pipeline parallelism over `pipeline` (train.microbatches micro-batches per step): the order
    # of passes (jaxtp/pipeline/schedules.py; "zb1": ZB-H1, backward split into input and weight gradient
    # passes), and for "interleaved" the number of model chunks (virtual stages) per rank.
    pipeline_schedule: PipelineSchedule = "1f1b"
    virtual_stages: int = 1  # model chunks per rank (interleaved)


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 8  # global, in sequences
    seq_len: int = 64  # tokens per row
    seed: int = 0  # parameter init and data order
    steps: int = 200  # total; a resume trains up to it
    microbatches: int = 1  # per step: accumulation / pipeline
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decay ends at lr x this
    warmup_steps: int = 20  # linear warmup from 0
    weight_decay: float = 0.1  # AdamW's, not on norms / biases
    grad_clip: float = 1.0  # global gradient-norm clip
    checkpoint_every: int = 100  # 0 = only at the end
    keep_checkpoints: int = 3  # newest kept
    log_every: int = 10  # steps per metrics record
    eval_every: int = 50  # held-out eval at these log steps
    eval_batches: int = 4  # held-out batches per eval
    prefetch: int = 1  # batches read and placed ahead on a background thread (0 = inline)
    checkpoint_overlap: Literal["auto", "on", "off"] = "auto"  # save beside next step (loop.py)
    out_dir: str = "runs/default"  # a preset's runs: runs/<preset> (get_preset)
    # Operations (run_guard.py, events.py): a step with no progress for this long stops the run
    # (a stuck peer must not hang a job); TensorBoard events; "START:END" jax.profiler traces.
    step_timeout_s: float = 1800.0
    tensorboard: bool = True  # scalars in <out_dir>/tensorboard
    profile_steps: str = ""  # e.g. 10:15 -> <out_dir>/profile


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # "" = the embedded default corpus (the Python standard library's sources)
    tokenizer: Literal["byte", "bpe"] = "byte"  # byte: 256 ids; bpe: see tokenizer_path
    # For "bpe": a HuggingFace tokenizer.json to load; "" = train a byte-level BPE of
    # model.vocab_size tokens on the corpus itself (cached beside the run in train.out_dir).
    tokenizer_path: str = ""
    eval_fraction: float = 0.02  # held out
    packing: bool = True  # documents stay apart (segment ids); false: one continuous stream
    mixture: str = ""  # weighted sources instead of data.path: "a.jsonl:0.7,b.parquet:0.3"
    text_field: str = "text"  # the field / column holding the text in JSONL, Parquet, ArrayRecord
    eos_id: int = -1  # end-of-document token; -1 = the tokenizer's (byte 0, or BPE <|endoftext|>)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------

PRESETS: dict[str, Callable[[], Config]] = {}


def preset(name: str):
    def register(fn: Callable[[], Config]) -> Callable[[], Config]:
        PRESETS[name] = fn
        return fn

    return register


@preset("tiny")
def tiny() -> Config:
    """Byte-level model that trains on a CPU in seconds; the default of ``jaxtp train``."""
    return Config(
        model=ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8,
                          d_ff=256, max_seq_len=128),
        train=TrainConfig(batch_size=8, seq_len=64, steps=500, eval_every=100),
    )


@preset("tiny-moe")
def tiny_moe() -> Config:
    """The tiny model with every MLP a mixture of 8 experts, top-2 (GShard's routing); run it
    expert-parallel with e.g. ``parallel.expert=4 parallel.data=2``."""
    base = tiny()
    return dataclasses.replace(base, model=dataclasses.replace(
        base.model, n_experts=8, top_k=2, capacity_factor=1.25, moe_every=1))


@preset("gpt2-small")
def gpt2_small() -> Config:
    """GPT-2 124M shapes (Radford et al. 2019), tied embeddings, GELU MLP."""
    return Config(
        model=ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                          d_ff=3072, max_seq_len=1024, tie_embeddings=True, activation="gelu"),
        train=TrainConfig(batch_size=8, seq_len=1024, lr=6e-4, warmup_steps=100),
    )


@preset("gpt3-1.3b")
def gpt3_1_3b() -> Config:
    """GPT-3 XL (Brown et al. 2020, Table 2.1): 24 layers, d=2048, 16 heads."""
    return Config(
        model=ModelConfig(vocab_size=50257, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=16,
                          d_ff=8192, max_seq_len=2048, tie_embeddings=True, activation="gelu",
                          compute_dtype="bfloat16"),
        train=TrainConfig(batch_size=16, seq_len=2048, lr=2e-4, warmup_steps=100),
    )


@preset("llama2-7b")
def llama2_7b() -> Config:
    """Llama 2 7B (Touvron et al. 2023): 32 layers, d=4096, SwiGLU d_ff=11008, untied."""
    return Config(
        model=ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                          d_ff=11008, max_seq_len=4096, activation="swiglu",
                          compute_dtype="bfloat16"),
        train=TrainConfig(batch_size=16, seq_len=4096, lr=3e-4, warmup_steps=100),
    )


@preset("gpt3-175b")
def gpt3_175b() -> Config:
    """GPT-3 175B (Brown et al. 2020): 96 layers, d=12288, 96 heads."""
    return Config(
        model=ModelConfig(vocab_size=50257, d_model=12288, n_layers=96, n_heads=96, n_kv_heads=96,
                          d_ff=49152, max_seq_len=2048, tie_embeddings=True, activation="gelu",
                          compute_dtype="bfloat16"),
        train=TrainConfig(batch_size=1536, seq_len=2048, lr=6e-5, warmup_steps=100),
    )


# Narayanan et al. 2021 (arXiv 2104.04473), Table 1: GPT models of 1.7B to 1T parameters,
# name -> (attention heads, hidden size, layers, batch size). Vocabulary 51,200, sequence 2,048,
# d_ff = 4h, tied embeddings, GELU, bf16 compute (the paper: fp16 mixed precision).
NARAYANAN_TABLE1: dict[str, tuple[int, int, int, int]] = {
    "megatron-1.7b": (24, 2304, 24, 512),
    "megatron-3.6b": (32, 3072, 30, 512),
    "megatron-7.5b": (32, 4096, 36, 512),
    "megatron-18b": (48, 6144, 40, 1024),
    "megatron-39b": (64, 8192, 48, 1536),
    "megatron-76b": (80, 10240, 60, 1792),
    "megatron-145b": (96, 12288, 80, 2304),
    "megatron-310b": (128, 16384, 96, 2160),
    "megatron-530b": (128, 20480, 105, 2520),
    "megatron-1t": (160, 25600, 128, 3072),
}


def _narayanan(heads: int, hidden: int, layers: int, batch: int) -> Config:
    """A GPT model of Narayanan et al. 2021, Table 1 (jaxtp's architecture at those shapes)."""
    return Config(
        model=ModelConfig(vocab_size=51200, d_model=hidden, n_layers=layers, n_heads=heads,
                          n_kv_heads=heads, d_ff=4 * hidden, max_seq_len=2048,
                          tie_embeddings=True, activation="gelu", compute_dtype="bfloat16"),
        train=TrainConfig(batch_size=batch, seq_len=2048, lr=1.5e-4, warmup_steps=100),
    )


for _name, _shape in NARAYANAN_TABLE1.items():
    preset(_name)(lambda _shape=_shape: _narayanan(*_shape))


def get_preset(name: str) -> Config:
    """The preset ``name``; its runs go to ``runs/<name>`` (``train.out_dir``), so runs of
    different models do not share a directory."""
    if name not in PRESETS:
        raise ConfigError(f"unknown config {name!r}; presets are: {', '.join(sorted(PRESETS))}")
    cfg = PRESETS[name]()
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=f"runs/{name}"))


# ----------------------------------------------------------------------------------------------
# Overrides: "section.field=value"
# ----------------------------------------------------------------------------------------------

def valid_keys(cfg: Config) -> list[str]:
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(cfg)
            for f in dataclasses.fields(getattr(cfg, s.name))]


def _parse_value(key: str, text: str, hint) -> object:
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if text not in choices:
            raise ConfigError(f"{key}={text!r} is not valid; choose one of {list(choices)}")
        return text
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(hint):
            if arm is type(None):
                if text.lower() in ("none", "null"):
                    return None
                continue
            try:
                return _parse_value(key, text, arm)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if hint is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={text!r} is not a boolean; use true or false")
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r} is not an integer") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r} is not a number") from None
    if hint is str:
        return text
    raise ConfigError(f"{key}: unsupported field type {hint!r}")


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """Return ``cfg`` with each ``section.field=value`` applied; unknown keys list the valid ones."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value, "
                              f"e.g. parallel.model=4")
        key, text = item.split("=", 1)
        key = key.strip().lstrip("-")
        section, _, name = key.partition(".")
        sections = {f.name for f in dataclasses.fields(cfg)}
        if section not in sections or not name:
            raise ConfigError(f"unknown config key {key!r}; valid keys are: "
                              + ", ".join(valid_keys(cfg)))
        sub = getattr(cfg, section)
        hints = typing.get_type_hints(type(sub))
        if name not in hints:
            raise ConfigError(f"unknown config key {key!r}; valid keys in {section!r} are: "
                              + ", ".join(f"{section}.{f.name}" for f in dataclasses.fields(sub)))
        value = _parse_value(key, text.strip(), hints[name])
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(sub, **{name: value})})
    return cfg


def load(name: str = "tiny", overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The preset ``name`` with ``overrides`` applied, checked for model-level consistency and
    train / data value ranges (:func:`jaxtp.configs.check_values.validate_settings`)."""
    cfg = apply_overrides(get_preset(name), overrides)
    validate_model(cfg.model)
    validate_settings(cfg)
    return cfg


def configure(preset: str = "tiny", overrides=()) -> Config:
    """The preset with ``overrides`` applied: a mapping ``{"parallel.data": 2}`` or the CLI's
    ``["parallel.data=2"]``; checked as :func:`load` checks. ``jaxtp.config(...)`` calls this."""
    if isinstance(overrides, typing.Mapping):
        overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in overrides.items()]
    return load(preset, list(overrides))

