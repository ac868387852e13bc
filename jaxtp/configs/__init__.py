"""The configuration: frozen dataclasses, named presets, ``key=value`` overrides, value checks,
the error jaxtp raises, and the mesh axis names. The bottom of the package order; it is named
``configs`` so that ``jaxtp.config(preset, overrides)`` stays a function."""
