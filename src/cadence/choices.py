"""The choices a run makes by name, and what each one brings: environment kinds, engines, losses
and the algorithm's other choice lists.

One description per choice, read by both sides of the config wall: `config/` takes its allowed
values and cross-key checks from here, and the room that implements a choice (`envs/`,
`engine/`, `algo/`) takes its traits from here too. Everywhere else a choice is asked of its
traits (`env_kind(k).chat`, `engine_kind(k).own_copy`, `loss_kind(k).whole_groups`), never
compared with its name (tests/test_layout.py holds it). A new choice is one row here plus its
implementation. Plain data: imports nothing of cadence, no torch. docs/layout.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- environment kinds -------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvKind:
    """What an environment kind brings of its own."""

    answers: bool = False  # an environment answers the policy (every kind but single_turn)
    episodes: bool = False  # cadence runs the turns under a Budget (tool, class, openenv)
    syntax_tools: bool = False  # calls in cadence's <call> syntax to env.tools (tool)
    chat: bool = False  # calls and replies in the model's chat template (needs data.chat_template)
    own_tasks: bool = False  # its taskset is the prompts; it renders them and fits their length
    reference_answers: bool = True  # its tasks have reference answers a warm start trains on
    own_rewards: bool = False  # its episodes give rewards of their own (get_reward, a step's)
    factory: str = ""  # what env.factory names for it ("": it takes no factory)


ENV_KINDS: dict[str, EnvKind] = {
    "single_turn": EnvKind(),
    "tool": EnvKind(answers=True, episodes=True, syntax_tools=True),
    "class": EnvKind(
        answers=True, episodes=True, chat=True, own_rewards=True, factory="package.module:Class"
    ),
    "openenv": EnvKind(
        answers=True, episodes=True, chat=True, own_rewards=True, factory="package.module:Class"
    ),
    "verifiers": EnvKind(
        answers=True,
        own_tasks=True,
        reference_answers=False,
        own_rewards=True,
        factory="module:function",
    ),
}
ENV_KIND_NAMES = tuple(ENV_KINDS)
EPISODE_KINDS = tuple(k for k, t in ENV_KINDS.items() if t.episodes)
CHAT_KINDS = tuple(k for k, t in ENV_KINDS.items() if t.chat)
ENV_KEYS = {  # an [env] key -> the kinds it applies to
    "tools": ("tool",),
    "factory": tuple(k for k, t in ENV_KINDS.items() if t.factory),
    "factories": ("class",),
    "max_turns": (*EPISODE_KINDS, "verifiers"),  # verifiers: the environment's own, stated
    "max_total_tokens": (*EPISODE_KINDS, "verifiers"),
    "tool_timeout_s": EPISODE_KINDS,
}


# --- engines -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineKind:
    """What an engine brings of its own."""

    own_copy: bool = False  # loads its own copy of the model (its instances' owns_weights)
    streams: bool = False  # work added at any time, a group handed out as soon as it is done
    in_flight: tuple[str, ...] = ()  # partial rollouts: the treatments of the K/V it offers
    options: str = ""  # its own settings' section under [rollout] ("": it takes none)
    adapters: bool = False  # takes a LoRA policy's versions as the adapter alone
    tensor_parallel: bool = False  # splits one model over several GPUs
    # its decode loop runs in this process's Python on a GPU: rewards scored beside it wait on
    # its GIL (reward processes are its default there)
    gil_on_gpu: bool = False
    extra: str = ""  # the package extra it needs ("": none)


ENGINES: dict[str, EngineKind] = {
    "continuous": EngineKind(streams=True, in_flight=("keep", "recompute")),
    "static": EngineKind(),  # a whole batch per call: a task is its batch
    "vllm": EngineKind(
        own_copy=True,
        streams=True,
        in_flight=("keep",),
        options="vllm",
        adapters=True,
        tensor_parallel=True,
        gil_on_gpu=True,
        extra="vllm",
    ),
}
ENGINE_NAMES = tuple(ENGINES)


# --- losses and the algorithm's other choices -------------------------------------------------


@dataclass(frozen=True)
class LossKind:
    """What a loss reads and needs."""

    ratio: bool = False  # its per-token term holds pi / pi_old (under the bypass: the weight)
    pairs: bool = False  # over preference pairs of a group (online DPO): the reference, no ratio
    whole_groups: bool = False  # reads its group (leave-one-out, pairs): never split
    advantage: str = ""  # the advantage it computes itself ("": algo.advantage's)
    aggregation: str = ""  # its loss_agg where unset ("": the key's default)
    dual_clip: bool = False  # takes algo.clip_ratio_c
    token_advantages: bool = True  # reads an advantage per token (distillation's), not per sequence


LOSS_KINDS: dict[str, LossKind] = {
    "ppo_clip": LossKind(ratio=True, dual_clip=True),
    "pg": LossKind(),
    "rloo": LossKind(whole_groups=True, advantage="rloo", token_advantages=False),
    "online_dpo": LossKind(pairs=True, whole_groups=True, token_advantages=False),
    "gspo": LossKind(ratio=True, aggregation="seq-mean", token_advantages=False),
    "cispo": LossKind(ratio=True),
}
LOSSES = tuple(LOSS_KINDS)
ADVANTAGES = ("grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_baseline")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean", "seq-sum-norm")
STD_MODES = ("unbiased", "population")
KL_ESTIMATORS = ("k1", "k2", "k3")
CORRECTION_MODES = (
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "geometric_mask",
    "icepop",
)
PROXIMAL_POLICIES = ("decoupled", "bypass")
DPO_LOSSES = ("sigmoid", "ipo", "ipo_token_mean")


def _known(table: dict, what: str, name: str):
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(table)}")
    return table[name]


def env_kind(name: str) -> EnvKind:
    """The traits of environment kind `name`."""
    return _known(ENV_KINDS, "env kind", name)


def engine_kind(name: str) -> EngineKind:
    """The traits of engine `name`."""
    return _known(ENGINES, "engine", name)


def loss_kind(name: str) -> LossKind:
    """The traits of loss `name`."""
    return _known(LOSS_KINDS, "loss", name)
