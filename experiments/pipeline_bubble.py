"""Pipeline bubble, stored activations, FLOPs and step time: GPipe, 1F1B, interleaved 1F1B, ZB-H1.

Measured beside the formulas on the simulated 8-device CPU mesh (``p`` pipeline ranks x ``8 / p``
data replicas), the ``tiny`` model with ``n_layers = 16`` (``--quick``: 4), ``seq_len = 32`` and a
FIXED micro-batch of ``b = 2`` sequences per data replica (``batch_size = m x b x data``), so
that more micro-batches means more work per step, as in the papers:

1. The bubble of the schedule tables (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019;
   interleaved, Narayanan et al. 2021): ``(p - 1) / (v m + p - 1)`` of the device-ticks when
   every pass is one tick (``Schedule.bubble_fraction``); ZB-H1 (Qi et al. 2023), whose
   backward is two passes (B: input gradient, W: weight gradient), ``(p - 1) / (3 m + p - 1)``.
2. The runtime's program (:mod:`jaxtp.pipeline.program`): the tables packed into ticks of at most
   one F and one B per rank (*packed ticks*), each tick lasting its busiest rank's work; its
   lock-step time with a backward of 2 forwards (the backward reads the forward's stored VJP
   residuals; GPipe's recomputes its stage, B = 3 F) against GPipe's at the same p and m; what
   a rank holds for its backwards (``Program.stash_slots``: GPipe ``m`` stage inputs, 1F1B
   ``min(2p - 2, m)`` residual sets; ZB-H1 the same, plus ``p - 1`` sets of W inputs).
3. The compiled step (``loss_and_grad``): matmul FLOPs per step over all ranks (each pipeline
   rank's own branch frequencies) against the unpipelined step's (``data = 8``, same batch),
   peak temporaries per device (``memory_analysis``), and the step time (median of a few runs
   after a warm-up). On this machine the 8 simulated devices share the host's cores, so the
   step time measures total work plus per-tick overhead, not a pipeline's wall-clock bubble.

4. Wall clock on two devices (full run only): ``p = 2`` pipeline ranks on 2 of the devices of
   this 2-core host, no data parallelism, wider models (8 layers, ``s = 128``; ``d_model = 256``
   with ``b = 4`` and ``d_model = 1024`` with ``b = 2``), so that an idle rank's time shows in
   the wall clock (XLA:CPU's intra-op pool may lend its core to the busy rank, so less than on
   accelerators); GPipe, 1F1B and ZB-H1 in interleaved rounds (A B C, then C B A), medians.
5. What splitting the backward costs (full run only): one stage on one device, its forward, its
   backward from the stored residuals, and ZB-H1's B and W passes, timed alone.

Combinations a schedule cannot run are skipped and listed (1F1B, interleaved and ZB-H1 need
``m >= p``, interleaved ``m % p == 0``). Exits non-zero unless the executed bubble equals the
formula for every row, 1F1B's temporaries are flat (at most 1.1x) over the m >= 2p - 2 at which
its slots stop growing, and GPipe's grow by at least its extra slots of stage inputs.
Usage: ``python experiments/pipeline_bubble.py [--out DIR] [--quick]``
(full: p in {2, 4, 8}, m in {4, 8, 16}, about 16 minutes on 2 cores; --quick: p = 2,
m in {4, 8}, n_layers = 4, GPipe and 1F1B only, one timed run each).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402

from jaxtp import testing  # noqa: E402
from jaxtp.configs import schema as config  # noqa: E402
from jaxtp.inspect import hlo  # noqa: E402
from jaxtp.pipeline import program as pipeline_program  # noqa: E402
from jaxtp import pipeline  # noqa: E402
from jaxtp.pipeline import schedules  # noqa: E402
from jaxtp.step import engine  # noqa: E402
from jaxtp.step import pipelined as pipelined_step  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1", 1))
N_DEVICES = 8
B, S = 2, 32      # fixed micro-batch: sequences per data replica, sequence length
FLAT_TOL = 1.10   # 1F1B temporaries, largest m over smallest m
REPEATS = 3


def grid(quick: bool) -> tuple[tuple[int, ...], tuple[int, ...], int, tuple[tuple[str, int], ...]]:
    """(pipeline degrees, micro-batch counts, n_layers, (schedule, v) pairs)."""
    if quick:  # CI's smoke run: the two claims a test checks, four compiles
        return (2,), (4, 8), 4, SCHEDULES[:2]
    return (2, 4, 8), (4, 8, 16), 16, SCHEDULES


def cfg_of(name: str, p: int, m: int, v: int, n_layers: int) -> config.Config:
    data = N_DEVICES // p
    return config.load("tiny", [
        f"model.n_layers={n_layers}", f"train.seq_len={S}", f"parallel.pipeline={p}",
        f"parallel.pipeline_schedule={name}", f"parallel.virtual_stages={v}",
        f"train.microbatches={m}", f"parallel.data={data}", f"train.batch_size={m * B * data}"])


def schedule_row(name: str, p: int, m: int, v: int) -> dict:
    """What the table and the runtime's program say: ticks, bubble, formulas, slots, time."""
    s = schedules.build_schedule(name, p, m, v)
    prog = pipeline.compile_schedule(s, residuals=pipeline_program.stores_residuals(name, "none"))
    gpipe = pipeline.compile_schedule(schedules.build_schedule("gpipe", p, m), residuals=False)
    return dict(schedule=name, p=p, m=m, v=v, ticks=s.ticks, bubble=s.bubble_fraction,
                textbook=schedules.formula_bubble(name, p, m, v),
                formula_1=(p - 1) / (m + p - 1), formula_v=(p - 1) / (2 * m + p - 1),
                formula_zb=schedules.zero_bubble_h1_bubble(p, m),
                in_flight=[s.in_flight(d) for d in range(p)], packed=prog.ticks,
                stash_slots=prog.stash_slots, grad_slots=prog.grad_slots,
                # a backward from stored residuals costs 2 F, a recomputing one 3 F; ZB-H1's
                # B and W 1 F each
                lockstep=prog.lockstep_time(1.0, 2.0 if prog.residuals else 3.0),
                lockstep_gpipe=gpipe.lockstep_time(1.0, 3.0))


