"""Export to Hugging Face: a jaxtp model as a directory ``transformers`` loads.

The inverse of :mod:`jaxtp.hf.importer`'s import: ``config.json`` (:func:`jaxtp.hf.importer.hf_config`), and the
parameters unfused into HF's names and ``[out, in]`` layouts, vocab padding stripped, fetched one
tensor (one layer of a stacked parameter) at a time and written into size-capped
``model-0000i-of-0000n.safetensors`` shards with their index; the tokenizer files travel along.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxtp.configs import Config, ModelConfig
from jaxtp.hf.importer import hf_config, layer_name, param_key


def _hf_tensors(params: nnx.State, m: ModelConfig):
    """``(HF name, np.ndarray)`` one tensor at a time, vocab padding stripped (each jaxtp
    parameter is fetched one layer at a time: no host copy of the whole model)."""
    flat = {param_key(k): v for k, v in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
    def fetch(a):  # one tensor to the host (gathered from every process when there are several)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            a = multihost_utils.process_allgather(a, tiled=True)
        return np.asarray(jax.device_get(a), np.float32)
    yield "model.embed_tokens.weight", fetch(flat["embed.table"][...][: m.vocab_size])
    if not m.tie_embeddings:
        yield "lm_head.weight", fetch(flat["head.w"][...][:, : m.vocab_size]).T
    yield "model.norm.weight", fetch(flat["final_norm.scale"][...])
    g, hd, kv = m.n_heads // m.n_kv_heads, m.resolved_head_dim, m.n_kv_heads
    for i in range(m.n_layers):
        def at(key):
            return fetch(flat["blocks." + key][...][i])
        yield layer_name(i, "input_layernorm.weight"), at("attn_norm.scale")
        yield layer_name(i, "post_attention_layernorm.weight"), at("mlp_norm.scale")
        qkv = at("attn.w_qkv").transpose(1, 2, 3, 0)                 # [K, g+2, hd, D]
        d = qkv.shape[-1]
        yield layer_name(i, "self_attn.q_proj.weight"), qkv[:, :g].reshape(kv * g * hd, d)
        yield layer_name(i, "self_attn.k_proj.weight"), qkv[:, g].reshape(kv * hd, d)
        yield layer_name(i, "self_attn.v_proj.weight"), qkv[:, g + 1].reshape(kv * hd, d)
        if m.qkv_bias:
            b = at("attn.b_qkv")
            yield layer_name(i, "self_attn.q_proj.bias"), b[:, :g].reshape(-1)
            yield layer_name(i, "self_attn.k_proj.bias"), b[:, g].reshape(-1)
            yield layer_name(i, "self_attn.v_proj.bias"), b[:, g + 1].reshape(-1)
        if m.qk_norm:
            yield layer_name(i, "self_attn.q_norm.weight"), at("attn.q_norm")
            yield layer_name(i, "self_attn.k_norm.weight"), at("attn.k_norm")
        yield layer_name(i, "self_attn.o_proj.weight"), at("attn.wo").reshape(m.n_heads * hd, -1).T
        up = at("mlp.w_up")                                          # [D, 2, F]
        yield layer_name(i, "mlp.gate_proj.weight"), np.ascontiguousarray(up[:, 0].T)
        yield layer_name(i, "mlp.up_proj.weight"), np.ascontiguousarray(up[:, 1].T)
        yield layer_name(i, "mlp.down_proj.weight"), at("mlp.w_down").T


def save_hf(params: nnx.State, m: ModelConfig, out: str | Path, *,
         max_shard_bytes: int = 2 * 2**30) -> Path:
    """Write ``config.json``, ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` and their index into ``out`` (process 0 writes; every process must
    call it, since fetching a sharded tensor is collective across processes)."""
    from safetensors.numpy import save_file

    out = Path(out)
    writer = jax.process_index() == 0
    shards, current, size = [], {}, 0
    for name, arr in _hf_tensors(params, m):
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(_flush(current, out, len(shards), save_file, writer))
            current, size = {}, 0
        current[name] = np.ascontiguousarray(arr)
        size += arr.nbytes
    shards.append(_flush(current, out, len(shards), save_file, writer))
    if writer:
        n = len(shards)
        weight_map = {}
        for i, names in enumerate(shards):
            final = out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (out / f"part-{i}.safetensors").rename(final)
            weight_map |= {k: final.name for k in names}
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": weight_map}, indent=1) + "\n")
        (out / "config.json").write_text(json.dumps(hf_config(m), indent=1) + "\n")
    return out


def _flush(tensors: dict, out: Path, i: int, save_file, writer: bool) -> list[str]:
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / f"part-{i}.safetensors"), metadata={"format": "pt"})
    return list(tensors)




TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def copy_tokenizer(src: str | Path | None, dst: str | Path) -> str | None:
    """Copy the tokenizer files of directory ``src`` into ``dst``; the path of the copied
    ``tokenizer.json`` (``None`` when ``src`` has none)."""
    import shutil

    if src is None or not (Path(src) / "tokenizer.json").is_file():
        return None
    Path(dst).mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, Path(dst) / name)
    return str((Path(dst) / "tokenizer.json").absolute())


def with_tokenizer(cfg: Config, tokenizer_json: str) -> Config:
    """``cfg`` tokenizing its data with the HF ``tokenizer_json``."""
    return dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, tokenizer="bpe", tokenizer_path=tokenizer_json))
