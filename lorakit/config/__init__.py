"""Run configs: the typed tree (`schema`, `data`), reading and merging its layers (`loading`), the paths it names
(`paths`), its reference page (`docs`). What the machine decides on top (the memory plan, compile, attention) is
`lorakit.plan`."""

from lorakit.config.data import DataConfig, DatasetConfig
from lorakit.config.loading import (
    assemble,
    deep_merge,
    dump_yaml,
    load_yaml,
    parse_overrides,
    parse_yaml,
    validate,
)
from lorakit.config.paths import check_paths
from lorakit.config.schema import Config

__all__ = ["Config", "DataConfig", "DatasetConfig", "assemble", "check_paths", "deep_merge", "dump_yaml",
           "load_yaml", "parse_overrides", "parse_yaml", "validate"]
