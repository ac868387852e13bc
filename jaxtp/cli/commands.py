"""``jaxtp train | inspect | plan | sample | eval | prepare-data | import-hf | export-hf`` (also
``python -m jaxtp``).

One convention across the verbs: ``--run DIR`` names a run directory (what ``jaxtp train``
writes, ``runs/<preset>`` by default, or ``jaxtp import-hf`` / ``Model.save``); ``--devices N``
simulates N CPU devices; ``--config NAME`` is a preset and dotted ``section.field=value``
overrides change it, e.g. ``jaxtp inspect --config tiny parallel.data=2 parallel.model=4``.
``sample``, ``eval`` and ``export-hf`` load a run with optional ``parallel.*`` overrides (another
layout to load it on).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import jax

from jaxtp.ckpt import CheckpointSaveError
from jaxtp.configs import (
    PRESETS,
    ConfigError,
    apply_overrides,
    check_devices,
    check_hardware_file,
    get_preset,
    load,
    validate_model,
    validate_settings,
)
from jaxtp.parallel import distributed, prepare_cpu_runtime, use_cpu_devices
from jaxtp.train import TrainingDiverged

ALIASES = """\
older spellings, still accepted:
  jaxtp train train.out_dir=DIR      = jaxtp train --run DIR
  jaxtp import-hf SRC DIR            = jaxtp import-hf SRC --run DIR
  jaxtp export-hf DIR OUT            = jaxtp export-hf --run DIR --out OUT
  jaxtp plan --devices N             = jaxtp plan --world-size N --devices N
