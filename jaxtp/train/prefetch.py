"""Batches prepared ahead of the step that consumes them, on a background thread.

While the devices run step ``k``, a thread reads batch ``k + 1`` from the loader (``next``) and
places it on the devices with the batch sharding (the trainer's ``put_batch``), so the host's
data work is off the step's critical path (MaxText's device-side input pipeline gets the same by
keeping a step in flight). Each prefetched batch travels with the loader's ``state()`` taken right
after it was read: the loop saves *that* state with the step that consumed the batch, never the
loader's own (which is ahead by the prefetch depth), so a checkpoint's data state is exactly the
batches its steps consumed and resume neither skips nor repeats one. A loader with
``log_fields()`` has those fields captured the same way. ``depth=0`` reads inline, as before.
"""

from __future__ import annotations

import copy
import queue
import threading
from dataclasses import dataclass, field


@dataclass
class Prefetched:
    """One batch on the devices, the loader state after it, and its extra log fields."""

    batch: dict
    data_state: dict
    log_fields: dict = field(default_factory=dict)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """``next()`` returns :class:`Prefetched` items in loader order; with ``depth >= 1`` they are
    made up to ``depth`` steps ahead on a daemon thread (an error there is raised by ``next()``).
    Call :meth:`close` when done."""

    def __init__(self, loader, put, *, depth: int):
        self.loader, self.put, self.depth = loader, put, depth
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._slots = threading.Semaphore(depth)  # items made but not yet taken
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._produce, name="jaxtp-prefetch",
                                            daemon=True)
            self._thread.start()

    def _make(self) -> Prefetched:
        batch = next(self.loader)
        data_state = copy.deepcopy(self.loader.state())
        log_fields = getattr(self.loader, "log_fields", None)
        fields = dict(log_fields()) if callable(log_fields) else {}
        return Prefetched(self.put(batch), data_state, fields)

    def _produce(self) -> None:
        while not self._stop.is_set():
            while not self._slots.acquire(timeout=0.1):
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                return
            try:
                item = self._make()
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                self._queue.put(_Failed(e))
                return
            self._queue.put(item)

    def next(self) -> Prefetched:
        if self._thread is None:
            return self._make()
        item = self._queue.get()
        if isinstance(item, _Failed):
            raise item.error
        self._slots.release()
        return item

    def close(self) -> None:
        """Stop the thread; items made but not taken are dropped (the loader is ahead of the
        consumed batches by at most ``depth``; the saved data state is the consumed one)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
