"""Multi-turn environments: the seam (`Environment`, `Episode`, `EnvReply`, `Budget`), the tool
environment with its call syntax and the `calculator` tool, environment classes on TRL's
contract, OpenEnv environments in-process, and deterministic fakes.

Read on: docs/envs.md.
"""

from cadence.envs.base import Budget, Environment, EnvReply, Episode
from cadence.envs.calculator import Calculator, CalculatorError, calculator, demonstration
from cadence.envs.chat_tools import (
    ChatFormat,
    ChatToolsError,
    MalformedToolCall,
    ToolCall,
    parse_calls,
)
from cadence.envs.classes import (
    ClassEnv,
    Factory,
    FactoryError,
    InstancePool,
    load_factory,
    reset_row,
)
from cadence.envs.fake import ScriptedEnv, SingleTurnEnv, replies
from cadence.envs.openenv import OpenEnvEnv, load_openenv, observation_text
from cadence.envs.spec import EnvSpec, VerifiersEnv, check_env, make_env
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
from cadence.envs.tools import (
    BUILTIN,
    Outcome,
    Ran,
    Tool,
    ToolBox,
    ToolThreads,
    load_tool,
    load_tools,
)

__all__ = [
    "BUILTIN",
    "CALL_END",
    "CALL_START",
    "RESULT_END",
    "RESULT_START",
    "Budget",
    "Calculator",
    "CalculatorError",
    "ChatFormat",
    "ChatToolsError",
    "ClassEnv",
    "EnvReply",
    "EnvSpec",
    "Environment",
    "Episode",
    "Factory",
    "FactoryError",
    "InstancePool",
    "MalformedCall",
    "MalformedToolCall",
    "OpenEnvEnv",
    "Outcome",
    "Ran",
    "ScriptedEnv",
    "SingleTurnEnv",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolEnv",
    "ToolEpisode",
    "ToolThreads",
    "VerifiersEnv",
    "calculator",
    "call_text",
    "check_env",
    "demonstration",
    "error_text",
    "load_factory",
    "load_openenv",
    "load_tool",
    "load_tools",
    "make_env",
    "observation_text",
    "parse_call",
    "parse_calls",
    "replies",
    "reset_row",
    "result_text",
]
