"""`cadence` command line: init-model, sft, train, eval, serve, and the measurements.

Exit codes: 0 success, 1 a failure during the run, 2 bad input (config key or value, a model
directory that is missing or not a causal LM, malformed data), with a message naming what is wrong.
"""

from __future__ import annotations

import argparse
import errno
import sys

from cadence.cli.args import parser
from cadence.config import ConfigError

__all__ = ["main", "parser"]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:  # Ctrl-C while the libraries import (seconds) is an interrupt too, not a traceback
        return _run(args)
    except KeyboardInterrupt:
        print("cadence: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    """The command, with every error it can meet mapped to its exit code and one line."""
    from cadence.backend import WorkerDied, WorkerError
    from cadence.data import DataError
    from cadence.learner import BadStepsError
    from cadence.metrics.files import device_of
    from cadence.models import ModelLoadError
    from cadence.models.fingerprint import WeightMismatch
    from cadence.pipeline.checkpoint_files import CheckpointError
    from cadence.pipeline.loop import BehaviourGapError
    from cadence.rewards import RewardBudgetExceeded, RewardLoadError

    try:
        return args.fn(args)
    except (ConfigError, ModelLoadError, DataError, CheckpointError, RewardLoadError) as e:
        print(f"cadence: error: {e}", file=sys.stderr)
        return 2
    except (
        BadStepsError,
        WorkerDied,
        WorkerError,
        RewardBudgetExceeded,
        WeightMismatch,
        BehaviourGapError,
    ) as e:
        print(f"cadence: run stopped: {e}", file=sys.stderr)
        return 1
    except TimeoutError as e:  # workers that stopped answering (pipeline.worker_timeout_s)
        print(f"cadence: run stopped: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" while writing {e.filename}" if e.filename else ""
        print(
            f"cadence: run stopped: no space left on {device_of(e.filename)}{where}",
            file=sys.stderr,
        )
        return 1
