"""Guards around a long run: one trainer per run directory, preemption signals, a hang watchdog.

- :class:`RunLock`: ``<out_dir>/jaxtp.lock`` holds the pid, host and start time of the trainer
  that owns the directory (created with ``O_EXCL``, so two trainers cannot both win). A second
  trainer gets a one-line error naming the owner; a lock whose process is gone (same host, pid
  not alive, e.g. after ``kill -9``) is stale and taken over with a note. In a multi-process run
  process 0 holds it for everyone.
- :class:`StopSignals`: SIGTERM (what SLURM, Kubernetes and TPU maintenance send before a
  preemption) and SIGINT (Ctrl-C) set a flag that the loop reads after every step; the loop then
  saves a checkpoint at that step and exits 0. With several processes, SIGTERM is left to JAX's
  preemption service (``jax.distributed`` installs it), which makes every process agree on the
  step to stop at (:func:`jax.experimental.multihost_utils.reached_preemption_sync_point`);
  SIGINT is forwarded to it as a SIGTERM. A second signal is not caught: it ends the process.
- :class:`Watchdog`: a daemon thread that ends the process (exit code 5, one line naming the
  step, the Python stacks in ``<out_dir>/watchdog-stacks.txt``) when the loop has not finished a
  step for ``train.step_timeout_s`` -- an alive-but-stuck peer otherwise hangs a job forever
  (jax issue 38503). It is armed when step 2 is dispatched, so compiling step 1 does not count.
- :func:`brief_background_errors`: orbax logs a failed background save with a full traceback
  from each of its threads (about 500 lines for one full disk); while it is active those log
  records keep their first line, and the run reports the failure itself, once.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from jaxtp.configs import ConfigError

WATCHDOG_EXIT_CODE = 5


class RunLockError(ConfigError):
    """Another trainer owns the run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class RunLock:
    """``<out_dir>/jaxtp.lock`` (see the module docstring); a context manager."""

    NAME = "jaxtp.lock"

    def __init__(self, out_dir: str | Path, *, enabled: bool = True):
        self.path = Path(out_dir) / self.NAME
        self.enabled = enabled
        self._held = False

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _stale(self, holder: dict | None) -> str | None:
        """Why the lock on disk is stale, or None when its owner may be alive."""
        if holder is None:  # unreadable: a writer died between create and write, or is writing
            try:
                age = time.time() - self.path.stat().st_mtime
            except OSError:
                return "it vanished"
            return "it is empty or unreadable" if age > 10 else None
        if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder["pid"])):
            return f"process {holder['pid']} on {holder['host']} is gone"
        return None

    def acquire(self) -> None:
        if not self.enabled:
            return
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "argv": sys.argv}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                why = self._stale(holder)
                if why is None:
                    owner = (f"process {holder['pid']} on host {holder['host']}, started "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}"
                             if holder else "a trainer that is starting")
                    raise RunLockError(
                        f"{self.path.parent} is in use by {owner} ({self.path}); one trainer "
                        f"per train.out_dir: wait for it, choose another train.out_dir, or, if "
                        f"that run is gone, delete {self.path}") from None
                print(f"jaxtp: taking over the stale lock {self.path} ({why})", file=sys.stderr,
                      flush=True)
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self._held = True
            return
        raise RunLockError(f"could not take {self.path}: other trainers keep creating it")

    def release(self) -> None:
        if not self._held:
            return
        holder = self._holder()
        if holder is not None and holder.get("pid") == os.getpid():
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self._held = False

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class StopSignals:
    """SIGTERM / SIGINT -> stop after the current step (see the module docstring)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, process_count: int = 1):
        self.multi = process_count > 1
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        # the next one is not caught: a second Ctrl-C ends the process
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        if self.multi and signum == signal.SIGINT:  # let JAX's preemption service agree a step
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            # several processes: SIGTERM belongs to JAX's preemption notifier
            for signum in (signal.SIGINT,) if self.multi else self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def should_stop(self, step: int) -> bool:
        """Whether to save at ``step`` and stop; every process gets the same answer."""
        if self.multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.received = self.received or "SIGTERM"
                return True
            return False
        return self.received is not None


class Watchdog:
    """Ends the process when :meth:`beat` is not called for ``timeout_s`` (see the module
    docstring); ``on_timeout`` runs first (e.g. to release the run lock)."""

    def __init__(self, timeout_s: float, *, stacks_path: str | Path | None = None,
                 on_timeout=None):
        self.timeout_s = float(timeout_s)
        self.stacks_path = Path(stacks_path) if stacks_path else None
        self.on_timeout = on_timeout
        # set by the loop once the layout is known: ``context()`` -> "on pipeline=2 x ...; <what
        # to try>", and where checkpoints are, to name the last good one
        self.context: Callable[[], str] | None = None
        self.checkpoints: Path | None = None
        self.step = 0
        self._beats = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxtp-watchdog", daemon=True)

    def beat(self, step: int) -> None:
        """Step ``step`` is the one now running (the previous ones are done)."""
        self.step = step
        self._last = time.monotonic()
        self._beats += 1
        if self._beats == 2 and not self._stop.is_set():
            # armed once the first step has been dispatched: loading the data and compiling
            # step 1 do not count; a hang in step 1's execution still blocks a later step
            self._thread.start()

    def _watch(self) -> None:
        poll = min(max(self.timeout_s / 10, 0.1), 10.0)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle <= self.timeout_s:
                continue
            where = ""
            if self.stacks_path is not None:
                try:
                    with open(self.stacks_path, "w") as f:
                        faulthandler.dump_traceback(file=f, all_threads=True)
                    where = f"; Python stacks in {self.stacks_path}"
                except OSError:
                    pass
            context = ""
            if self.context is not None:
                try:
                    context = " " + self.context()
                except Exception:  # the error line must come out whatever else is broken
                    pass
            saved = last_saved_step(self.checkpoints)
            kept = (f"; the last checkpoint, step {saved}, is kept: the same command resumes "
                    f"from it" if saved is not None else "")
            print(f"\njaxtp: error: step {self.step} made no progress for {idle:.0f} s "
                  f"(train.step_timeout_s={self.timeout_s:g}){context}; exiting with code "
                  f"{WATCHDOG_EXIT_CODE} so the job does not hang{kept}{where}",
                  file=sys.stderr, flush=True)
            try:
                if self.on_timeout is not None:
                    self.on_timeout()
            finally:
                os._exit(WATCHDOG_EXIT_CODE)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop.set()


def last_saved_step(checkpoints: Path | None) -> int | None:
    """The newest finished checkpoint step under ``checkpoints`` (orbax writes a step into a
    temporary name and renames it when complete), read from the directory names alone: the
    watchdog calls it while other threads may be stuck."""
    try:
        steps = [int(p.name) for p in Path(checkpoints).iterdir() if p.name.isdigit()]
    except (OSError, TypeError):
        return None
    return max(steps, default=None)


def hang_hint(*, layout: str, platform: str, processes: int, devices: int, pool_threads: int,
              nproc: str | None) -> str:
    """What a stuck step's error line says to try, for the layout and where it runs."""
    if devices == 1:  # no collectives to wait for: the step's own work (or a callback) is stuck
        return ("on 1 device: the step itself is stuck (a host callback, a data source or the "
                "device); the Python stacks show where")
    if platform == "cpu" and processes == 1:
        pool = (f"NPROC={nproc} sets it" if nproc else "one thread per core")
        return (f"on {layout} (simulated CPU devices): the devices' collectives wait in XLA:CPU's "
                f"intra-op thread pool ({pool}); give it >= {pool_threads} threads "
                f"(NPROC={pool_threads}, what jaxtp sets when NPROC is unset) or run fewer jobs "
                f"beside it")
    return (f"on {layout} over {processes} process(es): a device or a peer process is stuck; "
            f"look at the other processes' logs (the first error there is the cause)")


class _FirstLineOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info:
            record.exc_info, record.exc_text = None, None
            message = record.getMessage()
            record.msg, record.args = (message.splitlines() or [""])[0][:300], None
        return True


@contextlib.contextmanager
def brief_background_errors():
    """absl (orbax's logger) error records without their tracebacks, for the block's duration."""
    logger, brief = logging.getLogger("absl"), _FirstLineOnly()
    logger.addFilter(brief)
    try:
        yield
    finally:
        logger.removeFilter(brief)
