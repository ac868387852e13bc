"""What a checkpoint save costs the training loop, with and without ``train.checkpoint_overlap``.

Runs ``jaxtp.train.trainer.run`` on ``benchmarks/vs_maxtext.py``'s model at 8 x 64 tokens a step (8
simulated CPU devices, glibc's ``hugetlb=1`` malloc tunable, as ``jaxtp train`` starts a CPU run) in
a fresh process per (layout, mode), interleaved round by round: ``none`` saves no checkpoint in the
timed span, ``off`` and ``on`` save every ``--every`` steps, in place before the next step's
dispatch or from a device copy after it. The timed span runs from the dispatch of step ``every`` to
that of step ``3 * every + 2``, so it holds three saves in either mode; the cost of a save is the
span's extra time over ``none`` divided by three::

    python benchmarks/checkpoint_overlap.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from host_malloc import LAYOUTS, MODEL

MODES = ("none", "off", "on")
# the step 32x cheaper (8 x 64 tokens, not 16 x 256), the state (and so the save) the same size
SMALL_BATCH = ["train.batch_size=8", "train.seq_len=64"]


def worker(layout: str, mode: str, every: int) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxtp.configs import schema as config
    from jaxtp.train import trainer as train

    steps = 3 * every + 2
    stamps: list[float] = []
    step_fn = train.Trainer.step_fn

    def timed_step_fn(self, state):
        fn = step_fn(self, state)

        def call(*a, **k):
            stamps.append(time.perf_counter())  # on XLA:CPU: once the previous step is done
            return fn(*a, **k)
        return call

    train.Trainer.step_fn = timed_step_fn
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config.load("tiny", [
            *MODEL, *SMALL_BATCH, *LAYOUTS[layout], f"train.steps={steps}", f"train.out_dir={tmp}",
            f"train.checkpoint_every={0 if mode == 'none' else every}",
            f"train.checkpoint_overlap={'on' if mode == 'none' else mode}",
            "train.log_every=1", "train.eval_every=100000", "train.eval_batches=1",
            "train.tensorboard=false"])
        records = train.run(cfg)
    span = stamps[steps - 1] - stamps[every - 1]  # dispatch of step `every` .. of step `steps`
    print(json.dumps({"span_s": span, "steps": steps - every,
                      "step_s": statistics.median(r["step_time_s"] for r in records[2:-1])}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--every", type=int, default=3, help="steps between saves (>= 3)")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(*a.worker, a.every)
    env = {**{k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "XLA_FLAGS")},
           "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "JAXTP_HOST_MALLOC": "off"}
    got: dict = {}
    for r in range(a.rounds):
        for layout in a.layouts:
            modes = MODES if r % 2 == 0 else MODES[::-1]
            for mode in modes:
                out = subprocess.run([sys.executable, __file__, "--worker", layout, mode,
                                      "--every", str(a.every)], env=env, capture_output=True,
                                     text=True, check=True, cwd=Path(__file__).parent)
                run = json.loads(out.stdout.strip().splitlines()[-1])
                got.setdefault((layout, mode), []).append(run)
                print(f"round {r + 1} {layout:17s} {mode:4s} span {run['span_s']:6.2f} s over "
                      f"{run['steps']} steps", flush=True)
    print(f"\n| layout | mode | timed span, s per round | cost per save vs none, ms per round "
          f"| median cost per save (ms) |\n|---|---|---|---|---:|")
    for layout in a.layouts:
        base = [run["span_s"] for run in got[(layout, "none")]]
        for mode in MODES:
            spans = [run["span_s"] for run in got[(layout, mode)]]
            cost = [(s - b) / 3 * 1e3 for s, b in zip(spans, base)]
            print(f"| {layout} | {mode} | {', '.join(f'{s:.2f}' for s in spans)} | "
                  f"{'-' if mode == 'none' else ', '.join(f'{c:.0f}' for c in cost)} | "
                  f"{'-' if mode == 'none' else f'{statistics.median(cost):.0f}'} |")


if __name__ == "__main__":
    main()
