"""jaxtp against MaxText on MaxText's own terms: the same model, global batch and simulated 8-device
CPU mesh, each trained by its own training loop, in interleaved rounds.

Model (defaults): d=512, 4 layers, 8 heads x 64, d_ff=1408 SwiGLU, vocab 256 untied, RMSNorm,
RoPE, sequence 256, global batch 16, fp32 (13,111,808 parameters; both sides print their count).
Each run is a fresh process: jaxtp's ``train.run`` (its real loop: prefetched host data, metrics
one step late) or MaxText's ``maxtext.trainers.pre_train.train`` (synthetic data made on the
devices), ``--steps`` steps of which the first ``--warmup`` are dropped; tokens/s comes from the
sum of the remaining steps' times (jaxtp: ``step_time_s`` of each one-step log window; MaxText:
its ``completed step: k, seconds: s`` lines). Rounds alternate the order (A B, then B A, ...), the
ratio is taken per round. Both sides' FLOPs are :func:`jaxtp.train.flops.model_flops` of the one model.
The first round also compiles each side's train step for the collective census: jaxtp's from
``Trainer.step_fn(...).lower(...).compile().as_text()``, MaxText's from the optimized HLO that
``XLA_FLAGS=--xla_dump_to`` writes; both go through :func:`jaxtp.inspect.hlo.collectives`.

MaxText is installed on first use into ``~/.cache/jaxtp/maxtext-venv`` (Python >= 3.12 from
pyenv or PATH; ``pip install --no-deps maxtext`` plus the modules its train entry imports, listed
in ``MAXTEXT_MODULES``); ``--jaxtp-only`` (or no MaxText and ``--no-install``) runs jaxtp alone.

    python benchmarks/vs_maxtext.py                      # 4 layouts, 2 rounds, default remat
    python benchmarks/vs_maxtext.py --remat matched --layouts "data=2 x model=4" model=8
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from jaxtp.cli import host_malloc  # noqa: E402

HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("JAXTP_MAXTEXT_VENV", Path.home() / ".cache/jaxtp/maxtext-venv"))
# PyPI packages MaxText 0.2.5's train entry imports with hardware=cpu, dataset_type=synthetic
# (found by importing it and adding what was missing); installed with --no-deps
MAXTEXT_MODULES = (
    "jax[cpu] flax optax orbax-checkpoint pathwaysutils fastapi starlette annotated_doc anyio "
    "pydantic pydantic_core typing_inspection annotated_types opentelemetry-api requests urllib3 "
    "idna certifi uvicorn click omegaconf packaging jinja2 markupsafe aqtp qwix tokamax "
    "immutabledict xprof fire termcolor six jaxtyping einshape tqdm huggingface_hub transformers "
    "regex httpx2 filelock httpcore2 truststore h11 safetensors tokenizers grain cloudpickle "
    "portpicker array_record drjax wadler_lindig pillow tiktoken sentencepiece sympy mpmath "
    "ml_collections").split()

# name -> (jaxtp overrides, MaxText ici_* degrees (data, fsdp, tensor, tensor_sequence), mesh)
LAYOUTS = {
    "data=2 x model=4": (("parallel.data=2", "parallel.model=4"), (2, 1, 4, 1),
                         {"data": 2, "model": 4}),
    "model=8": (("parallel.data=1", "parallel.model=8"), (1, 1, 8, 1), {"model": 8}),
    "fsdp=8": (("parallel.data=1", "parallel.fsdp=8"), (1, 8, 1, 1), {"fsdp": 8}),
    "data=2 x model=4, SP": (("parallel.data=2", "parallel.model=4",
                              "parallel.sequence_parallel=true"), (2, 1, 1, 4),
                             {"data": 2, "model": 4}),
}
COLLECTIVE_TIMEOUT = ("--xla_cpu_collective_call_terminate_timeout_seconds=900 "
                      "--xla_cpu_collective_timeout_seconds=900")
REMAT = {"default": ("none", "full"), "matched": ("selective", "minimal_with_context")}


def jaxtp_overrides(a, layout: str, steps: int, out: str) -> list[str]:
    return [f"model.d_model={a.d_model}", f"model.n_layers={a.layers}", f"model.n_heads={a.heads}",
            f"model.n_kv_heads={a.heads}", f"model.d_ff={a.d_ff}", f"model.vocab_size={a.vocab}",
            f"model.max_seq_len={a.seq}", "model.activation=swiglu",
            "model.tie_embeddings=false", f"train.batch_size={a.batch}",
            f"train.seq_len={a.seq}", f"train.steps={steps}", "train.log_every=1",
            "train.checkpoint_every=0", "train.eval_every=1000000", "train.eval_batches=1",
            "train.tensorboard=false", f"train.out_dir={out}",
            f"parallel.remat={REMAT[a.remat][0]}", *LAYOUTS[layout][0]]


def maxtext_args(a, layout: str, steps: int, out: str) -> list[str]:
    dp, fsdp, tp, tsp = LAYOUTS[layout][1]
    return [str(maxtext_config()), "run_name=vs_jaxtp", f"base_output_directory={out}",
            "hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=synthetic",
            f"steps={steps}", f"log_period={steps}", "enable_checkpointing=false",
            "enable_tensorboard=false", "enable_dropout=false", "attention=dot_product",
            f"remat_policy={REMAT[a.remat][1]}", "dtype=float32", "weight_dtype=float32",
            f"base_emb_dim={a.d_model}", f"base_num_query_heads={a.heads}",
            f"base_num_kv_heads={a.heads}", f"base_mlp_dim={a.d_ff}",
            f"base_num_decoder_layers={a.layers}", f"head_dim={a.d_model // a.heads}",
            f"vocab_size={a.vocab}", f"max_target_length={a.seq}",
            f"per_device_batch_size={a.batch / 8:g}", "logits_via_embedding=false",
            f"ici_data_parallelism={dp}", f"ici_fsdp_parallelism={fsdp}",
            f"ici_tensor_parallelism={tp}", f"ici_tensor_sequence_parallelism={tsp}"]


# ---- MaxText's environment ------------------------------------------------------------------
def maxtext_python() -> Path:
    return VENV / "bin" / "python"


def maxtext_config() -> Path:
    out = subprocess.run([str(maxtext_python()), "-c", "import maxtext, os; print(os.path.dirname("
                          "maxtext.__file__))"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()) / "configs" / "base.yml"


def maxtext_ready() -> str | None:
    """``None`` if MaxText's train entry imports in its venv, else the error's last line."""
    if not maxtext_python().exists():
        return f"no MaxText venv at {VENV}"
    r = subprocess.run([str(maxtext_python()), "-c", "import maxtext.trainers.pre_train.train"],
                       capture_output=True, text=True, env=maxtext_env())
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def find_python312() -> str:
    candidates = sorted(Path("/root/.pyenv/versions").glob("3.1[2-9]*/bin/python"), reverse=True)
    for c in [*map(str, candidates), "python3.13", "python3.12"]:
        r = subprocess.run([c, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                           capture_output=True, text=True) if Path(c).exists() or "/" not in c \
            else None
        if r is not None and r.returncode == 0 and r.stdout.strip() == "True":
            return c
    raise SystemExit("MaxText needs Python >= 3.12 and none was found (pyenv or PATH)")


def install_maxtext() -> None:
    print(f"installing MaxText into {VENV} (first use; a few minutes)", flush=True)
    if not maxtext_python().exists():
        subprocess.run([find_python312(), "-m", "venv", str(VENV)], check=True)
    pip = [str(maxtext_python()), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--no-deps", "maxtext"], check=True)
    subprocess.run([*pip, "jax[cpu]", "flax", "optax", "orbax-checkpoint"], check=True)
    subprocess.run([*pip, "--no-deps", *MAXTEXT_MODULES[4:]], check=True)


def allocator(a, side: str) -> dict:
    """The host-allocator environment for ``side`` ("jaxtp" or "maxtext"): ``--preload LIB``
    puts LIB under both (``LD_PRELOAD``); ``--host-malloc hugetlb`` glibc's transparent-huge-page
    tunable under both; ``glibc`` neither; ``each`` (the default) runs each side the way its own
    command would: jaxtp as ``jaxtp train`` does on a CPU host (:mod:`jaxtp.cli.host_malloc`),
    MaxText under glibc as ``train.py`` starts."""
    if a.preload:
        return {"LD_PRELOAD": a.preload}
    if a.host_malloc == "hugetlb":
        return {"GLIBC_TUNABLES": host_malloc.HUGETLB}
    if a.host_malloc == "each" and side == "jaxtp":
        env = {k: v for k, v in os.environ.items() if k != host_malloc.ENV}
        change = host_malloc.plan({**env, "JAX_PLATFORMS": "cpu"}, ["train"])
        return change[0] if change else {}
    return {}


def side_env(drop: tuple[str, ...], alloc: dict) -> dict:
    """The environment a side runs in: this one, less ``drop``, with its host allocator
    (:func:`allocator`) on top."""
    env = {k: v for k, v in os.environ.items()
           if k not in drop and k != "JAXTP_HOST_MALLOC_APPLIED"}
    env.update(alloc)
    return env


def maxtext_env(dump: str | None = None, alloc: dict | None = None) -> dict:
    env = side_env(("XLA_FLAGS", "PYTHONPATH"), alloc or {})
    # 8 simulated devices on a loaded 2-core host can take longer than XLA:CPU's default 40 s to
    # meet at a collective, which aborts the process; both sides get the longer limit
    flags = f"--xla_force_host_platform_device_count=8 {COLLECTIVE_TIMEOUT}"
    if dump:
        flags += (f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                  " --xla_dump_hlo_module_re=.*train_step.*")
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE")
    return env


# ---- one run of each side -------------------------------------------------------------------
def cpu_seconds_of(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux ``/proc``), ``None`` elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_watched(cmd: list[str], env: dict, stall_s: float = 90.0, timeout_s: float = 1800.0,
                poll_s: float = 5.0) -> subprocess.CompletedProcess:
    """``subprocess.run`` that kills the process (return code -9) once it has used less than
    one CPU second in ``stall_s`` seconds: MaxText 0.2.5 on jax 0.12's XLA:CPU sometimes
    deadlocks mid-run, its 8 devices waiting at different all-reduces (seen 2026-12-06; with
    the collective limit at 900 s it would otherwise sit idle for 15 minutes, then abort).
    Without ``/proc`` (not Linux) only ``timeout_s`` applies."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        start = last_t = time.monotonic()
        last_cpu = cpu_seconds_of(proc.pid)
        while proc.poll() is None:
            time.sleep(poll_s)
            now, cpu = time.monotonic(), cpu_seconds_of(proc.pid)
            if cpu is not None and last_cpu is not None and cpu - last_cpu >= 1.0:
                last_t, last_cpu = now, cpu
            stalled = last_cpu is not None and now - last_t > stall_s
            if stalled or now - start > timeout_s:
                why = ("timed out" if now - start > timeout_s
                       else f"no CPU progress for {now - last_t:.0f} s")
                print(f"  killing pid {proc.pid}: {why}", flush=True)
                proc.kill()
                proc.wait()
        out.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), "")


