"""``jaxtp train | inspect`` (also ``python -m jaxtp``).

Every verb takes ``--config NAME`` (a preset) and dotted ``section.field=value`` overrides, e.g.
``jaxtp inspect --config tiny parallel.data=2 parallel.model=4``.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxtp.config import PRESETS, ConfigError, load


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxtp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True)

    def common(sub):
        sub.add_argument("--config", default="tiny",
                         help=f"preset name: {', '.join(sorted(PRESETS))} (default: tiny)")
        sub.add_argument("--devices", type=int, default=None,
                         help="simulate N CPU devices, e.g. to inspect a mesh larger than this "
                              "machine (default: accelerators if any, else 8 CPU devices)")
        sub.add_argument("overrides", nargs="*", metavar="section.field=value")

    ins = verbs.add_parser("inspect", help="compile the step ahead of time and print the "
                                           "placement report (bytes, collective census, FLOPs)")
    common(ins)
    ins.add_argument("--json", action="store_true", help="print the report as one JSON object")
    ins.add_argument("--hlo-out", default=None, metavar="FILE",
                     help="write the optimized HLO text to FILE")
    ins.add_argument("--step", choices=("grad", "loss"), default="grad",
                     help="compile loss and gradients (default) or the forward loss only")

    tr = verbs.add_parser("train", help="train a model (default: the tiny preset on the "
                                        "embedded corpus)")
    common(tr)
    return p


SIMULATED_DEVICES = 8


def _use_devices(n: int | None) -> None:
    """``--devices N``: N simulated CPU devices. Without it, the CPU backend still gets 8, so a
    machine with no accelerator runs the 8-device mesh; accelerators, when present, are used."""
    import os

    import jax

    if n is not None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    elif "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", SIMULATED_DEVICES)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load(args.config, args.overrides)
        _use_devices(args.devices)
        from jaxtp import engine

        if args.verb == "inspect":
            from jaxtp import inspect

            r = inspect.report(engine.build(cfg), step=args.step)
            if args.hlo_out:
                with open(args.hlo_out, "w") as f:
                    f.write(r.hlo_text)
            if args.json:
                print(json.dumps(r.to_json(), indent=2))
            else:
                print(inspect.format_report(r, title=f"{args.config}, {cfg.parallel.mode} mode, "
                                                     f"{args.step} step"))
            return 0
        if args.verb == "train":
            from jaxtp import train

            train.run(cfg)
            return 0
    except ConfigError as e:
        print(f"jaxtp: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
