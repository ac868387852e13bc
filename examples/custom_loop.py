"""A training loop of your own on a data=2 x model=4 mesh, with your own batches.

    python examples/custom_loop.py --steps 30 --save runs/custom

jaxtp.Trainer gives the sharded, jitted step; the loop, the data and the logging are yours. The
batches here are windows of a text (this file's own bytes, byte-level like the tiny preset);
any ``{"inputs", "targets"}`` pair of ``[batch_size, seq_len]`` int32 arrays works. On a machine
without 8 accelerators the script simulates 8 CPU devices.
"""

import argparse
import os
import sys

if "jax" not in sys.modules:  # 8 simulated CPU devices unless a real mesh is there
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import jaxtp  # noqa: E402


def batches(text: bytes, *, batch_size: int, seq_len: int, seed: int):
    """Random windows of ``text`` as next-token pairs, forever."""
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, batch_size)
        window = np.stack([tokens[s:s + seq_len + 1] for s in starts])
        yield {"inputs": window[:, :-1], "targets": window[:, 1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save", default="", help="save the trained model into this run dir")
    args = parser.parse_args()

    cfg = jaxtp.config("tiny", {"parallel.data": 2, "parallel.model": 4,
                                "train.batch_size": 8, "train.seq_len": 64, "train.lr": 3e-3,
                                "train.warmup_steps": 5, "train.steps": args.steps})
    trainer = jaxtp.Trainer(cfg)
    state = trainer.init_state()
    data = batches(open(__file__, "rb").read() * 4, batch_size=8, seq_len=64, seed=0)
    for step in range(1, args.steps + 1):
        state, metrics = trainer.step(state, next(data))
        if step == 1 or step % 10 == 0:  # float() waits for the step: only when we print
            print(f"step {step:3d}  loss {float(metrics['loss']):.3f}  "
                  f"grad norm {float(metrics['grad_norm']):.2f}", flush=True)
    if args.save:
        path = jaxtp.Model(cfg, params=state.params).save(args.save)
        print(f"saved the model to {path} (jaxtp.Model.from_run loads it)")


if __name__ == "__main__":
    main()