def _flops(cfg: config.Config, compiled, eng=None) -> float:
    """Compiled matmul FLOPs per step, all devices: each pipeline rank's branch frequencies."""
    text, n = compiled.as_text(), jax.device_count()
    if eng is None or not eng.pipelined:
        return hlo.dot_flops(text) * n
    p = cfg.parallel.pipeline
    return sum(hlo.dot_flops(text, pipelined_step.branch_weights(eng.layout, r))
               for r in range(p)) * n / p


@functools.cache
def unpipelined_flops(p: int, m: int, n_layers: int) -> float:
    """The same global batch without a pipeline (data = 8, one micro-batch)."""
    cfg = config.load("tiny", [f"model.n_layers={n_layers}", f"train.seq_len={S}",
                               f"parallel.data={N_DEVICES}", f"train.batch_size={m * B * 8 // p}"])
    eng = engine.build_engine(cfg)
    return _flops(cfg, eng.loss_and_grad().lower(*eng.abstract_inputs()).compile())


def measure(row: dict, n_layers: int, repeats: int) -> dict:
    """Compile ``loss_and_grad`` for the row's config; its FLOPs, per-device memory, step time."""
    cfg = cfg_of(row["schedule"], row["p"], row["m"], row["v"], n_layers)
    t0 = time.perf_counter()
    eng = engine.build_engine(cfg)
    compiled = eng.loss_and_grad().lower(*eng.abstract_inputs()).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    params = eng.layout.init_params()
    batch = eng.layout.shard_batch(testing.random_batch(cfg))
    jax.block_until_ready(compiled(params, batch))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, batch))
        times.append(time.perf_counter() - t0)
    flops = _flops(cfg, compiled, eng)
    return {**row, "temp": int(mem.temp_size_in_bytes),
            "arguments": int(mem.argument_size_in_bytes),
            "slot_bytes": B * S * cfg.model.d_model * 4,  # one stage input, fp32, per device
            "flops": flops, "flops_ratio": flops / unpipelined_flops(row["p"], row["m"], n_layers),
            "step_s": statistics.median(times), "step_spread": max(times) / min(times),
            "compile_s": compile_s}


# Section 4: two widths. ZB-H1's B hands each linear's input and output cotangent to its W
# (memory traffic ~ d per token) while the matmuls grow ~ d^2: the split costs more at d = 256
# than at d = 1024 on a CPU core (section 5 measures it).
WALLS = (dict(d_model=256, n_layers=8, b=4, s=128, rounds=5),
         dict(d_model=1024, n_layers=8, b=2, s=128, rounds=3))
