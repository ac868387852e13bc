"""What a run says and writes besides metrics.jsonl: its start lines, TensorBoard events, a
profiler window, and an honest summary.

- :func:`start_lines`, :func:`config_lines`: devices, mesh, parameter count, run directory, and
  the config keys that differ from the defaults (the whole config goes to ``config.json``).

- :class:`EventWriter`: TensorBoard event files in ``<out_dir>/tensorboard`` (``tensorboardX``'s
  writer; ``train.tensorboard=false`` turns it off). Scalars, one point per logged step:
  ``train/loss``, ``train/grad_norm``, ``train/lr``, ``train/tokens_per_s``, ``train/step_time_s``,
  ``train/mfu``; ``eval/loss`` at eval steps; for an MoE model also ``moe/lm_loss``,
  ``moe/aux_loss``, ``moe/dropped_fraction`` and ``moe/expert_load_max``.
- :class:`ProfileWindow`: ``train.profile_steps=START:END`` traces steps START .. END-1 with
  :func:`jax.profiler.start_trace` into ``<out_dir>/profile`` (open it with TensorBoard's profile
  plugin or Perfetto).
- :func:`steady_state`: tokens/s and MFU over the logged windows that do not include compilation
  (the loop already leaves checkpoint saves and evals out of each window's time), their median.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax

from jaxtp.configs import Config, parse_profile_steps
from jaxtp.parallel import describe_devices, describe_mesh

_SCALARS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
            "tokens_per_s": "train/tokens_per_s", "step_time_s": "train/step_time_s",
            "mfu": "train/mfu", "eval_loss": "eval/loss", "lm_loss": "moe/lm_loss",
            "aux_loss": "moe/aux_loss", "dropped_fraction": "moe/dropped_fraction",
            "expert_load_max": "moe/expert_load_max"}


class EventWriter:
    """TensorBoard scalars of each metrics record (see the module docstring)."""

    def __init__(self, out_dir: str | Path, *, enabled: bool = True):
        self.directory = Path(out_dir) / "tensorboard"
        self._writer = None
        if not enabled:
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            print("jaxtp: tensorboardX is not installed, so no TensorBoard events are written "
                  "(pip install tensorboardX, or set train.tensorboard=false)", file=sys.stderr)
            return
        self._writer = SummaryWriter(logdir=str(self.directory), flush_secs=30)

    def write(self, record: dict) -> None:
        if self._writer is None:
            return
        step = int(record["step"])
        for key, tag in _SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)):
                self._writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class ProfileWindow:
    """Trace steps START .. END-1 of ``train.profile_steps`` (see the module docstring)."""

    def __init__(self, spec: str, out_dir: str | Path):
        self.window = parse_profile_steps(spec)
        self.directory = Path(out_dir) / "profile"
        self.active = False

    def before_step(self, step: int) -> None:
        if self.window is None:
            return
        start, end = self.window
        if step == start and not self.active:
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        elif step == end and self.active:
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.effects_barrier()
            jax.profiler.stop_trace()
            self.active = False
            if jax.process_index() == 0:
                print(f"jaxtp: profile of steps {self.window[0]}..{self.window[1] - 1} in "
                      f"{self.directory}", flush=True)


def start_lines(cfg: Config, devices: Sequence[jax.Device], degrees: Mapping[str, int]
                ) -> list[str]:
    """What a run says before it starts: its devices, mesh, parameter count and directory."""
    m = cfg.model
    params = f"params: {_count(m.param_count())}"
    if m.n_experts:
        params += f" ({_count(m.param_count(active=True))} active per token)"
    return [describe_devices(devices), f"mesh: {describe_mesh(dict(degrees))}", params,
            f"run: {cfg.train.out_dir}"]


def config_lines(cfg: Config, path: Path) -> list[str]:
    """The resolved config for the log: one ``key = value`` line per key set differently from
    the defaults (the dataclasses'); every key is in ``path`` (``config.json``)."""
    default = Config()
    lines = [f"config: every key in {path}; these differ from the defaults:"]
    for section in dataclasses.fields(cfg):
        ours, base = getattr(cfg, section.name), getattr(default, section.name)
        for f in dataclasses.fields(ours):
            value = getattr(ours, f.name)
            if value != getattr(base, f.name):
                lines.append(f"  {section.name}.{f.name} = {_text(value)}")
    return lines


def _text(value) -> str:
    """A value as an override spells it (``true``, ``''``)."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if value != "" else "''"


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B ({n:,})" if n >= 1e9 else f"{n / 1e6:.3g}M ({n:,})"


def steady_state(records: list[dict]) -> tuple[float, float] | None:
    """Median ``(tokens_per_s, mfu)`` of the training windows without compilation (None: none)."""
    windows = [r for r in records if "tokens_per_s" in r and not r.get("includes_compile")]
    if not windows:
        return None
    return (statistics.median(r["tokens_per_s"] for r in windows),
            statistics.median(r["mfu"] for r in windows))


def plot_loss(records: list[dict], path: Path) -> None:
    """The train and eval loss curves of ``records`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
