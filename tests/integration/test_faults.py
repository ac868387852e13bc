"""Operating a long run (issue 21): bad values and files are one-line errors before any compile;
SIGTERM / SIGINT save and exit 0; corrupt checkpoints are detected and skipped; one trainer per
run directory; async save errors stop the run; a stalled step trips the watchdog; TensorBoard,
profiler and config.json are written.

Value and file errors run ``jaxtp.cli.commands.main`` in this process (they stop before JAX compiles
anything); signals, locks and the watchdog run ``python -m jaxtp`` as a user would.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtp.cli import commands as cli
from jaxtp.testing import train_env

TINY = ["train.log_every=5", "train.eval_every=1000", "train.eval_batches=1"]


def _cli_error(capsys, *args) -> tuple[int, str]:
    rc = cli.main(list(args))
    err = capsys.readouterr().err
    return rc, err


def _assert_one_line_error(rc, err, *needles):
    assert rc != 0
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("jaxtp: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ----------------------------------------------------------------------------------------------
# 1. Values: refused at config load, naming the key, the value and the range
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, needle", [
    ("train.lr=-1", "train.lr=-1.0 is out of range: it must be a finite number > 0.0"),
    ("train.lr=nan", "train.lr=nan is out of range"),
    ("train.lr=inf", "train.lr=inf is out of range"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0 is out of range"),
    ("train.min_lr_ratio=-5", "train.min_lr_ratio=-5.0 is out of range: it must be a number in "
                              "[0.0, 1.0]"),
    ("train.weight_decay=-0.1", "train.weight_decay=-0.1 is out of range"),
    ("train.batch_size=0", "train.batch_size=0 is out of range: it must be a whole number >= 1"),
    ("train.microbatches=0", "train.microbatches=0 is out of range"),
    ("train.seq_len=0", "train.seq_len=0 is out of range"),
    ("train.seed=-1", "train.seed=-1 is out of range: it must be a whole number in [0, "),
    ("train.steps=0", "train.steps=0 is out of range"),
    ("train.steps=-5", "train.steps=-5 is out of range"),
    ("train.log_every=0", "train.log_every=0 is out of range"),
    ("train.eval_every=0", "train.eval_every=0 is out of range"),
    ("train.eval_batches=0", "train.eval_batches=0 is out of range"),
    ("train.checkpoint_every=-1", "train.checkpoint_every=-1 is out of range: it must be a "
                                  "whole number >= 0"),
    ("train.warmup_steps=-5", "train.warmup_steps=-5 is out of range"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints=0 is out of range"),
    ("train.step_timeout_s=0", "train.step_timeout_s=0.0 is out of range"),
    ("train.out_dir=", "train.out_dir='' is empty"),
    ("train.profile_steps=5", "train.profile_steps='5' must look like START:END"),
    ("train.profile_steps=9:3", "train.profile_steps='9:3' must look like START:END"),
    ("data.eval_fraction=0", "data.eval_fraction=0.0 is out of range: it must be a number in "
                             "(0.0, 1.0)"),
    ("data.eval_fraction=1", "data.eval_fraction=1.0 is out of range"),
    ("data.tokenizer_path=tok.json", "data.tokenizer_path='tok.json' is set but "
                                     "data.tokenizer='byte' does not read it"),
])
def test_bad_train_and_data_values_are_refused_at_load(capsys, override, needle):
    rc, err = _cli_error(capsys, "train", "--config", "tiny", override)
    assert rc == 2
    _assert_one_line_error(rc, err, needle)


def test_microbatches_must_divide_the_batch(capsys):
    rc, err = _cli_error(capsys, "train", "train.batch_size=8", "train.microbatches=3")
    _assert_one_line_error(rc, err, "train.batch_size=8 is not divisible by train.microbatches=3")


@pytest.mark.parametrize("devices", ["0", "-3"])
def test_devices_must_be_positive(capsys, devices):
    rc, err = _cli_error(capsys, "train", "--devices", devices)
    _assert_one_line_error(rc, err, f"--devices {devices} must be at least 1")


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read it"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list"),
])
def test_bad_hardware_file(capsys, tmp_path, content, needle):
    path = tmp_path / "hw.json"
    if content is not None:
        path.write_text(content)
    rc, err = _cli_error(capsys, "plan", "--devices", "8", "--hardware-file", str(path))
    _assert_one_line_error(rc, err, needle)


# ----------------------------------------------------------------------------------------------
# 8. Files: one-line errors before the model is built
# ----------------------------------------------------------------------------------------------

def _data_case(tmp_path, name):
    if name == "empty-text":
        (tmp_path / "empty.txt").write_text("")
        return ["data.path=" + str(tmp_path / "empty.txt")], "holds no text (0 bytes)"
    if name == "empty-bin":
        (tmp_path / "empty.bin").write_bytes(b"")
        return ["data.path=" + str(tmp_path / "empty.bin")], "is empty (0 tokens)"
    if name == "odd-bin":
        (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
        return ["data.path=" + str(tmp_path / "odd.bin")], "has 3 bytes, not a whole number"
    if name == "dir-bin":
        (tmp_path / "dir.bin").mkdir()
        return ["data.path=" + str(tmp_path / "dir.bin")], "is a directory, but a .bin name"
    if name == "binary-as-text":
        (tmp_path / "blob.dat").write_bytes(bytes(range(256)) * 64)
        return ["data.path=" + str(tmp_path / "blob.dat")], "is binary (it has NUL bytes)"
    if name == "bad-tokenizer":
        (tmp_path / "tok.json").write_text('{"model": 3}')
        return ["data.tokenizer=bpe", "data.tokenizer_path=" + str(tmp_path / "tok.json")], \
            "is not a tokenizer.json that the HuggingFace tokenizers library loads"
    if name == "out-dir-is-file":
        (tmp_path / "f").write_text("x")
        return ["train.out_dir=" + str(tmp_path / "f")], "is a file; choose a directory"
    if name == "out-dir-under-file":
        (tmp_path / "f").write_text("x")
        return ["train.out_dir=" + str(tmp_path / "f" / "run")], "is under a file"
    if name == "tiny-eval-split":
        return ["data.eval_fraction=0.00001"], "fewer than one eval batch"
    raise AssertionError(name)


@pytest.mark.parametrize("case", ["empty-text", "empty-bin", "odd-bin", "dir-bin",
                                  "binary-as-text", "bad-tokenizer", "out-dir-is-file",
                                  "out-dir-under-file", "tiny-eval-split"])
def test_bad_files_are_one_line_errors(capsys, tmp_path, case):
    overrides, needle = _data_case(tmp_path, case)
    if not any(o.startswith("train.out_dir=") for o in overrides):
        overrides.append(f"train.out_dir={tmp_path / 'run'}")
    rc, err = _cli_error(capsys, "train", *overrides)
    _assert_one_line_error(rc, err, needle)


def test_read_only_out_dir(capsys, tmp_path, monkeypatch):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    if os.geteuid() == 0:  # root writes into read-only directories: report them as the OS would
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).startswith(
            str(tmp_path / "ro")) and mode & os.W_OK else real(p, mode, **kw))
    rc, err = _cli_error(capsys, "train", f"train.out_dir={tmp_path / 'ro' / 'run'}")
    _assert_one_line_error(rc, err, "is not writable")


# ----------------------------------------------------------------------------------------------
# 2, 4, 5, 6. Signals, the run lock, async save errors and the watchdog, in real processes
# ----------------------------------------------------------------------------------------------

def _env():
    env = train_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _train_cmd(out, *overrides):
    return [sys.executable, "-m", "jaxtp", "train", "--devices", "1", "--config", "tiny",
            f"train.out_dir={out}", *TINY, *overrides]


def _records(out):
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_step(proc, out, step, timeout=240):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the trainer exited early: {proc.communicate()}")
        if any(r["step"] >= step for r in _records(out)):
            return
        time.sleep(0.05)
    raise AssertionError("the trainer made no progress")


def test_sigterm_saves_the_current_step_and_resumes_exactly(tmp_path):
    import signal

    steps = ["train.steps=100", "train.checkpoint_every=1000"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    proc = subprocess.Popen(_train_cmd(cut, *steps), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_step(proc, cut, 10)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    line = next(x for x in out.splitlines() if x.startswith("jaxtp: SIGTERM at step"))
    saved = int(line.split("at step ")[1].split()[0])
    assert 10 <= saved < 100 and (cut / "checkpoints" / str(saved)).is_dir(), line
    assert not (cut / "jaxtp.lock").exists()
    r = subprocess.run(_train_cmd(cut, *steps), env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"resuming from step {saved}" in r.stdout
    subprocess.run(_train_cmd(full, *steps), env=_env(), check=True, capture_output=True,
                   timeout=300)
    want = {rec["step"]: rec["loss"] for rec in _records(full)}
    assert {rec["step"]: rec["loss"] for rec in _records(cut)} == want  # exactly, on CPU


def test_second_trainer_is_refused_and_sigint_saves(tmp_path, capsys):
    import signal

    out = tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(out, "train.steps=5000", "train.checkpoint_every=1000"),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for_step(proc, out, 5)
        lock = json.loads((out / "jaxtp.lock").read_text())
        assert lock["pid"] == proc.pid
        rc, err = _cli_error(capsys, "train", f"train.out_dir={out}")
        _assert_one_line_error(rc, err, f"is in use by process {proc.pid}", "one trainer per")
        seen = max(r["step"] for r in _records(out))
        _wait_for_step(proc, out, seen + 5)  # the first trainer is untouched
    finally:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "jaxtp: SIGINT at step" in stdout
    steps = [r["step"] for r in _records(out)]
    assert steps == sorted(set(steps))  # no interleaved or duplicated records
    assert not (out / "jaxtp.lock").exists()


def test_stale_lock_is_taken_over(tmp_path, capsys):
    import socket

    from jaxtp.train.run_guard import RunLock, RunLockError

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / RunLock.NAME).write_text(json.dumps(
        {"pid": dead.pid, "host": socket.gethostname(), "started": 0}))
    with RunLock(tmp_path):
        assert json.loads((tmp_path / RunLock.NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(RunLockError, match=f"in use by process {os.getpid()}"):
            RunLock(tmp_path).acquire()
    assert "taking over the stale lock" in capsys.readouterr().err
    assert not (tmp_path / RunLock.NAME).exists()
    (tmp_path / RunLock.NAME).write_text(json.dumps(
        {"pid": 1, "host": "another-host", "started": 0}))
    with pytest.raises(RunLockError, match="process 1 on host another-host"):
        RunLock(tmp_path).acquire()


def test_failed_background_save_stops_the_run(tmp_path):
    """Files over 64 KiB cannot be written (RLIMIT_FSIZE, as a full disk would refuse them): the
    save at step 20 fails in the background; the run stops with one line, step 10 intact."""
    import shlex

    out = tmp_path / "run"
    steps = ["train.steps=40", "train.checkpoint_every=10"]
    subprocess.run(_train_cmd(out, "train.steps=10", "train.checkpoint_every=10"), env=_env(),
                   check=True, capture_output=True, timeout=300)
    # SIGXFSZ ignored: a write past the limit fails with EFBIG instead of killing the process
    limited = f"trap '' XFSZ; ulimit -f 64; exec {shlex.join(_train_cmd(out, *steps))}"
    r = subprocess.run(["bash", "-c", limited], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 4, r.stderr
    # no traceback of jaxtp's; tensorstore may still print orbax's "Event loop is closed" one
    assert "jaxtp/" not in r.stderr and "CheckpointSaveError" not in r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("jaxtp: error:")]
    assert len(errors) == 1 and "failed in the background" in errors[0], r.stderr
    assert "the committed steps [10] are intact" in errors[0]
    assert max(rec["step"] for rec in _records(out)) < 40
    assert not (out / "jaxtp.lock").exists()


STALL = """
import sys, time
from jaxtp.cli import commands as cli; from jaxtp.train import trainer as train
make = train.Trainer.step_fn
def stalling(self, state):
    fn, calls = make(self, state), [0]
    def step(*args):
        calls[0] += 1
        if calls[0] == 3:
            time.sleep(600)  # a peer that never answers
        return fn(*args)
    return step
