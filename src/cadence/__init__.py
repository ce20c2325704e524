"""cadence: RL post-training of language models that overlaps generation and training."""

from cadence.config import Config, ConfigError, load_config
from cadence.types import Completion, Group, Prompt

__version__ = "0.1.0"

__all__ = [
    "Completion",
    "Config",
    "ConfigError",
    "Group",
    "Prompt",
    "__version__",
    "load_config",
]
