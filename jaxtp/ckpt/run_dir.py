"""A run directory's config: ``<run_dir>/config.json`` holds the resolved config of the run.

``jaxtp train`` writes it at start, :meth:`jaxtp.Model.save` beside a saved model; the public API
(:meth:`jaxtp.Model.from_run`) and the CLI's ``--run`` read it back, so a run is loaded with the
model it was trained with and any layout.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxtp.configs import Config, ConfigError


def to_dict(cfg: Config) -> dict:
    """``{"model": {...}, "parallel": {...}, "train": {...}, "data": {...}}``."""
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> Config:
    """Inverse of :func:`to_dict`; a field this jaxtp does not know is an error, a missing one
    takes its default."""
    sections = {}
    for f in dataclasses.fields(Config):
        cls = f.type if isinstance(f.type, type) else type(getattr(Config(), f.name))
        values = dict(d.get(f.name, {}))
        known = {x.name for x in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"config has unknown {f.name} fields {unknown}; valid fields are "
                              f"{sorted(known)}")
        sections[f.name] = cls(**values)
    return Config(**sections)


CONFIG_FILE = "config.json"  # the resolved config of a run, in its directory


def write_run_config(cfg: Config, run_dir) -> None:
    """Write ``cfg`` as ``<run_dir>/config.json``."""
    path = Path(run_dir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def read_run_config(run_dir) -> Config:
    """The config in ``<run_dir>/config.json``; a missing file is a :class:`ConfigError`."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: {run_dir} is not a jaxtp run directory (train "
                          f"with jaxtp train --run {run_dir}, or save a model there)")
    try:
        return from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path} is not a valid jaxtp config: {e}") from None