"""
RUN_HELP = "the run directory (what jaxtp train writes, runs/<preset> by default, or Model.save)"
DEVICES_HELP = ("simulate N CPU devices (default: the accelerators if any, else 8 simulated CPU "
                "devices); with several processes, those of each process")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxtp", description=__doc__, epilog=ALIASES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True)
    devices = argparse.ArgumentParser(add_help=False)
    devices.add_argument("--devices", type=int, default=None, metavar="N", help=DEVICES_HELP)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        return verbs.add_parser(name, help=help, parents=[devices])

    ins = verb("inspect", "compile the step ahead of time and print the placement report (bytes, "
                          "collective census, FLOPs)")
    _config_args(ins)
    ins.add_argument("--json", action="store_true", help="print the report as one JSON object")
    ins.add_argument("--hlo-out", default=None, metavar="FILE",
                     help="write the optimized HLO text to FILE")
    ins.add_argument("--step", choices=("grad", "loss", "train"), default="grad",
                     help="compile loss and gradients (default), the forward loss only, or the "
                          "whole train step (optimizer update included; adds the optimizer "
                          "state's bytes)")
    tr = verb("train", "train a model (default: the tiny preset on the embedded corpus, into "
                       "runs/tiny)")
    tr.add_argument("--run", default=None, metavar="DIR",
                    help=f"{RUN_HELP}; sets train.out_dir. Without --config, a run directory "
                         f"with a config.json continues with its config")
    _config_args(tr)
    _plan_args(verb("plan", "rank parallel layouts for a model on N devices by a cost model "
                            "(memory and step time); --verify compiles the best"))
    _sample_args(verb("sample", "generate text from a trained run (KV-cache decode on the "
                                "run's layout); streams the prompt's continuation (several "
                                "prompts: printed at the end)"))
    _eval_args(verb("eval", "held-out loss / perplexity / bits per byte of a text file, or "
                            "multiple-choice accuracy of a .jsonl file"))
    _hf_args(verb)
    _prepare_data_args(verbs.add_parser(
        "prepare-data", help="tokenise documents (text, JSONL, Parquet, ArrayRecord) once into "
                             "ArrayRecord shards that data.path / data.mixture read"))
    return p


def _config_args(sub) -> None:
    sub.add_argument("--config", default=None,
                     help=f"preset name: {', '.join(sorted(PRESETS))} (default: tiny; train "
                          f"continuing a run directory with a config.json: its config)")
    dist = sub.add_argument_group(
        "multi-process (one process per host; SLURM, Open MPI and TPU pods are detected "
        "without these)")
    dist.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="address of process 0, the same on every process "
                           "(env JAXTP_COORDINATOR)")
    dist.add_argument("--num-processes", type=int, default=None, metavar="N",
                      help="number of processes (env JAXTP_NUM_PROCESSES)")
    dist.add_argument("--process-id", type=int, default=None, metavar="I",
                      help="this process, 0 .. N-1 (env JAXTP_PROCESS_ID)")
    sub.add_argument("overrides", nargs="*", metavar="section.field=value")


def _plan_args(pl) -> None:
    from jaxtp.planner import HARDWARE

    pl.add_argument("--config", default="tiny",
                    help=f"preset name: {', '.join(sorted(PRESETS))} (default: tiny)")
    pl.add_argument("--world-size", type=int, default=None, metavar="N",
                    help="how many devices to plan for (default: --devices)")
    pl.add_argument("--hardware", default="a100",
                    help=f"hardware preset: {', '.join(HARDWARE)} (default: a100); change any "
                         f"field with hardware.FIELD=VALUE, e.g. hardware.hbm_bytes=40e9")
    pl.add_argument("--hardware-file", default=None, metavar="FILE.json",
                    help='hardware as a JSON object of fields ({"base": "h100", ...} changes '
                         'a preset)')
    pl.add_argument("--json", action="store_true",
                    help="print the ranked layouts as a JSON list, best first")
    pl.add_argument("--verify", type=int, default=0, metavar="K",
                    help="compile the grad step of the best K layouts this version runs, on "
                         "--world-size simulated CPU devices (slow for large N), and show "
                         "predicted vs compiled bytes and census")
    pl.add_argument("--top", type=int, default=10, help="layouts to show (0: all; default 10)")
    pl.add_argument("--runnable", action="store_true",
                    help="only layouts this version of jaxtp's engine accepts")
    pl.add_argument("--activations", choices=("jaxtp", "megatron"), default="jaxtp",
                    help="activation-memory model: jaxtp's own ops (default) or Korthikanti et "
                         "al.'s Megatron-LM formula")
    pl.add_argument("overrides", nargs="*", metavar="key=value",
                    help="config overrides; parallel.<field>=V / train.microbatches=V pin that "
                         "choice; hardware.FIELD=V changes the hardware")


def _loads_a_run(sub) -> None:
    sub.add_argument("--run", required=True, metavar="DIR", help=RUN_HELP)
    sub.add_argument("overrides", nargs="*", metavar="parallel.field=value",
                     help="another layout to load the run on, e.g. parallel.model=4")


def _sample_args(sa) -> None:
    _loads_a_run(sa)
    sa.add_argument("--prompt", required=True, action="append",
                    help="prompt text (repeat for a batch of prompts)")
    sa.add_argument("--max-new-tokens", type=int, default=64)
    sa.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    sa.add_argument("--top-k", type=int, default=0, help="0: off")
    sa.add_argument("--top-p", type=float, default=1.0, help="1: off")
    sa.add_argument("--seed", type=int, default=0)


def _eval_args(ev) -> None:
    _loads_a_run(ev)
    ev.add_argument("--data", required=True, metavar="PATH",
                    help='a text file, or a .jsonl of {"context", "choices", "answer"} items')
    ev.add_argument("--max-tokens", type=int, default=None,
                    help="score at most this many tokens of a text file")
    ev.add_argument("--json", action="store_true", help="print the metrics as one JSON object")


def _hf_args(verb) -> None:
    imp = verb("import-hf", "import a Hugging Face Llama-family model directory into a run "
                            "directory (train continues it)")
    imp.add_argument("src", help="a local HF directory: config.json, *.safetensors, tokenizer")
    imp.add_argument("--run", default=None, metavar="DIR",
                     help="the run directory to write (then: jaxtp train --run DIR)")
    exp = verb("export-hf", "write a run's model as a Hugging Face directory that transformers "
                            "loads")
    exp.add_argument("--run", default=None, metavar="DIR", help=RUN_HELP)
    exp.add_argument("--out", default=None, metavar="HF_DIR", help="the HF directory to write")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    for sub in (imp, exp):
        sub.add_argument("overrides", nargs="*", metavar="parallel.field=value",
                         help="the layout to load onto (default: the run's / data parallel)")


def _prepare_data_args(pre) -> None:
    pre.add_argument("src", nargs="+", help="files, directories or globs of documents")
    pre.add_argument("--out", required=True, help="the directory to write")
    pre.add_argument("--tokenizer", default="byte",
                     help="byte (default), bpe (train one of --vocab-size tokens on the "
                          "sources), or the path of a HuggingFace tokenizer.json")
    pre.add_argument("--vocab-size", type=int, default=4096, help="for --tokenizer bpe")
    pre.add_argument("--text-field", default="text",
                     help="the JSONL field / Parquet column that holds the text")
    pre.add_argument("--eos-id", type=int, default=-1,
                     help="end-of-document id (default: the tokenizer's)")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; positionals after an option (``train a=1 --run d b=2``) join the
    verb's list (argparse takes one run of them)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    listed = getattr(args, "src" if args.verb == "prepare-data" else "overrides", None)
    if extra and (not isinstance(listed, list) or any(a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        listed.extend(extra)
    return args


# ----------------------------------------------------------------------------------------------
# The verbs: one function each, from the parsed arguments to an exit status
# ----------------------------------------------------------------------------------------------

def _out_dir_key(item: str) -> bool:
    return item.partition("=")[0].strip().lstrip("-") == "train.out_dir"


def _with_run(run: str | None, overrides: list[str]) -> list[str]:
    """``--run DIR`` as the ``train.out_dir=DIR`` override; both, naming different
    directories, is an error."""
    if run is None:
        return list(overrides)
    for item in overrides:
        if _out_dir_key(item) and Path(item.partition("=")[2].strip()) != Path(run):
            raise ConfigError(f"--run {run} and {item.strip()} name two run directories; give "
                              f"one: --run DIR (train.out_dir=DIR is its older spelling)")
    return [*overrides, f"train.out_dir={run}"]


def _train_config(args):
    """The preset and overrides; ``jaxtp train`` into a run directory that has a config.json
    (an earlier run, ``jaxtp import-hf``, ``Model.save``) and no ``--config`` continues with the
    run's config, the overrides applied on top."""
    overrides = _with_run(args.run, args.overrides)
    name = args.config or "tiny"
    out_dir = next((o.partition("=")[2].strip() for o in reversed(overrides) if _out_dir_key(o)),
                   get_preset(name).train.out_dir)
    if args.config is None and (Path(out_dir) / "config.json").is_file():
        from jaxtp.ckpt import read_run_config

        cfg = apply_overrides(read_run_config(out_dir), overrides)
        validate_model(cfg.model)
        validate_settings(cfg)
        print(f"jaxtp: continuing the run in {out_dir} with its config.json", flush=True)
        return cfg
    return load(name, overrides)


