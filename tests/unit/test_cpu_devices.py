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
