"""The run configuration: TOML files validated by pydantic, with dotted `--set` overrides.

One module per section (model, data, rollout, reward, algo, env, and train with learner,
pipeline, sft and metrics), the whole in `root.py`, the checks across sections in `checks.py`,
reading and writing in `files.py`, the generated reference (docs/config.md) in `doc.py`. Every
field has a description; an unknown key or a bad value raises `ConfigError`, whose message names
the key and what is allowed (the CLI turns it into exit code 2). Only the CLI and the builder
read the whole config; components take plain keyword arguments.
"""

from cadence.config.algo import AlgoConfig
from cadence.config.base import ConfigError, Section, check_custom_resources
from cadence.config.data import DataConfig, ReasoningGymConfig, ReasoningGymDataset
from cadence.config.env import EnvConfig
from cadence.config.files import apply_overrides, load_config, to_toml
from cadence.config.model import LoraSettings, ModelConfig
from cadence.config.reward import RewardConfig
from cadence.config.rollout import VLLM_RESERVED_ARGS, RolloutConfig, VLLMConfig
from cadence.config.root import Config
from cadence.config.train import (
    RAY_ONLY,
    LearnerConfig,
    MetricsConfig,
    PipelineConfig,
    SFTConfig,
    TrainConfig,
)

__all__ = [
    "RAY_ONLY",
    "VLLM_RESERVED_ARGS",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "LearnerConfig",
    "LoraSettings",
    "MetricsConfig",
    "ModelConfig",
    "PipelineConfig",
    "ReasoningGymConfig",
    "ReasoningGymDataset",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "Section",
    "TrainConfig",
    "VLLMConfig",
    "apply_overrides",
    "check_custom_resources",
    "load_config",
    "to_toml",
]
