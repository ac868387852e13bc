"""``jaxtp train | inspect | plan | sample | eval | prepare-data | import-hf | export-hf`` (also
``python -m jaxtp``).

``sample`` and ``eval`` load a run directory (``--run``: what ``jaxtp train`` or ``Model.save``
writes) with optional ``parallel.*`` overrides. The other verbs take ``--config NAME`` (a preset) and dotted ``section.field=value`` overrides, e.g.
``jaxtp inspect --config tiny parallel.data=2 parallel.model=4``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax

from jaxtp.configs import (
    PRESETS,
    ConfigError,
    apply_overrides,
    check_devices,
    check_hardware_file,
    load,
    validate_model,
    validate_settings,
)
from jaxtp.parallel import distributed
from jaxtp.train import TrainingDiverged


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxtp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True)

    def common(sub):
        sub.add_argument("--config", default=None,
                         help=f"preset name: {', '.join(sorted(PRESETS))} (default: tiny; "
                              f"train continuing a run directory with a config.json: its config)")
        sub.add_argument("--devices", type=int, default=None,
                         help="simulate N CPU devices, e.g. to inspect a mesh larger than this "
                              "machine (default: accelerators if any, else 8 CPU devices); "
                              "with several processes, the CPU devices of each")
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

    ins = verbs.add_parser("inspect", help="compile the step ahead of time and print the "
                                           "placement report (bytes, collective census, FLOPs)")
    common(ins)
    ins.add_argument("--json", action="store_true", help="print the report as one JSON object")
    ins.add_argument("--hlo-out", default=None, metavar="FILE",
                     help="write the optimized HLO text to FILE")
    ins.add_argument("--step", choices=("grad", "loss", "train"), default="grad",
                     help="compile loss and gradients (default), the forward loss only, or the "
                          "whole train step (optimizer update included; adds the optimizer "
                          "state's bytes)")

    tr = verbs.add_parser("train", help="train a model (default: the tiny preset on the "
                                        "embedded corpus)")
    common(tr)

    from jaxtp.planner import HARDWARE

    pl = verbs.add_parser("plan", help="rank parallel layouts for a model on N devices by a cost "
                                       "model (memory and step time); --verify compiles the best")
    pl.add_argument("--config", default="tiny",
                    help=f"preset name: {', '.join(sorted(PRESETS))} (default: tiny)")
    pl.add_argument("--devices", type=int, required=True, metavar="N",
                    help="how many devices to plan for")
    pl.add_argument("--hardware", default="a100",
                    help=f"hardware preset: {', '.join(HARDWARE)} (default: a100); change any "
                         f"field with hardware.FIELD=VALUE, e.g. hardware.hbm_bytes=40e9")
    pl.add_argument("--hardware-file", default=None, metavar="FILE.json",
                    help='hardware as a JSON object of fields ({"base": "h100", ...} changes '
                         'a preset)')
    pl.add_argument("--json", action="store_true",
                    help="print the ranked layouts as a JSON list, best first")
    pl.add_argument("--verify", type=int, default=0, metavar="K",
                    help="compile the grad step of the best K layouts this version runs, on N "
                         "simulated CPU devices (slow for large N), and show predicted vs "
                         "compiled bytes and census")
    pl.add_argument("--top", type=int, default=10, help="layouts to show (0: all; default 10)")
    pl.add_argument("--runnable", action="store_true",
                    help="only layouts this version of jaxtp's engine accepts")
    pl.add_argument("--activations", choices=("jaxtp", "megatron"), default="jaxtp",
                    help="activation-memory model: jaxtp's own ops (default) or Korthikanti et "
                         "al.'s Megatron-LM formula")
    pl.add_argument("overrides", nargs="*", metavar="key=value",
                    help="config overrides; parallel.<field>=V / train.microbatches=V pin that "
                         "choice; hardware.FIELD=V changes the hardware")
    def run_verb(sub):
        sub.add_argument("--run", required=True, metavar="RUN_DIR",
                         help="a run directory (jaxtp train's train.out_dir, or Model.save's)")
        sub.add_argument("--devices", type=int, default=None,
                         help="simulate N CPU devices (default: accelerators if any, else 8 CPU "
                              "devices)")
        sub.add_argument("overrides", nargs="*", metavar="parallel.field=value",
                         help="another layout to load the run on, e.g. parallel.model=4")

    sa = verbs.add_parser("sample", help="generate text from a trained run (KV-cache decode on "
                                         "the run's layout); streams the prompt's "
                                         "continuation (several prompts: printed at the end)")
    run_verb(sa)
    sa.add_argument("--prompt", required=True, action="append",
                    help="prompt text (repeat for a batch of prompts)")
    sa.add_argument("--max-new-tokens", type=int, default=64)
    sa.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    sa.add_argument("--top-k", type=int, default=0, help="0: off")
    sa.add_argument("--top-p", type=float, default=1.0, help="1: off")
    sa.add_argument("--seed", type=int, default=0)

    ev = verbs.add_parser("eval", help="held-out loss / perplexity / bits per byte of a text "
                                       "file, or multiple-choice accuracy of a .jsonl file")
    run_verb(ev)
    ev.add_argument("--data", required=True, metavar="PATH",
                    help='a text file, or a .jsonl of {"context", "choices", "answer"} items')
    ev.add_argument("--max-tokens", type=int, default=None,
                    help="score at most this many tokens of a text file")
    ev.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    _hf_verbs(verbs)
    return p


def _hf_verbs(verbs) -> None:
    imp = verbs.add_parser("import-hf", help="import a Hugging Face Llama-family model directory "
                                             "into a run directory (train continues it)")
    imp.add_argument("src", help="a local HF directory: config.json, *.safetensors, tokenizer")
    imp.add_argument("run_dir", help="the run directory to write (train.out_dir of a fine-tune)")
    exp = verbs.add_parser("export-hf", help="write a run's model as a Hugging Face directory "
                                             "that transformers loads")
    exp.add_argument("run_dir", help="a run directory (jaxtp train's train.out_dir)")
    exp.add_argument("out", help="the HF directory to write")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    pre = verbs.add_parser("prepare-data", help="tokenise documents (text, JSONL, Parquet, "
                                                "ArrayRecord) once into ArrayRecord shards that "
                                                "data.path / data.mixture read")
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
    for sub in (imp, exp):
        sub.add_argument("--devices", type=int, default=None,
                         help="simulate N CPU devices (default: accelerators if any, else 8)")
        sub.add_argument("overrides", nargs="*", metavar="parallel.field=value",
                         help="the layout to load onto (default: the run's / data parallel)")


def _run_hf_verb(args) -> int:
    import jaxtp
    from jaxtp.hf import copy_tokenizer, with_tokenizer

    if args.verb == "import-hf":
        model = jaxtp.Model.from_hf(args.src, args.overrides)
        tokenizer = copy_tokenizer(args.src, args.run_dir)
        if tokenizer:  # the run tokenizes with the imported model's vocabulary
            model.cfg = with_tokenizer(model.cfg, tokenizer)
        model.save(args.run_dir)
        print(f"imported {args.src} ({model.cfg.model.param_count() / 1e6:.1f}M params) into "
              f"{args.run_dir}; continue with: jaxtp train train.out_dir={args.run_dir}")
        return 0
    model = jaxtp.Model.from_run(args.run_dir, args.overrides, step=args.step)
    model.save_hf(args.out)
    copy_tokenizer(Path(model.cfg.data.tokenizer_path).parent
                      if model.cfg.data.tokenizer_path else None, args.out)
    print(f"exported {args.run_dir} to {args.out} (transformers.AutoModelForCausalLM."
          f"from_pretrained loads it)")
    return 0


def _config(args):
    """The preset and overrides; ``jaxtp train`` into a run directory that has a config.json
    (an earlier run, ``jaxtp import-hf``, ``Model.save``) and no ``--config`` continues with the
    run's config, the overrides applied on top."""
    out_dir = next((o.partition("=")[2] for o in reversed(args.overrides)
                    if o.partition("=")[0].strip() == "train.out_dir"), "runs/default")
    if args.config is None and args.verb == "train" and (Path(out_dir) / "config.json").is_file():
        from jaxtp.ckpt import read_run_config

        cfg = apply_overrides(read_run_config(out_dir), args.overrides)
        validate_model(cfg.model)
        validate_settings(cfg)
        print(f"jaxtp: continuing the run in {out_dir} with its config.json", flush=True)
        return cfg
    return load(args.config or "tiny", args.overrides)


