"""The public Python API: a config, a sharded model you can run, and the trainer.

Everything a training script or notebook needs, without reaching into the machinery::

    import jaxtp
    jaxtp.use_cpu_devices(8)                    # on a host without accelerators, first
    cfg = jaxtp.config("tiny", {"parallel.data": 2, "parallel.model": 4})
    model = jaxtp.Model(cfg, seed=0)            # random init, sharded on the mesh
    logits = model.logits(tokens)               # [B, S, vocab_size], any layout
    out = model.generate("Once", max_new_tokens=20, temperature=0.8, top_p=0.9)  # KV cache
    losses = model.token_losses(inputs, targets)  # [B, S] fp32
    model.save("runs/start")                    # params-only checkpoint a run can start from
    model = jaxtp.Model.from_run("runs/x")      # the latest checkpoint of a run (params only)
    trainer = jaxtp.Trainer(cfg)
    state = trainer.init_state()
    state, metrics = trainer.step(state, batch)  # {"inputs", "targets"}: [B, S] int32

A :class:`Model` is a :class:`jaxtp.step.layout.Layout` (mesh, shardings) with parameters in it and the
forward functions of :mod:`jaxtp.step.plain` / :mod:`jaxtp.step.pipelined`; every layout the trainer
runs (TP in either mode, SP, CP, pipelines, ZeRO, EP) gives the same logits as one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtp.ckpt import Checkpointer, read_run_config, write_run_config
from jaxtp.configs import CONTEXT, MODEL, Config, ConfigError, apply_overrides, validate_model
from jaxtp.parallel import batch_shards, padded_seq_len
from jaxtp.serve import Generator, SamplerArgs
from jaxtp.step import Engine, build_engine


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def run_config(run_dir: str | Path, overrides: Mapping[str, object] | Sequence[str] = ()
               ) -> Config:
    """The config a run directory was trained with (its ``config.json``), with ``overrides``
    (e.g. another layout: ``{"parallel.model": 4}``)."""
    cfg = read_run_config(run_dir)
    if isinstance(overrides, Mapping):
        overrides = [f"{k}={_text(v)}" for k, v in overrides.items()]
    cfg = apply_overrides(cfg, list(overrides))
    validate_model(cfg.model)
    return cfg


class Model:
    """A Transformer with its parameters sharded on a mesh, ready to score and save.

    ``Model(cfg, seed=0)`` initialises randomly (directly in the shardings); ``params=`` takes an
    existing parameter State in natural layer order (e.g. the single-device reference's; it is
    padded to the layout's vocab and placed). :attr:`params` is the sharded ``nnx.State``.
    Token inputs are ``[B, S]`` integer arrays (numpy or jax) of any ``B`` and ``S <=
    model.max_seq_len``; they are padded to what the layout splits evenly and the padding cut
    off the results.
    """

    def __init__(self, cfg: Config, *, seed: int | None = None, params: nnx.State | None = None,
                 devices=None, _placed: tuple[Engine, nnx.State] | None = None):
        # _placed: (engine, params already in its shardings and layer order), from the loaders
        if _placed is None:
            engine = build_engine(cfg, devices, training=False)
            if params is None:
                params = engine.layout.init_params(seed)
            else:
                params = engine.layout.shard_params(_pad_vocab(params, engine))
        else:
            engine, params = _placed
        self.cfg = cfg
        self.engine: Engine = engine
        self.params = params
        self._fns: dict[str, object] = {}

    @classmethod
    def from_run(cls, run_dir: str | Path, overrides: Mapping[str, object] | Sequence[str] = (),
                 *, step: int | None = None, devices=None) -> Model:
        """The parameters of a run's latest (or ``step``'s) checkpoint, on the run's layout or
        another one given in ``overrides``. Reads the parameters only, never the optimizer."""
        cfg = run_config(run_dir, overrides)
        engine = build_engine(cfg, devices, training=False)
        layout = engine.layout
        ckpt = Checkpointer(Path(run_dir) / "checkpoints", keep=1, cfg=cfg,
                            layer_order=layout.natural_layers)
        try:
            params = ckpt.restore_params(step, like=layout.abstract_params_sharded())
        finally:
            ckpt.close()
        return cls(cfg, _placed=(engine, params))

    @classmethod
    def from_hf(cls, path: str | Path, overrides: Mapping[str, object] | Sequence[str] = (),
                *, devices=None) -> Model:
        """A Hugging Face Llama-family directory (``config.json`` + safetensors) on the layout
        ``overrides`` give (``{"parallel.model": 4}``); each device reads only its slices."""
        from jaxtp.hf import config_from_hf, load_params

        cfg = config_from_hf(path)
        if isinstance(overrides, Mapping):
            overrides = [f"{k}={_text(v)}" for k, v in overrides.items()]
        cfg = apply_overrides(cfg, list(overrides))
        validate_model(cfg.model)
        engine = build_engine(cfg, devices, training=False)
        return cls(cfg, _placed=(engine, load_params(path, engine.layout)))

    def save_hf(self, path: str | Path) -> Path:
        """Write a Hugging Face directory ``transformers.AutoModelForCausalLM`` loads: config.json
        and sharded safetensors with an index, vocab padding stripped, tensor by tensor."""
        from jaxtp.hf import save_hf

        params = self.layout.natural_layers(self.params)
        return save_hf(params, self.cfg.model, path)

    @property
    def layout(self):
        return self.engine.layout

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.engine.layout.mesh

    # ---- scoring ------------------------------------------------------------------------------
    def logits(self, tokens) -> jax.Array:
        """``[B, S, vocab_size]`` fp32 next-token logits of ``tokens [B, S]`` (padding removed)."""
        tokens = self._tokens(tokens, "tokens")
        out = self._run("logits", {"inputs": tokens, "targets": tokens})
        return out[..., : self.cfg.model.vocab_size]

    def token_losses(self, inputs, targets, *, segment_ids=None, positions=None) -> jax.Array:
        """``[B, S]`` fp32 cross-entropy of ``targets`` given ``inputs`` at every position. For
        packed rows pass ``segment_ids`` (documents 1, 2, ...; 0 = padding) and ``positions``
        (within each document): attention then stays inside each document."""
        batch = {"inputs": self._tokens(inputs, "inputs"),
                 "targets": self._tokens(targets, "targets")}
        if segment_ids is not None or positions is not None:
            if segment_ids is None or positions is None:
                raise ValueError("segment_ids and positions go together: pass both or neither")
            batch["segment_ids"] = np.asarray(segment_ids, np.int32)
            batch["positions"] = np.asarray(positions, np.int32)
        for k, v in batch.items():
            if v.shape != batch["inputs"].shape:
                raise ValueError(f"{k} {v.shape} must have the shape of inputs "
                                 f"{batch['inputs'].shape}")
        return self._run("losses", batch)

    def _compiled(self, kind: str):
        if kind not in self._fns:
            fn = self.engine.logits_fn() if kind == "logits" else self.engine.token_losses_fn()
            self._fns[kind] = jax.jit(fn, in_shardings=(self.layout.param_shardings,
                                                        self.layout.batch_sharding))
        return self._fns[kind]

    def _tokens(self, tokens, name: str) -> np.ndarray:
        """Check a ``[B, S]`` token array (one clear error per broken rule)."""
        arr = np.asarray(tokens)
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must be a [batch, seq] integer array of token ids; got "
                             f"shape {tuple(arr.shape)} dtype {arr.dtype}")
        if arr.shape[1] > self.cfg.model.max_seq_len:
            raise ValueError(f"{name} has {arr.shape[1]} positions, more than "
                             f"model.max_seq_len={self.cfg.model.max_seq_len}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.cfg.model.vocab_size):
            raise ValueError(f"{name} has token ids outside [0, model.vocab_size="
                             f"{self.cfg.model.vocab_size})")
        return arr.astype(np.int32)

    def _run(self, kind: str, batch: dict[str, np.ndarray]) -> jax.Array:
        """Pad the batch to what the layout splits evenly (rows: the batch shards; positions:
        the context / sequence-parallel split, on the right, which a causal model's earlier
        positions never see), run, and cut the padding off again."""
        b, s = batch["inputs"].shape
        lo, par = self.layout, self.cfg.parallel
        rows = -(-b // batch_shards(lo.degrees)) * batch_shards(lo.degrees)
        seq = padded_seq_len(s, context=lo.degrees[CONTEXT], layout=par.context_layout,
                             model=lo.degrees[MODEL], sequence_parallel=par.sequence_parallel)
        padded = {k: jax.device_put(np.pad(v, ((0, rows - b), (0, seq - s))), lo.batch_sharding)
                  for k, v in batch.items()}
        return self._compiled(kind)(self.params, padded)[:b, :s]

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts, *, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens=()):
        """Continue ``prompts`` (a string, strings, or token-id arrays of any lengths) with a KV
        cache on this layout (:mod:`jaxtp.serve.decode`); ``temperature=0`` is greedy. Returns a
        :class:`jaxtp.serve.generate.Generation`: ``.tokens`` (new ids per prompt), ``.text``."""
        if "generator" not in self._fns:
            self._fns["generator"] = Generator(self.layout, self.engine.region)
        return self._fns["generator"](
            self.params, prompts, max_new_tokens=max_new_tokens, seed=seed,
            stop_tokens=stop_tokens,
            sampler=SamplerArgs.make(temperature=temperature, top_k=top_k, top_p=top_p))

    # ---- saving -------------------------------------------------------------------------------
    def save(self, run_dir: str | Path) -> Path:
        """Write a params-only checkpoint (step 0) and ``config.json`` into ``run_dir``: a run
        directory that :meth:`from_run` loads and ``jaxtp train --run RUN_DIR`` starts
        from (fresh optimizer, step 0)."""
        run_dir = Path(run_dir)
        ckpt_dir = run_dir / "checkpoints"
        if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
            raise ConfigError(f"{ckpt_dir} already holds checkpoints; save into a new directory")
        cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train,
                                                                       out_dir=str(run_dir)))
        write_run_config(cfg, run_dir)
        ckpt = Checkpointer(ckpt_dir, keep=1, cfg=self.cfg,
                            layer_order=self.layout.natural_layers)
        try:
            ckpt.save(0, {"params": self.params}, data_state={}, force=True, params_only=True)
            ckpt.wait()
        finally:
            ckpt.close()
        return run_dir


def _pad_vocab(params: nnx.State, engine: Engine) -> nnx.State:
    """Zero-pad (or cut) the vocab rows of ``params`` to the layout's padded vocab."""
    def pad(p, like):
        p = jnp.asarray(p)
        if p.shape == like.shape:
            return p
        widths = [(0, w - h) if w > h else (0, 0) for h, w in zip(p.shape, like.shape)]
        p = jnp.pad(p, widths)
        return p[tuple(slice(0, w) for w in like.shape)]
    return jax.tree.map(pad, params, engine.layout.abstract_params)


__all__ = ["Model", "run_config"]
