"""Run configuration: typed schema, YAML recipes with dotted overrides, validation.

    cfg = load_config("recipes/smollm2-135m-grpo-cpu.yaml", ["actor.optim.lr=1e-5"])
"""
from megarl.config.loader import ConfigError, dump_config, field_help, load_config, parse_overrides
from megarl.config.schema import RunConfig
from megarl.config.validate import collect_problems, dp_size, max_sequence_len, validate_config

__all__ = ["ConfigError", "RunConfig", "collect_problems", "dp_size", "max_sequence_len", "dump_config", "field_help",
           "load_config", "parse_overrides", "validate_config"]
