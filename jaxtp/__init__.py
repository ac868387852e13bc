"""jaxtp: Megatron-style tensor parallelism in JAX, composed with the other parallelisms.

The public API (the README's "Python API" section): ``jaxtp.config(preset, overrides)`` (the
:mod:`jaxtp.config` module is callable), :class:`Model`, :class:`Trainer`.
"""

from jaxtp import config
from jaxtp.api import Config, ConfigError, Model, Trainer, run_config

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Model", "Trainer", "config", "run_config"]
