"""The ``jaxtp`` command's entry point: settles the host allocator (:mod:`jaxtp.cli.host_malloc`,
which may re-execute the process) before :mod:`jaxtp.cli.commands` imports JAX."""

from __future__ import annotations

import sys

from jaxtp.cli import host_malloc

# the verbs that run steps, where the allocator matters; the others start as they are
RUNS_STEPS = ("train", "sample", "eval")
HELP = ("-h", "--help")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    verb = next((a for a in args if not a.startswith("-")), None)
    if argv is None and verb in RUNS_STEPS and not any(a in HELP for a in args):
        host_malloc.reexec_if_needed(args)
    line = host_malloc.describe()  # set only in the process the re-execution started
    if line:
        print(line, file=sys.stderr, flush=True)
    from jaxtp.cli.commands import main as cli_main

    return cli_main(argv)
