"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, Sec. 3.2): train only on groups
whose rewards differ, and draw more prompts until the iteration has enough of them.

Read on: docs/pipeline.md#how-it-is-built.
"""

from __future__ import annotations

from cadence.types import Group

FILTERS = ("none", "zero_variance")


def zero_variance(group: Group) -> bool:
    """Every reward of the group equal (a single-sample group included)."""
    rewards = group.rewards
    return max(rewards) == min(rewards)


class Oversampler:
    """The filter's bookkeeping for one iteration of `size` prompts.

    For each group that arrives, `offer` says whether to train it now and whether to draw one
    more prompt; a group dropped for staleness is `forget`-ten. Once `outstanding` is 0 the
    iteration is complete: `top_up()` gives the filtered groups to train in place of missing
    informative ones (if the budget ran out), and `filtered` counts the groups left untrained.
    """

    def __init__(self, size: int, budget: int, enabled: bool = True) -> None:
        self.size, self.budget, self.enabled = size, budget, enabled
        self.outstanding = size  # groups drawn and not yet arrived
        self.kept = 0  # groups handed to the learner
        self.extra = 0  # prompts drawn beyond `size`
        self.held: list[Group] = []  # filtered after the budget ran out, for a top-up
        self.num_filtered = 0  # zero-variance groups seen

    def offer(self, group: Group) -> tuple[bool, bool]:
        """(train it now, draw one more prompt)."""
        self.outstanding -= 1
        if not self.enabled or not zero_variance(group):
            self.kept += 1
            return True, False
        self.num_filtered += 1
        if self.extra < self.budget:
            self.extra += 1
            self.outstanding += 1
            return False, True
        self.held.append(group)
        return False, False

    def forget(self) -> None:
        """A drawn group will not arrive (dropped as staler than allowed)."""
        self.outstanding -= 1

    def top_up(self) -> list[Group]:
        """Once all arrived: the earliest held groups that fill the iteration up to `size`."""
        chosen = sorted(self.held, key=lambda g: g.prompt.index)[: self.size - self.kept]
        self.held = []
        self.kept += len(chosen)
        self.num_filtered -= len(chosen)
        return chosen

    @property
    def filtered(self) -> int:
        """Zero-variance groups not trained."""
        return self.num_filtered
