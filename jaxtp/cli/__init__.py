"""The ``jaxtp`` command: a thin shell of verbs over the Python API."""

from jaxtp.cli.launch import main

__all__ = [
    "main"
]
