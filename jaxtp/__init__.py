"""jaxtp: Megatron-style tensor parallelism in JAX, composed with the other parallelisms."""

__version__ = "0.1.0"
