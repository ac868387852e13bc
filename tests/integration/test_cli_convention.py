"""One CLI convention (``--run DIR`` names a run directory, ``--devices N`` simulates N CPU
devices, ``plan --world-size N``), the older spellings that keep working, and what ``jaxtp
train`` says at start: devices, mesh, parameters, run directory, the config as ``key = value``
lines, a loud line when it falls back to CPU on a machine with an accelerator, the allocator line
only when it re-executes (never for ``--help``), and ``runs/<preset>`` as the default run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxtp
from jaxtp.cli import commands as cli
from jaxtp.testing import train_env

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
QUICK = ["train.steps=2", "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1",
         "train.tensorboard=false"]


def _jaxtp(*args, cwd, env):
    return subprocess.run([sys.executable, "-m", "jaxtp", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def test_a_run_says_what_it_runs_on_and_defaults_to_runs_preset(tmp_path):
    # a machine that seems to have a GPU (nvidia-smi on the PATH) and a jaxlib without GPU
    # support (this one): JAX falls back to CPU, and the run says so loudly
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    env = {k: v for k, v in train_env().items() if k != "JAX_PLATFORMS"}
    env["PATH"] = f"{fake.parent}{os.pathsep}{env.get('PATH', '')}"
    r = _jaxtp("train", *QUICK, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    for line in ("devices: 8 x cpu (simulated)", "mesh: data=8", "params: 0.164M (164,160)",
                 "run: runs/tiny",
                 "config: every key in runs/tiny/config.json; these differ from the defaults:",
                 "  train.steps = 2", "  train.out_dir = runs/tiny"):
        assert line in out, (line, r.stdout)
    assert not any(line.startswith("config: {") for line in out)
    warnings = [x for x in r.stderr.splitlines() if x.startswith("WARNING: running on CPU")]
    assert len(warnings) == 1 and "NVIDIA GPU (nvidia-smi)" in warnings[0], r.stderr
    assert "jax[cuda12]" in warnings[0] and "JAX_PLATFORMS=cpu" in warnings[0]
    assert r.stderr.count("host allocator:") == 1  # printed by the re-executed process only
    saved = json.loads((tmp_path / "runs" / "tiny" / "config.json").read_text())
    assert saved["train"]["out_dir"] == "runs/tiny" and saved["train"]["steps"] == 2

    # again without --config: the run directory's config.json continues; --devices chose the
    # CPU, so no warning
    r = _jaxtp("train", "--devices", "8", *QUICK, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "jaxtp: continuing the run in runs/tiny with its config.json" in r.stdout
    assert "nothing to train: the checkpoint is at step 2" in r.stdout
    assert "devices: 8 x cpu (simulated)" in r.stdout and "WARNING" not in r.stderr


def test_help_starts_nothing_and_lists_the_older_spellings_once(tmp_path):
    env = {**train_env(), "JAX_PLATFORMS": "cpu"}
    r = _jaxtp("train", "--help", cwd=tmp_path, env=env)
    assert r.returncode == 0 and "--run DIR" in r.stdout and "--devices N" in r.stdout
    assert "host allocator" not in r.stderr, r.stderr
    top = _jaxtp("--help", cwd=tmp_path, env=env)
    assert top.returncode == 0
    for alias in ("jaxtp train train.out_dir=DIR      = jaxtp train --run DIR",
                  "jaxtp import-hf SRC DIR            = jaxtp import-hf SRC --run DIR",
                  "jaxtp export-hf DIR OUT            = jaxtp export-hf --run DIR --out OUT",
                  "jaxtp plan --devices N             = jaxtp plan --world-size N --devices N"):
        assert alias in top.stdout


def test_devices_is_one_flag_with_one_meaning(capsys):
    for verb in ("inspect", "train", "plan", "sample", "eval", "import-hf", "export-hf"):
        with pytest.raises(SystemExit):
            cli.main([verb, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"--devices N {' '.join(cli.DEVICES_HELP.split())}" in text, verb


def _one_line_error(capsys, *args) -> str:
    assert cli.main(list(args)) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x]
    assert len(lines) == 1 and lines[0].startswith("jaxtp: error: "), lines
    return lines[0]


def test_run_dir_spellings(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    line = _one_line_error(capsys, "train", "--run", str(a), f"train.out_dir={b}")
    assert f"--run {a} and train.out_dir={b} name two run directories" in line
    # the same directory both ways is one; an override after --run is still an override
    line = _one_line_error(capsys, "train", f"train.out_dir={a}/", "--run", str(a),
                           "train.lr=-1")
    assert "train.lr=-1.0 is out of range" in line
    line = _one_line_error(capsys, "export-hf", "--out", str(b))
    assert "jaxtp export-hf needs --run DIR" in line
    assert jaxtp.config("tiny-moe").train.out_dir == "runs/tiny-moe"
    assert jaxtp.config("tiny").train.out_dir == "runs/tiny"


def test_import_and_export_hf_with_run_and_out(tmp_path, capsys):
    # the older spellings (import-hf SRC DIR, export-hf DIR OUT) run in tests/unit/hf/test_hf.py
    run, out = tmp_path / "run", tmp_path / "hf"
    assert cli.main(["import-hf", str(FIXTURES / "llama"), "--run", str(run),
                     "parallel.data=8"]) == 0
    assert f"continue with: jaxtp train --run {run}" in capsys.readouterr().out
    assert cli.main(["export-hf", "--run", str(run), "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))


def test_plan_world_size(capsys):
    line = _one_line_error(capsys, "plan", "--config", "tiny")
    assert "jaxtp plan needs --world-size N" in line
    line = _one_line_error(capsys, "plan", "--world-size", "8", "--devices", "4", "--verify", "1")
    assert "drop --devices 4 (or make it 8)" in line
    # the older spelling: --devices alone is the world size
    assert cli.main(["plan", "--devices", "8", "--json", "--top", "0"]) == 0
    old = capsys.readouterr().out
    assert cli.main(["plan", "--world-size", "8", "--json", "--top", "0"]) == 0
    assert capsys.readouterr().out == old and json.loads(old)
    assert cli.main(["plan", "--world-size", "8", "--top", "3"]) == 0
    assert "runs here: yes = this version of jaxtp trains the layout" in capsys.readouterr().out
