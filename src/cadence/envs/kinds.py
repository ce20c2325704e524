"""What each environment kind brings of its own, asked of the kind instead of compared by name.

The builder decides from these traits whether a run's tasks, prompt rendering, prompt lengths
and warm-start answers are the configuration's or the environment's; nothing outside `envs/` and
`config/` compares `env.kind` with a literal (tests/test_layout.py holds it). A new kind is one
row here. Traits only: building the environment is `spec.make_env`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.envs.base import KINDS


@dataclass(frozen=True)
class KindTraits:
    answers: bool = False  # an environment answers the policy (every kind but single_turn)
    episodes: bool = False  # cadence runs the turns under a Budget (tool, class, openenv)
    syntax_tools: bool = False  # calls in cadence's <call> syntax to env.tools (tool)
    chat: bool = False  # calls and replies in the model's chat template (class, openenv)
    own_tasks: bool = False  # its taskset is the prompts; it renders them and fits their length
    reference_answers: bool = True  # its tasks have reference answers a warm start trains on


TRAITS = {
    "single_turn": KindTraits(),
    "tool": KindTraits(answers=True, episodes=True, syntax_tools=True),
    "class": KindTraits(answers=True, episodes=True, chat=True),
    "openenv": KindTraits(answers=True, episodes=True, chat=True),
    "verifiers": KindTraits(answers=True, own_tasks=True, reference_answers=False),
}
assert tuple(TRAITS) == KINDS


def kind_traits(kind: str) -> KindTraits:
    """The traits of environment kind `kind` (one of `KINDS`)."""
    if kind not in TRAITS:
        raise ValueError(f"env kind {kind!r} is unknown; allowed: {', '.join(KINDS)}")
    return TRAITS[kind]
