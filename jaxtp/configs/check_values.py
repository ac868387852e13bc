"""Range checks of every training, data and run-directory value, before anything is compiled.

Two layers, both raising :class:`jaxtp.configs.schema.ConfigError` with one line that names the key, the
value and what is allowed:

- :func:`validate_settings` -- pure value checks of ``train.*`` and ``data.*`` (signs, ranges,
  finiteness, combinations), run by :func:`jaxtp.configs.schema.load`, so ``train.lr=-1`` or
  ``train.batch_size=0`` is refused in milliseconds by every verb.
- :func:`check_run_files` -- what ``jaxtp train`` reads and writes: ``data.path`` (exists, is a
  file or a directory of the right kind, a ``.bin`` holds whole tokens, text is text),
  ``data.tokenizer_path`` (a tokenizer JSON that loads) and ``train.out_dir`` (a directory that
  can be created and written). Run at the start of :func:`jaxtp.train.trainer.run`, before the model is
  built.

The model and mesh checks live with the model config and the mesh builder; this module checks
only the run's own settings.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from jaxtp.configs.errors import ConfigError

# (key, lowest, highest, whether the lowest itself is allowed); None = unbounded
_TRAIN_INT_RANGES = {
    "batch_size": (1, None), "seq_len": (1, None), "seed": (0, 2**32 - 1), "steps": (1, None),
    "microbatches": (1, None), "warmup_steps": (0, None), "checkpoint_every": (0, None),
    "keep_checkpoints": (1, None), "log_every": (1, None), "eval_every": (1, None),
    "eval_batches": (1, None), "prefetch": (0, None),
}


def _describe(lo, hi) -> str:
    if hi is None:
        return f">= {lo}"
    return f"in [{lo}, {hi}]"


def _check_int(key: str, value, lo, hi) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be a whole number {_describe(lo, hi)}")
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{key}={value} is out of range: it must be a whole number "
                          f"{_describe(lo, hi)}")


def _check_float(key: str, value, *, lo: float, hi: float | None = None,
                 lo_open: bool = False, hi_open: bool = False) -> None:
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    allowed = (f"a finite number > {lo}" if lo_open and hi is None else
               f"a finite number >= {lo}" if hi is None else
               f"a number in {left}{lo}, {hi}{right}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} must be {allowed}")
    bad = (not math.isfinite(value) or value < lo or (lo_open and value == lo)
           or (hi is not None and (value > hi or (hi_open and value == hi))))
    if bad:
        raise ConfigError(f"{key}={value} is out of range: it must be {allowed}")


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """``"START:END"`` -> ``(START, END)``: trace steps START .. END-1 (``""``: no trace)."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        first, last = int(start), int(end)
    except ValueError:
        first = last = -1
    if not sep or first < 1 or last <= first:
        raise ConfigError(f"train.profile_steps={text!r} must look like START:END with "
                          f"1 <= START < END (steps START .. END-1 are traced), e.g. 10:15")
    return first, last


def validate_model(m) -> None:  # m: a jaxtp.configs.schema.ModelConfig (config imports this module)
    """The model's own rules (no mesh): positive sizes, GQA grouping, RoPE's even head dim,
    whole MoE groups."""
    positive = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len",
                "vocab_pad_multiple"]
    for name in positive:
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must be a multiple of "
                          f"model.n_kv_heads={m.n_kv_heads} (grouped-query attention)")
    if not m.head_dim and m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads="
                          f"{m.n_heads}; set model.head_dim explicitly or change n_heads")
    if m.resolved_head_dim % 2:
        raise ConfigError(f"head_dim={m.resolved_head_dim} must be even for RoPE")
    if m.n_experts < 0:
        raise ConfigError(f"model.n_experts={m.n_experts} must be >= 0 (0 = dense, no experts)")
    if m.n_experts and m.moe_every >= 1 and m.n_layers % m.moe_every:
        raise ConfigError(
            f"model.n_layers={m.n_layers} is not divisible by model.moe_every={m.moe_every}: the "
            f"layer scan runs groups of moe_every layers (moe_every - 1 dense, then one MoE); use "
            f"an n_layers that is a multiple of {m.moe_every} or change model.moe_every")


def validate_settings(cfg) -> None:
    """Refuse any ``train.*`` / ``data.*`` value outside its range (see the module docstring)."""
    t, d = cfg.train, cfg.data
    for name, (lo, hi) in _TRAIN_INT_RANGES.items():
        _check_int(f"train.{name}", getattr(t, name), lo, hi)
    _check_float("train.lr", t.lr, lo=0.0, lo_open=True)
    _check_float("train.min_lr_ratio", t.min_lr_ratio, lo=0.0, hi=1.0)
    _check_float("train.weight_decay", t.weight_decay, lo=0.0)
    _check_float("train.grad_clip", t.grad_clip, lo=0.0, lo_open=True)
    _check_float("train.step_timeout_s", t.step_timeout_s, lo=0.0, lo_open=True)
    if t.batch_size % t.microbatches:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by "
                          f"train.microbatches={t.microbatches}; each micro-batch must hold "
                          f"whole sequences")
    if not t.out_dir.strip():
        raise ConfigError("train.out_dir='' is empty; give the run a directory, e.g. "
                          "train.out_dir=runs/my-run")
    parse_profile_steps(t.profile_steps)
    _check_float("data.eval_fraction", d.eval_fraction, lo=0.0, hi=1.0, lo_open=True,
                 hi_open=True)
    if d.tokenizer_path and d.tokenizer != "bpe":
        raise ConfigError(f"data.tokenizer_path={d.tokenizer_path!r} is set but "
                          f"data.tokenizer={d.tokenizer!r} does not read it; add "
                          f"data.tokenizer=bpe or drop the path")
    _check_int("data.eos_id", d.eos_id, -1, None)
    if not d.text_field.strip():
        raise ConfigError("data.text_field='' is empty; name the JSONL field / Parquet column "
                          "that holds the text, e.g. data.text_field=text")


