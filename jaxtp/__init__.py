"""jaxtp: Megatron-style tensor parallelism in JAX, composed with the other parallelisms.

The public API (the README's "Python API" section): ``jaxtp.config(preset, overrides)``
(:func:`jaxtp.configs.configure`), :class:`Model`, :class:`Trainer`, ``jaxtp.data.loaders``,
``jaxtp.prepare_data``, and ``jaxtp.use_cpu_devices(n)`` (n simulated CPU devices on a host
without accelerators; call it before anything touches JAX).

The names load on first use (PEP 562), so ``import jaxtp.cli.host_malloc`` — what the ``jaxtp``
command runs before anything else — does not import JAX.
"""

import importlib

__version__ = "0.1.0"
_FROM = {"Config": "jaxtp.configs", "ConfigError": "jaxtp.configs", "Model": "jaxtp.api",
         "Trainer": "jaxtp.train", "run_config": "jaxtp.api",
         "prepare_data": "jaxtp.data.prepare_data", "config": "jaxtp.configs",
         "use_cpu_devices": "jaxtp.parallel"}
_DEFINED_AS = {"prepare_data": "prepare", "config": "configure"}
_MODULES = {"data": "jaxtp.data"}
__all__ = ["Config", "ConfigError", "Model", "Trainer", "config", "data", "prepare_data",
           "run_config", "use_cpu_devices"]


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name in _FROM:
        module = importlib.import_module(_FROM[name])
        value = getattr(module, _DEFINED_AS.get(name, name))
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxtp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
