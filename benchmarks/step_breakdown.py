"""Where a jaxtp step's time goes on the simulated CPU mesh, next to the plain baseline.

For the baseline and a few jaxtp layouts it times, interleaved round-robin, the forward loss, the
loss and gradients, the full train step, and two parts of the step measured alone on the same
shardings: the optimizer update (clip + AdamW + apply, the state donated) and, for layouts with
data parallelism, the data-parallel gradient all-reduce (the same per-device bytes over the same
axes, nothing else). Each is reported as wall time and as CPU time (user + system, all threads of
the process): 8 simulated devices share the host's cores, so CPU time is the work a layout adds.
It also counts the ops of the compiled full step (dots, fusions, copies, transposes, collectives,
and whether the donated state is aliased to the output). A second table measures the matmul
ceiling of the simulation: the same FLOPs as one big single-device matmul, split into the
per-device matmuls a layout runs (8 devices sharing the host's cores). A third runs the real
training loop and reports the host time per step outside the compiled step (data, dispatch, loop,
logging), with batches read inline and prefetched (``--loop-only``: just that, in a few minutes).

    python benchmarks/step_breakdown.py [--shape gpt2-small-ish] [--repeats 3] [--hlo-dir DIR]
    python benchmarks/step_breakdown.py --loop-only [--loop-steps 12]
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.force_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import baseline  # noqa: E402
from throughput import baseline_shape  # noqa: E402
from jaxtp.configs import schema as config_lib  # noqa: E402
import optax  # noqa: E402

from jaxtp.train.trainer import Trainer, TrainState  # noqa: E402

VARIANTS = {
    "data=2 x model=4": ("parallel.data=2", "parallel.model=4"),
    "data=2 x model=4, explicit": ("parallel.data=2", "parallel.model=4", "parallel.mode=explicit"),
    "model=8": ("parallel.data=1", "parallel.model=8"),
    "model=8, explicit": ("parallel.data=1", "parallel.model=8", "parallel.mode=explicit"),
    "data=8": ("parallel.data=8",),
    "data=2 x model=4, ZeRO-1": ("parallel.data=2", "parallel.model=4", "parallel.zero_stage=1"),
    "data=2 x model=4, ZeRO-2": ("parallel.data=2", "parallel.model=4", "parallel.zero_stage=2"),
}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(", re.M)
COUNTED = ("dot", "fusion", "copy", "transpose", "all-reduce", "all-reduce-start", "all-gather",
           "reduce-scatter", "all-to-all", "collective-permute", "while", "custom-call")


def op_counts(hlo: str) -> dict:
    """Static op counts of the optimized module (loop bodies counted once)."""
    c = collections.Counter(_OP.findall(hlo))
    out = {k: c.get(k, 0) for k in COUNTED}
    out["aliased"] = "input_output_alias" in hlo
    return out


def timeit(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timeit_cpu(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of one call, CPU = user + system time of every thread."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0, cpu_seconds() - c0


def dp_sync_fn(engine):
    """The data-parallel gradient all-reduce alone: each device's gradient shard (the per-device
    shapes of the engine's gradient specs), summed over the data-parallel axes the step syncs
    over, and an elementwise pass over the same per-device arrays for scale; ``None`` when no
    axis replicates the parameters. Inputs carry a leading axis over the data-parallel ranks so
    that every rank holds its own values, as before the real sync."""
    lo = engine.layout
    axes = tuple(a for a in ("data", "fsdp", "context") if lo.degrees[a] > 1)
    if not axes or lo.zero.grads:  # ZeRO >= 2 reduce-scatters instead; not measured here
        return None
    n = math.prod(lo.degrees[a] for a in axes)
    specs = jax.tree.leaves(lo.grad_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    shapes = [v.shape for v in jax.tree.leaves(lo.abstract_params)]
    in_specs = [PartitionSpec(axes, *sp) for sp in specs]
    grads = [jax.device_put(jnp.full((n, *shape), 1e-3, jnp.float32),
                            NamedSharding(lo.mesh, sp)) for shape, sp in zip(shapes, in_specs)]

    def body(*gs):
        return [jax.lax.psum(g, axes) for g in gs]

    def scale(*gs):  # the reference: one elementwise pass over the same per-device bytes
        return [g * 1.0001 for g in gs]

    sync, ref = (jax.jit(jax.shard_map(f, mesh=lo.mesh, in_specs=tuple(in_specs),
                                       out_specs=in_specs, check_vma=False))
                 for f in (body, scale))
    return (lambda: sync(*grads)), (lambda: ref(*grads))


def optimizer_fn(tx, holder, grads, *, jaxtp_state: bool):
    """The optimizer update alone (clip, AdamW, apply), the state donated, as the train step
    runs it; ``holder["state"]`` is replaced by the result."""
    def update(state, grads):
        params = state.params if jaxtp_state else state["params"]
        opt = state.opt_state if jaxtp_state else state["opt"]
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        if jaxtp_state:
            return TrainState(params, opt, state.step + 1)
        return {"params": params, "opt": opt, "step": state["step"] + 1}

    shardings = jax.tree.map(lambda x: x.sharding, holder["state"])
    step = jax.jit(update, donate_argnums=(0,), out_shardings=shardings)

    def run():
        holder["state"] = step(holder["state"], grads)
        return holder["state"]
    return run


def run_breakdown(args) -> list[dict]:
    preset, shape_overrides, desc = common.SHAPES[args.shape]
    print(f"shape: {desc}", flush=True)
    base_cfg = config_lib.load(preset, list(shape_overrides) + ["train.steps=1000"])
    t = base_cfg.train
    rng = np.random.default_rng(0)
    toks = rng.integers(0, base_cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), np.int32)
    np_batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}

    entries = []  # (name, {component: callable returning something to block on}, hlo)
    shape = baseline_shape(base_cfg.model)
    tx = baseline.optimizer(lr=t.lr, warmup=t.warmup_steps, steps=t.steps)
    dev0 = jax.devices()[0]
    b_batch = jax.device_put({k: jnp.asarray(v) for k, v in np_batch.items()}, dev0)
    b_holder = {"state": baseline.init_state(shape, tx, device=dev0)}
    b_step = baseline.make_train_step(shape, tx)
    b_loss = jax.jit(partial(baseline.loss_fn, shape))
    b_grad = jax.jit(jax.value_and_grad(partial(baseline.loss_fn, shape)))

    def b_full():
        b_holder["state"], m = b_step(b_holder["state"], b_batch)
        return b_holder["state"], m

    b_hlo = b_step.lower(b_holder["state"], b_batch).compile().as_text()
    b_grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), b_holder["state"]["params"])
    entries.append(("baseline (1 device)", {
        "fwd": lambda: b_loss(b_holder["state"]["params"], b_batch),
        "fwd+bwd": lambda: b_grad(b_holder["state"]["params"], b_batch),
        "step": b_full,
        "optimizer": optimizer_fn(tx, b_holder, b_grads, jaxtp_state=False)}, b_hlo))

    errors = []
    for name in args.variants:
        cfg = config_lib.load(preset, list(shape_overrides) + ["train.steps=1000",
                                                               *VARIANTS[name]])
        try:
            tr = Trainer(cfg)
            holder = {"state": tr.init_state()}
            step = tr.step_fn(holder["state"])
            batch = tr.put_batch(np_batch)
            loss, grad = tr.engine.loss(), tr.engine.loss_and_grad()
            hlo = step.lower(holder["state"], batch).compile().as_text()
            grad.lower(holder["state"].params, batch).compile()
        except Exception as e:  # noqa: BLE001 - a layout the current jaxtp cannot compile
            text = str(e).strip().splitlines()
            errors.append((f"jaxtp {name}", f"{type(e).__name__}: {text[0][:160] if text else ''}"))
            print(f"{name}: ERROR {errors[-1][1]}", flush=True)
            continue
        if args.hlo_dir:
            Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
            fname = re.sub(r"[^\w]+", "_", name) + ".step.hlo.txt"
            (Path(args.hlo_dir) / fname).write_text(hlo)

        def full(step=step, holder=holder, batch=batch):
            holder["state"], m = step(holder["state"], batch)
            return holder["state"], m

        grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), holder["state"].params)
        fns = {"fwd": lambda loss=loss, holder=holder, batch=batch: loss(holder["state"].params,
                                                                         batch),
               "fwd+bwd": lambda grad=grad, holder=holder, batch=batch: grad(
                   holder["state"].params, batch),
               "step": full,
               "optimizer": optimizer_fn(tr.tx, holder, grads, jaxtp_state=True)}
        sync = dp_sync_fn(tr.engine)
        if sync is not None:
            fns["dp sync"], fns["elementwise"] = sync
        entries.append((f"jaxtp {name}", fns, hlo))
    if args.hlo_dir:
        (Path(args.hlo_dir) / "baseline.step.hlo.txt").write_text(b_hlo)

    times = collections.defaultdict(list)
    for r in range(args.repeats + 1):  # round 0 compiles and warms up
        for name, fns, _ in entries:
            for comp, fn in fns.items():
                # one untimed call first: switching between functions that allocate different
                # buffers makes the first call after a switch slower (allocator page faults)
                timeit_cpu(fn)
                if r:
                    times[(name, comp)].append(timeit_cpu(fn))
        print(f"round {r} done", flush=True)
    rows = []
    for name, fns, hlo in entries:
        wall = {c: statistics.median(w for w, _ in times[(name, c)]) for c in fns}
        cpu = {c: statistics.median(u for _, u in times[(name, c)]) for c in fns}
        rows.append({"name": name, "wall": wall, "cpu": cpu, "ops": op_counts(hlo)})
    return rows + [{"name": n, "error": e} for n, e in errors]


def loop_host_time(shape: str, variants: list[str], steps: int, warmup: int) -> list[dict]:
    """The real training loop (``jaxtp.train.trainer.run``, a log window every step, no checkpoints) with
    batches read inline (``train.prefetch=0``, the data path before the prefetching loop) and one
    step ahead (``prefetch=1``): the main thread's host seconds per step outside the compiled
    step -- data (read + place, or the wait for the prefetched batch), dispatch, loop bookkeeping,
    logging -- from each record's ``host_parts_s``, over the median step time."""
    import tempfile

    from jaxtp.train import trainer as train

    preset, shape_overrides, _ = common.SHAPES[shape]
    rows = []
    for name in variants:
        for prefetch in (0, 1):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = config_lib.load(preset, [
                    *shape_overrides, *VARIANTS[name], f"train.steps={steps}",
                    "train.log_every=1", "train.checkpoint_every=0", "train.eval_every=100000",
                    "train.eval_batches=1", "train.tensorboard=false",
                    f"train.prefetch={prefetch}", f"train.out_dir={tmp}"])
                records = train.run(cfg)[warmup:-1]  # the last one waits for its final eval
            step = statistics.median(r["step_time_s"] for r in records)
            parts = {k: statistics.median(r["host_parts_s"][k] for r in records)
                     for k in records[0]["host_parts_s"]}
            rows.append({"name": name, "prefetch": prefetch, "step": step, "parts": parts,
                         "host": statistics.median(r["host_time_s"] for r in records)})
            print(f"loop {name} prefetch={prefetch}: step {1e3 * step:.0f} ms, host "
                  f"{1e3 * rows[-1]['host']:.1f} ms", flush=True)
    return rows


