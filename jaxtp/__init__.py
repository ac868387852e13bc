"""jaxtp: Megatron-style tensor parallelism in JAX, composed with the other parallelisms.

The public API (see the README's "Python API" section): :func:`config`, :class:`Model`,
:class:`Trainer`.
"""

from jaxtp.api import Config, ConfigError, Model, Trainer, config, run_config

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "Model", "Trainer", "config", "run_config"]
