"""Tools behind MCP: mount async Python tools on an in-process MCP server (official `mcp` SDK 2.x), list them
as OpenAI-style schemas for rendering, and turn parsed tool calls into observation text.

One `MCPToolbox` per episode (ENVIRONMENTS.md section 1: never reuse a server or a state across episodes):

    async with MCPToolbox(build_server([search_tickets, update_ticket])) as toolbox:
        tools = await toolbox.list_tools()            # for render(messages, tools)
        turn = parse_assistant(text, tools)
        observations = await toolbox.call_all(turn.tool_calls)

Observation text: the tool's text content; a `ToolError` raised by the tool reaches the agent as the SDK's
"Error executing tool NAME: message"; any other exception only as "Error executing tool NAME" (the SDK hides
it). A call that failed to parse is not executed: its `error_message()` is the observation. A call that runs
past `call_timeout_s` is abandoned with a timeout error. An external server (stdio or streamable HTTP) is
mounted the same way: `MCPToolbox(external_server(config))` (see `mcp_external.py`).
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from mercury_jax.chat.parse import ToolCall


@dataclass(frozen=True)
class ToolObservation:
    """What one call produced for the agent: `text`, whether it is an error, whether the tool ran at all."""
    name: str
    text: str
    is_error: bool
    executed: bool


def build_server(tools: Sequence[Callable[..., Any]] | Mapping[str, Callable[..., Any]], *,
                 name: str = "mercury-tools", instructions: str | None = None):
    """A fresh in-process `MCPServer` with `tools` (named by function name, or by the mapping's keys).

    Each tool is an `async def` with type hints and a docstring: the SDK derives the input schema from the
    signature and the description from the docstring. Raise `mcp.server.mcpserver.exceptions.ToolError` for
    errors the agent should read.
    """
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(name, instructions=instructions, warn_on_duplicate_tools=False, log_level="WARNING")
    items = tools.items() if isinstance(tools, Mapping) else ((fn.__name__, fn) for fn in tools)
    seen = set()
    for tool_name, fn in items:
        if tool_name in seen:
            raise ValueError(f"two tools are named {tool_name!r}; tool names must be unique on one server")
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {tool_name!r} must be an `async def` function (it would block the event loop)")
        seen.add(tool_name)
        server.add_tool(fn, name=tool_name)
    return server


class MCPToolbox:
    """An MCP client session on one server (an `MCPServer`, a `StdioServerParameters`, or a streamable-HTTP URL)."""

    def __init__(self, server: Any, *, call_timeout_s: float = 30.0):
        self.server = server
        self.call_timeout_s = call_timeout_s
        self._client = None
        self._stack: AsyncExitStack | None = None
        self._tools: list[dict[str, Any]] | None = None

    async def __aenter__(self) -> MCPToolbox:
        from mcp import Client

        self._stack = AsyncExitStack()
        try:  # no cancel scope around this: the client's task groups must outlive the enter call
            self._client = await self._stack.enter_async_context(Client(self.server))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._client = self._stack = None

    async def list_tools(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas of the server's tools, sorted by name (stable prompt text)."""
        if self._tools is None:
            tools, cursor = [], None
            while True:
                page = await self._session().list_tools(cursor=cursor) if cursor else await self._session().list_tools()
                tools += page.tools
                cursor = getattr(page, "next_cursor", None)
                if not cursor:
                    break
            self._tools = [openai_schema(t.name, t.description, t.input_schema)
                           for t in sorted(tools, key=lambda t: t.name)]
        return self._tools

    async def call(self, call: ToolCall) -> ToolObservation:
        """Execute one parsed call (unless it has errors) and return its observation; never raises for tool
        failures, timeouts or protocol errors."""
        import anyio

        if not call.ok:
            return ToolObservation(call.name, call.error_message(), is_error=True, executed=False)
        try:
            with anyio.fail_after(self.call_timeout_s):
                result = await self._session().call_tool(call.name, call.arguments)
        except TimeoutError:
            return ToolObservation(call.name, f"Error: tool {call.name!r} did not answer within "
                                   f"{self.call_timeout_s:g} s", is_error=True, executed=True)
        except Exception as error:  # noqa: BLE001 (protocol errors from the server become observations)
            return ToolObservation(call.name, f"Error calling tool {call.name!r}: {error}", is_error=True,
                                   executed=True)
        return ToolObservation(call.name, result_text(result), is_error=bool(result.is_error), executed=True)

    async def call_all(self, calls: Sequence[ToolCall]) -> list[ToolObservation]:
        """Each call in order (later calls may depend on the effects of earlier ones)."""
        return [await self.call(c) for c in calls]

    def _session(self):
        if self._client is None:
            raise RuntimeError("MCPToolbox is not open: use `async with MCPToolbox(server) as toolbox:`")
        return self._client


def openai_schema(name: str, description: str | None, input_schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """An MCP tool as an OpenAI-style function schema, without pydantic's `title` noise."""
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description.strip()
    function["parameters"] = _without_titles(dict(input_schema or {"type": "object", "properties": {}}))
    return {"type": "function", "function": function}


def result_text(result: Any) -> str:
    """The text of a `CallToolResult`: its text blocks joined; other blocks named; structured content as JSON
    when there is no text."""
    parts = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{kind or 'unknown'} content: {getattr(block, 'mime_type', '')}]".replace(": ]", "]"))
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _without_titles(schema: Any, *, in_names: bool = False) -> Any:
    """Drop schema `title`s (kept where "title" is a property name, inside `properties` / `$defs`)."""
    if isinstance(schema, dict):
        if in_names:
            return {k: _without_titles(v) for k, v in schema.items()}
        return {k: _without_titles(v, in_names=k in ("properties", "$defs", "definitions", "patternProperties"))
                for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_without_titles(v) for v in schema]
    return schema
