"""The ``jaxtp`` command: a thin shell of verbs over the Python API."""