def host_time_lines(rows: list[dict], steps: int, warmup: int) -> list[str]:
    lines = ["", "## Host time per step outside the compiled step (the training loop)", "",
             f"`jaxtp.train.trainer.run`, {steps} steps with a log record every step, the first {warmup} "
             "and the last left out; medians; ms on the main thread per step, and their sum as a "
             "share of the step. prefetch=0 reads and places each batch inline, as the loop did "
             "before batches were prefetched; prefetch=1 (the default) makes the next batch on a "
             "background thread, so 'data' is only the hand-over. Waits on the devices "
             "(reading a window's loss) are not host work and are left out.", "",
             "| layout | prefetch | step (ms) | data | dispatch | loop | logging | host total | "
             "host / step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r["parts"]
        lines.append(f"| {r['name']} | {r['prefetch']} | {1e3 * r['step']:.0f} | "
                     f"{1e3 * p['data']:.2f} | {1e3 * p['dispatch']:.2f} | {1e3 * p['loop']:.2f} | "
                     f"{1e3 * p['logging']:.2f} | {1e3 * r['host']:.2f} | "
                     f"{100 * r['host'] / r['step']:.2f}% |")
    return lines


def matmul_ceiling(repeats: int) -> list[dict]:
    """GFLOP/s of one [M,K]x[K,N] matmul on one device vs the same FLOPs as 8 per-device matmuls."""
    devs = np.array(jax.devices())
    mesh = Mesh(devs, ("d",))
    shard = NamedSharding(mesh, PartitionSpec("d"))
    cases = [  # (label, single-device M,K,N, per-device m,k,n) -- all with 8x(mkn) == MKN
        ("MLP up, d2 x m4", (512, 768, 3072), (256, 768, 768)),
        ("MLP up, model=8", (512, 768, 3072), (512, 768, 384)),
        ("MLP up, data=8", (512, 768, 3072), (64, 768, 3072)),
        ("head, d2 x m4 (vocab/4)", (512, 768, 50688), (256, 768, 12672)),
    ]
    rows = []
    for label, (M, K, N), (m, k, n) in cases:
        assert 8 * m * k * n == M * K * N
        a = jax.device_put(jnp.ones((M, K), jnp.float32), devs[0])
        b = jax.device_put(jnp.ones((K, N), jnp.float32), devs[0])
        one = jax.jit(lambda x, y: x @ y)
        xa = jax.device_put(jnp.ones((8, m, k), jnp.float32), shard)
        xb = jax.device_put(jnp.ones((8, k, n), jnp.float32), shard)
        many = jax.jit(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y), out_shardings=shard)
        timeit(one, a, b), timeit(many, xa, xb)
        t1 = min(timeit(one, a, b) for _ in range(repeats))
        t8 = min(timeit(many, xa, xb) for _ in range(repeats))
        flops = 2.0 * M * K * N
        rows.append({"case": label, "single": f"{M}x{K}x{N}", "per_device": f"8 x {m}x{k}x{n}",
                     "single_gflops": flops / t1 / 1e9, "split_gflops": flops / t8 / 1e9})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(common.SHAPES), default="gpt2-small-ish")
    p.add_argument("--variants", nargs="*", default=["data=2 x model=4",
                                                     "data=2 x model=4, explicit", "model=8",
                                                     "model=8, explicit"],
                   choices=sorted(VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hlo-dir", default=None, help="write each compiled full step's HLO here")
    p.add_argument("--out", default=str(common.RESULTS))
    p.add_argument("--loop-steps", type=int, default=12,
                   help="steps of the training-loop host-time runs (0 = skip them)")
    p.add_argument("--loop-only", action="store_true", help="only the loop host-time section")
    args = p.parse_args()
    loop_rows = (loop_host_time(args.shape, args.variants, args.loop_steps, warmup=2)
                 if args.loop_steps else [])
    if args.loop_only:
        text = "\n".join(["# Training-loop host time", "",
                          f"- shape: {common.SHAPES[args.shape][2]}",
                          f"- machine: {common.machine()}; code: {common.git_state()}; "
                          f"{time.strftime('%Y-%m-%d %H:%M %Z')}",
                          *host_time_lines(loop_rows, args.loop_steps, 2)]) + "\n"
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "loop_host_time.md").write_text(text)
        print(text)
        return
    rows = run_breakdown(args)
    mm = matmul_ceiling(5)
    lines = ["# Step breakdown on the simulated 8-device CPU mesh", "",
             f"- shape: {common.SHAPES[args.shape][2]}",
             f"- machine: {common.machine()}; code: {common.git_state()}; "
             f"{time.strftime('%Y-%m-%d %H:%M %Z')}",
             f"- medians of {args.repeats} interleaved rounds (each timed call preceded by an "
             "untimed one of the same function); each cell: wall ms / CPU ms "
             "(user + system, all threads); optimizer and dp sync are measured alone on the "
             "step's shardings; dp sync is the data-parallel gradient all-reduce (same bytes, "
             "same axes; '-' where no axis replicates the parameters), elementwise one fused "
             "`x * c` over the sync's per-device arrays, for scale", "",
             "| | fwd | fwd+bwd | optimizer | dp sync | elementwise | full step | dot | fusion | "
             "copy | "
             "transpose | all-reduce | all-gather | reduce-scatter | all-to-all | "
             "coll.-permute | state aliased |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def cell(r, comp):
        if comp not in r["wall"]:
            return "-"
        return f"{1e3 * r['wall'][comp]:.0f} / {1e3 * r['cpu'][comp]:.0f}"

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} |" + " |" * 15)
            continue
        o = r["ops"]
        lines.append(
            f"| {r['name']} | {cell(r, 'fwd')} | {cell(r, 'fwd+bwd')} | {cell(r, 'optimizer')} | "
            f"{cell(r, 'dp sync')} | {cell(r, 'elementwise')} | {cell(r, 'step')} | "
            f"{o['dot']} | {o['fusion']} | "
            f"{o['copy']} | {o['transpose']} | {o['all-reduce'] + o['all-reduce-start']} | "
            f"{o['all-gather']} | {o['reduce-scatter']} | {o['all-to-all']} | "
            f"{o['collective-permute']} | {o['aliased']} |")
    base = next((r for r in rows if r["name"].startswith("baseline") and "error" not in r), None)
    if base is not None:
        lines += ["", "What the step costs beyond the baseline, in CPU ms (the simulated devices "
                  "share the cores, so CPU time is the budget): the layout's full step, its "
                  "data-parallel sync and its optimizer's extra work over the baseline's, and "
                  "what is left for the model itself.", "",
                  "| | full step | dp sync | optimizer - baseline's | rest (model) | "
                  "baseline full step |", "|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            if "error" in r or r is base:
                continue
            c, b = r["cpu"], base["cpu"]
            sync = c.get("dp sync", 0.0)
            extra_opt = c["optimizer"] - b["optimizer"]
            lines.append(f"| {r['name']} | {1e3 * c['step']:.0f} | {1e3 * sync:.0f} | "
                         f"{1e3 * extra_opt:.0f} | {1e3 * (c['step'] - sync - extra_opt):.0f} | "
                         f"{1e3 * b['step']:.0f} |")
    lines += ["", "(op counts are static: a loop body's ops are counted once)", "",
              "## Matmul ceiling of the simulation (fp32, same FLOPs)", "",
              "| case | one device | split over 8 devices | one device GFLOP/s | "
              "8 devices GFLOP/s |", "|---|---|---|---:|---:|"]
    for r in mm:
        lines.append(f"| {r['case']} | {r['single']} | {r['per_device']} | "
                     f"{r['single_gflops']:.1f} | {r['split_gflops']:.1f} |")
    if loop_rows:
        lines += host_time_lines(loop_rows, args.loop_steps, 2)
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_breakdown.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
