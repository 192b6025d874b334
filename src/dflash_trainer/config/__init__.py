"""Run configuration: the typed schema, presets, and YAML + ``--set`` resolution."""

from .loader import ConfigError, dump_config, load_config, preset_names, valid_keys, write_resolved_config
from .schema import TINY_TARGET, DataConfig, DrafterConfig, LossConfig, RunConfig, TargetConfig, TrainConfig

__all__ = [
    "TINY_TARGET",
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "LossConfig",
    "RunConfig",
    "TargetConfig",
    "TrainConfig",
    "dump_config",
    "load_config",
    "preset_names",
    "valid_keys",
    "write_resolved_config",
]
