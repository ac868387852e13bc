"""Multi-process training on localhost, as on a cluster: one ``jaxtp train`` per "host".

Two processes of 4 CPU devices each (joined by ``jax.distributed``, gloo collectives) must train
exactly like one process of 8 devices on the same ``data=2 x model=4`` mesh; and a dead peer must
make the survivor exit with a clear error in bounded time, never hang. Every subprocess runs under a
timeout and is killed on the way out, so these tests cannot hang either.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxtp.testing import train_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ["--config", "tiny", "train.steps=20", "train.log_every=5", "train.eval_every=20",
          "parallel.data=2", "parallel.model=4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    # conftest's XLA_FLAGS would fix 8 devices per process; --devices sets the count instead.
    env = train_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env | extra


def _start(tmp: Path, name: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    with open(tmp / f"{name}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "jaxtp", "train", *args], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT)


def _worker(tmp: Path, port: int, i: int, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return _start(tmp, f"p{i}", "--devices", "4", "--coordinator", f"127.0.0.1:{port}",
                  "--num-processes", "2", "--process-id", str(i), *args, env=env)


def _finish(procs: dict[str, subprocess.Popen], tmp: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for name, p in procs.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still running after {timeout} s:\n{_log(tmp, name)}")
            assert p.returncode == 0, f"{name} exited {p.returncode}:\n{_log(tmp, name)}"
    finally:
        for p in procs.values():
            p.kill()  # SIGKILL: JAX's preemption service catches SIGTERM


def _log(tmp: Path, name: str, tail: int | None = 4000) -> str:
    text = (tmp / f"{name}.log").read_text()
    return text if tail is None else text[-tail:]


def _losses(out: Path) -> tuple[list[int], np.ndarray]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records], np.array([r["loss"] for r in records])


def test_two_processes_train_like_one(tmp_path):
    env, port = _env(), _free_port()
    # One out_dir for both processes, as a shared filesystem on a cluster: orbax's multi-process
    # checkpoint is written by all processes into directories that process 0 creates.
    multi = tmp_path / "multi"
    procs = {f"p{i}": _worker(tmp_path, port, i, *CONFIG, f"train.out_dir={multi}", env=env)
             for i in (0, 1)}
    procs["single"] = _start(tmp_path, "single", "--devices", "8", *CONFIG,
                             f"train.out_dir={tmp_path / 'single'}", env=env)
    _finish(procs, tmp_path, timeout=240)

    steps, multi_loss = _losses(multi)
    single_steps, single_loss = _losses(tmp_path / "single")
    assert steps == single_steps == [5, 10, 15, 20]
    # Same mesh, same sharded init, same global batches: only the data-axis all-reduce differs
    # (gloo across processes vs in-process CPU collectives), which may sum in another order. That
    # is float32 rounding (~1e-7 relative) that 20 Adam steps can grow by a few ulps; 1e-5 allows
    # it and still catches a real error (a wrong shard or a double-counted batch moves the loss
    # by 1e-2 or more).
    np.testing.assert_allclose(multi_loss, single_loss, rtol=1e-5)
    assert "done: 20 steps" in _log(tmp_path, "p0")
    assert "done:" not in _log(tmp_path, "p1")  # only process 0 reports


def test_dead_peer_is_an_error_not_a_hang(tmp_path):
    heartbeat = 5
    env = _env(JAXTP_HEARTBEAT_TIMEOUT_S=str(heartbeat), JAXTP_INIT_TIMEOUT_S="40")
    port = _free_port()
    args = ["--config", "tiny", "train.steps=100000", "train.log_every=100000",
            "parallel.data=2", "parallel.model=4", f"train.out_dir={tmp_path / 'run'}"]
    p0, p1 = (_worker(tmp_path, port, i, *args, env=env) for i in (0, 1))
    try:
        deadline = time.monotonic() + 45
        while "train:" not in _log(tmp_path, "p0"):  # the bar: both joined, the loop began
            assert p0.poll() is None and p1.poll() is None, _log(tmp_path, "p0")
            assert time.monotonic() < deadline, "training did not start:\n" + _log(tmp_path, "p0")
            time.sleep(0.2)
        p1.kill()
        t0 = time.monotonic()
        try:
            rc = p0.wait(timeout=heartbeat + 20)
        except subprocess.TimeoutExpired:
            raise AssertionError("process 0 hangs after its peer died:\n" + _log(tmp_path, "p0"))
        elapsed = time.monotonic() - t0
    finally:
        p0.kill()
        p1.kill()
    log = _log(tmp_path, "p0", tail=None)
    print(f"process 0 exited with {rc}, {elapsed:.1f} s after its peer was killed")
    assert rc != 0, log[-4000:]
    # The runtime names the cause; which one it sees first is a race: the coordination service's
    # missed heartbeats, or (when a step is in flight) the gloo collective that lost its peer,
    # whose error repeats once per queued dispatch and can push the first line out of any tail.
    causes = r"stopped sending heartbeats|another task died|Connection closed by peer"
    assert re.search(causes, log), log[:2000] + "\n...\n" + log[-2000:]
    assert elapsed < heartbeat + 15, f"took {elapsed:.1f} s"


def test_missing_peer_at_start_is_an_error_not_a_hang(tmp_path):
    env, port = _env(JAXTP_INIT_TIMEOUT_S="3"), _free_port()
    p0 = _worker(tmp_path, port, 0, *CONFIG, f"train.out_dir={tmp_path / 'run'}", env=env)
    try:
        rc = p0.wait(timeout=40)
    finally:
        p0.kill()
    log = _log(tmp_path, "p0")
    assert rc != 0, log
    assert "process 0 of 2 joining coordinator" in log and "DEADLINE_EXCEEDED" in log, log


def test_single_process_and_bad_flags(monkeypatch):
    from jaxtp.parallel import distributed
    from jaxtp.configs.schema import ConfigError

    for var in ("JAXTP_COORDINATOR", "JAXTP_NUM_PROCESSES", "JAXTP_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    none = dict(coordinator=None, num_processes=None, process_id=None, local_devices=None)
    if distributed._launcher() is None:
        assert distributed.initialize(**none) is False  # nothing to join
        with pytest.raises(ConfigError, match="--num-processes, --process-id missing"):
            distributed.initialize(**none | {"coordinator": "127.0.0.1:1234"})
    with pytest.raises(ConfigError, match="must be HOST:PORT"):
        distributed.initialize(**none | dict(coordinator="10.0.0.1", num_processes=2,
                                             process_id=0))
    with pytest.raises(ConfigError, match="--process-id=2 must be in 0 .. 1"):
        distributed.initialize(**none | dict(coordinator="10.0.0.1:1", num_processes=2,
                                             process_id=2))