SIMULATED_DEVICES = 8


def _use_devices(n: int | None, step_timeout_s: float | None = None) -> None:
    """``--devices N``: N simulated CPU devices. Without it, the CPU backend still gets 8 (unless
    XLA_FLAGS sets a count), so a machine with no accelerator runs the 8-device mesh;
    accelerators, when present, are used. XLA:CPU's thread pool and collective timeouts are
    set up for the count (:func:`jaxtp.parallel.prepare_cpu_runtime`; a train run's
    ``train.step_timeout_s`` puts XLA's own abort behind jaxtp's watchdog)."""
    forced = re.search(r"xla_force_host_platform_device_count=(\d+)",
                       os.environ.get("XLA_FLAGS", ""))
    count = n if n is not None else int(forced.group(1)) if forced else SIMULATED_DEVICES
    prepare_cpu_runtime(count, step_timeout_s=step_timeout_s)
    if n is not None:
        use_cpu_devices(n)
    elif not forced:
        jax.config.update("jax_num_cpu_devices", SIMULATED_DEVICES)


def _start_processes(args, step_timeout_s: float | None = None) -> None:
    """The devices, and this process joined to the others (multi-process runs)."""
    _use_devices(args.devices, step_timeout_s)
    distributed.initialize(coordinator=args.coordinator, num_processes=args.num_processes,
                           process_id=args.process_id, local_devices=args.devices)


