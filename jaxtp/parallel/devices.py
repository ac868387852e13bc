"""Which devices a process runs on, and saying so.

A host without accelerators still runs every mesh on simulated CPU devices: XLA:CPU splits the
host into ``n`` devices when JAX's ``jax_num_cpu_devices`` is set before its backend starts
(:func:`use_cpu_devices`, the Python API's ``jaxtp.use_cpu_devices(8)`` and the CLI's
``--devices 8``; ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` from the shell does the
same). A run says what it runs on in one line (:func:`describe_devices`), and warns when it runs on CPU
on a machine that seems to have an accelerator (:func:`cpu_fallback_warning`): a jaxlib without
GPU / TPU support would otherwise train on the CPU without a word.
"""

from __future__ import annotations

import functools
import mmap
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax

from jaxtp.configs import ConfigError

FORCE_FLAG = "--xla_force_host_platform_device_count"
# threads of XLA:CPU's intra-op pool per simulated device: a device can have several independent
# collectives pending (the tick's permute and the tensor-parallel all-reduces of a pipelined
# step) and the next step's may start before the last one's end
POOL_THREADS_PER_DEVICE = 4
WARN_STUCK_FLAG = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"
TERMINATE_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"


def cpu_pool_threads(n_devices: int) -> int:
    """The intra-op pool size :func:`prepare_cpu_runtime` asks for ``n_devices`` devices."""
    return max(os.cpu_count() or 1, POOL_THREADS_PER_DEVICE * n_devices)


@functools.cache
def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA has the flag ``flag``: XLA aborts on an unknown XLA_FLAGS
    entry, and these debug flags come and go between releases, so the shared libraries are
    searched for its name before it is set."""
    import jaxlib

    needle = flag.lstrip("-").encode()
    for lib in Path(jaxlib.__file__).parent.rglob("*.so"):
        try:
            if lib.stat().st_size < 1 << 24:  # XLA lives in the big one(s)
                continue
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(needle) >= 0:
                    return True
        except (OSError, ValueError):
            continue
    return False


def prepare_cpu_runtime(n_devices: int, *, step_timeout_s: float | None = None,
                        environ: dict | None = None) -> list[str]:
    """Set up ``environ`` (``os.environ``) before JAX's CPU backend starts with ``n_devices``
    simulated devices (see the module docstring): ``NPROC`` to :func:`cpu_pool_threads` unless
    it is set already, and, when ``step_timeout_s`` is given, XLA:CPU's collective timeouts
    behind it (XLA's "may be stuck" lines 60 s after it, its abort 120 s after it), so jaxtp's
    watchdog ends a hang first, with its one line. A value already in ``XLA_FLAGS`` is kept.
    Returns what it set, e.g. ``["NPROC=32"]``."""
    env = os.environ if environ is None else environ
    done = []
    if n_devices > 1 and not env.get("NPROC"):
        env["NPROC"] = str(cpu_pool_threads(n_devices))
        done.append(f"NPROC={env['NPROC']}")
    if step_timeout_s is not None and n_devices > 1:
        flags = env.get("XLA_FLAGS", "")
        for flag, seconds in ((WARN_STUCK_FLAG, int(step_timeout_s) + 60),
                              (TERMINATE_FLAG, int(step_timeout_s) + 120)):
            if flag not in flags and _xla_knows(flag):
                flags = f"{flags} {flag}={seconds}".strip()
                done.append(f"{flag}={seconds}")
        if flags:
            env["XLA_FLAGS"] = flags
    return done


def use_cpu_devices(n: int) -> None:
    """Run JAX on ``n`` simulated CPU devices. Call it before anything touches JAX (the first
    thing a script does; in a notebook, before any cell creates an array); calling it again with
    the same ``n`` is harmless. Once JAX's backend has started with other devices it cannot take
    effect, and it raises a :class:`~jaxtp.configs.ConfigError` naming the fix."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"use_cpu_devices({n!r}): the number of simulated CPU devices must be "
                          f"a whole number >= 1, e.g. jaxtp.use_cpu_devices(8)")
    prepare_cpu_runtime(n)  # no effect once the backend has started, which the update detects
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # JAX refuses a new count once a backend has started
        devices = jax.devices()
        if devices[0].platform == "cpu" and len(devices) == n:
            return
        raise ConfigError(
            f"jaxtp.use_cpu_devices({n}) came too late: JAX has already started on "
            f"{len(devices)} {devices[0].platform} device(s); call it before anything touches "
            f"JAX (first in the script; in a notebook, restart the kernel and run it first), or "
            f"start Python with XLA_FLAGS={FORCE_FLAG}={n}") from None
    jax.config.update("jax_platforms", "cpu")


