"""`[env]`: what a sample is: one response, a multi-turn episode with tools, an environment
class, an OpenEnv or verifiers environment."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from cadence.choices import ENV_KEYS, ENV_KIND_NAMES, env_kind
from cadence.config.base import Section, changed


class EnvConfig(Section):
    kind: Literal[ENV_KIND_NAMES] = "single_turn"
    """single_turn: one prompt, one response; tool: multi-turn episodes in which the policy calls
    tools with <call>NAME: ARGUMENT</call> and reads <result>...</result>
    (src/cadence/envs/syntax.py); a turn without a call is the final answer; class: an
    environment class on TRL's environment_factory contract (env.factory or env.factories), its
    methods the tools, called and answered in the model's chat template; openenv: an OpenEnv
    Environment class run in the rollout worker, no server (env.factory; the 'openenv' extra).
    class and openenv need data.chat_template; verifiers: the episodes of a verifiers environment
    (env.factory), run by verifiers against cadence's own endpoint in each rollout worker (the
    'verifiers' extra; docs/envs.md)."""
    tools: list[str] = Field(default_factory=lambda: ["calculator"])
    """kind 'tool': the tools the policy may call: 'calculator' (arithmetic, parsed safely) or
    'module:function' (fn(argument: str) -> str, called by its function name)."""
    factory: str | None = None
    """kind 'class': the environment class, 'package.module:Class', made with no arguments:
    reset(**row) -> str | None, every other public method a tool (type hints and an Args:
    docstring), optional get_reward() -> float (TRL's environment_factory contract;
    'cadence.envs.calculator:Calculator' ships). kind 'openenv': an OpenEnv Environment class (an
    MCPEnvironment's tools are called in the chat format; any other gets the policy's text as its
    action). kind 'verifiers': 'module:function' returning the environment (a verifiers.v1.Env, as
    an environment package's load_environment does), importable where the workers run; prompts come
    from its taskset, rewards from its tasks' rubric."""
    factories: dict[str, str] | None = None
    """kind 'class', instead of factory: several environment classes by name, { name =
    'package.module:Class' }; each row picks one by its 'environment' field (a data set column), as
    TRL's dict environment_factory does, and its prompt shows that class's tools only."""
    max_turns: int = Field(4, ge=1)
    """kinds but single_turn: most policy turns per episode (each a call or the end). verifiers:
    the environment's own limit, stated here for the overlong penalty's and seq-sum-norm's cap
    (the environment enforces it; cadence does not)."""
    max_total_tokens: int = Field(256, ge=1)
    """kinds but single_turn: most tokens per episode after the prompt, policy and environment
    replies together (each turn is also capped by rollout.max_new_tokens). verifiers: as
    max_turns, the environment's own limit, stated."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """kinds but single_turn: a tool call (an OpenEnv step) still running after this many seconds is
    cut off; the policy reads an error (counted as tool_timeouts), the run goes on."""

    @field_validator("factory")
    @classmethod
    def _module_and_attribute(cls, factory: str | None) -> str | None:
        if factory is not None and not _FACTORY.fullmatch(factory):
            raise ValueError(
                f"{factory!r} is not 'module:name' (a dotted module path, a colon, a name)"
            )
        return factory

    @model_validator(mode="after")
    def _factory_for_verifiers(self) -> EnvConfig:
        if self.kind == "verifiers" and self.factory is None:
            raise ValueError(
                "env.kind = 'verifiers' needs env.factory = 'module:function' returning the "
                "verifiers environment"
            )
        return self

    @model_validator(mode="after")
    def _keys_of_the_kind(self) -> EnvConfig:
        for key in changed(self, ENV_KEYS):
            kinds = ENV_KEYS[key]
            if self.kind not in kinds:
                names = [f"'{k}'" for k in kinds]
                allowed = " or ".join([", ".join(names[:-1]), names[-1]] if names[1:] else names)
                raise ValueError(
                    f"env.{key} applies to env.kind = {allowed} only, not '{self.kind}': set "
                    f"the kind or leave env.{key} out"
                )
        if self.kind == "tool" and not self.tools:
            raise ValueError("env.kind = 'tool' needs at least one tool in env.tools")
        if self.kind == "class" and (self.factory is None) == (self.factories is None):
            raise ValueError(
                "env.kind = 'class' needs env.factory = 'package.module:Class', or "
                "env.factories = { name = 'package.module:Class' } for a mix: one of the two"
            )
        if self.kind == "class" and self.factories == {}:
            raise ValueError("env.factories is empty: name at least one environment class")
        own = env_kind(self.kind).factory
        if own and not self.factory and not self.factories:
            raise ValueError(f"env.kind = '{self.kind}' needs env.factory = '{own}'")
        return self


_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