def _train(args) -> int:
    from jaxtp.train import run

    cfg = _train_config(args)
    _start_processes(args, cfg.train.step_timeout_s)
    run(cfg)
    return 0


def _inspect(args) -> int:
    from jaxtp.inspect import format_report, report
    from jaxtp.step import build_engine

    cfg = load(args.config or "tiny", args.overrides)
    _start_processes(args)
    r = report(build_engine(cfg), step=args.step)
    if jax.process_index() != 0:  # every process compiles; one reports
        return 0
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(r.hlo_text)
    if args.json:
        print(json.dumps(r.to_json(), indent=2))
    else:
        print(format_report(r, title=f"{args.config or 'tiny'}, {cfg.parallel.mode} mode, "
                                     f"{args.step} step"))
    return 0


def _plan(args) -> int:
    """``--world-size N`` devices to plan for (``--devices N`` alone: N, as before the flag
    existed); ``--verify`` compiles on that many simulated CPU devices."""
    from jaxtp.cli import plan as plan_cli

    check_hardware_file(args.hardware_file)
    world = args.world_size if args.world_size is not None else args.devices
    if world is None:
        raise ConfigError("jaxtp plan needs --world-size N, the number of devices to plan for "
                          "(e.g. --world-size 64)")
    if args.verify and args.devices not in (None, world):
        raise ConfigError(f"--verify compiles the layouts for --world-size {world} on {world} "
                          f"simulated CPU devices; drop --devices {args.devices} (or make it "
                          f"{world})")
    print(plan_cli.run_cli(config_name=args.config, n_devices=world, hardware=args.hardware,
                           hardware_file=args.hardware_file, overrides=args.overrides,
                           as_json=args.json, verify_k=args.verify, top=args.top,
                           activations=args.activations, runnable=args.runnable,
                           use_devices=use_cpu_devices))
    return 0


def _prepare_data(args) -> int:
    from jaxtp.data import prepare

    m = prepare(args.src, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                text_field=args.text_field, eos_id=args.eos_id, progress=sys.stderr.isatty())
    print(f"prepared {m['documents']} documents, {m['tokens']} tokens ({m['tokenizer_hash']}) in "
          f"{len(m['shards'])} shard(s) under {args.out}; train on it with data.path={args.out}"
          + (f" data.tokenizer=bpe data.tokenizer_path={m['tokenizer_path']}"
             if m["tokenizer"] == "bpe" else ""))
    return 0