SIMULATED_DEVICES = 8


def _use_devices(n: int | None) -> None:
    """``--devices N``: N simulated CPU devices. Without it, the CPU backend still gets 8, so a
    machine with no accelerator runs the 8-device mesh; accelerators, when present, are used."""
    if n is not None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    elif "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", SIMULATED_DEVICES)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_devices(getattr(args, "devices", None))
        if args.verb == "prepare-data":
            from jaxtp.data import prepare

            m = prepare(args.src, args.out, tokenizer=args.tokenizer,
                        vocab_size=args.vocab_size, text_field=args.text_field,
                        eos_id=args.eos_id, progress=sys.stderr.isatty())
            print(f"prepared {m['documents']} documents, {m['tokens']} tokens "
                  f"({m['tokenizer_hash']}) in {len(m['shards'])} shard(s) under {args.out}; "
                  f"train on it with data.path={args.out}"
                  + (f" data.tokenizer=bpe data.tokenizer_path={m['tokenizer_path']}"
                     if m["tokenizer"] == "bpe" else ""))
            return 0
        if args.verb in ("import-hf", "export-hf"):
            _use_devices(args.devices)
            return _run_hf_verb(args)
        if args.verb == "plan":
            check_hardware_file(args.hardware_file)
            from jaxtp.cli import plan as plan_cli

            print(plan_cli.run_cli(config_name=args.config, n_devices=args.devices,
                                   hardware=args.hardware, hardware_file=args.hardware_file,
                                   overrides=args.overrides, as_json=args.json,
                                   verify_k=args.verify, top=args.top,
                                   activations=args.activations, runnable=args.runnable,
                                   use_devices=_use_devices))
            return 0
        if args.verb in ("sample", "eval"):
            _use_devices(args.devices)
            return _run_verb(args)
        cfg = _config(args)
        _use_devices(args.devices)
        distributed.initialize(coordinator=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, local_devices=args.devices)
        from jaxtp.step import build_engine

        if args.verb == "inspect":
            from jaxtp.inspect import format_report, report

            r = report(build_engine(cfg), step=args.step)
            if jax.process_index() != 0:  # every process compiles; one reports
                return 0
            if args.hlo_out:
                with open(args.hlo_out, "w") as f:
                    f.write(r.hlo_text)
            if args.json:
                print(json.dumps(r.to_json(), indent=2))
            else:
                print(format_report(r, title=f"{args.config or 'tiny'}, "
                                                     f"{cfg.parallel.mode} mode, "
                                                     f"{args.step} step"))
            return 0
        if args.verb == "train":
            from jaxtp.ckpt import CheckpointSaveError
            from jaxtp.train import run

            try:
                run(cfg)
            except CheckpointSaveError as e:  # disk full, permissions: the older steps are kept
                print(f"jaxtp: error: {e}", file=sys.stderr)
                return 4
            return 0
    except ConfigError as e:
        print(f"jaxtp: error: {e}", file=sys.stderr)
        return 2
    except distributed.DistributedError as e:
        print(f"jaxtp: error: {e}", file=sys.stderr)
        return 1
    except TrainingDiverged as e:
        print(f"jaxtp: error: {e}", file=sys.stderr)
        return 3
    return 1


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


def _run_verb(args) -> int:
    model = _load_run(args)
    if args.verb == "sample":
        _sample(model, args)
        return 0
    from jaxtp.serve import evaluate

    metrics = evaluate(model, args.data, max_tokens=args.max_tokens,
                                progress=sys.stderr.isatty() or not args.json)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        for k, v in metrics.items():
            print(f"{k:>14}: {v:.4f}" if isinstance(v, float) else f"{k:>14}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
