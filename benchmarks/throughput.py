"""Throughput side by side: the plain single-device baseline (``baseline.py``) vs jaxtp's
``Trainer`` on a simulated 8-device CPU mesh, same model shape, same global batch, same optimizer.

For each layout the baseline (on CPU device 0) and jaxtp (on all 8 simulated devices) are compiled
and warmed up, then run in interleaved blocks A B A B ... (``--rounds`` pairs of ``--steps`` steps
each), so that drift in machine load hits both alike; the ratio is taken per pair and its median
reported. MFU is the analytic model FLOPs (6NT + attention, as ``jaxtp.inspect.placement.analytic_flops``)
per second over a matmul peak measured in the same run (best of ``jaxtp.train.flops.measure_cpu_peak``
before and after). The 8 simulated devices share the host's cores, so ~1.0x the single-device
baseline is the realistic ceiling on CPU: this measures jaxtp's overhead, not a parallel speed-up.

Layouts the installed jaxtp refuses (``ConfigError`` from ``jaxtp.parallel.mesh.validate``) are reported
as "not landed" rows (all of the listed ones run today).

    python benchmarks/throughput.py [--shape gpt2-small-ish|tiny] [--steps N] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.force_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import baseline  # noqa: E402
from jaxtp.configs import schema as config_lib  # noqa: E402
from jaxtp.step import engine as engine_lib  # noqa: E402
from jaxtp.configs.schema import ConfigError  # noqa: E402
from jaxtp.inspect.placement import analytic_flops  # noqa: E402
from jaxtp.train.flops import measure_cpu_peak  # noqa: E402
from jaxtp.train.trainer import Trainer  # noqa: E402

# (label, parallel overrides). Anything jaxtp.parallel.mesh.validate accepts gets measured.
LAYOUTS: list[tuple[str, tuple[str, ...]]] = [
    ("data=8", ("parallel.data=8",)),
    ("data=2 x model=4", ("parallel.data=2", "parallel.model=4")),
    ("data=2 x model=4, explicit", ("parallel.data=2", "parallel.model=4",
                                    "parallel.mode=explicit")),
    ("data=2 x model=4, ZeRO-2", ("parallel.data=2", "parallel.model=4", "parallel.zero_stage=2")),
    ("model=8", ("parallel.data=1", "parallel.model=8")),
    ("model=8, explicit", ("parallel.data=1", "parallel.model=8", "parallel.mode=explicit")),
    ("fsdp=8 (ZeRO-3 over fsdp)", ("parallel.data=1", "parallel.fsdp=8")),
    ("data=8, ZeRO-1", ("parallel.data=8", "parallel.zero_stage=1")),
    ("data=2 x model=4, sequence parallel", ("parallel.data=2", "parallel.model=4",
                                             "parallel.sequence_parallel=true")),
    ("pipeline=2 x data=4", ("parallel.pipeline=2", "parallel.data=4", "train.microbatches=2")),
    ("context=2 x data=4", ("parallel.context=2", "parallel.data=4")),
]


def baseline_shape(m: config_lib.ModelConfig) -> baseline.Shape:
    return baseline.Shape(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                          n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, d_ff=m.d_ff,
                          head_dim=m.head_dim, tie_embeddings=m.tie_embeddings,
                          activation=m.activation, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                          init_std=m.init_std, vocab_pad_multiple=m.vocab_pad_multiple,
                          compute_dtype=m.compute_dtype)


def baseline_params_from_jaxtp(state) -> dict:
    """jaxtp's single-device reference parameters in the baseline's layout (for the parity check)."""
    p = state.to_pure_dict()
    b = p["blocks"]
    out = {"embed": p["embed"]["table"], "final_norm": p["final_norm"]["scale"],
           "blocks": {"attn_norm": b["attn_norm"]["scale"], "w_qkv": b["attn"]["w_qkv"],
                      "wo": b["attn"]["wo"], "mlp_norm": b["mlp_norm"]["scale"],
                      "w_up": b["mlp"]["w_up"], "w_down": b["mlp"]["w_down"]}}
    if "head" in p:
        out["head"] = p["head"]["w"]
    return out


def parity_check(cfg, shape: baseline.Shape, batch: dict) -> float:
    """|baseline loss - jaxtp reference loss| on the same parameters: same architecture, same math."""
    ref = engine_lib.reference_params(cfg)
    ours = baseline_params_from_jaxtp(ref)
    a = float(jax.jit(lambda p, b: baseline.loss_fn(shape, p, b))(ours, batch))
    b = float(jax.jit(engine_lib.reference_loss_fn(cfg))(ref, batch))
    return abs(a - b)


def timed_block(step, state, batch, steps: int):
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - t0) / steps, float(metrics["loss"])


def run(args) -> dict:
    preset, shape_overrides, shape_desc = common.SHAPES[args.shape]
    base_cfg = config_lib.load(preset, list(shape_overrides) + ["train.steps=1000"])
    t = base_cfg.train
    tokens = t.batch_size * t.seq_len
    shape = baseline_shape(base_cfg.model)

    rng = np.random.default_rng(0)
    toks = rng.integers(0, base_cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), np.int32)
    np_batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    dev0 = jax.devices()[0]
    b_batch = jax.device_put({k: jnp.asarray(v) for k, v in np_batch.items()}, dev0)

    print(f"shape: {args.shape}: {shape_desc}", flush=True)
    parity = parity_check(base_cfg, shape, b_batch)
    print(f"parity: |baseline loss - jaxtp reference loss| = {parity:.2e}", flush=True)
    peaks = [measure_cpu_peak(2048)]
    print(f"matmul peak (fp32 2048^3, all cores): {peaks[0] / 1e9:.1f} GFLOP/s", flush=True)

    tx = baseline.optimizer(lr=t.lr, warmup=t.warmup_steps, steps=t.steps,
                            weight_decay=t.weight_decay, clip=t.grad_clip)
    b_state = baseline.init_state(shape, tx, device=dev0)
    b_step = baseline.make_train_step(shape, tx)
    t0 = time.perf_counter()
    b_state, _ = b_step(b_state, b_batch)
    jax.block_until_ready(b_state)
    b_compile = time.perf_counter() - t0
    for _ in range(args.warmup):
        b_state, _, _ = timed_block(b_step, b_state, b_batch, 1)
    flops = shape.train_flops(t.batch_size, t.seq_len)

    rows, b_times = [], []
    for label, overrides in LAYOUTS:
        if args.layouts and not any(s in label for s in args.layouts):
            continue
        row = {"layout": label, "overrides": list(overrides)}
        try:
            cfg = config_lib.load(preset, list(shape_overrides) + ["train.steps=1000",
                                                                   *overrides])
            trainer = Trainer(cfg)
        except ConfigError as e:
            row.update(status="not landed", note=str(e))
            rows.append(row)
            print(f"{label}: not landed ({e})", flush=True)
            continue
        try:
            jflops = analytic_flops(trainer.engine)
            assert abs(jflops - flops) <= 1e-6 * flops, (jflops, flops)
            state = trainer.init_state()
            step = trainer.step_fn(state)
            batch = trainer.put_batch(np_batch)
            t0 = time.perf_counter()
            state, _ = step(state, batch)
            jax.block_until_ready(state)
            row["compile_s"] = time.perf_counter() - t0
            for _ in range(args.warmup):
                state, _, _ = timed_block(step, state, batch, 1)
            pairs = []
            for _ in range(args.rounds):  # A B A B ...
                b_state, tb, _ = timed_block(b_step, b_state, b_batch, args.steps)
                state, tj, loss = timed_block(step, state, batch, args.steps)
                pairs.append((tb, tj))
            b_times += [tb for tb, _ in pairs]
            tj = statistics.median(tj for _, tj in pairs)
            tb = statistics.median(tb for tb, _ in pairs)
            row.update(status="measured", step_s=tj, baseline_step_s=tb,
                       tokens_per_s=tokens / tj, baseline_tokens_per_s=tokens / tb,
                       ratio=statistics.median(b / j for b, j in pairs),
                       pairs=pairs, loss=loss)
            print(f"{label}: {tj * 1e3:.1f} ms/step vs baseline {tb * 1e3:.1f} ms "
                  f"(ratio {row['ratio']:.2f}x), compile {row['compile_s']:.1f} s", flush=True)
        except Exception as e:  # a layout that validates but fails to build / compile / run
            row.update(status="error", note=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            print(f"{label}: ERROR {row['note']}", flush=True)
        rows.append(row)
        state = step = trainer = batch = None
        gc.collect()

    peaks.append(measure_cpu_peak(2048))
    peak = max(peaks)
    for row in rows:
        if row["status"] == "measured":
            row["mfu"] = flops / row["step_s"] / peak
    b_step_s = statistics.median(b_times) if b_times else float("nan")
    return {"shape": args.shape, "shape_desc": shape_desc, "preset": preset,
            "overrides": list(shape_overrides), "tokens_per_step": tokens,
            "flops_per_step": flops, "peaks": peaks, "peak": peak, "parity": parity,
            "baseline": {"step_s": b_step_s, "tokens_per_s": tokens / b_step_s,
                         "mfu": flops / b_step_s / peak, "compile_s": b_compile},
            "rows": rows, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
            "git": common.git_state(), "machine": common.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def to_markdown(r: dict, command: str) -> str:
    b = r["baseline"]
    lines = [
        f"# Throughput: plain JAX baseline vs jaxtp ({r['shape']})", "",
        f"- shape: {r['shape_desc']}",
        f"- jaxtp config: `{r['preset']}` + `{' '.join(r['overrides'])}`",
        f"- {r['tokens_per_step']} tokens / step; {r['flops_per_step']:.3g} model FLOPs / step "
        f"(6NT + attention, the same count for both)",
        f"- parity: baseline loss vs jaxtp's single-device reference on the same parameters, "
        f"|diff| = {r['parity']:.1e}",
        f"- matmul peak measured in this run (fp32 2048^3 on all cores, best of before/after): "
        f"{r['peak'] / 1e9:.1f} GFLOP/s ({', '.join(f'{p / 1e9:.1f}' for p in r['peaks'])})",
        f"- timing: compile + {r['warmup']} warm-up step each, then {r['rounds']} interleaved "
        f"rounds A B of {r['steps']} steps; medians; ratio = median over rounds of baseline "
        f"step time / jaxtp step time (> 1: jaxtp faster)",
        f"- machine: {r['machine']}; the 8 simulated devices share these cores",
        f"- code: {r['git']}; {r['date']}; `{command}`", "",
        "| layout | step (ms) | paired baseline step (ms) | tokens/s | vs baseline | CPU MFU "
        "| compile (s) | status |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        f"| baseline, 1 device (plain JAX), all pairs | {b['step_s'] * 1e3:.1f} | - | "
        f"{b['tokens_per_s']:.0f} | 1.00x | {100 * b['mfu']:.1f}% | {b['compile_s']:.1f} | "
        f"measured |",
    ]
    for row in r["rows"]:
        if row["status"] == "measured":
            lines.append(f"| jaxtp {row['layout']} | {row['step_s'] * 1e3:.1f} | "
                         f"{row['baseline_step_s'] * 1e3:.1f} | "
                         f"{row['tokens_per_s']:.0f} | {row['ratio']:.2f}x | "
                         f"{100 * row['mfu']:.1f}% | {row['compile_s']:.1f} | measured |")
        else:
            note = row["note"].replace("|", "/")
            lines.append(f"| jaxtp {row['layout']} | - | - | - | - | - | - | {row['status']}: "
                         f"{note} |")
    lines += ["", "Baseline step time per pair (ms) / jaxtp step time per pair (ms):", ""]
    for row in r["rows"]:
        if row["status"] == "measured":
            lines.append(f"- {row['layout']}: " + ", ".join(
                f"{1e3 * a:.0f}/{1e3 * j:.0f}" for a, j in row["pairs"]))
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [x for x in r["rows"] if x["status"] == "measured"]
    labels = ["baseline\n1 device"] + [x["layout"].replace(", ", "\n") for x in rows]
    tps = [r["baseline"]["tokens_per_s"]] + [x["tokens_per_s"] for x in rows]
    mfu = [100 * r["baseline"]["mfu"]] + [100 * x["mfu"] for x in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = ["gray"] + ["tab:blue"] * len(rows)
    a1.bar(range(len(tps)), tps, color=colors)
    a1.set_ylabel("tokens / s")
    a2.bar(range(len(mfu)), mfu, color=colors)
    a2.set_ylabel("CPU MFU (%) vs measured matmul peak")
    for ax in (a1, a2):
        ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{r['shape']}: plain JAX on 1 device vs jaxtp on 8 simulated CPU devices")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(common.SHAPES), default="gpt2-small-ish")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per timed block (default: 1 for gpt2-small-ish, 10 for tiny)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved A B pairs per layout")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the compile")
    p.add_argument("--layouts", nargs="*", default=None,
                   help="only layouts whose label contains one of these strings")
    p.add_argument("--out", default=str(common.RESULTS), help="directory for the results")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 10 if args.shape == "tiny" else 1
    r = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/throughput.py " + " ".join(sys.argv[1:])
    (out / "throughput.md").write_text(to_markdown(r, command.strip()))
    (out / "throughput.json").write_text(json.dumps(r, indent=1))
    plot(r, out / "throughput.png")
    print(to_markdown(r, command.strip()))
    print(f"wrote {out / 'throughput.md'}, {out / 'throughput.png'}, {out / 'throughput.json'}")


if __name__ == "__main__":
    main()
