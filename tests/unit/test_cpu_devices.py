"""``jaxtp.use_cpu_devices(n)`` (jaxtp.parallel.devices): n simulated CPU devices from the Python
API when JAX has not started, a one-line error naming the fix when it has; the mesh error that
names the same fix; and what counts as evidence of an accelerator."""

import os
import subprocess
import sys

import jax
import pytest

import jaxtp
from jaxtp.parallel.devices import accelerator_evidence

FRESH = """
import jaxtp
jaxtp.use_cpu_devices(8)
import jax
cfg = jaxtp.config("tiny", {"parallel.data": 2, "parallel.model": 4})
model = jaxtp.Model(cfg, seed=0)
print(len(jax.devices()), jax.devices()[0].platform, dict(model.engine.layout.mesh.shape)["model"])
"""
STARTED = """
import jax, jax.numpy as jnp
jnp.ones(1)  # JAX starts on this host's one CPU device
import jaxtp
cfg = jaxtp.config("tiny", {"parallel.data": 2, "parallel.model": 4})
for call in (lambda: jaxtp.Model(cfg, seed=0), lambda: jaxtp.use_cpu_devices(8)):
    try:
        call()
    except jaxtp.ConfigError as e:
        print(e)
"""


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_a_fresh_process_gets_the_devices_and_runs_the_readme_layout():
    r = _python(FRESH)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["8", "cpu", "4"]


def test_too_late_is_one_line_naming_the_fix():
    r = _python(STARTED)
    assert r.returncode == 0, r.stderr
    mesh, late = r.stdout.strip().splitlines()
    assert mesh.startswith("mesh data=2 x model=4 needs 8 devices but 1 are available")
    for fix in ("jaxtp.use_cpu_devices(8) before anything touches JAX", "--devices 8",
                "XLA_FLAGS=--xla_force_host_platform_device_count=8"):
        assert fix in mesh
    assert late.startswith("jaxtp.use_cpu_devices(8) came too late: JAX has already started on "
                           "1 cpu device(s)")
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in late


def test_in_a_started_process_the_same_count_is_harmless():
    assert len(jax.devices()) == 8  # conftest's XLA_FLAGS; JAX has started
    jaxtp.use_cpu_devices(8)
    with pytest.raises(jaxtp.ConfigError, match=r"use_cpu_devices\(4\) came too late: JAX has "
                                                r"already started on 8 cpu device"):
        jaxtp.use_cpu_devices(4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(jaxtp.ConfigError, match="a whole number >= 1"):
            jaxtp.use_cpu_devices(bad)


def test_accelerator_evidence():
    none = {"environ": {}, "exists": lambda path: False, "which": lambda name: None}
    assert accelerator_evidence(**none) is None
    gpu = accelerator_evidence(**{**none, "exists": lambda path: path == "/dev/nvidia0"})
    assert gpu[:2] == ("an NVIDIA GPU", "/dev/nvidia0") and "jax[cuda12]" in gpu[2]
    smi = accelerator_evidence(**{**none, "which": lambda name: f"/usr/bin/{name}"})
    assert smi[:2] == ("an NVIDIA GPU", "nvidia-smi")
    tpu = accelerator_evidence(**{**none, "environ": {"TPU_ACCELERATOR_TYPE": "v5p-8"}})
    assert tpu[:2] == ("a TPU", "TPU_ACCELERATOR_TYPE is set") and "jax[tpu]" in tpu[2]


# XLA:CPU's thread pool and collective timeouts (issue 37: the devices' collectives blocked every
# thread of a 2-core host's pool, a deadlock that XLA ended with SIGABRT)

def test_prepare_cpu_runtime_sizes_the_pool_and_puts_xla_aborts_behind_the_watchdog():
    from jaxtp.parallel.devices import (
        TERMINATE_FLAG,
        WARN_STUCK_FLAG,
        cpu_pool_threads,
        prepare_cpu_runtime,
    )

    assert cpu_pool_threads(8) == max(os.cpu_count(), 32)
    env = {}
    done = prepare_cpu_runtime(8, step_timeout_s=300, environ=env)
    assert env["NPROC"] == str(cpu_pool_threads(8))
    assert env["XLA_FLAGS"].split() == [f"{WARN_STUCK_FLAG}=360", f"{TERMINATE_FLAG}=420"]
    assert done == [f"NPROC={env['NPROC']}", *env["XLA_FLAGS"].split()]
    again = dict(env)
    assert prepare_cpu_runtime(8, step_timeout_s=300, environ=again) == [] and again == env
    # what the user set is kept; one device needs none of it
    mine = {"NPROC": "7", "XLA_FLAGS": f"--xla_dump_to=/tmp/x {TERMINATE_FLAG}=9"}
    prepare_cpu_runtime(8, step_timeout_s=300, environ=mine)
    assert mine["NPROC"] == "7"
    assert mine["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", f"{TERMINATE_FLAG}=9",
                                         f"{WARN_STUCK_FLAG}=360"]
    single = {}
    assert prepare_cpu_runtime(1, step_timeout_s=300, environ=single) == [] and single == {}


def test_only_flags_this_xla_knows_are_set():
    from jaxtp.parallel.devices import TERMINATE_FLAG, _xla_knows

    assert _xla_knows(TERMINATE_FLAG)  # jax 0.10.2 has it; XLA aborts on an unknown flag
    assert not _xla_knows("--xla_cpu_no_such_flag_jaxtp_made_up")


def test_use_cpu_devices_sets_nproc_before_jax_starts():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "NPROC")}
    code = ("import os, jaxtp; jaxtp.use_cpu_devices(8); import jax; "
            "print(os.environ['NPROC'], len(jax.devices()))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(max(os.cpu_count(), 32)), "8"]
