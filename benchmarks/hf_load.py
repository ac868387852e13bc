"""Peak host memory and time of importing / exporting a 1B-shape Llama checkpoint.

    python benchmarks/hf_load.py [--dir /tmp/llama-1b] [--dtype float32]

Writes (once) a random Llama checkpoint of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 /
4 heads, MLP 5632, vocab 32000) as fp32 safetensors shards, then in a fresh process on 8 simulated
CPU devices imports it onto data=2 x model=4 (``jaxtp.Model.from_hf``) and exports it again
(``save_hf``), and reports the process's peak RSS beside the issue's bound: 1.2 x (the bytes
this process's devices hold + the largest single tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
             rms_norm_eps=1e-5, hidden_act="silu", model_type="llama", rope_theta=10000.0,
             tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def make_checkpoint(path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    if (path / "model.safetensors.index.json").is_file():
        return
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    d, f, hd = SHAPE["hidden_size"], SHAPE["intermediate_size"], 64
    kv = SHAPE["num_key_value_heads"] * hd
    weight_map = {}

    def write(i, tensors):
        name = f"model-{i:05d}.safetensors"
        save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(path / name))
        weight_map.update({k: name for k in tensors})

    write(0, {"model.embed_tokens.weight": rng.standard_normal((32000, d), np.float32),
              "lm_head.weight": rng.standard_normal((32000, d), np.float32) / 45,
              "model.norm.weight": np.ones(d, np.float32)})
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        write(i + 1, {p + "self_attn.q_proj.weight": rng.standard_normal((d, d), np.float32) / 45,
                      p + "self_attn.k_proj.weight": rng.standard_normal((kv, d), np.float32) / 45,
                      p + "self_attn.v_proj.weight": rng.standard_normal((kv, d), np.float32) / 45,
                      p + "self_attn.o_proj.weight": rng.standard_normal((d, d), np.float32) / 45,
                      p + "mlp.gate_proj.weight": rng.standard_normal((f, d), np.float32) / 45,
                      p + "mlp.up_proj.weight": rng.standard_normal((f, d), np.float32) / 45,
                      p + "mlp.down_proj.weight": rng.standard_normal((d, f), np.float32) / 75,
                      p + "input_layernorm.weight": np.ones(d, np.float32),
                      p + "post_attention_layernorm.weight": np.ones(d, np.float32)})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(SHAPE))


CHILD = """
import os, resource, sys, time, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, jaxtp
src, out, dtype = sys.argv[1:4]
t0 = time.perf_counter()
m = jaxtp.Model.from_hf(src, {"parallel.data": 2, "parallel.model": 4,
                              "model.param_dtype": dtype})
jax.block_until_ready(m.params)
t_import = time.perf_counter() - t0
rss_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
held = sum(s.data.nbytes for a in jax.tree.leaves(m.params) for s in a.addressable_shards)
t0 = time.perf_counter()
m.save_hf(out)
t_export = time.perf_counter() - t0
print(json.dumps(dict(import_s=t_import, export_s=t_export, rss_after_import=rss_import,
                      rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      held=held, params=m.cfg.model.param_count())))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/jaxtp-llama-1b")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    src = Path(args.dir)
    t0 = time.perf_counter()
    make_checkpoint(src)
    print(f"checkpoint at {src} ({time.perf_counter() - t0:.0f} s)", flush=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(src), str(src) + "-export",
                           args.dtype], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = 32000 * 2048 * 4
    bound = 1.2 * (r["held"] + largest)
    gib = 2**30
    print(f"{r['params'] / 1e9:.2f}B params ({args.dtype}) onto data=2 x model=4, 8 CPU devices "
          f"in one process\n"
          f"  import {r['import_s']:.1f} s, export {r['export_s']:.1f} s\n"
          f"  peak RSS after import {r['rss_after_import'] / gib:.2f} GiB, after export "
          f"{r['rss_peak'] / gib:.2f} GiB\n"
          f"  bytes held by this process's devices {r['held'] / gib:.2f} GiB, largest tensor "
          f"{largest / gib:.2f} GiB: peak / (held + largest) = "
          f"{r['rss_after_import'] / (r['held'] + largest):.2f} (goal <= 1.2, i.e. <= "
          f"{bound / gib:.2f} GiB)")


if __name__ == "__main__":
    main()
