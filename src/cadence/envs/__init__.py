"""Multi-turn environments: the seam (`Environment`, `Episode`, `EnvReply`, `Budget`), the tool
environment with its call syntax and the `calculator` tool, and deterministic fakes.

`env.kind = "single_turn"` (the default) is one prompt and one response, as ever; `"tool"` lets
the policy call tools over up to `env.max_turns` turns; `"verifiers"` runs a verifiers
environment (`env.factory`), whose adapter lives in `cadence.envs.verifiers` (imported on use).
The rollout worker runs the episodes (rollout/episodes.py, rollout/verifiers.py); this package
only decides what the environment says.
"""

from cadence.envs.base import KINDS, Budget, Environment, EnvReply, Episode
from cadence.envs.calculator import CalculatorError, calculator, demonstration
from cadence.envs.fake import ScriptedEnv, SingleTurnEnv, replies
from cadence.envs.spec import EnvSpec, VerifiersEnv, make_env
from cadence.envs.syntax import (
    CALL_END,
    CALL_START,
    RESULT_END,
    RESULT_START,
    MalformedCall,
    call_text,
    error_text,
    parse_call,
    result_text,
)
from cadence.envs.tool_env import ToolEnv, ToolEpisode
from cadence.envs.tools import BUILTIN, Outcome, Tool, ToolBox, load_tool, load_tools

__all__ = [
    "BUILTIN",
    "CALL_END",
    "CALL_START",
    "KINDS",
    "RESULT_END",
    "RESULT_START",
    "Budget",
    "CalculatorError",
    "EnvReply",
    "EnvSpec",
    "Environment",
    "Episode",
    "MalformedCall",
    "Outcome",
    "ScriptedEnv",
    "SingleTurnEnv",
    "Tool",
    "ToolBox",
    "ToolEnv",
    "ToolEpisode",
    "VerifiersEnv",
    "calculator",
    "call_text",
    "demonstration",
    "error_text",
    "load_tool",
    "load_tools",
    "make_env",
    "parse_call",
    "replies",
    "result_text",
]
