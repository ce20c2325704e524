"""cadence: RL post-training of language models that overlaps generation and training."""

import multiprocessing as _mp
import signal as _signal

# A worker process that cadence starts ("cadence-worker-N", "cadence-reward-N") ignores Ctrl-C
# from its first import of cadence on: the terminal sends SIGINT to every process of its group,
# the learner stops its workers itself, and each worker would otherwise print a traceback. (Most
# start ignoring it already: see backend/procs.py `_ignoring_ctrl_c`.)
if _mp.current_process().name.startswith("cadence-"):
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)

from cadence.types import Completion, Group, Prompt

__version__ = "0.1.0"

_CONFIG = ("Config", "ConfigError", "load_config")


def __getattr__(name: str):
    """The configuration's names, imported when first asked for: its pydantic models need not be
    loaded to use the learner or the engines (`make gpu-check` runs where pydantic is not)."""
    if name in _CONFIG:
        import cadence.config

        return getattr(cadence.config, name)
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")


__all__ = [
    "Completion",
    "Config",
    "ConfigError",
    "Group",
    "Prompt",
    "__version__",
    "load_config",
]
