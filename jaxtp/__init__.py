"""jaxtp: Megatron-style tensor parallelism in JAX, composed with the other parallelisms.

The public API (the README's "Python API" section): ``jaxtp.config(preset, overrides)`` (the
:mod:`jaxtp.config` module is callable), :class:`Model`, :class:`Trainer`, ``jaxtp.data.loaders``
and ``jaxtp.prepare_data``.
"""

from jaxtp import config, data
from jaxtp.api import Config, ConfigError, Model, Trainer, run_config
from jaxtp.prepare import prepare as prepare_data

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Model", "Trainer", "config", "data", "prepare_data",
           "run_config"]
