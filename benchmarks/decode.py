"""Decode speed: KV-cache decode (jaxtp.serve.decode) vs recomputing the whole forward every step.

For each shape and layout, after a warm-up (compile) call, on the same prompts and cache length:

- ``ttft``: time to first token, ``generate_fn`` with ``n_new=1`` (prefill + first sample);
- ``cached``: ``generate_fn`` with ``n_new=N`` (one compiled ``while_loop``); per-token latency is
  ``(t(N) - t(1)) / (N - 1)``, tokens/s is ``rows * N / t(N)``;
- ``recompute``: a jitted full forward over the fixed ``[rows, L]`` buffer per new token (greedy,
  one dispatch per token: the no-cache baseline), timed over ``--recompute-steps`` tokens and
  reported per token.

    python benchmarks/decode.py                          # tiny, model=1 and model=4; ~2 min
    python benchmarks/decode.py --shapes tiny gpt2-small --recompute-steps 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import force_cpu_devices, git_state

force_cpu_devices(8)

import jax
import jax.numpy as jnp
import numpy as np

import jaxtp
from jaxtp.serve import decode
from jaxtp.serve.sampling import SamplerArgs
from jaxtp.parallel.sharding import named

SHAPES = {"tiny": ("tiny", {}), "gpt2-small": ("gpt2-small", {})}


def _best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(shape: str, model_degree: int, *, rows: int, prompt: int, new: int, rounds: int,
            recompute_steps: int) -> dict:
    preset, extra = SHAPES[shape]
    length = 1 << (prompt + new - 1).bit_length()
    cfg = jaxtp.config(preset, {"parallel.data": 1, "parallel.model": model_degree,
                                "model.max_seq_len": length, **extra})
    model = jaxtp.Model(cfg, seed=0, devices=jax.devices()[:model_degree])
    lo, region = model.layout, model.engine.region
    prompts = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (rows, prompt),
                                                dtype=np.int32)
    row_sharding = named(lo.mesh, lo.activation_rules.spec(decode.ROW_NAMES))
    lengths = jax.device_put(np.full((rows,), prompt, np.int32), row_sharding)
    ids = jax.device_put(np.arange(rows, dtype=np.int32), row_sharding)
    tokens = jax.device_put(prompts, lo.batch_sharding)
    gen = decode.generate_fn(lo, region)
    stops = jnp.full((8,), -1, jnp.int32)

    def run(n):
        cache = decode.init_cache(lo, rows, length)
        return gen(model.params, cache, tokens, lengths, ids, jnp.int32(n),
                   jax.random.PRNGKey(0), SamplerArgs.make(), stops)

    run(1)  # compile (n_new is traced: one compile for every n)
    ttft = _best(lambda: run(1), rounds)
    total = _best(lambda: run(new), rounds)

    logits = jax.jit(model.engine.logits_fn())
    buf = np.zeros((rows, length), np.int32)
    buf[:, :prompt] = prompts
    buf = jax.device_put(buf, lo.batch_sharding)

    @jax.jit
    def pick(logits_out, pos):
        return jnp.argmax(logits_out[:, pos, : cfg.model.vocab_size], axis=-1).astype(jnp.int32)

    def recompute(seq):
        for i in range(recompute_steps):
            pos = prompt - 1 + i
            tok = pick(logits(model.params, {"inputs": seq, "targets": seq}), pos)
            seq = seq.at[:, pos + 1].set(tok)
        return seq

    jax.block_until_ready(recompute(buf))  # compile
    t_re = _best(lambda: recompute(buf), rounds) / recompute_steps
    per_token = (total - ttft) / (new - 1)
    return {"shape": shape, "model": model_degree, "rows": rows, "prompt": prompt, "new": new,
            "cache_len": length, "ttft_ms": ttft * 1e3, "cached_total_s": total,
            "cached_per_token_ms": per_token * 1e3, "cached_tokens_s": rows * new / total,
            "recompute_per_token_ms": t_re * 1e3, "recompute_tokens_s": rows / t_re,
            "speedup": t_re / per_token}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["tiny"], choices=sorted(SHAPES))
    p.add_argument("--models", nargs="+", type=int, default=[1, 4])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--recompute-steps", type=int, default=32)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args()
    rows = [measure(s, m, rows=a.rows, prompt=a.prompt, new=a.new, rounds=a.rounds,
                    recompute_steps=a.recompute_steps) for s in a.shapes for m in a.models]
    print(f"code {git_state()}, {jax.devices()[0].platform}, jax {jax.__version__}")
    print("| shape | model | rows | TTFT (ms) | cached ms/token | cached tokens/s | "
          "recompute ms/token | recompute tokens/s | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['model']} | {r['rows']} | {r['ttft_ms']:.1f} | "
              f"{r['cached_per_token_ms']:.2f} | {r['cached_tokens_s']:.0f} | "
              f"{r['recompute_per_token_ms']:.2f} | {r['recompute_tokens_s']:.0f} | "
              f"{r['speedup']:.1f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
