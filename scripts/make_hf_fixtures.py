"""Make the Hugging Face golden fixtures: tiny random Llama-family checkpoints and their logits.

    python scripts/make_hf_fixtures.py        # needs torch + transformers (NOT jaxtp deps)

For each architecture jaxtp imports, a 2-layer width-64 model with grouped-query attention and a
vocabulary not divisible by any tensor-parallel multiple is built with ``transformers``, its
weights are drawn at realistic scales (with HF's default init every logit is nearly equal, so a
wrong mapping would barely move them), and ``tests/fixtures/hf/<name>/`` receives what
``save_pretrained`` writes (``config.json``, safetensors, an index when sharded) plus
``golden.npz``: a fixed token batch and transformers' fp32 logits on it. CI reads these files;
it never needs torch.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, hidden_act="silu")
ARCHS = {
    # Llama 2 style: untied, plain RoPE
    "llama": ("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    # Llama 3.1 / 3.2 style: llama3 rope scaling, tied embeddings
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, tie_word_embeddings=True,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(rope_theta=10000.0, tie_word_embeddings=False,
                                      sliding_window=None)),
    # Qwen2 / 2.5: biases on q, k, v; sharded safetensors with an index
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    # Qwen3: RMSNorm of each q / k head, an explicit head_dim
    "qwen3": ("Qwen3Config", dict(rope_theta=1000000.0, tie_word_embeddings=False,
                                  head_dim=32)),
}
SHARDED = {"qwen2": "150KB"}
WITH_TOKENIZER = "llama"  # its directory also gets a tokenizer.json of the model's vocab size


def tokenizer_(out: Path, vocab: int) -> None:
    """A BPE tokenizer of ``vocab`` tokens trained on a few lines of text (tokenizers library)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = [f"the quick brown fox {i} jumps over the lazy dog; def f(x): return x + {i}"
            for i in range(200)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab,
                                                      special_tokens=["<unk>", "<eos>"]))
    assert tok.get_vocab_size() <= vocab
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}) + "\n")


def realistic_(model: torch.nn.Module, seed: int) -> None:
    """Weights of O(1) activations: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.2),
    biases ~ N(0, 0.1), the embedding ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def main() -> None:
    torch.manual_seed(0)
    for i, (name, (cls, extra)) in enumerate(ARCHS.items()):
        cfg = getattr(transformers, cls)(**COMMON, **extra)
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        model.eval()
        realistic_(model, seed=100 + i)
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, safe_serialization=True,
                              max_shard_size=SHARDED.get(name, "10GB"))
        tokens = np.random.default_rng(i).integers(0, COMMON["vocab_size"], (2, 24))
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens)).logits.float().numpy()
        np.savez(out / "golden.npz", tokens=tokens.astype(np.int32), logits=logits)
        if name == WITH_TOKENIZER:
            tokenizer_(out, COMMON["vocab_size"])
        files = sorted(p.name for p in out.iterdir())
        print(f"{name}: {files}, logits std {logits.std():.3f}")
    (OUT / "VERSIONS.json").write_text(json.dumps(
        {"torch": torch.__version__, "transformers": transformers.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
