"""Hugging Face interop: Llama-family checkpoints in, and out, on any layout.

Import maps a local HF model directory (``config.json``, ``*.safetensors`` with or without an
index) onto jaxtp's tree: q / k / v fused into ``w_qkv[embed, kv_heads, q_per_kv + 2, head_dim]``
grouped by KV head (HF's query head ``n`` uses KV head ``n // q_per_kv``, so KV head ``j``'s slot
holds query heads ``j q_per_kv ..``, its key and its value), gate / up into ``w_up[embed, 2, mlp]``,
``o_proj`` into ``wo[heads, head_dim, embed]``, torch's ``[out, in]`` matrices transposed, the
layers stacked, the vocab padded to the TP multiple (the padding is masked in the loss). Each
array is created with ``jax.make_array_from_callback``: a device's callback reads from the
memory-mapped safetensors only the rows of the layers it holds, one layer at a time, so no host
copy of the whole model is made. Export writes the inverse, tensor by tensor, into size-capped
safetensors shards with an index, and a ``config.json`` that ``transformers`` loads
(:mod:`jaxtp.hf.exporter`).

Architectures: ``llama`` (Llama 2; Llama 3 / 3.1 / 3.2 with ``llama3`` rope scaling and tied
embeddings), ``mistral``, ``qwen2`` (q / k / v biases), ``qwen3`` (per-head QK RMSNorm).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxtp.configs import Config, ConfigError, ModelConfig

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


# ---- config ------------------------------------------------------------------------------------

def read_config(path: str | Path) -> dict:
    """``<path>/config.json`` as a dict; a one-line error when it is missing or unreadable."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{file} not found: a Hugging Face model directory holds config.json "
                          f"and *.safetensors")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e})") from None


def _rope(hf: dict) -> dict:
    """jaxtp's rope fields from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` /
    ``rope_scaling`` (older)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "llama3":
        raise ConfigError(f"rope scaling type {kind!r} is not supported; jaxtp imports 'default' "
                          f"and 'llama3'")
    return {"rope_theta": float(theta), "rope_scaling": "llama3",
            "rope_scaling_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_len": int(params["original_max_position_embeddings"])}


def model_config(hf: dict) -> ModelConfig:
    """The jaxtp model of an HF ``config.json``; anything jaxtp cannot run is a ConfigError."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ConfigError(f"model_type={kind!r} is not supported; jaxtp imports "
                          f"{', '.join(SUPPORTED)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r}: jaxtp's Llama-family MLP is SwiGLU "
                          f"(silu)")
    if hf.get("mlp_bias") or (kind == "llama" and hf.get("attention_bias")):
        raise ConfigError("attention_bias / mlp_bias on a llama model are not supported")
    heads = hf["num_attention_heads"]
    max_len = hf.get("max_position_embeddings", 4096)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window:  # attention is full up to the window: run sequences no longer than it
        max_len = min(max_len, window)
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"], max_seq_len=max_len,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings")),
        activation="swiglu", qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3", **_rope(hf))


def hf_config(m: ModelConfig) -> dict:
    """The ``config.json`` ``transformers`` loads for a jaxtp model (inverse of
    :func:`model_config`)."""
    kind = "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"
    rope = {"rope_theta": m.rope_theta, "rope_type": "default"}
    if m.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=m.rope_scaling_factor,
                    low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_len)
    return {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
            "vocab_size": m.vocab_size, "hidden_size": m.d_model,
            "intermediate_size": m.d_ff, "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.resolved_head_dim, "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps, "hidden_act": "silu", "torch_dtype": m.param_dtype,
            "tie_word_embeddings": m.tie_embeddings, "attention_bias": m.qkv_bias,
            "rope_theta": m.rope_theta, "rope_parameters": rope,
            **({"rope_scaling": rope} if m.rope_scaling != "none" else {})}


# ---- the name and layout map -------------------------------------------------------------------

def layer_name(i: int, name: str) -> str:
    """HF's name of tensor ``name`` of decoder layer ``i``."""
    return f"model.layers.{i}.{name}"