def run_maxtext(a, layout: str, census: bool, tries: int = 3) -> dict:
    """One MaxText run; a run that dies or stalls before its last step is retried (MaxText
    0.2.5 on this host sometimes aborts, SIGABRT, or deadlocks mid-run), a death after its last
    step is accepted."""
    for attempt in range(tries):
        with tempfile.TemporaryDirectory() as tmp:
            dump = str(Path(tmp) / "hlo") if census else None
            cmd = [str(maxtext_python()), str(HERE / "maxtext_runner.py"),
                   *maxtext_args(a, layout, a.steps, str(Path(tmp) / "out"))]
            r = run_watched(cmd, maxtext_env(dump, allocator(a, "maxtext")))
            log = r.stdout + r.stderr
            times = {int(m.group(1)): float(m.group(2))
                     for m in re.finditer(r"completed step: (\d+), seconds: ([\d.]+)", log)}
            if r.returncode == 0 or len(times) == a.steps:
                params = re.search(r"VS_MAXTEXT_PARAMS (\d+)", log)
                out = {"times": [times[k] for k in sorted(times)],
                       "params": int(params.group(1)) if params else None,
                       "exit": r.returncode}
                if census:
                    texts = sorted(Path(dump).glob("*after_optimizations.txt"),
                                   key=lambda p: p.stat().st_size)
                    out["hlo"] = texts[-1].read_text() if texts else ""
                return out
        saved = Path(tempfile.gettempdir()) / f"vs_maxtext_failed_{attempt}.log"
        saved.write_text(log)
        print(f"  MaxText exited {r.returncode} after {len(times)} of {a.steps} steps "
              f"(log: {saved}){'; retrying' if attempt + 1 < tries else ''}", flush=True)
    raise RuntimeError(f"MaxText exited {r.returncode} {tries} times; last log in {saved}")