WALL_P, WALL_MS = 2, (4, 8)


def _wall_cfg(w: dict, name: str, m: int, p: int = WALL_P) -> config.Config:
    return config.load("tiny", [
        f"model.n_layers={w['n_layers']}", f"model.d_model={w['d_model']}",
        f"model.d_ff={4 * w['d_model']}", f"train.seq_len={w['s']}",
        f"parallel.pipeline={p}", f"parallel.pipeline_schedule={name}",
        f"train.microbatches={m}", "parallel.data=1", f"train.batch_size={m * w['b']}"])


def wall_rows() -> list[dict]:
    """Section 4: step times on ``p`` of the devices (this host's cores shared by them),
    interleaved rounds."""
    out = []
    if os.cpu_count() < WALL_P:
        return out
    for w in WALLS:
        for m in WALL_MS:
            steps = {}
            for name in ("gpipe", "1f1b", "zb1"):
                cfg = _wall_cfg(w, name, m)
                eng = engine.build_engine(cfg, jax.devices()[:WALL_P])
                compiled = eng.loss_and_grad().lower(*eng.abstract_inputs()).compile()
                args = (eng.layout.init_params(), eng.layout.shard_batch(testing.random_batch(cfg)))
                jax.block_until_ready(compiled(*args))  # warm-up
                steps[name] = functools.partial(compiled, *args)
            times = {name: [] for name in steps}
            for r in range(w["rounds"]):
                for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
                    t0 = time.perf_counter()
                    jax.block_until_ready(steps[name]())
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                prog = pipeline.compile_schedule(
                    schedules.build_schedule(name, WALL_P, m),
                    residuals=pipeline_program.stores_residuals(name, "none"))
                out.append(dict(schedule=name, m=m, d_model=w["d_model"], b=w["b"],
                                step_s=statistics.median(ts), spread=max(ts) / min(ts),
                                lockstep=prog.lockstep_time(1.0, 2.0 if prog.residuals else 3.0)))
            print("wall", w["d_model"], m,
                  {r["schedule"]: f"{r['step_s'] * 1e3:.0f} ms" for r in out[-3:]}, flush=True)
    return out


def _wall_twin(rows: list[dict], r: dict, name: str) -> dict:
    return next(x for x in rows if (x["d_model"], x["m"], x["schedule"])
                == (r["d_model"], r["m"], name))


