"""The host allocator the ``jaxtp`` command runs a CPU job under.

XLA:CPU allocates each step's temporaries from the host's ``malloc`` and frees them when the step
ends. glibc serves blocks that large with fresh ``mmap`` regions and unmaps them on ``free``, so
every step faults its temporaries in again, one 4 KiB page at a time: 0.63 M minor faults per step
(2.4 GiB) for ``benchmarks/vs_maxtext.py``'s model at ``parallel.model=8``. Two remedies, both of
which must be in place before the interpreter starts:

- glibc's own tunable ``glibc.malloc.hugetlb=1`` (glibc >= 2.35), which advises transparent huge
  pages for what ``malloc`` maps, so a step faults 2 MiB at a time (0.005 M faults per step);
- a caching allocator such as tcmalloc in ``LD_PRELOAD``, which keeps the pages between steps.

``jaxtp`` (the CLI) applies the first one to CPU jobs by re-executing itself once, at start-up,
before JAX is imported. ``JAXTP_HOST_MALLOC`` chooses: ``auto`` (the default: the glibc tunable,
on Linux, for CPU runs), ``off`` (leave the process as started), ``hugetlb`` (the tunable on any
platform) or the path of an allocator library to preload (``LD_PRELOAD``). Nothing changes when
``LD_PRELOAD`` or ``GLIBC_TUNABLES`` already names a malloc setting: the user chose.

This module imports only the standard library, so the check costs nothing before the re-exec.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence

ENV = "JAXTP_HOST_MALLOC"
HUGETLB = "glibc.malloc.hugetlb=1"
# the plugins through which jax finds an accelerator; with none installed a run is on CPU
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                       "jax_rocm7_plugin", "libtpu", "jax_plugins")
ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


class HostMallocError(ValueError):
    pass


def _accelerator_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS)


def cpu_run(environ: Mapping[str, str], argv: Sequence[str]) -> bool:
    """Whether this ``jaxtp`` command will run on XLA:CPU: ``JAX_PLATFORMS`` says cpu only,
    ``--devices N`` (simulated CPU devices) is given, or no accelerator plugin is installed."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms == ["cpu"]
    if any(a == "--devices" or a.startswith("--devices=") for a in argv):
        return True
    return not _accelerator_installed()


def _chosen(environ: Mapping[str, str]) -> bool:
    """Whether the environment already sets the host allocator."""
    preload = environ.get("LD_PRELOAD", "")
    return (any(name in preload for name in ALLOCATORS)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""))


def plan(environ: Mapping[str, str], argv: Sequence[str],
         platform: str = sys.platform) -> tuple[dict[str, str], str] | None:
    """The environment changes to re-execute under and a one-line description, or None (run as
    started). Raises :class:`HostMallocError` for a bad ``JAXTP_HOST_MALLOC``."""
    choice = environ.get(ENV, "auto").strip() or "auto"
    if choice == "off" or _chosen(environ):
        return None
    if choice not in ("auto", "hugetlb"):
        if not os.path.isfile(choice):
            raise HostMallocError(
                f"{ENV}={choice!r}: not a file; use auto, off, hugetlb or the path of an "
                f"allocator library, e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
        preload = environ.get("LD_PRELOAD", "")
        return ({"LD_PRELOAD": f"{choice}:{preload}" if preload else choice},
                f"host allocator: {choice} (LD_PRELOAD; {ENV}=off to run under the default)")
    if not platform.startswith("linux"):
        return None
    if choice == "auto" and not cpu_run(environ, argv):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    return ({"GLIBC_TUNABLES": f"{tunables}:{HUGETLB}" if tunables else HUGETLB},
            f"host allocator: glibc malloc with transparent huge pages (GLIBC_TUNABLES={HUGETLB};"
            f" {ENV}=off to run without)")


MARK = "JAXTP_HOST_MALLOC_APPLIED"


def describe(environ: dict[str, str] | None = None) -> str | None:
    """The line the re-executed process prints (None when it was not re-executed). Takes the
    marker out of the environment, so a ``jaxtp`` command this process starts decides afresh."""
    return (os.environ if environ is None else environ).pop(MARK, None) or None


def reexec_if_needed(argv: Sequence[str] | None = None) -> None:
    """Re-execute this process (same interpreter, same command line) under :func:`plan`'s
    environment; returns when nothing needs to change. A bad ``JAXTP_HOST_MALLOC`` exits with one
    line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get(MARK):
        return
    try:
        change = plan(os.environ, argv)
    except HostMallocError as e:
        sys.exit(f"error: {e}")
    if change is None:
        return
    env = {**os.environ, **change[0], MARK: change[1]}
    orig = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *orig[1:]], env)