def run_jaxtp(a, layout: str, census: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--worker", "--layout", layout,
               "--json", str(Path(tmp) / "w.json"), *worker_flags(a)]
        if census:
            cmd.append("--census")
        env = side_env(("XLA_FLAGS",), allocator(a, "jaxtp"))
        env["XLA_FLAGS"] = COLLECTIVE_TIMEOUT
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800,
                           check=False)
        if r.returncode:
            raise RuntimeError(f"jaxtp exited {r.returncode}:\n{r.stderr[-2000:]}")
        return json.loads((Path(tmp) / "w.json").read_text())


def worker_flags(a) -> list[str]:
    return [f"--d-model={a.d_model}", f"--layers={a.layers}", f"--heads={a.heads}",
            f"--d-ff={a.d_ff}", f"--vocab={a.vocab}", f"--seq={a.seq}", f"--batch={a.batch}",
            f"--steps={a.steps}", f"--remat={a.remat}"]


def worker(a) -> None:
    """One jaxtp run in this process: the real training loop, then (``--census``) the step's HLO."""
    common.force_cpu_devices(8)
    from jaxtp.configs import schema as config_lib
    from jaxtp.train import trainer as train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_lib.load("tiny", jaxtp_overrides(a, a.layout, a.steps, tmp))
        trainer = train.Trainer(cfg)
        records = train.run(cfg, trainer=trainer)
        out = {"times": [r["step_time_s"] for r in records],
               "host": [r["host_time_s"] for r in records],
               "params": cfg.model.param_count()}
        if a.census:
            state = trainer.abstract_state()
            _, batch = trainer.engine.abstract_inputs()
            out["hlo"] = trainer.step_fn(state).lower(state, batch).compile().as_text()
    Path(a.json).write_text(json.dumps(out))