train.Trainer.step_fn = stalling
sys.exit(cli.main(sys.argv[1:]))
"""


def test_watchdog_ends_a_stalled_step(tmp_path):
    cmd = [sys.executable, "-c", STALL, *_train_cmd(tmp_path / "run", "train.steps=50",
                                                    "train.step_timeout_s=3")[3:]]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 5, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("jaxtp: error:"))
    assert "step 3 made no progress for" in line and "train.step_timeout_s=3" in line
    assert "on 1 device: the step itself is stuck" in line  # no collectives to blame
    assert "<string>\", line 10 in step" in (tmp_path / "run" / "watchdog-stacks.txt").read_text()
    assert not (tmp_path / "run" / "jaxtp.lock").exists()


PIPELINE_EXAMPLE = ["model.n_layers=4", "parallel.pipeline=2", "parallel.model=2",
                    "train.microbatches=4"]


def test_a_real_collective_deadlock_is_one_line_and_the_run_resumes(tmp_path):
    """Issue 37's deadlock made on purpose: XLA:CPU's intra-op pool cut to one thread
    (NPROC=1), so the pipelined step's pending collectives block it. The watchdog ends the run
    with one line naming the step, the layout, the fix and the kept checkpoint (no C++ abort:
    XLA's own rendezvous timeouts now sit behind train.step_timeout_s); the lock is released;
    the same command with the pool jaxtp sets resumes from that checkpoint."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxtp", "train", "--devices", "8", "--config", "tiny",
           *PIPELINE_EXAMPLE, f"train.out_dir={out}", "train.checkpoint_every=1",
           "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1"]
    r = subprocess.run(cmd + ["train.steps=200", "train.step_timeout_s=10"],
                       env=_env() | {"NPROC": "1"}, capture_output=True, text=True, timeout=240)
    assert r.returncode == 5, r.stderr[-2000:]
    assert "rendezvous" not in r.stderr and "SIGABRT" not in r.stderr  # XLA never got to abort
    errors = [x for x in r.stderr.splitlines() if x.startswith("jaxtp: error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    step = int(re.search(r"step (\d+) made no progress", errors[0]).group(1))
    assert 2 <= step < 200
    assert "on pipeline=2 x data=2 x model=2 (simulated CPU devices)" in errors[0]
    assert "NPROC=1 sets it" in errors[0] and "NPROC=32" in errors[0]
    saved = re.search(r"the last checkpoint, step (\d+), is kept", errors[0])
    assert not (out / "jaxtp.lock").exists()
    resume_to = (int(saved.group(1)) if saved else 0) + 2
    r = subprocess.run(cmd + [f"train.steps={resume_to}"], env=_env(), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    if saved:
        assert f"resuming from step {saved.group(1)}" in r.stdout
    assert [x["step"] for x in _records(out)][-1] == resume_to


# ----------------------------------------------------------------------------------------------
# 3. Integrity: a flipped byte is caught, the previous good step is used, and said so
# ----------------------------------------------------------------------------------------------

def _flip_one_byte(step_dir: Path) -> None:
    files = sorted((p for p in (step_dir / "state").rglob("*")
                    if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 0x01
    files[-1].write_bytes(bytes(data))


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_good_one(tmp_path, capsys):
    from jaxtp.configs import schema as config
    from jaxtp.train import trainer as train
    from jaxtp.ckpt.integrity import CorruptCheckpointError

    args = [f"train.out_dir={tmp_path}", "train.checkpoint_every=10", *TINY]
    train.run(config.load("tiny", ["train.steps=20", *args]))
    _flip_one_byte(tmp_path / "checkpoints" / "20")
    capsys.readouterr()
    records = train.run(config.load("tiny", ["train.steps=30", *args]))
    out = capsys.readouterr().out
    assert "checkpoint" in out and "/20 is corrupt" in out
    assert "resuming from step 10, the newest checkpoint that verifies" in out
    assert (tmp_path / "corrupt-checkpoints" / "20").is_dir()
    assert records[-1]["step"] == 30 and (tmp_path / "checkpoints" / "30").is_dir()
    # every step corrupt: a clear error, and nothing is moved
    for step in (10, 20, 30):
        _flip_one_byte(tmp_path / "checkpoints" / str(step))
    with pytest.raises(CorruptCheckpointError, match=r"no checkpoint in .* verifies \(steps "
                                                     r"\[30, 20, 10\]"):
        train.run(config.load("tiny", ["train.steps=40", *args]))
    assert (tmp_path / "checkpoints" / "30").is_dir()
    assert not (tmp_path / "jaxtp.lock").exists()


# ----------------------------------------------------------------------------------------------
# 7. Observability: TensorBoard scalars, a profiler window, config.json, an honest summary
# ----------------------------------------------------------------------------------------------

def test_tensorboard_profile_config_and_summary(tmp_path, capsys):
    from jaxtp.configs import schema as config
    from jaxtp.train import trainer as train

    cfg = config.load("tiny", [f"train.out_dir={tmp_path}", "train.steps=10", "train.log_every=5",
                               "train.eval_every=10", "train.eval_batches=1",
                               "train.profile_steps=3:5"])
    train.run(cfg)
    out = capsys.readouterr().out
    events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").glob("events.out.*"))
    for tag in (b"train/loss", b"train/tokens_per_s", b"train/mfu", b"train/lr", b"eval/loss"):
        assert tag in events, tag
    assert any((tmp_path / "profile").rglob("*.xplane.pb"))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["train"]["steps"] == 10 and saved["train"]["profile_steps"] == "3:5"
    # the start lines, then the keys that differ from the defaults, one per line
    assert out.startswith(f"devices: 8 x cpu (simulated)\nmesh: data=8\nparams: 0.164M "
                          f"(164,160)\nrun: {tmp_path}\n")
    assert f"config: every key in {tmp_path / 'config.json'}; these differ" in out
    assert "\n  train.steps = 10\n" in out and "\n  train.profile_steps = 3:5\n" in out
    assert "(steady state: median over logged windows" in out
    cfg = config.load("tiny", [f"train.out_dir={tmp_path}", "train.steps=5",
                               "train.tensorboard=false"])
    train.run(cfg)
    assert "nothing to train: the checkpoint is at step 10 and train.steps=5" in \
        capsys.readouterr().out


def test_a_layout_predicted_not_to_fit_is_warned_about_before_step_1(capsys, tmp_path,
                                                                     monkeypatch):
    """The planner's memory prediction is checked before step 1 against the memory the devices
    report (CPU devices report none: no warning on a simulated mesh unless told a limit)."""
    import jax

    from jaxtp.planner import fit_check
    from jaxtp.train import trainer as train
    from jaxtp.configs.schema import load

    cfg = load("tiny", ["train.steps=1", "train.eval_batches=1", "train.checkpoint_every=0",
                        f"train.out_dir={tmp_path / 'run'}", "train.tensorboard=false",
                        "parallel.data=8"])
    need = fit_check.predicted_bytes(cfg, {"data": 8, "fsdp": 1, "pipeline": 1, "model": 1,
                                           "context": 1, "expert": 1})
    assert fit_check.fit_warning(cfg, {}, jax.devices()) is None  # CPU: no limit reported
    monkeypatch.setattr(fit_check, "device_bytes", lambda devices: int(need // 2))
    train.run(cfg)
    out = capsys.readouterr().out
    assert "predicted to need" in out and "will likely run out of memory" in out
    monkeypatch.setattr(fit_check, "device_bytes", lambda devices: int(need * 2))
    assert fit_check.fit_warning(cfg, {"data": 8, "fsdp": 1, "pipeline": 1, "model": 1,
                                       "context": 1, "expert": 1}, jax.devices()) is None