def _directories(args, flags: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """``(the directories of flags, overrides)``: each flag not given (``--run``, ``--out``)
    takes the next leading positional, the older spelling (``export-hf DIR OUT``)."""
    rest, dirs = list(args.overrides), []
    for flag in flags:
        value = getattr(args, flag)
        if value is None:
            if not rest or "=" in rest[0]:
                raise ConfigError(f"jaxtp {args.verb} needs --{flag} DIR")
            value = rest.pop(0)
        dirs.append(value)
    return dirs, rest


def _import_hf(args) -> int:
    import jaxtp
    from jaxtp.hf import copy_tokenizer, with_tokenizer

    (run_dir,), overrides = _directories(args, ("run",))
    _use_devices(args.devices)
    model = jaxtp.Model.from_hf(args.src, overrides)
    tokenizer = copy_tokenizer(args.src, run_dir)
    if tokenizer:  # the run tokenizes with the imported model's vocabulary
        model.cfg = with_tokenizer(model.cfg, tokenizer)
    model.save(run_dir)
    print(f"imported {args.src} ({model.cfg.model.param_count() / 1e6:.1f}M params) into "
          f"{run_dir}; continue with: jaxtp train --run {run_dir}")
    return 0


def _export_hf(args) -> int:
    import jaxtp
    from jaxtp.hf import copy_tokenizer

    (run_dir, out), overrides = _directories(args, ("run", "out"))
    _use_devices(args.devices)
    model = jaxtp.Model.from_run(run_dir, overrides, step=args.step)
    model.save_hf(out)
    copy_tokenizer(Path(model.cfg.data.tokenizer_path).parent
                   if model.cfg.data.tokenizer_path else None, out)
    print(f"exported {run_dir} to {out} (transformers.AutoModelForCausalLM.from_pretrained "
          f"loads it)")
    return 0


def _sample_verb(args) -> int:
    _use_devices(args.devices)
    _sample(_load_run(args), args)
    return 0


def _eval(args) -> int:
    from jaxtp.serve import evaluate

    _use_devices(args.devices)
    metrics = evaluate(_load_run(args), args.data, max_tokens=args.max_tokens,
                       progress=sys.stderr.isatty() or not args.json)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        for k, v in metrics.items():
            print(f"{k:>14}: {v:.4f}" if isinstance(v, float) else f"{k:>14}: {v}")
    return 0


VERBS = {"train": _train, "inspect": _inspect, "plan": _plan, "sample": _sample_verb,
         "eval": _eval, "prepare-data": _prepare_data, "import-hf": _import_hf,
         "export-hf": _export_hf}
# a failure's exit status: a bad value or file, a failed process group, a diverged run, a failed
# checkpoint save (the older steps are kept); each is one line on stderr
EXIT_CODES = ((ConfigError, 2), (distributed.DistributedError, 1), (TrainingDiverged, 3),
              (CheckpointSaveError, 4))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        check_devices(getattr(args, "devices", None))
        return VERBS[args.verb](args)
    except tuple(kind for kind, _ in EXIT_CODES) as e:
        print(f"jaxtp: error: {e}", file=sys.stderr)
        return next(code for kind, code in EXIT_CODES if isinstance(e, kind))


def _load_run(args):
    """The run's model, on as many devices as its layout names (all, when one degree is
    inferred)."""
    import math

    from jaxtp.api import Model, run_config

    par = run_config(args.run, args.overrides).parallel
    degrees = [par.pipeline, par.data, par.fsdp, par.context, par.expert, par.model]
    n = len(jax.devices()) if -1 in degrees else math.prod(degrees)
    return Model.from_run(args.run, args.overrides, devices=jax.devices()[:n])


def _sample(model, args) -> None:
    """Stream one prompt's continuation as it is made (a chunk of tokens per compiled call);
    print several prompts' continuations when the batch is done."""
    from jaxtp.serve import Generator, SamplerArgs

    try:
        sampler = SamplerArgs.make(temperature=args.temperature, top_k=args.top_k,
                                   top_p=args.top_p)
        chunks = Generator(model.layout, model.engine.region).stream(
            model.params, args.prompt, max_new_tokens=args.max_new_tokens, sampler=sampler,
            seed=args.seed)
        if len(args.prompt) > 1:
            *_, last = chunks
            for prompt, text in zip(args.prompt, last.text):
                print(prompt + text)
            return
        print(args.prompt[0], end="", flush=True)
        shown = ""
        for part in chunks:
            text = part.text[0].rstrip("\ufffd")  # an unfinished UTF-8 character: wait
            print(text[len(shown):], end="", flush=True)
            shown = text
        print(part.text[0][len(shown):])
    except ValueError as e:
        raise ConfigError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