# ---- the comparison -------------------------------------------------------------------------
def steady(run: dict, warmup: int, tokens: int) -> float:
    times = run["times"][warmup:]
    return tokens * len(times) / sum(times) if times and sum(times) > 0 else float("nan")


def census_rows(hlo_text: str, mesh: dict) -> dict:
    from jaxtp.inspect import hlo

    rows = hlo.census(hlo.collectives(hlo_text, mesh))
    return {f"{r['kind']} over {'+'.join(r['axes']) or '-'}": (r["count"], r["bytes"])
            for r in rows}


_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(", re.M)
OPS = ("dot", "fusion", "copy", "transpose", "all-reduce", "all-gather", "reduce-scatter",
       "collective-permute", "while", "custom-call")


def op_counts(hlo_text: str) -> dict:
    """Static op counts of the optimized module (a loop body's ops once; async pairs once), and
    the instructions from outside the forward and backward pass (JAX name stack without
    ``jvp(`` / ``transpose(``: the gradient norm, clipping and the AdamW update; optax's own
    names do not survive into the HLO)."""
    found = collections.Counter(_OP.findall(hlo_text))
    out = {k: found[k] + found[k + "-start"] for k in OPS}
    out["instructions"] = sum(found.values())
    names = re.findall(r' = .*op_name="jit\([\w]+\)/([^"]*)"', hlo_text)
    out["update (not jvp/transpose)"] = sum(1 for n in names if "jvp(" not in n)
    return out


def config_differences(a) -> list[str]:
    jr, mr = REMAT[a.remat]
    return [f"- remat: jaxtp `parallel.remat={jr}`; MaxText `remat_policy={mr}`",
            "- attention: jaxtp `jax.nn.dot_product_attention` (XLA); MaxText "
            "`attention=dot_product` (its own einsum attention)",
            "- data: jaxtp reads byte-tokenised text (the stdlib corpus) on the host, prefetched "
            "one step ahead (`train.prefetch=1`); MaxText `dataset_type=synthetic` (made on the "
            "devices)",
            "- both: fp32 params and compute, AdamW + clip 1.0, scanned layers, no dropout, "
            "GSPMD / Shardy partitioning from logical names; SP row: jaxtp "
            "`parallel.sequence_parallel=true` on model=4, MaxText "
            "`ici_tensor_sequence_parallelism=4`",
            f"- host allocator: {allocator_line(a)}"]


def allocator_line(a) -> str:
    def name(env: dict) -> str:
        if "LD_PRELOAD" in env:
            return f"`LD_PRELOAD={env['LD_PRELOAD']}`"
        if "GLIBC_TUNABLES" in env:
            return f"glibc malloc, `GLIBC_TUNABLES={env['GLIBC_TUNABLES']}`"
        return "glibc malloc (defaults)"
    j, m = name(allocator(a, "jaxtp")), name(allocator(a, "maxtext"))
    if j == m:
        return f"{j} (both)"
    return f"jaxtp {j} (as `jaxtp train` runs on a CPU host), MaxText {m} (`--host-malloc each`)"


def measure(a, layout: str, have_maxtext: bool) -> dict:
    tokens = a.batch * a.seq
    rounds = []
    census = {}
    for r in range(a.rounds):
        order = ["jaxtp", "maxtext"] if r % 2 == 0 else ["maxtext", "jaxtp"]
        got = {}
        for side in order:
            if side == "maxtext" and not have_maxtext:
                continue
            faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
            run = (run_jaxtp if side == "jaxtp" else run_maxtext)(a, layout, census=r == 0)
            # minor page faults of the whole run (startup and compile included); sequential
            # runs, so the children's total grows by this run's alone (a retried run: all tries)
            run["faults"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults
            if "hlo" in run:
                text = run.pop("hlo")
                census[side] = census_rows(text, LAYOUTS[layout][2])
                census[side + "_ops"] = op_counts(text)
                if a.hlo_dir:
                    Path(a.hlo_dir).mkdir(parents=True, exist_ok=True)
                    name = re.sub(r"[^\w]+", "_", f"{side} {layout} {a.remat}")
                    (Path(a.hlo_dir) / f"{name}.hlo.txt").write_text(text)
                census[side + "_params"] = run["params"]
            got[side] = run
            print(f"  round {r + 1} {side}: {steady(run, a.warmup, tokens):.0f} tokens/s "
                  f"(steps {[round(t, 3) for t in run['times']]}; {run['faults']:,} minor "
                  "page faults)", flush=True)
        rounds.append({"order": order, **{s: steady(v, a.warmup, tokens) for s, v in got.items()},
                       "faults": {s: v["faults"] for s, v in got.items()},
                       "host": (statistics.mean(got["jaxtp"]["host"][a.warmup:])
                                / statistics.mean(got["jaxtp"]["times"][a.warmup:]))})
    return {"layout": layout, "rounds": rounds, "census": census}


def report(a, results: list[dict], blocked: str | None) -> str:
    from jaxtp.configs import schema as config_lib
    from jaxtp.train.flops import model_flops

    cfg = config_lib.load("tiny", jaxtp_overrides(a, "model=8", a.steps, "/tmp/unused"))
    flops = model_flops(cfg.model, batch_size=a.batch, seq_len=a.seq)
    lines = ["# jaxtp vs MaxText on the simulated 8-device CPU mesh", "",
             f"- machine: {common.machine()}; code: {common.git_state()}; "
             f"{time.strftime('%Y-%m-%d %H:%M %Z')}",
             f"- model: d={a.d_model}, {a.layers} layers, {a.heads} heads, d_ff={a.d_ff} SwiGLU, "
             f"vocab {a.vocab}, seq {a.seq}, global batch {a.batch}, fp32; jaxtp param count "
             f"{cfg.model.param_count():,}; model FLOPs per step {flops / 1e9:.2f} GFLOP "
             "(jaxtp.train.flops.model_flops, both sides)",
             f"- {a.rounds} interleaved rounds per layout (odd rounds jaxtp first, even rounds "
             f"MaxText first), {a.steps} steps per run, the first {a.warmup} dropped; tokens/s "
             "from the summed step times", f"- command: `python benchmarks/vs_maxtext.py "
             f"{' '.join(sys.argv[1:])}`", "", "Config differences:", *config_differences(a), ""]
    if blocked:
        lines += [f"**MaxText not run**: {blocked}", ""]
    lines += ["| layout | jaxtp tokens/s per round | MaxText tokens/s per round | "
              "ratio per round | median ratio | jaxtp host time / step | minor page faults per "
              "run, jaxtp / MaxText (median) |",
              "|---|---|---|---|---:|---:|---:|"]
    def faults(rs, side):
        xs = [r["faults"][side] for r in rs if side in r.get("faults", {})]
        return f"{statistics.median(xs) / 1e6:.2f} M" if xs else "-"

    for res in results:
        rs = res["rounds"]
        ratios = [r["jaxtp"] / r["maxtext"] for r in rs if "maxtext" in r]
        fmt = lambda xs: ", ".join(f"{x:.0f}" for x in xs) or "-"  # noqa: E731
        lines.append(
            f"| {res['layout']} | {fmt(r['jaxtp'] for r in rs)} | "
            f"{fmt(r['maxtext'] for r in rs if 'maxtext' in r)} | "
            f"{', '.join(f'{x:.2f}x' for x in ratios) or '-'} | "
            f"{f'{statistics.median(ratios):.2f}x' if ratios else '-'} | "
            f"{100 * statistics.median(r['host'] for r in rs):.2f}% | "
            f"{faults(rs, 'jaxtp')} / {faults(rs, 'maxtext')} |")
    lines += ["", "Collective census of the compiled train step (per device per step: count, "
              "MiB; loop trip counts multiplied in):", ""]
    for res in results:
        c = res["census"]
        lines += [f"### {res['layout']}", "",
                  f"params: jaxtp {c.get('jaxtp_params')}, MaxText {c.get('maxtext_params')}",
                  "", "| collective | jaxtp | MaxText |", "|---|---:|---:|"]
        keys = sorted(set(c.get("jaxtp", {})) | set(c.get("maxtext", {})))
        cell = lambda side, k: (f"{c[side][k][0]} / {c[side][k][1] / 2**20:.1f}"  # noqa: E731
                                if k in c.get(side, {}) else "-")
        for k in keys:
            lines.append(f"| {k} | {cell('jaxtp', k)} | {cell('maxtext', k)} |")
        tot = lambda side: (f"{sum(v[0] for v in c[side].values())} / "  # noqa: E731
                            f"{sum(v[1] for v in c[side].values()) / 2**20:.1f}"
                            if side in c else "-")
        lines += [f"| **total** | {tot('jaxtp')} | {tot('maxtext')} |", ""]
        if "jaxtp_ops" in c:
            lines += ["Op counts of the compiled step (static: a loop body's ops counted once):",
                      "", "| op | jaxtp | MaxText |", "|---|---:|---:|"]
            for k in c["jaxtp_ops"]:
                lines.append(f"| {k} | {c['jaxtp_ops'][k]} | "
                             f"{c.get('maxtext_ops', {}).get(k, '-')} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--remat", choices=list(REMAT), default="default")
    p.add_argument("--jaxtp-only", action="store_true", help="do not run (or install) MaxText")
    p.add_argument("--no-install", action="store_true", help="run MaxText only if installed")
    p.add_argument("--out", default=str(common.RESULTS))
    p.add_argument("--name", default="vs_maxtext", help="results/<name>.{md,json}")
    p.add_argument("--hlo-dir", default=None, help="write both compiled steps' HLO text here")
    p.add_argument("--host-malloc", choices=("each", "glibc", "hugetlb"), default="each",
                   help="each: every side as its own command runs it (jaxtp train: glibc with "
                        "transparent huge pages on a CPU host; MaxText: glibc); glibc: both "
                        "plain glibc; hugetlb: both with GLIBC_TUNABLES=glibc.malloc.hugetlb=1")
    p.add_argument("--preload", default=None,
                   help="a host allocator both sides run with (LD_PRELOAD; overrides "
                        "--host-malloc), e.g. "
                        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    for flag, default in [("--d-model", 512), ("--layers", 4), ("--heads", 8), ("--d-ff", 1408),
                          ("--vocab", 256), ("--seq", 256), ("--batch", 16)]:
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--census", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.warmup >= a.steps:
        raise SystemExit(f"--warmup={a.warmup} must be below --steps={a.steps}")
    common.force_cpu_devices(8)
    blocked = "--jaxtp-only" if a.jaxtp_only else maxtext_ready()
    if blocked and not (a.jaxtp_only or a.no_install):
        try:
            install_maxtext()
            blocked = maxtext_ready()
        except (subprocess.CalledProcessError, SystemExit) as e:
            blocked = f"installing MaxText failed: {e}"
    if blocked:
        print(f"MaxText not run: {blocked}", flush=True)
    results = []
    for layout in a.layouts:
        print(f"{layout}:", flush=True)
        results.append(measure(a, layout, have_maxtext=blocked is None))
    text = report(a, results, blocked)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.md").write_text(text)
    (out / f"{a.name}.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
