"""Does the input pipeline keep up with the step? Samples/s of the loader alone beside the train
step's consumption, measured in one run on the simulated 8-device CPU mesh.

For the tiny and GPT-2-small-shaped configs (``common.SHAPES``) and three sources -- the embedded
corpus tokenised in memory, the same documents prepared once into ArrayRecord shards
(``jaxtp prepare-data``; read record by record through grain), and a 0.5 / 0.5 mixture of the
two -- it times ``Loader.batch_at`` alone, then with the batch placed on the devices
(``Trainer.put_batch``), and the compiled train step on a batch already on the devices. The last
column is the loader's headroom: how many times faster than the step it produces batches.

    python benchmarks/data_loader.py [--batches 200] [--steps 5] [--out results/data_loader.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.force_cpu_devices(8)

import jax  # noqa: E402

from jaxtp.configs import schema as config_lib  # noqa: E402
from jaxtp.data import batches as data  # noqa: E402
from jaxtp.data.prepare_data import prepare  # noqa: E402
from jaxtp.train.trainer import Trainer  # noqa: E402


def _rate(fn, n: int, rows: int) -> float:
    fn(0)  # warm: the first call opens files and draws the first epoch's order
    start = time.perf_counter()
    for i in range(1, n + 1):
        fn(i)
    return rows * n / (time.perf_counter() - start)


def _step_rate(trainer: Trainer, batch, steps: int, rows: int) -> float:
    state = trainer.init_state()
    step = trainer.step_fn(state)
    state, m = step(state, batch)  # compile
    jax.block_until_ready(m["loss"])
    start = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
    jax.block_until_ready(m["loss"])
    return rows * steps / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=200, help="batches timed per loader")
    p.add_argument("--steps", type=int, default=5, help="train steps timed per shape")
    p.add_argument("--shapes", nargs="+", default=["tiny", "gpt2-small-ish"])
    p.add_argument("--out", default=str(common.RESULTS / "data_loader.md"))
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="jaxtp-data-bench-"))
    t0 = time.perf_counter()
    m = prepare([""], str(tmp / "prepared"), progress=False)
    prep_s = time.perf_counter() - t0
    rows_out = []
    for shape in a.shapes:
        preset, overrides, _ = common.SHAPES[shape]
        base = [*overrides, f"train.out_dir={tmp / 'run'}"]
        sources = {"embedded corpus (in memory)": [],
                   "prepared ArrayRecord (grain)": [f"data.path={tmp / 'prepared'}"],
                   "mixture 0.5 / 0.5 of both": None}
        cfg = config_lib.load(preset, base)
        trainer = Trainer(cfg)
        rows = cfg.train.batch_size
        step_rate = None
        for name, extra in sources.items():
            if extra is None:
                loader = _mixture_loader(cfg, tmp)
            else:
                loader, _ = data.loaders(config_lib.load(preset, base + extra))
            alone = _rate(loader.batch_at, a.batches, rows)
            placed = _rate(lambda i: jax.block_until_ready(trainer.put_batch(loader.batch_at(i))),
                           a.batches, rows)
            if step_rate is None:
                step_rate = _step_rate(trainer, trainer.put_batch(loader.batch_at(0)), a.steps,
                                       rows)
            rows_out.append((shape, name, alone, placed, step_rate))
            print(f"{shape:>15} | {name:<30} | loader {alone:9.0f} samples/s | + put on devices "
                  f"{placed:9.0f} | step {step_rate:8.1f} samples/s | headroom "
                  f"{placed / step_rate:7.1f}x", flush=True)
    lines = [
        "# Input pipeline vs train step",
        "",
        f"{common.machine()}; code {common.git_state()}; "
        f"`python benchmarks/data_loader.py --batches {a.batches} --steps {a.steps}`",
        "",
        f"prepare-data of the embedded corpus: {m['documents']} documents, {m['tokens']} tokens "
        f"in {prep_s:.1f} s ({m['tokens'] / prep_s / 1e6:.2f} M tokens/s, byte tokenizer)",
        "",
        "| config | source | loader alone (samples/s) | loader + put on devices | train step "
        "consumes | headroom |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for shape, name, alone, placed, step in rows_out:
        lines.append(f"| {shape} | {name} | {alone:.0f} | {placed:.0f} | {step:.1f} | "
                     f"{placed / step:.1f}x |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


def _mixture_loader(cfg, tmp: Path) -> data.Loader:
    """The embedded corpus (path "") and its prepared copy, 0.5 / 0.5 (a mixture entry cannot
    name the embedded corpus, so the two sources are built here)."""
    (emb,), (prep,) = (data.loaders(config_lib.apply_overrides(cfg, extra))[0].sources
                       for extra in ([], [f"data.path={tmp / 'prepared'}"]))
    prep.name = "prepared"
    t = cfg.train
    return data.Loader(batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed,
                       sources_=[emb, prep], weights=[0.5, 0.5], mixture="bench")


if __name__ == "__main__":
    main()
