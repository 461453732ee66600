"""Typed configuration: the dataclass tree, YAML recipes with dotted overrides, validation."""

from megatron_sao.config.errors import ConfigError
from megatron_sao.config.loader import dump_config, load_config, parse_override
from megatron_sao.config.schema import SaoConfig

__all__ = ["ConfigError", "SaoConfig", "dump_config", "load_config", "parse_override"]
