"""cadence: RL post-training of language models that overlaps generation and training."""

import multiprocessing as _mp
import signal as _signal

# A worker process that cadence starts ("cadence-worker-N", "cadence-reward-N") ignores Ctrl-C
# from its first import of cadence on: the terminal sends SIGINT to every process of its group,
# the learner stops its workers itself, and each worker would otherwise print a traceback. (Most
# start ignoring it already: see backend/procs.py `_ignoring_ctrl_c`.)
if _mp.current_process().name.startswith("cadence-"):
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)

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