def _per_layer(m: ModelConfig) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """jaxtp block parameter -> (its HF tensor names per layer, ``(*hf tensors) -> one layer``)."""
    g, hd, kv = m.n_heads // m.n_kv_heads, m.resolved_head_dim, m.n_kv_heads

    def qkv(q, k, v):  # [N*hd, D], [K*hd, D] x 2 -> [D, K, g+2, hd]
        d = q.shape[1]
        parts = [q.reshape(kv, g, hd, d), k.reshape(kv, 1, hd, d), v.reshape(kv, 1, hd, d)]
        return np.concatenate(parts, axis=1).transpose(3, 0, 1, 2)

    def bias(q, k, v):  # [N*hd], [K*hd] x 2 -> [K, g+2, hd]
        return np.concatenate([q.reshape(kv, g, hd), k.reshape(kv, 1, hd),
                               v.reshape(kv, 1, hd)], axis=1)

    attn = "self_attn."
    table = {
        "attn_norm.scale": (("input_layernorm.weight",), lambda w: w),
        "mlp_norm.scale": (("post_attention_layernorm.weight",), lambda w: w),
        "attn.w_qkv": (tuple(attn + f"{p}_proj.weight" for p in "qkv"), qkv),
        "attn.wo": ((attn + "o_proj.weight",), lambda w: w.T.reshape(m.n_heads, hd, -1)),
        "mlp.w_up": (("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                     lambda gate, up: np.stack([gate.T, up.T], axis=1)),
        "mlp.w_down": (("mlp.down_proj.weight",), lambda w: w.T),
    }
    if m.qkv_bias:
        table["attn.b_qkv"] = (tuple(attn + f"{p}_proj.bias" for p in "qkv"), bias)
    if m.qk_norm:
        table["attn.q_norm"] = ((attn + "q_norm.weight",), lambda w: w)
        table["attn.k_norm"] = ((attn + "k_norm.weight",), lambda w: w)
    return table


_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": "bfloat16"}


class _Tensors:
    """The safetensors files of an HF directory, by tensor name. Reads are positional
    (``np.fromfile`` at the tensor's offset, only the rows asked for), not memory-mapped: the
    pages of a mapped file count in the process's resident memory, and a whole-model import
    would hold the checkpoint twice (measured on a 1.1B model: 15.4 GiB peak RSS mapped, see
    benchmarks/hf_load.py)."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"no *.safetensors in {path}: jaxtp imports safetensors checkpoints "
                              f"(convert .bin files with transformers' save_pretrained)")
        self.where: dict[str, tuple[Path, int, dict]] = {}
        for name in files:
            file = path / name
            if not file.is_file():
                raise ConfigError(f"{file} is listed in the index but missing")
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            self.where.update({k: (file, 8 + n, v) for k, v in header.items()})

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[2]["shape"])

    def get(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """Rows ``rows`` of tensor ``name`` (all of it by default), as fp32."""
        file, base, entry = self._entry(name)
        shape = entry["shape"]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ConfigError(f"tensor {name} has dtype {entry['dtype']}; jaxtp reads "
                              f"{', '.join(_DTYPES)}")
        if dtype == "bfloat16":
            import ml_dtypes
            dtype = ml_dtypes.bfloat16
        start, stop, _ = rows.indices(shape[0]) if shape else (0, 1, 1)
        per_row = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        itemsize = np.dtype(dtype).itemsize
        offset = base + entry["data_offsets"][0] + start * per_row * itemsize
        count = max(stop - start, 0) * per_row
        data = np.fromfile(file, dtype=dtype, count=count, offset=offset)
        return data.reshape((max(stop - start, 0), *shape[1:]) if shape else ()).astype(
            np.float32, copy=False)

    def _entry(self, name: str):
        if name not in self.where:
            raise ConfigError(f"the checkpoint has no tensor {name!r}; its config.json and its "
                              f"weights do not match")
        return self.where[name]


def check_tensors(t: _Tensors, m: ModelConfig) -> None:
    """Every tensor the config implies is there with the shape it implies (before anything is
    allocated); one line naming the tensor, both shapes and the fix otherwise."""
    hd, d = m.resolved_head_dim, m.d_model
    want = {"model.embed_tokens.weight": (m.vocab_size, d), "model.norm.weight": (d,)}
    if not m.tie_embeddings:
        want["lm_head.weight"] = (m.vocab_size, d)
    per = {"self_attn.q_proj.weight": (m.n_heads * hd, d),
           "self_attn.k_proj.weight": (m.n_kv_heads * hd, d),
           "self_attn.v_proj.weight": (m.n_kv_heads * hd, d),
           "self_attn.o_proj.weight": (d, m.n_heads * hd),
           "mlp.gate_proj.weight": (m.d_ff, d), "mlp.up_proj.weight": (m.d_ff, d),
           "mlp.down_proj.weight": (d, m.d_ff), "input_layernorm.weight": (d,),
           "post_attention_layernorm.weight": (d,)}
    if m.qkv_bias:
        per |= {"self_attn.q_proj.bias": (m.n_heads * hd,),
                "self_attn.k_proj.bias": (m.n_kv_heads * hd,),
                "self_attn.v_proj.bias": (m.n_kv_heads * hd,)}
    if m.qk_norm:
        per |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    want |= {layer_name(i, k): v for i in range(m.n_layers) for k, v in per.items()}
    for name, shape in want.items():
        have = t.shape(name)
        if have != shape:
            raise ConfigError(f"tensor {name} has shape {have} but config.json implies {shape}; "
                              f"the checkpoint and its config.json do not match")


def _reader(key: str, m: ModelConfig, t: _Tensors, padded_vocab: int) -> Callable:
    """``index -> np.ndarray``: the block of jaxtp parameter ``key`` at ``index`` (a tuple of
    slices), read from the checkpoint without building the whole parameter."""
    if key == "embed.table":
        return lambda index, dtype: _vocab_rows(t, "model.embed_tokens.weight", index[0], m)[
            :, index[1]].astype(dtype, copy=False)
    if key == "head.w":
        return lambda index, dtype: np.ascontiguousarray(
            _vocab_rows(t, "lm_head.weight", index[1], m)[:, index[0]].T, dtype)
    if key == "final_norm.scale":
        return lambda index, dtype: t.get("model.norm.weight")[index].astype(dtype, copy=False)
    names, build = _per_layer(m)[key.removeprefix("blocks.")]
    cache: dict[int, np.ndarray] = {}

    def layer(i: int) -> np.ndarray:  # one layer in jaxtp's layout, built once per parameter
        if i not in cache:
            cache.clear()
            cache[i] = build(*(t.get(layer_name(i, n)) for n in names))
        return cache[i]

    def read(index, dtype):  # filled layer by layer: one copy of the block, no stack
        rows = range(m.n_layers)[index[0]]
        first = layer(rows[0])[index[1:]]
        out = np.empty((len(rows), *first.shape), dtype)
        for j, i in enumerate(rows):
            out[j] = layer(i)[index[1:]]
        return out
    return read


def _vocab_rows(t: _Tensors, name: str, rows: slice, m: ModelConfig) -> np.ndarray:
    """Rows ``rows`` of a ``[vocab, D]`` tensor padded with zero rows past ``vocab_size``."""
    start, stop, _ = rows.indices(10**12)
    real = t.get(name, slice(min(start, m.vocab_size), min(stop, m.vocab_size)))
    return np.concatenate([real, np.zeros((stop - start - len(real), real.shape[1]),
                                          np.float32)])


def param_key(path) -> str:
    """A jaxtp parameter's dotted key (``blocks.attn.w_qkv``) from its tree path."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def load_params(path: str | Path, layout) -> nnx.State:
    """The parameters of the HF checkpoint at ``path`` in ``layout``'s shardings (a
    :class:`jaxtp.step.layout.Layout` of the model :func:`model_config` describes)."""
    t = _Tensors(Path(path))
    m = layout.cfg.model
    check_tensors(t, m)
    if layout.cfg.parallel.virtual_stages > 1:
        raise ConfigError("importing onto an interleaved pipeline (virtual_stages > 1) is not "
                          "supported yet; import, save, and load the run on that layout")

    def one(keypath, var):
        sds = var.get_value()
        read = _reader(param_key(keypath), m, t, layout.padded_vocab)
        # one device's block on the host at a time, moved to its device before the next is read
        # (make_array_from_callback would hold every local block of the parameter at once)
        index_of = sds.sharding.addressable_devices_indices_map(sds.shape)
        blocks = [jax.device_put(read(_full(index, sds.shape), sds.dtype), device)
                  for device, index in index_of.items()]
        return var.replace(jax.make_array_from_single_device_arrays(sds.shape, sds.sharding,
                                                                    blocks))
    return jax.tree_util.tree_map_with_path(one, layout.abstract_params_sharded(),
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def _full(index, shape) -> tuple[slice, ...]:
    """``index`` with ``slice(None)`` made explicit for every dim."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def config_from_hf(path: str | Path, base: Config | None = None) -> Config:
    """A jaxtp config for the HF model at ``path``: its model, ``base``'s (default) parallel,
    train and data settings, the train sequence no longer than the model's, and the directory's
    ``tokenizer.json`` as the data tokenizer when there is one."""
    base = base or Config()
    m = model_config(read_config(path))
    train = dataclasses.replace(base.train, seq_len=min(base.train.seq_len, m.max_seq_len))
    data = base.data
    tok = Path(path) / "tokenizer.json"
    if tok.is_file():
        data = dataclasses.replace(data, tokenizer="bpe", tokenizer_path=str(tok.absolute()))
    return dataclasses.replace(base, model=m, train=train, data=data)
