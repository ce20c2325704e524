"""The `reasoning_gym` reward: each row scored by its own dataset's `score_answer`, the dataset
built with the settings the run configured (a row carries them in its metadata): a grader that
reads its config (decimal places, word length, board formats) grades as the rows were made.

reasoning-gym (1-5 s to import) is imported when the reward is built, in each process that
scores, never inside a timed call. This module holds no state beyond one grader per dataset.

Read on: docs/data.md#rewards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cadence.data.reasoning_gym import CONFIG_KEY
from cadence.rewards.answers import check_format, extract

INSTALL_HINT = "pip install 'cadence[reasoning-gym]'"


class ReasoningGymReward:
    """reasoning-gym's own grader of each row, in [0, 1]; see the module docstring.

    Raises ValueError for a row without metadata (it needs `data.task = "reasoning_gym"`).
    """

    concurrency = 1  # its default reward.concurrency: graders compute, they do not wait

    def __init__(self, answer_format: str = "auto") -> None:
        check_format(answer_format)
        try:
            from reasoning_gym import create_dataset
            from reasoning_gym.utils import extract_answer
        except ImportError as e:
            raise ImportError(f"reasoning-gym is not installed ({e}): {INSTALL_HINT}") from None
        self.answer_format = answer_format
        self._create = create_dataset
        self._extract_answer = extract_answer
        self._graders: dict[str, Callable[[str | None, dict[str, Any]], float]] = {}

    def extract(self, completion: str) -> str | None:
        """The graded answer of `completion`, or None when it has none."""
        if self.answer_format == "auto":
            return self._extract_answer(completion)
        return extract(completion, self.answer_format)

    def __call__(
        self, prompt: str, completion: str, answer: str, *, metadata: dict[str, Any] | None = None
    ) -> float:
        if metadata is None or "source_dataset" not in metadata:
            raise ValueError(
                "reward.function = 'reasoning_gym' scores reasoning-gym rows, whose metadata names "
                "their dataset: this prompt has none (use data.task = 'reasoning_gym')"
            )
        grader = self._grader(metadata["source_dataset"], metadata.get(CONFIG_KEY, {}))
        entry = {"question": prompt, "answer": answer or None, "metadata": metadata}
        return float(grader(self.extract(completion), entry))

    def _grader(self, name: str, config: dict[str, Any]):
        """The `score_answer` of dataset `name` built with `config`: once per settings."""
        key = name + json.dumps(config, sort_keys=True, default=str)
        if key not in self._graders:
            self._graders[key] = self._create(name, **config).score_answer
        return self._graders[key]
