"""Every CLI verb, run as a user would (a subprocess, `python -m jaxtp`)."""

import json
import os
import subprocess
import sys

import pytest


def _jaxtp(*args, devices=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "jaxtp", *args]
    if devices:
        cmd[4:4] = ["--devices", str(devices)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_inspect_prints_report():
    r = _jaxtp("inspect", "--config", "tiny", "parallel.data=2", "parallel.model=4")
    assert r.returncode == 0, r.stderr
    assert "collective census" in r.stdout and "all-reduce" in r.stdout
    assert "data=2 x model=4" in r.stdout


def test_inspect_json_and_hlo_out(tmp_path):
    hlo_file = tmp_path / "step.hlo.txt"
    r = _jaxtp("inspect", "--config", "tiny", "--json", "--hlo-out", str(hlo_file),
               "parallel.data=4", "parallel.model=4", "parallel.mode=explicit", devices=16)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report) >= {"mesh", "per_device_bytes", "collectives", "flops_per_step"}
    assert report["mesh"]["data"] == 4 and report["mesh"]["model"] == 4
    kinds = {(c["kind"], tuple(c["axes"])) for c in report["collectives"]}
    assert ("all-reduce", ("model",)) in kinds and ("all-reduce", ("data",)) in kinds
    for c in report["collectives"]:
        assert set(c) >= {"kind", "axes", "count", "bytes"}
    assert "all-reduce" in hlo_file.read_text()


@pytest.mark.parametrize("args, message", [
    (["parallel.data=3", "parallel.model=4"], "needs 12 devices"),
    (["parallel.nope=1"], "valid keys in 'parallel'"),
    (["parallel.mode=fast"], "choose one of"),
])
def test_bad_input_is_a_clear_error_not_a_trace(args, message):
    r = _jaxtp("inspect", "--config", "tiny", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_train_runs_and_writes_metrics(tmp_path):
    out = tmp_path / "run"
    r = _jaxtp("train", "--config", "tiny", "train.steps=30", "train.log_every=10",
               "train.eval_every=30", f"train.out_dir={out}", "parallel.data=2",
               "parallel.model=4")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [10, 20, 30]
    for rec in records:
        assert {"step", "loss", "tokens_per_s", "mfu"} <= set(rec)
    assert "eval_loss" in records[-1]
    # byte-level text is learnable: 30 steps take the loss well below uniform (ln 256 = 5.55)
    assert records[-1]["loss"] < 4.0
    assert (out / "loss.png").stat().st_size > 0


def test_train_divergence_is_a_clear_error(tmp_path):
    r = _jaxtp("train", "--config", "tiny", "train.steps=50", "train.lr=1e12",
               "train.warmup_steps=1", "train.grad_clip=1e30", "train.log_every=1",
               f"train.out_dir={tmp_path}")
    assert r.returncode == 3, r.stderr
    assert "stopping" in r.stderr and "Traceback" not in r.stderr