def simulate_hint(n: int) -> str:
    """How to get ``n`` simulated CPU devices, for an error that needs them."""
    return (f"on a CPU host, simulate {n} devices: jaxtp.use_cpu_devices({n}) before anything "
            f"touches JAX, --devices {n} on the command line, or XLA_FLAGS={FORCE_FLAG}={n}")


def describe_devices(devices: Sequence[jax.Device]) -> str:
    """``devices: 8 x cpu (simulated)`` / ``devices: 8 x NVIDIA H100 80GB HBM3 (gpu)``, and how
    many processes share them."""
    first, n = devices[0], len(devices)
    processes = len({d.process_index for d in devices})
    if first.platform == "cpu":
        text = f"{n} x cpu" + (" (simulated)" if n > processes else "")
    else:
        text = f"{n} x {first.device_kind} ({first.platform})"
    return "devices: " + text + (f" over {processes} processes" if processes > 1 else "")


# what the machine seems to have, and what installs JAX for it
_NVIDIA = ("an NVIDIA GPU", 'pip install -U "jax[cuda12]"')
_AMD = ("an AMD GPU", "a ROCm jaxlib (JAX's installation guide)")
_TPU = ("a TPU", 'pip install -U "jax[tpu]"')
TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_HOSTNAMES")


def accelerator_evidence(*, environ: Mapping[str, str] = os.environ,
                         exists: Callable[[str], bool] = os.path.exists,
                         which: Callable[[str], str | None] = shutil.which
                         ) -> tuple[str, str, str] | None:
    """``(what, evidence, install)`` when this machine seems to have an accelerator (a device
    file, ``nvidia-smi`` on the PATH, a TPU VM's environment), else None."""
    if exists("/dev/nvidia0"):
        return _NVIDIA[0], "/dev/nvidia0", _NVIDIA[1]
    if which("nvidia-smi"):
        return _NVIDIA[0], "nvidia-smi", _NVIDIA[1]
    if exists("/dev/kfd"):
        return _AMD[0], "/dev/kfd", _AMD[1]
    if exists("/dev/accel0"):
        return _TPU[0], "/dev/accel0", _TPU[1]
    for key in TPU_ENV:
        if environ.get(key):
            return _TPU[0], f"{key} is set", _TPU[1]
    return None


def cpu_fallback_warning(devices: Sequence[jax.Device], **probe) -> str | None:
    """A loud line when JAX fell back to CPU on a machine that seems to have an accelerator
    (``probe``: :func:`accelerator_evidence`'s arguments); None when the run is on an
    accelerator, or on CPU by choice (``JAX_PLATFORMS=cpu``, ``--devices``,
    :func:`use_cpu_devices`)."""
    if devices[0].platform != "cpu" or jax.config.jax_platforms:
        return None
    found = accelerator_evidence(**probe)
    if found is None:
        return None
    what, evidence, install = found
    return (f"WARNING: running on CPU, yet this machine seems to have {what} ({evidence}): JAX "
            f"found no usable accelerator, so the installed jaxlib lacks its support or could "
            f"not start it (JAX's own log above says which); install {install}, or set "
            f"JAX_PLATFORMS=cpu to run on CPU on purpose")
