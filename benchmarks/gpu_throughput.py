"""jaxtp train-step throughput and MFU on NVIDIA GPUs: a GPT-3 1.3B-shaped model in bf16.

Run through ``benchmarks/gpu.sh`` (which sets XLA flags and installs jaxtp); on a machine with no
GPU it prints a message, writes a "skipped" result and exits 0.

What it does, in a few minutes: for each candidate (global batch, remat) in turn it compiles the
full train step ahead of time from ``trainer.abstract_state()`` / ``engine.abstract_inputs()``,
skips the candidate when XLA's ``memory_analysis`` says it will not fit in device memory, and
otherwise allocates the state, runs ``--warmup`` + ``--steps`` steps with the compiled executable and
reports tokens/s and MFU (analytic 6NT + attention FLOPs over the dense bf16 peak,
``jaxtp.planner.hardware.PEAK_FLOPS``: 989e12 per H100 / H200). An out-of-memory at run time moves on to
the next candidate. Master weights and Adam moments are fp32 (``model.param_dtype=float32``), the
matmuls bf16 (``model.compute_dtype=bfloat16``).

Attention: ``model.attention_impl`` picks ``jax.nn.dot_product_attention``'s implementation;
``--attention cudnn`` (or ``auto`` when a small cuDNN probe compiles) runs with
``model.attention_impl=cudnn`` (cuDNN flash attention), else ``xla`` (XLA's unfused
softmax(QK^T)V, the ``[B,N,S,S]`` scores materialised). With ``--compare-attention`` and time left it also
measures the other implementation at the chosen batch.

    python benchmarks/gpu_throughput.py [--config gpt3-1.3b] [--seq 2048] [--batches 16,8,4,2]
        [--attention auto|cudnn|xla] [--out DIR] [section.field=value ...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

T_START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T_START


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def write(out: Path, result: dict) -> None:
    """Results so far, rewritten after every candidate (a timeout still leaves them)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_throughput.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "gpu_throughput.md").write_text(to_markdown(result))


