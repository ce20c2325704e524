"""The `reasoning_gym` reward: each row scored by its own dataset's `score_answer`.

reasoning-gym (1-5 s to import) is imported when the reward is built, in each process that
scores, never inside a timed call. This module holds no state beyond one grader per dataset.

The design in full: docs/internals.md, `cadence/rewards/reasoning_gym.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
            from reasoning_gym import get_score_answer_fn
            from reasoning_gym.utils import extract_answer
        except ImportError as e:
            raise ImportError(f"reasoning-gym is not installed ({e}): {INSTALL_HINT}") from None
        self.answer_format = answer_format
        self._grader_of = get_score_answer_fn
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
        name = metadata["source_dataset"]
        if name not in self._graders:  # get_score_answer_fn builds a dataset: once per name
            self._graders[name] = self._grader_of(name)
        entry = {"question": prompt, "answer": answer or None, "metadata": metadata}
        return float(self._graders[name](self.extract(completion), entry))
