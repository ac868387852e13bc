"""Load a trained run and score text with it: bits per byte and each byte's surprise.

    python examples/score_text.py --run runs/custom "def main():" "qzx vbn wpl"

A run directory is what ``jaxtp train`` writes (``train.out_dir``) or what ``Model.save`` wrote;
``jaxtp.Model.from_run`` reads its config and only the parameters of its latest checkpoint, on
the run's layout or another one (``--layout parallel.model=2``, repeated for several).
"""

import argparse
import math
import os
import sys

if "jax" not in sys.modules:  # 8 simulated CPU devices unless a real mesh is there
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import jaxtp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a run directory")
    parser.add_argument("--layout", action="append", default=[], metavar="KEY=VALUE",
                        help="a parallel.* override (repeat for several)")
    parser.add_argument("texts", nargs="+")
    args = parser.parse_args()

    model = jaxtp.Model.from_run(args.run, args.layout)
    width = max(len(t) for t in args.texts) + 1
    ids = np.zeros((len(args.texts), width), np.int32)  # right-padded; padding is not scored
    for i, text in enumerate(args.texts):
        ids[i, :len(text.encode())] = np.frombuffer(text.encode(), np.uint8)
    losses = np.asarray(model.token_losses(ids[:, :-1], ids[:, 1:]))  # nats, [B, S - 1]
    for i, text in enumerate(args.texts):
        n = len(text.encode()) - 1
        bits = losses[i, :n] / math.log(2)
        worst = int(np.argmax(bits)) + 1
        print(f"{bits.mean():5.2f} bits/byte  {text!r}  (most surprising: byte {worst} "
              f"{text.encode()[worst:worst + 1]!r}, {bits.max():.1f} bits)")


if __name__ == "__main__":
    main()
