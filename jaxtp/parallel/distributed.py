"""Multi-process start-up: one JAX process per host, joined by ``jax.distributed``.

JAX is multi-controller: every host runs the same program on its local devices, and
``jax.distributed.initialize`` joins the processes into one runtime (a coordination service on
process 0, heartbeats, a key-value store that NCCL / ICI / gloo use to connect). :func:`initialize`
does that when asked (``--coordinator`` / ``--num-processes`` / ``--process-id``, or
``JAXTP_COORDINATOR`` / ``JAXTP_NUM_PROCESSES`` / ``JAXTP_PROCESS_ID``), or when a launcher that
JAX can read is present (an ``srun`` step of more than one task, ``mpirun``, a Cloud TPU VM), and
does nothing for a plain single process. CPU collectives use gloo.

When a peer dies, nothing waits forever; JAX's runtime aborts every survivor (SIGABRT, exit 134)
with a ``Terminating process because the JAX distributed service detected fatal errors`` log line
that names the cause. Processes that do not all connect within ``JAXTP_INIT_TIMEOUT_S`` (default
120 s) fail ``RegisterTask`` with ``DEADLINE_EXCEEDED``. A killed peer stops heartbeating and is
declared dead within ``JAXTP_HEARTBEAT_TIMEOUT_S`` (default 30 s; the tasks are named). If process 0
dies, the coordination service dies with it and the others fail at once (their collectives and
heartbeats lose the socket). A peer that exits early on a Python exception waits at the shutdown
barrier, which fails everyone after ``JAXTP_SHUTDOWN_TIMEOUT_S`` (default 60 s; also how long a
normal exit waits for the slowest process).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from jaxtp.configs import ConfigError

TIMEOUTS_S = {"init": 120, "heartbeat": 30, "shutdown": 60}


class DistributedError(RuntimeError):
    """The processes could not be joined; the message says which process and what to check."""


def _env_int(var: str, default: int | None = None) -> int | None:
    value = os.environ.get(var, default)
    try:
        return None if value is None else int(value)
    except ValueError:
        raise ConfigError(f"{var}={value!r} must be a whole number") from None


def _timeout(name: str) -> int:
    return _env_int(f"JAXTP_{name.upper()}_TIMEOUT_S", TIMEOUTS_S[name])


def _launcher() -> str | None:
    """The multi-process launcher JAX can read its parameters from, if any."""
    env = os.environ
    if (all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID",
                               "SLURM_LOCALID")) and int(env.get("SLURM_NTASKS", "1")) > 1):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "ompi"
    chips = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")
    if chips and importlib.util.find_spec("libtpu"):
        return "tpu"  # a Cloud TPU VM: JAX reads the pod's workers from the VM metadata
    return None


def _slurm_gpus_per_task() -> list[int] | None:
    """JAX gives each SLURM task one GPU (it assumes a task per GPU); one task per node drives all
    the node's GPUs. (``JAX_LOCAL_DEVICE_IDS=0,1,...`` overrides either.)"""
    env = os.environ
    if "JAX_LOCAL_DEVICE_IDS" in env or env.get("SLURM_NTASKS") != env.get("SLURM_NNODES"):
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    n = (len(visible.split(",")) if visible else int(env.get("SLURM_GPUS_ON_NODE", 0))
         or len(glob.glob("/dev/nvidia[0-9]*")))
    return list(range(n)) if n else None


def initialize(*, coordinator: str | None, num_processes: int | None, process_id: int | None,
               local_devices: int | None) -> bool:
    """Join this process to the others before anything touches a device; True if it did.

    ``local_devices``: simulated CPU devices of this process (``--devices``). Simulating means the
    processes are launched by hand, so a launcher's environment is then ignored.
    """
    import jax

    env = os.environ
    coordinator = coordinator or env.get("JAXTP_COORDINATOR")
    num_processes = _env_int("JAXTP_NUM_PROCESSES") if num_processes is None else num_processes
    process_id = _env_int("JAXTP_PROCESS_ID") if process_id is None else process_id
    given = {"--coordinator": coordinator, "--num-processes": num_processes,
             "--process-id": process_id}
    launcher = _launcher() if local_devices is None else None
    if launcher is None:
        if all(v is None for v in given.values()):
            return False  # a plain single process
        if missing := [k for k, v in given.items() if v is None]:
            raise ConfigError(f"{', '.join(missing)} missing: outside SLURM / MPI / a TPU pod, "
                              f"give all of --coordinator HOST:PORT, --num-processes N and "
                              f"--process-id I (the same coordinator on every process)")
    if coordinator is not None and not coordinator.rpartition(":")[2].isdigit():
        raise ConfigError(f"--coordinator={coordinator!r} must be HOST:PORT, e.g. 10.0.0.1:1234")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id={process_id} must be in 0 .. {num_processes - 1} "
                          f"(--num-processes={num_processes})")

    # Both are read when the CPU backend is created, so they must be set before it is.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_devices is not None:
        jax.config.update("jax_num_cpu_devices", local_devices)
    who = f"process {process_id if process_id is not None else '?'} of {num_processes or '?'}"
    # Said before connecting: the runtime reports a failure to connect itself, and then aborts.
    print(f"jaxtp: {who} joining coordinator {coordinator or f'(from {launcher})'}; all must "
          f"join within {_timeout('init')} s, a silent peer is dead after "
          f"{_timeout('heartbeat')} s", file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
            local_device_ids=_slurm_gpus_per_task() if launcher == "slurm" else None,
            initialization_timeout=_timeout("init"),
            heartbeat_timeout_seconds=_timeout("heartbeat"),
            shutdown_timeout_seconds=_timeout("shutdown"))
    except (RuntimeError, ValueError) as e:  # jax.errors.JaxRuntimeError is a RuntimeError
        raise DistributedError(f"{who} could not start the distributed runtime: {e}. Start every "
                               f"process with the same --coordinator and --num-processes, before "
                               f"anything touches a device") from e
    return True