def check_devices(n: int | None) -> None:
    """``--devices N``: a positive device count (None: not given)."""
    if n is not None and n < 1:
        raise ConfigError(f"--devices {n} must be at least 1 (the number of simulated CPU "
                          f"devices)")


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------

_SNIFF_BYTES = 64 * 1024


def _looks_binary(path: Path) -> bool:
    """NUL bytes in the first 64 KiB: not text (UTF-8 text has none)."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(_SNIFF_BYTES)
    except OSError:
        return False


_RECORD_SUFFIXES = (".parquet", ".arrayrecord", ".array_record")  # binary by design


def _check_data_path(text: str, key: str = "data.path") -> None:
    if not text:
        return  # the embedded corpus
    if any(c in text for c in "*?["):
        import glob

        if not glob.glob(os.path.expanduser(text), recursive=True):
            raise ConfigError(f"{key}={text!r} matches no files; check the pattern")
        return
    path = Path(os.path.expanduser(text))
    if not path.exists():
        raise ConfigError(f"{key}={text!r} does not exist")
    if (path / "manifest.json").is_file():
        return  # a set made by jaxtp prepare-data (checked against the tokenizer when opened)
    if path.suffix == ".bin":
        if not path.is_file():
            raise ConfigError(f"{key}={text!r} is a directory, but a .bin name means one "
                              f"token file; point at the file, or rename the directory")
        width = 4 if path.name.endswith(".u32.bin") else 2
        size = path.stat().st_size
        if size == 0:
            raise ConfigError(f"{key}={text!r} is empty (0 tokens)")
        if size % width:
            raise ConfigError(f"{key}={text!r} has {size} bytes, not a whole number of "
                              f"{8 * width}-bit tokens; the file is truncated or not a "
                              f"{'.u32' if width == 4 else 'uint16'} .bin token file")
        return
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"{key}={text!r} is a directory with no files")
    if all(p.stat().st_size == 0 for p in files):
        raise ConfigError(f"{key}={text!r} holds no text (0 bytes)")
    binary = [p for p in files if not p.name.endswith(_RECORD_SUFFIXES) and _looks_binary(p)]
    if binary:
        raise ConfigError(f"{key}={text!r}: {binary[0]} is binary (it has NUL bytes), not "
                          f"text; pass a pre-tokenised .bin token file, or remove it from the "
                          f"corpus ({len(binary)} such file(s))")


def _check_tokenizer(text: str) -> None:
    if not text:
        return
    path = Path(os.path.expanduser(text))
    if not path.is_file():
        raise ConfigError(f"data.tokenizer_path={text!r} "
                          f"{'is not a file' if path.exists() else 'does not exist'}")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"data.tokenizer_path={text!r} is not a tokenizer.json that the "
                          f"HuggingFace tokenizers library loads ({detail})") from None


def _check_out_dir(text: str) -> None:
    path = Path(os.path.expanduser(text)).absolute()
    existing = path
    while not existing.exists():  # the nearest ancestor that exists
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is under a file ({existing})"
        raise ConfigError(f"train.out_dir={text!r} {what}; choose a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"train.out_dir={text!r} is not writable ({existing} is read-only "
                          f"for this user); choose a writable directory")


def check_run_files(cfg) -> None:
    """The data, tokenizer and run directory of ``jaxtp train`` (see the module docstring)."""
    _check_data_path(cfg.data.path)
    for part in filter(None, (p.strip() for p in cfg.data.mixture.split(","))):
        _check_data_path(part.rpartition(":")[0] or part, key="data.mixture entry")
    _check_tokenizer(cfg.data.tokenizer_path)
    _check_out_dir(cfg.train.out_dir)


def check_hardware_file(text: str | None) -> None:
    """``jaxtp plan --hardware-file F.json``: a readable file holding one JSON object."""
    if text is None:
        return
    import json

    path = Path(os.path.expanduser(text))
    try:
        obj = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"--hardware-file {text}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--hardware-file {text} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"--hardware-file {text} holds a JSON {type(obj).__name__}; it must "
                          f"hold one object of hardware fields")


def check_eval_split(cfg, eval_tokens: int) -> None:
    """The held-out split (the last ``data.eval_fraction`` of the corpus) fills one eval batch."""
    t = cfg.train
    need = t.batch_size * t.seq_len + 1
    if eval_tokens < need:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction} holds out {eval_tokens} "
                          f"tokens, fewer than one eval batch (train.batch_size x train.seq_len "
                          f"+ 1 = {need}); raise data.eval_fraction or use more data")
