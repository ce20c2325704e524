"""A verifiers harness that runs its chat loop in the rollout's own process: no program to
install, no subprocess, nothing fetched.

Read on: docs/envs.md.
"""

from __future__ import annotations

import functools
import json
import ssl
from contextlib import AsyncExitStack
from typing import Any

import httpx
import verifiers.v1 as vf
from openai import APIStatusError, AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.compaction import is_context_overflow
from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content


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
        messages = _opening(*self.resolve_prompt(data))
        http = httpx.AsyncClient(verify=_tls(), timeout=None)  # verifiers bounds the run
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http)
        try:
            async with AsyncExitStack() as stack:
                tools, dispatch = await _connect(stack, mcp_urls, self.config.tool_timeout)
                await self._loop(client, ctx.model, messages, tools, dispatch)
        except APIStatusError as e:
            if is_context_overflow(e):
                return vf.ProgramResult(0, "", "")  # the context is full: the run ends here
            # verifiers reads a stop hook's refusal off the trace, anything else is an error
            return vf.ProgramResult(1, "", f"{type(e).__name__}: {e}")
        finally:
            await client.close()
        return vf.ProgramResult(0, "", "")

    async def _loop(self, client, model, messages, tools, dispatch) -> None:
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
                content = await _run_tool(call, dispatch)
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "name": call.function.name,
                        "content": content,
                    }
                )


def _opening(system_prompt: str | None, prompt) -> list[dict[str, Any]]:
    """The conversation before the first turn: the system prompt, then the task's prompt."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if isinstance(prompt, str):
        return [*messages, {"role": "user", "content": prompt}]
    return [*messages, *(message_to_wire(m) for m in prompt or [])]


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every rollout's client: building one loads the CA bundle, 0.1 s of
    CPU each (the interception endpoint is plain HTTP on loopback, but a client builds it)."""
    return ssl.create_default_context()


async def _connect(
    stack: AsyncExitStack, urls: dict[str, str], timeout_s: float
) -> tuple[list[dict[str, Any]], dict[str, tuple[Any, str]]]:
    """One MCP client per tool server for the rollout: (the tools' schemas as chat tools,
    tool name -> (its client, its name on the server)), named as verifiers' chat programs name
    them (`SERVER_TOOL`, or the tool's own name on a server without a prefix)."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    schemas: list[dict[str, Any]] = []
    dispatch: dict[str, tuple[Any, str]] = {}
    for server, url in urls.items():
        timeout = httpx2.Timeout(timeout_s, connect=5.0)
        http = httpx2.AsyncClient(verify=_tls(), timeout=timeout, follow_redirects=True)
        await stack.enter_async_context(http)
        client = await stack.enter_async_context(
            Client(streamable_http_client(url, http_client=http))
        )
        for tool in (await client.list_tools()).tools:
            name = f"{server}_{tool.name}" if server else tool.name
            if name in dispatch:
                raise ValueError(f"two tools are called {name!r}: give their servers prefixes")
            function = {"name": name, "description": tool.description or ""}
            schemas.append(
                {"type": "function", "function": function | {"parameters": tool.input_schema}}
            )
            dispatch[name] = (client, tool.name)
    return schemas, dispatch


async def _run_tool(call, dispatch) -> str | list[dict[str, Any]]:
    name = call.function.name
    if name not in dispatch:
        return f"error: unknown tool {name!r}; tools: {', '.join(sorted(dispatch)) or 'none'}"
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: the arguments are not JSON ({e})"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    client, tool = dispatch[name]
    try:
        result = await client.call_tool(tool, arguments)
    except Exception as e:  # a tool that fails costs the model a turn, not the run
        return f"error: {type(e).__name__}: {e}"
    return mcp_content_to_chat_content(result.content)
