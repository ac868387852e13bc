"""Eight simulated CPU devices for every test, set before jax is imported (with a cheaper LLVM
optimisation level, below); one persistent compilation cache per session for the tests'
``jaxtp train`` subprocesses (:func:`jaxtp.testing.train_env`; in-process compiles never use
it)."""

import atexit
import os
import shutil
import tempfile

# LLVM at -O0 for the machine code of in-process compiles: XLA's HLO passes (sharding,
# fusion, buffer assignment: what the census and memory tests read) run as always, compiles take
# about half the time (tests/unit/step/test_pipeline_model and unit/inspect/test_census: 39 -> 22 s), and steps run
# slower, which no test times (speed lives in benchmarks/). Subprocesses started with
# jaxtp.testing.train_env drop XLA_FLAGS and compile at the default level.
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAXTP_TEST_COMPILE_CACHE" not in os.environ:  # xdist workers inherit the controller's
    _cache = tempfile.mkdtemp(prefix="jaxtp-test-xla-cache-")
    os.environ["JAXTP_TEST_COMPILE_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402

from jaxtp.parallel import prepare_cpu_runtime  # noqa: E402

# XLA:CPU's intra-op pool sized for the 8 devices (NPROC, read when the backend starts, and
# inherited by the tests' subprocesses): with one thread per core the devices' collectives can
# block every thread and deadlock (issue 37; jaxtp.parallel.devices explains it)
prepare_cpu_runtime(8)

jax.config.update("jax_default_matmul_precision", "highest")
