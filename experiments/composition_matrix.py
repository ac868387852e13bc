"""Every composition the validator accepts on 8 devices, through ``jaxtp train``'s real loop.

The matrix is :func:`jaxtp.testing.composition_layouts`: pipeline (x schedule: gpipe, 1f1b,
interleaved with 2 virtual stages, zb1), data, fsdp, context, expert and model degrees whose
product is 8, x sequence parallelism (with a model axis), x ZeRO stage 0-3 (with a data axis),
x mode (gspmd, explicit); MoE layouts use ``tiny-moe`` with capacity = every token. Each layout
is two ``jaxtp train`` subprocesses on 8 simulated CPU devices (prefetch, metrics, checkpoints at
steps 2 and 4, evals at 2, 4 and 6): one to step 4, then the same command to step 6, which
resumes from step 4's checkpoint; every step's train and eval loss is compared with the
one-device run of the same model and batch (fp32; the test suite's tolerance is 2e-4).

    python experiments/composition_matrix.py                 # the covering subset CI runs (~8 min)
    python experiments/composition_matrix.py --set degrees   # + one layout per degree split
    python experiments/composition_matrix.py --set all       # all of it (~4.5 h on 2 cores)
    python experiments/composition_matrix.py --set all --shard 1/4   # a quarter of it

Writes ``results/composition_matrix.{md,json}``: a row per layout run (steps, max |loss
difference|, max |eval loss difference|, the largest difference after the resume, seconds) and
the refused layouts with the validator's error. Exits non-zero if a run fails or differs by more
than the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOLERANCE = 2e-4


def _version() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                       capture_output=True)
    return r.stdout.strip() or "?"


def select(which: str, accepted, covering_subset):
    chosen = covering_subset(accepted)
    if which == "degrees":  # one more layout for each degree split the subset lacks
        seen = {x.degrees for x in chosen}
        for x in accepted:
            if x.degrees not in seen:
                chosen.append(x)
                seen.add(x.degrees)
    elif which == "all":
        chosen += [x for x in accepted if x not in chosen]
    return chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=("covering", "degrees", "all"), default="covering")
    ap.add_argument("--shard", default="1/1", help="K/N: run the K-th of N equal parts")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    from jaxtp.testing import composition_layouts, covering_subset, run_matrix_layout

    accepted, refused = composition_layouts(8)
    chosen = select(args.set, accepted, covering_subset)
    k, n = (int(v) for v in args.shard.split("/"))
    chosen = chosen[k - 1::n]
    env = {key: v for key, v in os.environ.items() if key != "XLA_FLAGS"}
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxtp-matrix-") as tmp:
        env.update(JAX_COMPILATION_CACHE_DIR=f"{tmp}/xla-cache",
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
        for i, layout in enumerate(chosen, 1):
            row = run_matrix_layout(layout, Path(tmp), env)
            rows.append(row)
            ok = "error" not in row and max(row["max_loss_diff"], row["max_eval_diff"]) <= TOLERANCE
            row["ok"] = ok
            what = row.get("error") or (f"max |dloss| {row['max_loss_diff']:.2e}, eval "
                                        f"{row['max_eval_diff']:.2e}, after resume "
                                        f"{row['resumed_diff']:.2e}, {row['seconds']:.0f} s")
            print(f"[{i}/{len(chosen)}] {'ok ' if ok else 'BAD'} {layout.name}: {what}", flush=True)
    minutes = (time.perf_counter() - t0) / 60
    good = sum(r["ok"] for r in rows)
    by_error = defaultdict(list)
    for layout, error in refused:
        by_error[error].append(layout.name)
    args.out.mkdir(parents=True, exist_ok=True)
    head = (f"`python experiments/composition_matrix.py {' '.join(argv or sys.argv[1:])}`; "
            f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), code "
            f"{_version()}, {minutes:.0f} min. The validator accepts {len(accepted)} layouts on "
            f"8 devices and refuses {len(refused)}; this run ran {len(rows)} "
            f"(set `{args.set}`, shard {args.shard}): {good} match the one-device run within "
            f"{TOLERANCE:g} at every step, resumed from step 4's checkpoint.")
    lines = [f"# Compositions through `jaxtp train` ({good} of {len(rows)} match one device)", "",
             head, "",
             "| layout | steps | max \\|loss diff\\| | max \\|eval diff\\| | after resume "
             "| resumed | s |",
             "|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | error: {r['error'][:150]} | | | | | |")
        else:
            lines.append(f"| {r['layout']} | {r['steps'][0]}-{r['steps'][-1]} | "
                         f"{r['max_loss_diff']:.1e} | {r['max_eval_diff']:.1e} | "
                         f"{r['resumed_diff']:.1e} | {'yes' if r['resumed'] else 'NO'} | "
                         f"{r['seconds']:.0f} |")
    lines += ["", f"## Refused ({len(refused)})", "", "| error | layouts |", "|---|---:|"]
    for error, names in sorted(by_error.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"| {error} | {len(names)} (e.g. {names[0]}) |")
    (args.out / "composition_matrix.md").write_text("\n".join(lines) + "\n")
    (args.out / "composition_matrix.json").write_text(json.dumps(
        {"command": head, "rows": rows,
         "refused": [{"layout": x.name, "error": e} for x, e in refused]}, indent=1))
    print(f"{good} of {len(rows)} layouts match; {args.out / 'composition_matrix.md'}")
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
