"""The configuration: frozen dataclasses, named presets, ``key=value`` overrides, value checks,
the error jaxtp raises, and the mesh axis names. The bottom of the package order; it is named
``configs`` so that ``jaxtp.config(preset, overrides)`` stays a function."""

from jaxtp.configs.axes import (
    AXES,
    BATCH_AXES,
    CONTEXT,
    DATA,
    EXPERT,
    FSDP,
    MODEL,
    PIPELINE,
    TP_AXIS,
    ZERO_AXES,
    entry_axes,
    spec_axes,
    token_axes,
)
from jaxtp.configs.check_values import (
    check_devices,
    check_eval_split,
    check_hardware_file,
    check_run_files,
    parse_profile_steps,
    validate_model,
    validate_settings,
)
from jaxtp.configs.errors import ConfigError
from jaxtp.configs.schema import (
    CONTEXT_LAYOUTS,
    PIPELINE_SCHEDULES,
    PRESETS,
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    apply_overrides,
    configure,
    get_preset,
    load,
    valid_keys,
)

__all__ = [
    "AXES", "BATCH_AXES", "CONTEXT", "CONTEXT_LAYOUTS", "Config", "ConfigError", "DATA",
    "DataConfig", "EXPERT", "FSDP", "MODEL", "ModelConfig", "PIPELINE", "PIPELINE_SCHEDULES",
    "PRESETS", "ParallelConfig", "TP_AXIS", "TrainConfig", "ZERO_AXES", "apply_overrides",
    "check_devices", "check_eval_split", "check_hardware_file", "check_run_files", "configure",
    "entry_axes", "get_preset", "load", "parse_profile_steps", "spec_axes", "token_axes",
    "valid_keys", "validate_model", "validate_settings"
]
