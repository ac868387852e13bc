"""Runs MaxText's own pre-training entry point (``maxtext.trainers.pre_train.train``) unchanged,
under MaxText's Python (the venv ``vs_maxtext.py`` makes), and prints the exact parameter count
MaxText computes (its log rounds it to 0.013 billion) as ``VS_MAXTEXT_PARAMS <n>``.

    <maxtext-venv>/bin/python benchmarks/maxtext_runner.py <base.yml> key=value ...

Imports nothing of jaxtp. The compiled train step's HLO comes from ``XLA_FLAGS=--xla_dump_to``,
set by the caller.
"""

import runpy
import sys

from maxtext.utils import max_utils

_count = max_utils.calculate_num_params_from_pytree


def _print_count(params):
    n = _count(params)
    print(f"VS_MAXTEXT_PARAMS {int(n)}", flush=True)
    return n


max_utils.calculate_num_params_from_pytree = _print_count
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__")
