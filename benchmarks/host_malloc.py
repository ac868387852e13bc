"""One training step of ``benchmarks/vs_maxtext.py``'s model under each host allocator.

XLA:CPU takes each step's temporaries from ``malloc``; under glibc's defaults they come back as
fresh pages every step. This runs ``Trainer.step_fn`` on 8 simulated CPU devices in a fresh
process per (layout, allocator), interleaved round by round, and prints the median step time and
the minor page faults per step::

    python benchmarks/host_malloc.py --rounds 3 --steps 5

Allocators: ``glibc`` (the defaults), ``hugetlb`` (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``,
what ``jaxtp train`` starts a CPU run with) and, when ``--tcmalloc`` names the library,
``tcmalloc`` (``LD_PRELOAD``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=8",
         "model.d_ff=1408", "model.vocab_size=256", "model.max_seq_len=256",
         "model.activation=swiglu", "model.tie_embeddings=false", "train.batch_size=16",
         "train.seq_len=256"]
LAYOUTS = {"data=2 x model=4": ["parallel.data=2", "parallel.model=4"],
           "model=8": ["parallel.model=8"]}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def worker(layout: str, steps: int) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from jaxtp import testing
    from jaxtp.configs import schema as config
    from jaxtp.train.trainer import Trainer

    cfg = config.load("tiny", [*MODEL, *LAYOUTS[layout]])
    trainer = Trainer(cfg)
    state = trainer.init_state()
    batch = trainer.engine.layout.shard_batch(testing.random_batch(cfg))
    step = trainer.step_fn(state)
    for _ in range(2):  # compile, then one step that settles the allocator
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    print(json.dumps({"step_ms": statistics.median(times) * 1e3, "faults": faults}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--tcmalloc", default=TCMALLOC if Path(TCMALLOC).exists() else None,
                   help=f"tcmalloc's library (default: {TCMALLOC} when present)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.steps)
    base = {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "XLA_FLAGS")}
    modes = {"glibc": {}, "hugetlb": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}}
    if a.tcmalloc:
        modes["tcmalloc"] = {"LD_PRELOAD": a.tcmalloc}
    got: dict = {}
    for r in range(a.rounds):
        for layout in a.layouts:
            for mode, env in modes.items():
                out = subprocess.run([sys.executable, __file__, "--worker", layout,
                                      "--steps", str(a.steps)], env={**base, **env},
                                     capture_output=True, text=True, check=True)
                run = json.loads(out.stdout.strip().splitlines()[-1])
                got.setdefault((layout, mode), []).append(run)
                print(f"round {r + 1} {layout:17s} {mode:8s} {run['step_ms']:7.0f} ms "
                      f"{run['faults']:9.0f} faults/step", flush=True)
    print("\n| layout | allocator | step ms per round | / glibc per round | faults per step |")
    print("|---|---|---|---|---:|")
    for layout in a.layouts:
        glibc = [run["step_ms"] for run in got[(layout, "glibc")]]
        for mode in modes:
            runs = got[(layout, mode)]
            ms = [run["step_ms"] for run in runs]
            print(f"| {layout} | {mode} | {', '.join(f'{t:.0f}' for t in ms)} | "
                  f"{', '.join(f'{t / g:.2f}' for t, g in zip(ms, glibc))} | "
                  f"{statistics.median(run['faults'] for run in runs):,.0f} |")


if __name__ == "__main__":
    main()
