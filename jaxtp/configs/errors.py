"""The error jaxtp raises for input it refuses: one line naming the key, the value and the fix.

A leaf module, so that every layer (the config and its value checks included) can raise it.
"""


class ConfigError(ValueError):
    """A configuration that jaxtp refuses to run; the message names the constraint and the fix."""
