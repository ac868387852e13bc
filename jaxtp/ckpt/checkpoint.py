"""Sharded, asynchronous, atomic checkpoints of the train state, restorable onto any mesh.

A checkpoint is one orbax-checkpoint step directory ``<directory>/<step>`` holding three items:
``state`` (the :class:`~jaxtp.train.trainer.TrainState` arrays, each written shard by shard from the
devices that own it), ``data`` (the data loader's JSON state, for exact resume) and ``meta`` (the
model config and the padded vocab size it was saved with). Orbax writes into a temporary directory
and renames it only once every host has committed, so a kill at any moment leaves either the whole
step or none of it; saves run in a background thread after the device-to-host copy, and only the
last ``keep`` steps are kept. Restoring reads each array directly into the shardings of the target
state, so a run saved on (data=2, model=4) resumes on (data=4, model=2) without gathering the model
anywhere. The one shape that depends on the mesh is the vocabulary dim of the embedding and output
head (and their Adam moments), padded to a multiple of ``vocab_pad_multiple x TP degree`` as in
Megatron-LM (Shoeybi et al. 2019): those rows past ``vocab_size`` are truncated or zero-padded,
which never changes the loss because padded logits are masked.

Every array's checksum is written in ``meta`` with the step and verified when the step is
restored (:mod:`jaxtp.ckpt.integrity`); a state holding NaN / Inf is never saved, and a failed
background save is raised by :meth:`Checkpointer.raise_save_errors` at the next step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from jaxtp.ckpt import integrity
from jaxtp.configs import Config, ConfigError, ModelConfig

# Bumped when the layout of the items changes; restore refuses a format it does not know.
FORMAT_VERSION = 1
# Padding differs across TP degrees by design, so it is not part of a model's identity.
_IGNORED_MODEL_FIELDS = ("vocab_pad_multiple",)


def _flatten(tree) -> tuple[dict[str, Any], Any]:
    """``{"params.embed.table.value": leaf, ...}`` and the treedef to rebuild ``tree``.

    Orbax would have to know how to (de)serialise every custom node (nnx ``State`` and
    ``Variable``, optax's named tuples); a flat dict of arrays keyed by the path is plain data, and
    the structure comes back from the restore target instead.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("two leaves of the train state flatten to the same checkpoint key")
    return flat, treedef


def _tensor_parallel_degree(tree) -> int:
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return int(sharding.mesh.shape.get("model", 1))
    return 1


@jax.jit
def _device_copy(flat: dict) -> dict:
    # new buffers with the same shardings: XLA never aliases an output to an undonated input
    return {k: jnp.copy(v) for k, v in flat.items()}


@dataclasses.dataclass
class Snapshot:
    """A train state ready to save (:meth:`Checkpointer.snapshot`): its arrays by checkpoint key
    (copied on the devices when ``copied``) and their checksums and finite flag, still on the
    devices."""

    flat: dict[str, Any]
    sums: dict[str, Any]
    finite: Any
    tensor_parallel: int
    copied: bool


class CheckpointSaveError(RuntimeError):
    """An asynchronous save failed (disk full, permissions); the earlier steps are intact."""


def _root_cause(e: BaseException) -> str:
    """``Type: first line`` of the innermost cause (orbax wraps tensorstore's informative error
    in generic ones)."""
    root = e
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    detail = (str(root).strip().splitlines() or [""])[0]
    errno = re.search(r"([^:\]]+) \[os_error_code='(\d+)'\]", detail)
    if errno:  # tensorstore's OS errors: the reason is at the end of a long path
        return f"{errno.group(1).strip()}, errno {errno.group(2)}"
    return f"{type(root).__name__}: {detail[:300]}"


class Checkpointer:
    """Save / restore :class:`~jaxtp.train.trainer.TrainState` plus the data-loader state under
    ``directory``, keeping the last ``keep`` steps. Call :meth:`close` (or :meth:`wait`) before the
    process exits, or the last asynchronous save may not be committed."""

    def __init__(self, directory: str | Path, *, keep: int, cfg: Config,
                 layer_order: Callable | None = None):
        """``layer_order(tree, inverse=False)``: the state with its stacked layers in natural
        order (``inverse``: back), e.g. :meth:`jaxtp.step.layout.Layout.natural_layers`; checkpoints
        always hold layer ``i`` at index ``i``, whatever the pipeline layout that wrote them."""
        if keep < 1:
            raise ConfigError(f"train.keep_checkpoints={keep} must be at least 1")
        self.directory = Path(directory).absolute()
        self.cfg = cfg
        self._layer_order = layer_order
        self._options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=True,
            # a save killed midway leaves a "<step>.orbax-checkpoint-tmp-*" directory; drop it
            cleanup_tmp_directories=True,
        )
        # Opened lazily for a directory that does not exist yet, so that only a save creates it
        # (a mistyped restore path is reported, not silently created).
        self._manager: ocp.CheckpointManager | None = None
        self._pending = False  # a save was started and its outcome not yet checked
        if self.directory.exists():
            self._open()

    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            # Naming each item's handler lets a fresh process read an item's metadata (the saved
            # shapes) before restoring it.
            registry = ocp.handlers.create_default_handler_registry(
                state=ocp.StandardCheckpointHandler(), data=ocp.JsonCheckpointHandler(),
                meta=ocp.JsonCheckpointHandler())
            self._manager = ocp.CheckpointManager(self.directory, options=self._options,
                                                  handler_registry=registry)
        return self._manager

    # ------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return [] if self._manager is None else sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step saved (or being saved asynchronously), ``None`` if there is none."""
        return None if self._manager is None else self._manager.latest_step()

    def snapshot(self, state, *, copy: bool = True) -> Snapshot:
        """Start a save of ``state`` without waiting on the devices: its checksums are
        dispatched and, with ``copy``, its arrays copied on the devices, so the next step may
        donate ``state`` while :meth:`save` sends the copy to the host. The copy holds one train
        state's device memory until that save returns."""
        if self._layer_order is not None:
            state = self._layer_order(state)
        flat, _ = _flatten(state)
        tp = _tensor_parallel_degree(state)
        if copy:
            flat = _device_copy(flat)
        vocab, padded = self.cfg.model.vocab_size, self.cfg.model.padded_vocab_size(tp)
        sums, finite = integrity.start_fingerprint(
            flat, integrity.vocab_dims(flat, padded, vocab), vocab)
        return Snapshot(flat, sums, finite, tp, copy)

    def save(self, step: int, state, *, data_state: dict, force: bool = False,
             params_only: bool = False) -> None:
        """Start saving ``state`` (or a :meth:`snapshot` of it) at ``step``; returns once the
        arrays are copied off the devices.

        A step at or behind the latest saved one is skipped unless ``force``; a step that already
        exists is never overwritten (that would risk the only good copy). ``params_only``:
        ``state`` is ``{"params": params}``, a model a run can start from (:meth:`restore_params`).
        """
        manager = self._open()
        if step in manager.all_steps():
            return
        snap = state if isinstance(state, Snapshot) else self.snapshot(state, copy=False)
        sums, finite = jax.device_get((snap.sums, snap.finite))
        if not finite:
            raise CheckpointSaveError(f"refusing to save step {step}: the train state holds "
                                      f"NaN or Inf; the saved steps {self.committed_steps()} "
                                      f"are kept")
        tp = snap.tensor_parallel
        vocab, padded = self.cfg.model.vocab_size, self.cfg.model.padded_vocab_size(tp)
        meta = {"format": FORMAT_VERSION, "model": dataclasses.asdict(self.cfg.model),
                "tensor_parallel": tp, "padded_vocab": padded,
                "checksums": {k: int(v) for k, v in sums.items()},
                "checksum_vocab_dims": integrity.vocab_dims(snap.flat, padded, vocab),
                "params_only": params_only}
        self.raise_save_errors()  # orbax would raise the previous save's error from save()
        manager.save(step, force=force, args=ocp.args.Composite(
            state=ocp.args.StandardSave(snap.flat),
            data=ocp.args.JsonSave(dict(data_state)),
            meta=ocp.args.JsonSave(meta)))
        self._pending = True

    def raise_save_errors(self) -> None:
        """Raise :class:`CheckpointSaveError` (one line) if a background save has failed since
        the last call: a full disk or a permission error stops the run at the next step, not
        after many more steps whose checkpoints cannot be written."""
        if self._manager is None:
            return
        try:
            self._manager.check_for_errors()
            # orbax's finalize thread takes a failed write's error; joining it (instant once it
            # is done) raises it here
            if self._pending and not self._manager.is_saving_in_progress():
                self._pending = False
                self._manager.wait_until_finished()
        except Exception as e:
            self._pending = False
            raise CheckpointSaveError(
                f"saving a checkpoint in {self.directory} failed in the background "
                f"({_root_cause(e)}); the committed steps {self.committed_steps()} are intact. "
                f"Free space or fix permissions, then run the same command to resume") from None

    def committed_steps(self) -> list[int]:
        """Steps whose directory is in place (renamed from its temporary name)."""
        if not self.directory.exists():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    def reload(self) -> None:
        """Re-read the steps on disk (after steps were moved away)."""
        if self._manager is not None:
            self._manager.reload()

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed (renamed into place)."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    # ------------------------------------------------------------------------------------------
    def restore(self, step: int | None, *, like) -> tuple[Any, dict]:
        """``(state, data_state)`` of ``step`` (``None``: the latest), in ``like``'s shardings.

        ``like`` is a train state of ``jax.ShapeDtypeStruct`` (with ``.sharding``) or of arrays;
        only its structure, shapes, dtypes and shardings are used.
        """
        step = self._resolve_step(step)
        manager = self._open()
        where = self.directory / str(step)
        with self._reading(step):
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta["meta"]
            if not isinstance(meta, dict):
                raise FileNotFoundError(f"{where / 'meta'} is missing")
        self._check_model(meta, where)

        target, treedef = _flatten(like)
        with self._reading(step):
            saved = manager.item_metadata(step)["state"]
            if saved is None:  # its _METADATA (the saved tree's shapes) is gone
                raise FileNotFoundError(f"{where / 'state' / '_METADATA'} is missing")
        saved = dict(saved.tree if hasattr(saved, "tree") else saved)
        resized = self._check_shapes(saved, target, meta, where)

        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self._sharding_of(k, v))
                    for k, v in target.items()}
        with self._reading(step):
            restored = manager.restore(step, args=ocp.args.Composite(
                # strict=False lets orbax truncate / zero-pad while reading each shard; allowed
                # only after _check_shapes has confirmed every resize is of vocab padding rows.
                state=ocp.args.StandardRestore(abstract, strict=not resized),
                data=ocp.args.JsonRestore()))
            if not isinstance(restored["data"], dict):  # without it the resume is not exact
                raise FileNotFoundError(f"{where / 'data'} is missing")
        integrity.verify(restored["state"], meta, where)
        state = jax.tree_util.tree_unflatten(treedef, [restored["state"][k] for k in target])
        if self._layer_order is not None:
            state = self._layer_order(state, inverse=True)
        return state, dict(restored["data"])

    def _meta(self, step: int) -> dict:
        """The checked ``meta`` item of ``step`` (model config, padding, format)."""
        where = self.directory / str(step)
        with self._reading(step):
            meta = self._open().restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
            if not isinstance(meta, dict):
                raise FileNotFoundError(f"{where / 'meta'} is missing")
        self._check_model(meta, where)
        return meta

    def is_params_only(self, step: int) -> bool:
        """Whether ``step`` holds parameters alone (written by :meth:`jaxtp.Model.save`)."""
        return bool(self._meta(step).get("params_only", False))

    def restore_params(self, step: int | None, *, like):
        """The parameters of ``step`` (``None``: the latest; a full train state or a params-only
        checkpoint), in ``like``'s shardings (an abstract or placed parameter State). Reads
        only the parameter arrays, never the optimizer state."""
        step = self._resolve_step(step)
        meta = self._meta(step)
        where = self.directory / str(step)
        target, treedef = _flatten({"params": like})
        with self._reading(step):
            saved = self._open().item_metadata(step)["state"]
        saved = dict(saved.tree if hasattr(saved, "tree") else saved)
        saved = {k: v for k, v in saved.items() if k.startswith("params.")}
        resized = self._check_shapes(saved, target, meta, where)
        args = {k: ocp.ArrayRestoreArgs(sharding=self._sharding_of(k, v), global_shape=v.shape,
                                        dtype=v.dtype,
                                        strict=not resized) for k, v in target.items()}
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in target.items()}
        with self._reading(step):
            restored = ocp.PyTreeCheckpointer().restore(
                where / "state", args=ocp.args.PyTreeRestore(
                    item=abstract, restore_args=args, partial_restore=True))
        params = jax.tree_util.tree_unflatten(treedef, [restored[k] for k in target])["params"]
        if self._layer_order is not None:
            params = self._layer_order({"params": params}, inverse=True)["params"]
        return params

    def _resolve_step(self, step: int | None) -> int:
        if not self.directory.exists():
            raise ConfigError(f"checkpoint directory {self.directory} does not exist; check "
                              f"train.out_dir, or start without a checkpoint")
        steps = self.all_steps()
        if not steps:
            raise ConfigError(f"no checkpoints in {self.directory}; check train.out_dir, or "
                              f"start without a checkpoint")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ConfigError(f"no checkpoint for step {step} in {self.directory}; the saved "
                              f"steps are {steps}")
        return step

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Turn orbax / tensorstore failures on a damaged step into an error that names it."""
        try:
            yield
        except ConfigError:
            raise
        except Exception as e:  # orbax raises many types (ValueError, OSError, tensorstore's)
            earlier = [s for s in self.all_steps() if s < step]
            hint = (f"restore an earlier step ({', '.join(map(str, earlier))})" if earlier
                    else "start from scratch")
            raise integrity.CorruptCheckpointError(
                f"checkpoint step {step} in {self.directory} is incomplete or corrupt "
                f"({_root_cause(e)}); delete {self.directory / str(step)} and {hint}") from e

    def _check_model(self, meta: dict, where: Path) -> None:
        if meta.get("format") != FORMAT_VERSION:
            raise ConfigError(f"checkpoint {where} has format {meta.get('format')!r}; this jaxtp "
                              f"reads format {FORMAT_VERSION}: restore it with the jaxtp that "
                              f"wrote it, or start from scratch")
        saved = meta.get("model", {})
        ours = dataclasses.asdict(self.cfg.model)
        defaults = dataclasses.asdict(ModelConfig())
        # a field added after the checkpoint was written counts as its default
        diffs = [f"model.{k}={saved.get(k, defaults[k])!r} in the checkpoint but {v!r} here"
                 for k, v in ours.items()
                 if k not in _IGNORED_MODEL_FIELDS and saved.get(k, defaults[k]) != v]
        if diffs:
            raise ConfigError(f"checkpoint {where} was written by a different model: "
                              f"{'; '.join(diffs)}. Set the model config to match, or use a "
                              f"fresh train.out_dir")

    def _check_shapes(self, saved: dict, target: dict, meta: dict, where: Path) -> bool:
        """Whether any leaf is resized; errors unless every resize is vocab padding."""
        missing, extra = sorted(set(target) - set(saved)), sorted(set(saved) - set(target))
        if missing or extra:
            raise ConfigError(f"checkpoint {where} holds a different train state (missing: "
                              f"{missing[:4]}, unexpected: {extra[:4]}); was it written with "
                              f"another optimizer config? Match it, or use a fresh train.out_dir")
        vocab, padded = self.cfg.model.vocab_size, meta.get("padded_vocab")
        resized = False
        for key, want in target.items():
            have = tuple(saved[key].shape)
            if have == tuple(want.shape):
                continue
            padding_only = len(have) == len(want.shape) and all(
                h == w or (min(h, w) >= vocab and h == padded)
                for h, w in zip(have, want.shape))
            if not padding_only:
                raise ConfigError(f"checkpoint {where}: {key} has shape {have} but the target is "
                                  f"{tuple(want.shape)}; only vocab padding rows (past "
                                  f"model.vocab_size={vocab}) may differ")
            resized = True
        return resized

    @staticmethod
    def _sharding_of(key: str, leaf):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            raise ValueError(f"restore target {key} has no sharding; pass like= as "
                             f"Trainer.abstract_state() or a state of placed arrays")
        return sharding