def to_markdown(r: dict) -> str:
    lines = [f"# jaxtp GPU throughput ({r.get('config', '?')})", ""]
    if r.get("skipped"):
        return "\n".join(lines + [f"skipped: {r['skipped']}"]) + "\n"
    for k in ("devices", "jax", "xla_flags", "model", "overrides", "attention_probe", "peak"):
        if k in r:
            lines.append(f"- {k}: {r[k]}")
    lines += ["", "| attention | batch x seq | remat | status | step (ms) | tokens/s | MFU | "
                  "compile (s) | est. peak mem (GiB) | loss first -> last |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for c in r.get("runs", []):
        def f(key, fmt):
            return fmt.format(c[key]) if key in c and c[key] is not None else "-"
        loss = (f"{c['losses'][0]:.3f} -> {c['losses'][-1]:.3f}" if c.get("losses") else "-")
        lines.append(f"| {c['attention']} | {c['batch']} x {c['seq']} | {c['remat']} | "
                     f"{c['status']} | {f('step_s_ms', '{:.1f}')} | {f('tokens_per_s', '{:.0f}')} | "
                     f"{f('mfu_pct', '{:.1f}%')} | {f('compile_s', '{:.1f}')} | "
                     f"{f('est_peak_gib', '{:.1f}')} | {loss} |")
    if r.get("best"):
        b = r["best"]
        lines += ["", f"**best: {b['tokens_per_s']:.0f} tokens/s, MFU {b['mfu_pct']:.1f}% "
                      f"({b['attention']} attention, batch {b['batch']}, remat {b['remat']})**"]
    return "\n".join(lines) + "\n"


def is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory",
                                   "OOM", "Failed to allocate"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gpt3-1.3b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batches", default="16,8,4,2",
                   help="global batch sizes to try, largest first (remat none, then full)")
    p.add_argument("--attention", choices=("auto", "cudnn", "xla"), default="auto")
    p.add_argument("--compare-attention", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=210.0,
                   help="start no new candidate past this many seconds (one takes ~1-2 min)")
    p.add_argument("--mem-headroom", type=float, default=0.95,
                   help="skip a candidate whose estimated peak exceeds this fraction of memory")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="device memory to plan for (default: the allocator's bytes_limit)")
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: a dry run of this script's logic on CPU (MFU meaningless)")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/gpu")
    p.add_argument("overrides", nargs="*", metavar="section.field=value",
                   help="extra jaxtp overrides, e.g. parallel.model=8 on an 8-GPU host")
    args = p.parse_args()
    out = Path(args.out)
    result: dict = {"config": args.config, "runs": []}

    import jax

    try:
        gpus = jax.devices(args.platform)
    except Exception as e:  # noqa: BLE001 - RuntimeError today; any failure means "no GPU"
        gpus = []
        why = str(e).splitlines()[0]
    else:
        why = "jax found no GPU devices"
    if not gpus:
        msg = (f"no GPU visible to jax {jax.__version__} ({why}); default backend is "
               f"{jax.default_backend()}. Nothing measured.")
        log(msg)
        result["skipped"] = msg
        write(out, result)
        return 0

    import jax.numpy as jnp
    import numpy as np

    from jaxtp.configs import schema as config_lib
    from jaxtp.configs.schema import ConfigError
    from jaxtp.inspect.placement import analytic_flops
    from jaxtp.planner.hardware import PEAK_FLOPS
    from jaxtp.train.trainer import Trainer

    kind = gpus[0].device_kind
    per_device_peak = next((v for k, v in PEAK_FLOPS.items() if k in kind.lower()), None)
    peak_note = ""
    if per_device_peak is None:
        per_device_peak, peak_note = 989e12, f" (device kind {kind!r} not in PEAK_FLOPS; assumed)"
    peak = per_device_peak * len(gpus)
    mem_limit = None
    try:
        mem_limit = (gpus[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - memory_stats is optional on some runtimes
        pass
    if args.mem_limit_gib:
        mem_limit = args.mem_limit_gib * 2**30
    result.update(devices=f"{len(gpus)} x {kind}" + (f", {mem_limit / 2**30:.1f} GiB usable each"
                                                       if mem_limit else ""),
                  jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                  peak=f"{peak:.3g} FLOP/s dense bf16 ({len(gpus)} x {per_device_peak:.3g})"
                       + peak_note)
    log(f"{result['devices']}; jax {jax.__version__}; XLA_FLAGS={result['xla_flags']!r}")

    # ---- attention implementation --------------------------------------------------------
    original_dpa = jax.nn.dot_product_attention

    def cudnn_works() -> tuple[bool, str]:
        try:
            q = jnp.ones((2, 256, 16, 128), jnp.bfloat16)
            fn = functools.partial(original_dpa, is_causal=True, implementation="cudnn")
            loss = lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum()  # noqa: E731
            jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q))
            return True, "cuDNN flash attention fwd+bwd compiled and ran"
        except Exception as e:  # noqa: BLE001
            return False, f"cuDNN attention unavailable: {type(e).__name__}: {str(e)[:200]}"

    if args.attention == "xla":
        impls, probe = ["xla"], "not probed (--attention xla)"
    else:
        ok, probe = cudnn_works()
        if args.attention == "cudnn" and not ok:
            log(probe + "; falling back to xla")
        impls = ["cudnn", "xla"] if ok else ["xla"]
    result["attention_probe"] = probe
    log(f"attention: {probe}")

    base = [f"train.seq_len={args.seq}", "model.param_dtype=float32",
            "model.compute_dtype=bfloat16", "train.steps=1000", *args.overrides]
    if not any(o.startswith("parallel.") for o in args.overrides):
        base.append(f"parallel.data={len(gpus)}")
    result["overrides"] = " ".join(base)

    def candidates():
        for remat in ("none", "full"):
            for b in [int(x) for x in args.batches.split(",")]:
                if b % len(gpus) == 0:
                    yield b, remat

    def measure(impl: str, batch: int, remat: str) -> dict:
        rec = {"attention": impl, "batch": batch, "seq": args.seq, "remat": remat}
        result["runs"].append(rec)
        state = compiled = None
        try:
            cfg = config_lib.load(args.config, base + [f"train.batch_size={batch}",
                                                       f"parallel.remat={remat}",
                                                       f"model.attention_impl={impl}"])
            trainer = Trainer(cfg)
            result.setdefault("model", f"{cfg.model.n_layers} layers, d={cfg.model.d_model}, "
                                       f"{cfg.model.n_heads} heads, d_ff={cfg.model.d_ff}, vocab "
                                       f"{cfg.model.vocab_size}, {cfg.model.param_count() / 1e9:.2f}B "
                                       f"params, tied={cfg.model.tie_embeddings}")
            abstract = trainer.abstract_state()
            _, abatch = trainer.engine.abstract_inputs()
            t0 = time.perf_counter()
            compiled = trainer.step_fn(abstract).lower(abstract, abatch).compile()
            rec["compile_s"] = time.perf_counter() - t0
            mem = compiled.memory_analysis()
            if mem is not None:
                est = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                       + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
                rec["est_peak_gib"] = est / 2**30
                if mem_limit and est > args.mem_headroom * mem_limit:
                    rec["status"] = "skipped: estimated peak does not fit"
                    log(f"{impl} b={batch} remat={remat}: est. {est / 2**30:.1f} GiB > "
                        f"{args.mem_headroom:.0%} of {mem_limit / 2**30:.1f} GiB, next")
                    return rec
            log(f"{impl} b={batch} remat={remat}: compiled in {rec['compile_s']:.1f} s, "
                f"est. peak {rec.get('est_peak_gib', float('nan')):.1f} GiB; running")
            state = trainer.init_state()
            rng = np.random.default_rng(0)
            toks = rng.integers(0, cfg.model.vocab_size, (batch, args.seq + 1), np.int32)
            data = trainer.put_batch({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
            losses, times = [], []
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                state, metrics = compiled(state, data)
                losses.append(float(metrics["loss"]))  # host sync each step: times whole steps
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            dt = statistics.median(times)
            flops = analytic_flops(trainer.engine)
            rec.update(status="measured", step_s_ms=1e3 * dt, tokens_per_s=batch * args.seq / dt,
                       mfu_pct=100 * flops / dt / peak, flops_per_step=flops, losses=losses,
                       step_times_ms=[1e3 * t for t in times])
            hlo_path = out / f"step_{impl}_b{batch}_{remat}.hlo.txt"
            try:  # the compiled program, for offline reading (fusions, cuDNN custom-calls)
                out.mkdir(parents=True, exist_ok=True)
                hlo_path.write_text(compiled.as_text())
                rec["hlo"] = str(hlo_path)
            except Exception:  # noqa: BLE001
                pass
            try:
                rec["peak_bytes_in_use_gib"] = gpus[0].memory_stats()["peak_bytes_in_use"] / 2**30
            except Exception:  # noqa: BLE001
                pass
            log(f"{impl} b={batch} remat={remat}: {1e3 * dt:.1f} ms/step, "
                f"{rec['tokens_per_s']:.0f} tokens/s, MFU {rec['mfu_pct']:.1f}%, loss "
                f"{losses[0]:.3f} -> {losses[-1]:.3f}")
        except ConfigError as e:
            rec["status"] = f"config error: {e}"
            log(rec["status"])
        except Exception as e:  # noqa: BLE001
            rec["status"] = ("out of memory" if is_oom(e) else
                             f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            log(f"{impl} b={batch} remat={remat}: {rec['status']}")
            if not is_oom(e):
                traceback.print_exc()
        finally:
            state = compiled = None
            gc.collect()
            write(out, result)
        return rec

    best = None
    for batch, remat in candidates():
        if elapsed() > args.budget_s:
            log("time budget spent; stopping")
            break
        rec = measure(impls[0], batch, remat)
        if rec["status"] == "measured":
            best = rec
            break
        if rec["status"].startswith("error") and impls[0] == "cudnn":
            log("cuDNN attention failed inside the model; switching to xla")
            impls = ["xla"]
            rec = measure("xla", batch, remat)
            if rec["status"] == "measured":
                best = rec
                break
    if best and args.compare_attention and len(impls) > 1 and elapsed() < args.budget_s:
        other = measure(impls[1], best["batch"], best["remat"])
        if other["status"] == "measured" and other["tokens_per_s"] > best["tokens_per_s"]:
            best = other
    result["best"] = best
    write(out, result)
    print(to_markdown(result), flush=True)
    log(f"wrote {out / 'gpu_throughput.md'} and {out / 'gpu_throughput.json'}")
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
