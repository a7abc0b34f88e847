"""Typed run configuration: the schema (``schema``), loading YAML and dotted overrides (``loading``), and the
rules checked before any process group exists (``rules``, ``overlap_rules``), after ``auto`` in the MoE exchange's
switches is resolved (``defaults``). Everything a caller needs is named
here."""

from moe_overlap.config.loading import config_yaml, load_config
from moe_overlap.config.rules import validate, validate_for_world
from moe_overlap.config.schema import (CheckpointConfig, Config, ConfigError, DataConfig, ModelConfig, OverlapConfig,
                                       ParallelConfig, SyntheticSource, TrainConfig, synthetic_source)

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "ModelConfig", "OverlapConfig", "ParallelConfig",
           "SyntheticSource", "TrainConfig", "config_yaml", "load_config", "synthetic_source", "validate",
           "validate_for_world"]