def wall_table(rows: list[dict]) -> str:
    lines = ["| d_model | m | schedule | step ms (median) | slowest / fastest run | / GPipe's | "
             "/ 1F1B's | lock-step (F=1) | / 1F1B's |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g, o = (_wall_twin(rows, r, n) for n in ("gpipe", "1f1b"))
        lines.append(f"| {r['d_model']} | {r['m']} | {r['schedule']} | {r['step_s'] * 1e3:.0f} | "
                     f"{r['spread']:.2f} | {r['step_s'] / g['step_s']:.2f} | "
                     f"{r['step_s'] / o['step_s']:.2f} | {r['lockstep']:.0f} | "
                     f"{r['lockstep'] / o['lockstep']:.2f} |")
    return "\n".join(lines)


def split_rows(repeats: int = 5) -> list[dict]:
    """Section 5: one stage (``n_layers / p`` layers) on one device, its forward, its backward
    from the stored VJP residuals (as 1F1B runs it), and the same backward split into ZB-H1's
    B (input gradient, keeping what W needs) and W (weight gradients)."""
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxtp.pipeline import runtime  # noqa: PLC0415
    from jaxtp.pipeline import weight_grad  # noqa: PLC0415

    def timed(f, *args):
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    out = []
    for w in WALLS:
        d, b, s = w["d_model"], w["b"], w["s"]
        cfg = config.load("tiny", [f"model.n_layers={w['n_layers'] // WALL_P}",
                                   f"model.d_model={d}", f"model.d_ff={4 * d}",
                                   f"train.seq_len={s}", "parallel.data=1",
                                   f"train.batch_size={b}"])
        eng = engine.build_engine(cfg, jax.devices()[:1])
        parts = pipelined_step._Parts(eng.layout, eng.region, manual=False)
        blocks = eng.layout.init_params()["blocks"]
        rope = parts.rope(jnp.broadcast_to(jnp.arange(s), (b, s)))
        x = jax.random.normal(jax.random.key(0), (b, s, d))
        g = jax.random.normal(jax.random.key(1), (b, s, d))

        def stage(pc, x):
            return parts.stage(pc, x, rope)

        with weight_grad.splitting(True):
            _, vjp = jax.vjp(stage, blocks, x)
        recipe, stored = runtime.split_vjp(vjp, blocks)
        leaves, vjp_def = jax.tree_util.tree_flatten(vjp)
        bw = weight_grad.split(
            lambda lv, g: jax.tree.leaves(jax.tree_util.tree_unflatten(vjp_def, lv)(g)),
            leaves, g)
        markers = [leaves[i] for i in bw.markers]

        def forward(pc, x):
            with weight_grad.splitting(True):
                y, vjp = jax.vjp(stage, pc, x)
            return y, runtime.split_vjp(vjp, pc)[1]

        def joint(pc, kept, g):
            return runtime.join_vjp(recipe, pc, kept)(g)

        def backward_b(pc, kept, g):
            outs, wres = weight_grad.run_known(bw, runtime.vjp_leaves(recipe, pc, kept),
                                               g)
            return outs[-1], [o for o in outs[:-1] if o is not None], wres

        def backward_w(wres, markers):
            return [o for o in weight_grad.run_unknown(bw, wres, markers) if o is not None]

        f_s = timed(jax.jit(forward), blocks, x)
        joint_s = timed(jax.jit(joint), blocks, stored, g)
        b_s = timed(jax.jit(backward_b), blocks, stored, g)
        wres = jax.jit(backward_b)(blocks, stored, g)[2]
        w_s = timed(jax.jit(backward_w), wres, markers)
        out.append(dict(d_model=d, b=b, s=s, layers=w["n_layers"] // WALL_P, f_s=f_s,
                        joint_s=joint_s, b_s=b_s, w_s=w_s,
                        wres_mib=sum(a.size * a.dtype.itemsize for a in wres) / 2**20))
        print("split", {k: (f"{v * 1e3:.1f} ms" if k.endswith("_s") else v)
                        for k, v in out[-1].items()}, flush=True)
    return out


def wall_findings(walls: list[dict], splits: list[dict]) -> list[str]:
    """One line per width: 1F1B against GPipe, ZB-H1 against 1F1B (and what its lock-step
    predicts), and what splitting the backward cost there (section 5)."""
    lines = []
    for w in WALLS:
        rows = [r for r in walls if r["d_model"] == w["d_model"]]
        if not rows:
            continue
        ratio = {n: [_wall_twin(rows, r, n) for r in rows if r["schedule"] == "zb1"]
                 for n in ("gpipe", "1f1b", "zb1")}
        f_g = [o["step_s"] / g["step_s"] for o, g in zip(ratio["1f1b"], ratio["gpipe"])]
        z_o = [z["step_s"] / o["step_s"] for z, o in zip(ratio["zb1"], ratio["1f1b"])]
        z_lock = [z["lockstep"] / o["lockstep"] for z, o in zip(ratio["zb1"], ratio["1f1b"])]
        sp = next((x for x in splits if x["d_model"] == w["d_model"]), None)
        cost = ("" if sp is None else
                f"; splitting the backward costs {(sp['b_s'] + sp['w_s']) / sp['joint_s']:.2f}x "
                f"the joint one there (section below)")
        ms = ", ".join(str(r["m"]) for r in ratio["zb1"])
        lines.append(f"d_model = {w['d_model']}, m = {ms}: "
                     f"1F1B {_span(f_g)}x GPipe's step; ZB-H1 {_span(z_o)}x 1F1B's (lock-step "
                     f"{_span(z_lock)}x){cost}.")
    return lines


def split_table(rows: list[dict]) -> str:
    lines = ["| d_model | layers | b x s | F ms | backward ms (1F1B) | B ms | W ms | "
             "(B + W) / backward | B -> W hand-off MiB |", "|---:|---:|---|---:|---:|---:|"
             "---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['d_model']} | {r['layers']} | {r['b']} x {r['s']} | "
                     f"{r['f_s'] * 1e3:.0f} | {r['joint_s'] * 1e3:.0f} | {r['b_s'] * 1e3:.0f} | "
                     f"{r['w_s'] * 1e3:.0f} | {(r['b_s'] + r['w_s']) / r['joint_s']:.2f} | "
                     f"{r['wres_mib']:.0f} |")
    return "\n".join(lines)


def run(quick: bool) -> tuple[list[dict], list[str], tuple[float, float]]:
    """The measured rows, the skipped combinations and the host's load average (1 min) at the
    start and the end."""
    ps, ms, n_layers, scheds = grid(quick)
    rows, skipped = [], []
    load0 = os.getloadavg()[0]
    for p in ps:
        for m in ms:
            for name, v in scheds:
                try:
                    pipeline.check_pipeline(name, p, m, v)
                except schedules.ScheduleError as e:
                    skipped.append(f"p={p} m={m} {name}: {e}")
                    print("skip", skipped[-1], flush=True)
                    continue
                r = measure(schedule_row(name, p, m, v), n_layers, 1 if quick else REPEATS)
                rows.append(r)
                print(f"p={p} m={m:2d} {name:<11} bubble {r['bubble']:.4f} (formula "
                      f"{r['textbook']:.4f})  slots {r['stash_slots']:2d}  FLOPs x"
                      f"{r['flops_ratio']:.3f}  temp "
                      f"{r['temp'] / 1024:8.1f} KiB  step {r['step_s'] * 1e3:7.1f} ms  "
                      f"(compile {r['compile_s']:.1f} s)", flush=True)
    return rows, skipped, (load0, os.getloadavg()[0])


# ---- the report --------------------------------------------------------------------------------

def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def table(rows: list[dict]) -> str:
    lines = ["| p | m | schedule | ticks | bubble (table) | (p-1)/(m+p-1) | (p-1)/(2m+p-1) | "
             "(p-1)/(3m+p-1) | in flight per rank | stash slots | packed ticks | temp bytes | "
             "temp KiB | FLOPs / unpipelined | step ms | step / GPipe's | step / 1F1B's | "
             "lockstep (F=1) | / GPipe's | / 1F1B's |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
             "---:|---:|---:|---:|"]
    for r in rows:
        gpipe, onef = _twin(rows, r, "gpipe"), _twin(rows, r, "1f1b")
        vs = f"{r['step_s'] / gpipe['step_s']:.2f}" if gpipe else "-"
        vs1 = f"{r['step_s'] / onef['step_s']:.2f}" if onef else "-"
        lock1 = f"{r['lockstep'] / onef['lockstep']:.2f}" if onef else "-"
        lines.append(
            f"| {r['p']} | {r['m']} | {r['schedule']}{' v=2' if r['v'] > 1 else ''} | "
            f"{r['ticks']} | {r['bubble']:.4f} | {r['formula_1']:.4f} | {r['formula_v']:.4f} | "
            f"{r['formula_zb']:.4f} | "
            f"{','.join(map(str, r['in_flight']))} | {r['stash_slots']} | {r['packed']} | "
            f"{r['temp']:,} | {_kib(r['temp'])} | {r['flops_ratio']:.3f} | "
            f"{r['step_s'] * 1e3:.1f} | {vs} | {vs1} | {r['lockstep']:.1f} | "
            f"{r['lockstep'] / r['lockstep_gpipe']:.2f} | {lock1} |")
    return "\n".join(lines)


def _twin(rows: list[dict], r: dict, name: str) -> dict | None:
    """The row of schedule ``name`` at ``r``'s p and m."""
    return next((g for g in rows if g["schedule"] == name and (g["p"], g["m"]) == (r["p"], r["m"])),
                None)


def _by(rows, name, p):
    return sorted((r for r in rows if r["schedule"] == name and r["p"] == p), key=lambda r: r["m"])


def _span(xs, fmt="{:.2f}") -> str:
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def findings(rows: list[dict], load: tuple[float, float] | None = None) -> list[str]:
    """What the numbers say; every number is computed from ``rows``."""
    out = []
    err = max(abs(r["bubble"] - r["textbook"]) for r in rows)
    out.append(f"**Bubble.** The executed tables equal the formulas to {err:.0e} in every row.")
    fl = {name: [r["flops_ratio"] for r in rows if r["schedule"] == name]
          for name in ("gpipe", "1f1b", "interleaved", "zb1")}
    out.append("**FLOPs.** The compiled pipelined step does "
               + ", ".join(f"{_span(v, '{:.3f}')}x ({k})" for k, v in fl.items() if v)
               + " the matmul FLOPs of the unpipelined one: a 1F1B, interleaved or ZB-H1 "
               "backward reads its forward's stored VJP residuals; GPipe's, holding all m "
               "micro-batches, keeps only stage inputs and recomputes its stage (4/3x; every "
               "schedule did before).")
    pairs = [(o, g) for o in rows if o["schedule"] == "1f1b" for g in rows
             if g["schedule"] == "gpipe" and (g["p"], g["m"]) == (o["p"], o["m"])]
    if pairs:
        lock = _span([o["lockstep"] / g["lockstep"] for o, g in pairs])
        step = _span([o["step_s"] / g["step_s"] for o, g in pairs])
        ticks = _span([o["packed"] / g["packed"] for o, g in pairs])
        out.append(
            f"**1F1B against GPipe.** Packed into ticks of one F and one B per rank, with B = 2F "
            f"(stored residuals) against GPipe's recomputing 3F, 1F1B's lock-step time is "
            f"{lock}x GPipe's at the same p and m (the one-pass-per-tick runtime had "
            f"1.21-1.44x), in {ticks}x its ticks; measured step time {step}x on "
            "this shared host, where a step costs the total work of all ranks plus per-tick "
            "overhead (fewer ticks, less overhead).")
    inter = [(i, g) for i in rows if i["v"] > 1 for g in rows
             if g["schedule"] == "gpipe" and (g["p"], g["m"]) == (i["p"], i["m"])]
    if inter:
        out.append("**Interleaved.** Lock-step time "
                   + _span([i["lockstep"] / g["lockstep"] for i, g in inter])
                   + "x GPipe's (half-sized passes); measured step time "
                   + _span([i["step_s"] / g["step_s"] for i, g in inter]) + "x.")
    zb = [(z, o) for z in rows if z["schedule"] == "zb1" for o in [_twin(rows, z, "1f1b")] if o]
    if zb:
        out.append(
            "**ZB-H1 against 1F1B.** With the backward split into B (input gradient) and W (weight "
            "gradient), 1 F each, and the W passes packed into the cool-down, ZB-H1's lock-step "
            f"time is {_span([z['lockstep'] / o['lockstep'] for z, o in zb])}x 1F1B's at the "
            f"same p and m (bubble {_span([z['bubble'] for z, _ in zb], '{:.3f}')} of its "
            f"table's device-ticks against 1F1B's {_span([o['bubble'] for _, o in zb], '{:.3f}')}"
            f"), in {_span([z['packed'] / o['packed'] for z, o in zb])}x its ticks, holding "
            f"{_span([z['temp'] / o['temp'] for z, o in zb])}x its temporaries; measured step "
            f"time {_span([z['step_s'] / o['step_s'] for z, o in zb])}x.")
    for p in sorted({r["p"] for r in rows}):
        g, o, z = _by(rows, "gpipe", p), _by(rows, "1f1b", p), _by(rows, "zb1", p)
        parts = []
        if len(g) > 1:
            parts.append(f"GPipe's temp grows {_kib(g[0]['temp'])} -> {_kib(g[-1]['temp'])} KiB "
                         f"from m={g[0]['m']} to m={g[-1]['m']} ({g[0]['stash_slots']} -> "
                         f"{g[-1]['stash_slots']} stage inputs held: GPipe recomputes)")
        if o:
            parts.append("1F1B's is " + "/".join(_kib(r["temp"]) for r in o) + " KiB at m="
                         + "/".join(str(r["m"]) for r in o) + " ("
                         + "/".join(str(r["stash_slots"]) for r in o)
                         + " residual sets: min(2p - 2, m))")
        if z:
            parts.append("ZB-H1's is " + "/".join(_kib(r["temp"]) for r in z) + " KiB at m="
                         + "/".join(str(r["m"]) for r in z))
        if parts:
            out.append(f"**Memory, p={p}.** " + "; ".join(parts) + ".")
    noise = max(r["step_spread"] for r in rows)
    text = (f"**Noise.** Within a row's runs the slowest was up to {noise:.2f}x the fastest")
    if load is not None:
        text += (f"; the host's load average was {load[0]:.1f} at the start and {load[1]:.1f} "
                 f"at the end, on {os.cpu_count()} cores")
    out.append(text + ". Rows with different p are not comparable: the global batch is "
               f"m x {B} x 8/p sequences.")
    return out


def _check(rows: list[dict]) -> list[str]:
    bad = [f"p={r['p']} m={r['m']} {r['schedule']}: bubble {r['bubble']} vs {r['textbook']}"
           for r in rows if abs(r["bubble"] - r["textbook"]) > 1e-12]
    for p in sorted({r["p"] for r in rows}):
        o = [r for r in _by(rows, "1f1b", p) if r["m"] >= 2 * p - 2]
        g = _by(rows, "gpipe", p)
        if len(o) > 1 and o[-1]["temp"] > FLAT_TOL * o[0]["temp"]:
            bad.append(f"p={p}: 1F1B temp {o[0]['temp']} -> {o[-1]['temp']} grows > {FLAT_TOL}x")
        if len(g) > 1:
            extra = (g[-1]["stash_slots"] - g[0]["stash_slots"]) * g[0]["slot_bytes"]
            if g[-1]["temp"] - g[0]["temp"] < extra:
                bad.append(f"p={p}: GPipe temp {g[0]['temp']} -> {g[-1]['temp']} grows less "
                           f"than its {extra} bytes of extra slots")
    return bad


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D

    colours = {"gpipe": "tab:blue", "1f1b": "tab:orange", "interleaved": "tab:green",
               "zb1": "tab:red"}
    ps = sorted({r["p"] for r in rows})
    ms = sorted({r["m"] for r in rows})
    styles = dict(zip(ps, ("-", "--", ":")))
    markers = dict(zip(ps, ("o", "s", "^")))
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    bubble, temp, growth, step = axes.flat
    mm = np.linspace(ms[0], ms[-1], 100)
    for p in ps:
        for v, colour in ((1, "grey"), (2, colours["interleaved"]), (3, colours["zb1"])):
            bubble.plot(mm, (p - 1) / (v * mm + p - 1), styles[p], color=colour, lw=1, alpha=0.6)
    for name in colours:
        for p in ps:
            rs = _by(rows, name, p)
            if not rs:
                continue
            m = [r["m"] for r in rs]
            kw = dict(color=colours[name], marker=markers[p], ls=styles[p])
            bubble.plot(m, [r["bubble"] for r in rs], ls="none", marker=markers[p],
                        color=colours[name], mfc="none", ms=10 if name == "gpipe" else 6)
            temp.plot(m, [r["temp"] / 2**20 for r in rs], **kw)
            growth.plot(m, [(r["temp"] - rs[0]["temp"]) / 1024 for r in rs], **kw)
            step.plot(m, [r["step_s"] * 1e3 for r in rs], **kw)
    bubble.set(ylabel="bubble fraction",
               title="Bubble: executed table (open markers) vs formula (lines)")
    temp.set(ylabel="MiB per device",
             title=f"Compiled temporaries (fixed micro-batch b={B}, s={S})")
    growth.set(ylabel="KiB per device", title="Temporaries minus those at the smallest m")
    step.set(ylabel="ms", title="Step time, simulated mesh (8 devices on shared CPU cores)")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches m")
    keys = [Line2D([], [], color=c, lw=2, label=n) for n, c in colours.items()]
    keys += [Line2D([], [], color="k", ls=styles[p], marker=markers[p], label=f"p={p}")
             for p in ps]
    formulas = [Line2D([], [], color="grey", label="(p-1)/(m+p-1)"),
                Line2D([], [], color=colours["interleaved"], label="(p-1)/(2m+p-1)"),
                Line2D([], [], color=colours["zb1"], label="(p-1)/(3m+p-1)")]
    bubble.legend(handles=keys + formulas, fontsize=8)
    growth.legend(handles=keys, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(rows: list[dict], skipped: list[str], *, wall: float, quick: bool, out: Path,
                 load: tuple[float, float] | None = None, walls: list[dict] = (),
                 splits: list[dict] = ()) -> None:
    """The markdown table with its findings, and the plot."""
    n_layers = grid(quick)[2]
    command = "python experiments/pipeline_bubble.py" + (" --quick" if quick else "")
    suffix = "_quick" if quick else ""
    text = table(rows)
    md = [
        "# Pipeline bubble, stored residuals, FLOPs and step time: GPipe, 1F1B, interleaved, "
        "ZB-H1",
        "",
        f"`{command}` ({wall:.0f} s); jax {jax.__version__}, {jax.device_count()} simulated CPU "
        f"devices on {os.cpu_count()} cores; fp32.",
        "",
        f"Model: `tiny` (d_model 64, 8 heads, d_ff 256, vocab 256), n_layers = {n_layers}, "
        f"seq_len = {S}; mesh pipeline = p x data = 8 / p; a fixed micro-batch of b = {B} "
        f"sequences per data replica, so batch_size = m x {B} x data. Memory and time are of the "
        "compiled `loss_and_grad` (forward and backward, no optimizer), per device. "
        "*Bubble (table)*: idle device-ticks / all device-ticks of the executed schedule "
        "(`Schedule.bubble_fraction`). *In flight per rank*: `Schedule.in_flight(rank)` (chunk "
        "passes for interleaved). *Stash slots*: `Program.stash_slots`, the VJP residual sets "
        "the busiest rank keeps from a forward to its backward. *Packed ticks*: the runtime's "
        "ticks (`Program.ticks`: at most one F and one B per rank). *Temp*: "
        "`memory_analysis().temp_size_in_bytes`. *FLOPs / unpipelined*: compiled matmul FLOPs "
        "per step, all ranks, over those of the same batch on data = 8 without a pipeline. "
        "*Lockstep*: `Program.lockstep_time`, the step in forward-pass units when each tick "
        "lasts its busiest rank's work (a backward from stored residuals = 2 F; GPipe's, which "
        "recomputes its stage, 3 F; ZB-H1's B and W 1 F each). *Step*: "
        + ("one timed run" if quick else f"median of {REPEATS} timed runs")
        + " after one warm-up, on real arrays.",
        "",
        text,
        "",
        "Skipped (the schedule cannot run them):" if skipped else "Nothing skipped.",
        *[f"- {s}" for s in skipped],
        "",
        "## What the numbers say",
        "",
        *[f"- {s}" for s in findings(rows, load)],
        "",
        f"![pipeline bubble](pipeline_bubble{suffix}.png)",
        "",
    ]
    if walls:
        widths = ", ".join(f"d_model = {w['d_model']} (micro-batch b = {w['b']}, "
                           f"{w['rounds']} rounds)" for w in WALLS)
        md += [
            "## Wall clock, two devices on two cores",
            "",
            f"p = {WALL_P} pipeline ranks on {WALL_P} of the simulated devices (this host has "
            f"{os.cpu_count()} cores), data = 1; `tiny` widened to {widths}, d_ff = 4 d_model, "
            f"n_layers = {WALLS[0]['n_layers']}, seq_len = {WALLS[0]['s']}; interleaved "
            "rounds of `loss_and_grad` (GPipe, 1F1B, ZB-H1, then the reverse), after one "
            "warm-up each. A rank with nothing to do leaves its core to XLA:CPU's shared "
            "intra-op thread pool, which may run the busy rank's matmuls on it: the bubble costs "
            "wall time, but less than on accelerators.",
            "",
            wall_table(list(walls)),
            "",
            *[f"- {line}" for line in wall_findings(list(walls), list(splits))],
            "",
        ]
    if splits:
        md += [
            "## What splitting the backward costs",
            "",
            f"One stage ({splits[0]['layers']} layers) on one device, jitted alone, median of "
            "5 runs: its forward (keeping the VJP residuals), its backward from them as 1F1B "
            "runs it, and the same backward as ZB-H1's two passes: B (the input gradient; it "
            "also writes each linear's input and output cotangent for W, the hand-off) and W "
            "(the weight gradients from them).",
            "",
            split_table(list(splits)),
            "",
        ]
    (out / f"pipeline_bubble{suffix}.md").write_text("\n".join(md))
    _plot(rows, out / f"pipeline_bubble{suffix}.png")
    print(text)
    print("\n".join(f"- {s}" for s in findings(rows, load)))
    if walls:
        print(wall_table(list(walls)))
    if splits:
        print(split_table(list(splits)))
    print(f"wall {wall:.1f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows, skipped, load = run(args.quick)
    walls = [] if args.quick else wall_rows()
    splits = [] if args.quick else split_rows()
    write_report(rows, skipped, wall=time.perf_counter() - t0, quick=args.quick, out=out,
                 load=load, walls=walls, splits=splits)
    bad = _check(rows)
    for line in bad:
        print("MISMATCH", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
