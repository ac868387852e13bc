"""The pipeline example of docs/pipelines.md, trained N times in a row while another
``jaxtp train`` runs beside it (issue 37's load test).

Before issue 37's fix this example (pipeline=2 x data=2 x model=2 on 8 simulated CPU devices)
aborted in XLA:CPU's collective rendezvous on a 2-core host, 7 runs of 7; the cause and the
standalone repro are in docs/troubleshooting.md. Each run here is the example as a user types it
(its 500 steps, a fresh run directory, every other setting the CLI's), with a neighbour
(``tiny``, ``parallel.data=8``) training the whole time. ``--nproc N`` sets ``NPROC`` (XLA:CPU's
intra-op pool) for the example's runs, e.g. ``--nproc 2`` for the pool a 2-core host had before
the fix.

    python benchmarks/under_load.py                  # 10 runs, ~40 min on 2 cores
    python benchmarks/under_load.py --runs 2 --steps 100

Writes ``results/under_load.md`` (one row per run: exit code, steps trained, seconds, the
error line if any).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = ["model.n_layers=4", "parallel.pipeline=2", "parallel.model=2", "train.microbatches=4"]
NEIGHBOUR = ["--config", "tiny", "parallel.data=8", "train.steps=1000000",
             "train.checkpoint_every=0", "train.eval_every=1000000"]


def _version() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True).stdout.strip() or "?"
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: the example's)")
    ap.add_argument("--nproc", type=int, default=None, help="NPROC for the example's runs")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    jaxtp = [sys.executable, "-m", "jaxtp", "train"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    example_env = env | ({"NPROC": str(args.nproc)} if args.nproc else {})
    steps = [f"train.steps={args.steps}"] if args.steps else []
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxtp-under-load-") as tmp:
        neighbour = subprocess.Popen([*jaxtp, *NEIGHBOUR, f"train.out_dir={tmp}/neighbour"],
                                     env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        try:
            time.sleep(20)  # the neighbour is compiled and training
            for i in range(1, args.runs + 1):
                out = Path(tmp) / f"pp{i}"
                cmd = [*jaxtp, "--config", "tiny", *EXAMPLE, *steps, f"train.out_dir={out}"]
                t0 = time.perf_counter()
                try:
                    r = subprocess.run(cmd, env=example_env, capture_output=True, text=True,
                                       timeout=args.timeout)
                    rc, stdout, stderr = r.returncode, r.stdout, r.stderr
                except subprocess.TimeoutExpired as e:
                    rc, stdout, stderr = "timeout", str(e.stdout or ""), str(e.stderr or "")
                seconds = time.perf_counter() - t0
                done = re.search(r"done: (\d+) steps", stdout)
                error = next((x for x in reversed(stderr.splitlines())
                              if x.startswith("jaxtp: error") or "may be stuck" in x), "")
                rows.append((i, rc, int(done.group(1)) if done else 0, seconds, error[:160]))
                print(f"run {i}: exit {rc}, {rows[-1][2]} steps, {seconds:.0f} s {error[:120]}",
                      flush=True)
            alive = neighbour.poll() is None
        finally:
            neighbour.kill()
            neighbour.wait()
    ok = sum(1 for r in rows if r[1] == 0)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# The pipeline example under load ({ok} of {len(rows)} trained)", "",
             f"`python benchmarks/under_load.py {' '.join(argv or sys.argv[1:])}`; "
             f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), code "
             f"{_version()}, NPROC "
             f"{'=' + str(args.nproc) if args.nproc else 'unset (jaxtp sets it)'}"
             f"; the neighbour (`jaxtp train {' '.join(NEIGHBOUR)}`) "
             f"{'was still training at the end' if alive else 'had stopped'}.", "",
             f"Example: `jaxtp train --config tiny {' '.join(EXAMPLE + steps)}`", "",
             "| run | exit | steps | seconds | error |", "|---:|---|---:|---:|---|"]
    lines += [f"| {i} | {rc} | {n} | {s:.0f} | {e} |" for i, rc, n, s, e in rows]
    (args.out / "under_load.md").write_text("\n".join(lines) + "\n")
    print(f"{ok} of {len(rows)} runs trained; {args.out / 'under_load.md'}")
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
