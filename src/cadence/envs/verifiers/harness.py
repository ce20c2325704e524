"""A verifiers harness that runs its chat loop in the rollout's own process: no program to
install, no subprocess, nothing fetched.

verifiers' own chat harnesses (`null`, `bash`) run their loop as a separate Python program that
`uv` installs into the rollout's runtime, which needs `uv` and the network. verifiers allows a
harness to run its loop in-process instead, as long as every model call goes through the
rollout's interception endpoint (`Harness.launch`'s docstring): then the trace records every
turn exactly as with a program. `InProcessChatHarness` is that loop: the task's prompt (and
system prompt), then model turns; each tool call of a turn runs on the task's MCP tool servers
(a `vf.Toolset`, which verifiers serves itself) and its result is the next message; a turn
without tool calls ends the run, and so does a context overflow (a budget, not a failure).
A tool call that fails is a tool message saying so: the model reads what went wrong.

A harness is found by verifiers through a top-level module's `__all__` (its id is the module's
name), so an environment module re-exports it: `from cadence.envs.verifiers import
InProcessChatHarness` and `__all__ = ["MyTaskset", "InProcessChatHarness"]` make it the
taskset's default harness.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import verifiers.v1 as vf
from openai import APIStatusError, AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.compaction import is_context_overflow
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp


class InProcessChatHarnessConfig(vf.HarnessConfig):
    """No settings beyond verifiers' own (`tool_timeout` bounds one MCP tool call)."""


class InProcessChatHarness(vf.Harness[InProcessChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] * bool(
            system_prompt
        )
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                servers = {
                    name: {"url": url, "timeout": self.config.tool_timeout}
                    for name, url in mcp_urls.items()
                }
                tools, dispatch, connections = await connect_mcp({"mcpServers": servers}, stack)
                await self._loop(client, ctx.model, messages, tools, dispatch, connections)
        except APIStatusError as e:
            if is_context_overflow(e):
                return vf.ProgramResult(0, "", "")  # the context is full: the run ends here
            # verifiers reads a stop hook's refusal off the trace, anything else is an error
            return vf.ProgramResult(1, "", f"{type(e).__name__}: {e}")
        finally:
            await client.close()
        return vf.ProgramResult(0, "", "")

    async def _loop(self, client, model, messages, tools, dispatch, connections) -> None:
        while True:
            extra = {"tools": tools} if tools else {}
            completion = await client.chat.completions.create(
                model=model, messages=messages, **extra
            )
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return
            for call in message.tool_calls:
                content = await _run_tool(call, dispatch, connections)
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "name": call.function.name,
                        "content": content,
                    }
                )


async def _run_tool(call, dispatch, connections) -> str | list[dict[str, Any]]:
    name = call.function.name
    if name not in dispatch:
        return f"error: unknown tool {name!r}; tools: {', '.join(sorted(dispatch)) or 'none'}"
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: the arguments are not JSON ({e})"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    try:
        return await call_mcp(connections, dispatch, name, arguments)
    except Exception as e:  # a tool that fails costs the model a turn, not the run
        return f"error: {type(e).__name__}: {e}"
